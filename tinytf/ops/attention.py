"""Scaled dot-product attention (the paper's equation 1) as one op."""
from __future__ import annotations

import math

from tinytf.engine import backend
from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function
from tinytf.ops.dropout import keep_mask


def attention_weights(q, k, mask=None, scale: float = 1.0):
    """softmax(scale * q k^T) with masked scores set to the dtype's most negative finite value."""
    return masked_softmax_(q @ k.swapaxes(-1, -2), mask, scale)


def masked_softmax_(scores, mask=None, scale: float = 1.0):
    """softmax(scale * scores) over the last axis, masked scores set to the dtype's most
    negative finite value, computed in place in ``scores`` (returned)."""
    xp = get_array_module(scores)
    if scale != 1.0:
        scores *= scale
    if mask is not None:
        xp.copyto(scores, xp.asarray(backend.finfo(scores.dtype).min, dtype=scores.dtype),
                  where=~mask)
    scores -= scores.max(axis=-1, keepdims=True)   # softmax's stabilising shift, in place
    xp.exp(scores, out=scores)
    scores /= scores.sum(axis=-1, keepdims=True)
    return scores


def masked_softmax_grad_(dp, weights, mask=None):
    """dS = P * (dP - sum(dP * P)), zero where masked, computed in place in ``dp``."""
    ds = dp
    ds -= (dp * weights).sum(axis=-1, keepdims=True)
    ds *= weights
    if mask is not None:
        ds *= mask
    return ds


class Attention(Function):
    """Scaled dot-product attention, softmax(q k^T / sqrt(d) + mask) v, as one node.

    q (B, h, Tq, d), k and v (B, h, Tk, d); ``mask`` is boolean, broadcastable to
    (B, h, Tq, Tk), True where attention is allowed. Masked scores are set to the dtype's
    most negative finite value (not -1e9, which overflows in float16), so a masked
    position gets exactly zero weight and a fully masked row stays finite (uniform).
    Optional dropout on the attention weights: P' = D * P with D the scaled keep mask (P'
    is P without dropout). Backward: dV = P'^T g, dP = D * (g V^T),
    dS = P * (dP - sum(dP * P)), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).
    """

    def forward(self, q, k, v, mask=None, dropout=0.0):
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        weights = self.weights_of(q, k, mask)                    # (B, h, Tq, Tk)
        self.weights, self.mask = weights, mask
        self.drop_mask = None
        if dropout:
            self.drop_mask, weights = self.drop(weights, dropout)
        self.save_for_backward(q, k, v, weights)
        return self.product(weights, v)                          # (B, h, Tq, d)

    def backward(self, grad):
        q, k, v, dropped = self.saved
        need_q, need_k, need_v = self.needs_input_grad[:3]
        gv = self.product(dropped.swapaxes(-1, -2), grad) if need_v else None
        if not (need_q or need_k):
            return None, None, gv
        dp = self.product(grad, v.swapaxes(-1, -2))
        # Masked scores are constants: a fully masked row's uniform weights must not send
        # gradient to q or k.
        ds = self.scores_grad(self.weights, dp)
        gq = self.product(ds, k, self.scale) if need_q else None
        gk = self.product(ds.swapaxes(-1, -2), q, self.scale) if need_k else None
        return gq, gk, gv

    # The steps a faster variant replaces (tinytf.fast.cpu.ops.RowParallelAttention,
    # tinytf.fast.cuda.ops.FusedAttention).
    def weights_of(self, q, k, mask):
        """P = softmax(q k^T / sqrt(d), masked)."""
        return attention_weights(q, k, mask, self.scale)

    def drop(self, weights, p: float):
        """Dropout on the weights: (the scaled keep mask D, D * P)."""
        mask = keep_mask(get_array_module(weights), weights.shape, p, weights.dtype)
        return mask, weights * mask

    def product(self, a, b, alpha: float = 1.0):
        """alpha * (a @ b)."""
        out = a @ b
        if alpha != 1.0:
            out *= alpha
        return out

    def scores_grad(self, weights, dp):
        """dS = P * (dP' - sum(dP' * P)) with dP' = D * dP (the dropout mask D, if any),
        zero where masked (``dp`` is overwritten)."""
        if self.drop_mask is not None:
            dp *= self.drop_mask
        return masked_softmax_grad_(dp, weights, self.mask)
