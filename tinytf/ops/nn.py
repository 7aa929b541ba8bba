"""Neural-network ops with hand-written, fused backward passes.

Each of these could be composed from primitives, but the composed graph would save many
intermediate arrays and be slower and less stable. Here each op saves only what its
closed-form gradient needs.
"""
from __future__ import annotations

import math
import sys

import numpy as np

from .. import backend, kernels
from ..backend import get_array_module, scatter_add
from ..tensor import Function


def _softmax(x, axis):
    """Numerically stable softmax: subtracting the max keeps exp() from overflowing."""
    xp = get_array_module(x)
    out = x - x.max(axis=axis, keepdims=True)
    xp.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


class Softmax(Function):
    """y = exp(x) / sum(exp(x)); dL/dx = y * (g - sum(g * y))."""

    def forward(self, x, axis=-1):
        self.axis = axis
        y = kernels.softmax_forward(x, axis) if kernels.fused(x) else _softmax(x, axis)
        self.save_for_backward(y)
        return y

    def backward(self, grad):
        (y,) = self.saved
        if kernels.fused(y):
            return kernels.softmax_backward(y, grad, self.axis)
        return y * (grad - (grad * y).sum(axis=self.axis, keepdims=True))


class LogSoftmax(Function):
    """y = x - logsumexp(x); dL/dx = g - softmax(x) * sum(g)."""

    def forward(self, x, axis=-1):
        xp = get_array_module(x)
        self.axis = axis
        if kernels.fused(x):
            self.save_for_backward(kernels.softmax_forward(x, axis, log=True))
            return self.saved[0]
        y = x - x.max(axis=axis, keepdims=True)
        y -= xp.log(xp.exp(y).sum(axis=axis, keepdims=True))
        self.save_for_backward(y)
        return y

    def backward(self, grad):
        (y,) = self.saved
        if kernels.fused(y):
            return kernels.softmax_backward(y, grad, self.axis, log=True)
        xp = get_array_module(y)
        return grad - xp.exp(y) * grad.sum(axis=self.axis, keepdims=True)


class LayerNorm(Function):
    """Layer normalisation over the last axis (biased variance, eps inside the sqrt).

    y = x_hat * w + b, x_hat = (x - mean) * rstd, rstd = 1 / sqrt(var + eps).
    Closed-form backward (saving x_hat and rstd, not the graph):
    dx = rstd * (dx_hat - mean(dx_hat) - x_hat * mean(dx_hat * x_hat)), dx_hat = g * w.
    """

    def forward(self, x, weight=None, bias=None, eps=1e-5):
        if kernels.fused(x, weight, bias):
            out, x_hat, rstd = kernels.layer_norm_forward(x, weight, bias, eps)
            self.save_for_backward(x_hat, rstd, weight)
            return out
        xp = get_array_module(x)
        d = x.shape[-1]
        # Few passes, one new buffer besides the output: x_hat starts as x - mean and is
        # scaled in place; the variance is the row-wise dot product of x - mean with itself
        # (einsum: no squared temporary; subtracting the mean first keeps float32 accurate).
        x_hat = x - x.mean(axis=-1, keepdims=True)
        var = xp.einsum("...i,...i->...", x_hat, x_hat)[..., None]
        rstd = 1.0 / xp.sqrt(var * (1.0 / d) + eps)
        x_hat *= rstd
        self.save_for_backward(x_hat, rstd, weight)
        out = x_hat * weight if weight is not None else x_hat.copy()
        if bias is not None:
            out += bias
        return out

    def backward(self, grad):
        x_hat, rstd, weight = self.saved
        if kernels.fused(x_hat):
            need = self.needs_input_grad + (False, False)
            return kernels.layer_norm_backward(grad, x_hat, rstd, weight, *need[:3])[:len(self.inputs)]
        xp = get_array_module(grad)
        d = x_hat.shape[-1]
        gx = None
        if self.needs_input_grad[0]:
            # The two row reductions, mean(dx_hat) and mean(dx_hat * x_hat), then the rest
            # in one buffer: gx = rstd * (dx_hat - mean(dx_hat) - x_hat * mean(dx_hat x_hat)).
            dx_hat = grad * weight if weight is not None else grad
            mean_dx_hat = dx_hat.mean(axis=-1, keepdims=True)
            mean_dot = xp.einsum("...i,...i->...", dx_hat, x_hat)[..., None] * (1.0 / d)
            gx = x_hat * mean_dot
            xp.subtract(dx_hat, gx, out=gx)
            gx -= mean_dx_hat
            gx *= rstd
        result = [gx]
        # The parameter gradients sum over every row: (N, d) views, column sums (einsum for
        # sum(grad * x_hat) without the product array).
        g2, x_hat2 = grad.reshape(-1, d), x_hat.reshape(-1, d)
        if len(self.inputs) > 1:
            result.append(xp.einsum("ij,ij->j", g2, x_hat2) if self.needs_input_grad[1]
                          else None)
        if len(self.inputs) > 2:
            result.append(g2.sum(axis=0) if self.needs_input_grad[2] else None)
        return tuple(result)


class Dropout(Function):
    """Inverted dropout: zero each element with probability p, scale the rest by 1/(1-p).

    The scaled mask is saved; backward multiplies by the same mask.
    """

    def forward(self, x, p):
        xp = get_array_module(x)
        if kernels.fused(x):
            out, self.mask = kernels.dropout_forward(x, p)
            return out
        keep = backend.rng(xp).random(x.shape, dtype=np.float32) >= p
        self.mask = keep.astype(x.dtype)
        self.mask *= 1.0 / (1.0 - p)
        return x * self.mask

    def backward(self, grad):
        return _dropout_grad(grad, self.mask)


def _dropout_grad(grad, mask):
    """Dropout's backward: grad * mask (the scaled keep mask), one launch on the GPU."""
    if kernels.fused(grad, mask):
        return kernels.dropout_backward(grad, mask)
    return grad * mask


class DropoutAdd(Function):
    """residual + dropout(x): the residual connection around a sub-layer, one node.

    ``x`` and ``residual`` have one shape; the result has NumPy's dtype of the sum (a bf16
    sub-layer output added to the float32 residual stream is float32). The random mask
    is drawn as :class:`Dropout` draws it. Backward: d(residual) = g, dx = g * mask.
    On the GPU the forward is one launch (``kernels.dropout_forward`` with a residual).
    """

    def forward(self, x, residual, p):
        if x.shape != residual.shape:
            raise ValueError(f"dropout_add: x {x.shape} and residual {residual.shape} "
                             f"must have one shape")
        xp = get_array_module(x)
        if kernels.fused(x, residual):
            out, self.mask = kernels.dropout_forward(x, p, residual=residual)
            return out
        keep = backend.rng(xp).random(x.shape, dtype=np.float32) >= p
        self.mask = keep.astype(x.dtype)
        self.mask *= 1.0 / (1.0 - p)
        out = x * self.mask
        if out.dtype == np.result_type(out, residual):
            out += residual          # in place: no second array of the activations' size
            return out
        return residual + out

    def backward(self, grad):
        gx = _dropout_grad(grad, self.mask) if self.needs_input_grad[0] else None
        return gx, grad


class Embedding(Function):
    """Rows of ``weight`` picked by integer ``ids``; backward scatter-adds into the rows.

    A repeated id receives the sum of its gradients (``add.at``, not ``g[idx] += ...``).
    """

    def forward(self, weight, ids):
        self.ids, self.shape = ids, weight.shape
        return weight[ids]

    def backward(self, grad):
        xp = get_array_module(grad)
        v, d = self.shape
        if xp is not np:  # CuPy's scatter_add takes row indices at full speed
            gw = xp.zeros(self.shape, dtype=grad.dtype)
            scatter_add(gw, self.ids.reshape(-1), grad.reshape(-1, d))
            return gw, None
        # Scatter element by element into the flattened table: element j of row i goes to
        # i * d + j. NumPy's add.at is ~3x faster with such flat indices than with row indices.
        flat = (self.ids.reshape(-1, 1).astype(np.intp) * d + np.arange(d)).reshape(-1)
        gw = np.zeros(v * d, dtype=grad.dtype)
        scatter_add(gw, flat, grad.reshape(-1))
        return gw.reshape(v, d), None


class CrossEntropy(Function):
    """Label-smoothed cross-entropy of logits (N, V) against integer targets (N,).

    With smoothing eps, the target distribution is (1 - eps) on the true class plus eps / V
    on every class (as in PyTorch), so per row
    loss = -(1 - eps) * logp[t] - (eps / V) * sum_j logp[j].
    Rows whose target is ``ignore_index`` contribute nothing. Reductions: "sum", "mean"
    (over non-ignored rows) or "none". No one-hot is built: the forward computes the
    gradient softmax - target in place, in the one (N, V) buffer it keeps.
    """

    ROWS_PER_BLOCK = 64  # 64 rows x 8k classes x 4 bytes = 2 MB: one block fits in cache

    # The (N, V) buffer is large (130 MB for 4k tokens x 8k classes), and in a training step
    # writing fresh memory costs more than the arithmetic done in it (page faults: measured
    # ~250 ms of CPU per step, against ~30 ms to rewrite memory already in use). So the buffer
    # that backward hands out is kept here and reused by the next forward, provided nothing
    # else refers to it by then (the engine drops a gradient once it has been used).
    _spare = None

    @classmethod
    def _buffer_like(cls, logits):
        """An uninitialised array like ``logits``: the last backward's buffer if it is free."""
        buf, cls._spare = cls._spare, None
        # 2 references when free: ``buf`` here and getrefcount's own argument (a view of
        # the buffer, or a caller holding it, adds one).
        if (buf is not None and type(buf) is type(logits) and buf.shape == logits.shape
                and buf.dtype == logits.dtype and sys.getrefcount(buf) == 2):
            return buf
        return get_array_module(logits).empty_like(logits)

    def forward(self, logits, target, label_smoothing=0.0, ignore_index=None,
                reduction="mean"):
        xp = get_array_module(logits)
        n, v = logits.shape
        eps = float(label_smoothing)
        if kernels.fused(logits):
            loss, probs, weights = kernels.cross_entropy_forward(logits, target, eps, ignore_index)
            return self._reduce(loss, probs, weights, reduction)
        valid = None if ignore_index is None else target != ignore_index
        safe_target = target if valid is None else xp.where(valid, target, 0)
        rows = xp.arange(n)

        # One (N, V) buffer does all the work (each full pass over it costs as much as a
        # small GEMM): z = x - max, then exp(z) in place, then the gradient in place, a
        # block of rows at a time so that the passes stay in cache.
        # With lse = log sum exp(z), logp = z - lse, so the two loss terms need only
        # z[t] and sum(z), taken before z is overwritten:
        # loss = -(1 - eps) (z[t] - lse) - (eps / V) (sum(z) - V lse).
        grad = self._buffer_like(logits)
        loss = xp.empty(n, dtype=logits.dtype)
        for lo in range(0, n, self.ROWS_PER_BLOCK):
            hi = min(lo + self.ROWS_PER_BLOCK, n)
            r, t = rows[:hi - lo], safe_target[lo:hi]
            buf = grad[lo:hi]
            xp.subtract(logits[lo:hi], logits[lo:hi].max(axis=1, keepdims=True), out=buf)
            z_target = buf[r, t]
            z_sum = buf.sum(axis=1) if eps else None
            xp.exp(buf, out=buf)
            total = buf.sum(axis=1, keepdims=True)
            lse = xp.log(total[:, 0])
            block_loss = (lse - z_target) * (1.0 - eps)
            if eps:
                block_loss += (lse - z_sum * (1.0 / v)) * eps
            loss[lo:hi] = block_loss
            # buf becomes d(loss_i)/d(logits_i) = softmax - smoothed one-hot.
            buf *= 1.0 / total
            if eps:
                buf -= eps / v
            buf[r, t] -= 1.0 - eps
        weights = xp.ones(n, dtype=logits.dtype) if valid is None else valid.astype(logits.dtype)
        loss *= weights
        return self._reduce(loss, grad, weights, reduction)

    def _reduce(self, loss, probs, weights, reduction):
        if reduction not in ("none", "sum", "mean"):
            raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
        self.reduction, self.probs, self.weights = reduction, probs, weights
        if reduction == "none":
            return loss
        if reduction == "sum":
            return loss.sum()
        # The count stays a 0-d array on the device: reading it on the host would stall
        # every GPU step until the forward pass had finished.
        xp = get_array_module(loss)
        self.count = xp.maximum(weights.sum(), 1.0).astype(loss.dtype)
        return loss.sum() / self.count

    def backward(self, grad):
        if self.reduction == "none":
            scale = grad * self.weights
        else:
            scale = self.weights * (grad / self.count if self.reduction == "mean" else grad)
        # The node is freed after this single backward, so its buffer can be scaled in place
        # instead of allocating another (N, V) array.
        probs, self.probs = self.probs, None
        probs *= scale.astype(probs.dtype, copy=False)[:, None]
        if get_array_module(probs) is np:  # (CuPy keeps freed memory in its own pool)
            CrossEntropy._spare = probs
        return probs, None


def attention_weights(q, k, mask=None, scale: float = 1.0):
    """softmax(scale * q k^T) with masked scores set to the dtype's most negative finite value."""
    xp = get_array_module(q)
    scores = kernels.matmul(q, k.swapaxes(-1, -2), alpha=scale)
    if kernels.fused(scores):
        return kernels.softmax_forward(scores, -1, mask=mask)
    if mask is not None:
        xp.copyto(scores, xp.asarray(backend.finfo(scores.dtype).min, dtype=scores.dtype),
                  where=~mask)
    return _softmax(scores, -1)


class Attention(Function):
    """Scaled dot-product attention, softmax(q k^T / sqrt(d) + mask) v, fused.

    q (B, h, Tq, d), k and v (B, h, Tk, d); ``mask`` is boolean, broadcastable to
    (B, h, Tq, Tk), True where attention is allowed. Masked scores are set to the dtype's
    most negative finite value (not -1e9, which overflows in float16), so a masked
    position gets exactly zero weight and a fully masked row stays finite (uniform).
    Optional dropout on the attention weights. Backward, with P the weights:
    dV = P^T g, dP = g V^T, dS = P * (dP - sum(dP * P)), dQ = dS K / sqrt(d), dK = dS^T Q / sqrt(d).
    """

    def forward(self, q, k, v, mask=None, dropout=0.0):
        xp = get_array_module(q)
        # The 1/sqrt(d) scale rides on the products (cuBLAS's alpha on the GPU): no pass
        # over q or the scores of its own, forward or backward.
        self.scale = 1.0 / math.sqrt(q.shape[-1])
        weights = attention_weights(q, k, mask, self.scale)      # (B, h, Tq, Tk)
        self.weights, self.mask = weights, mask
        if dropout:
            keep = backend.rng(xp).random(weights.shape, dtype=np.float32) >= dropout
            self.drop_mask = keep.astype(weights.dtype) * (1.0 / (1.0 - dropout))
            weights = weights * self.drop_mask
        else:
            self.drop_mask = None
        self.save_for_backward(q, k, v, weights)
        return kernels.matmul(weights, v)                        # (B, h, Tq, d)

    def backward(self, grad):
        q, k, v, dropped = self.saved
        weights = self.weights
        scale = self.scale
        need_q, need_k, need_v = self.needs_input_grad[:3]
        gv = kernels.matmul(dropped.swapaxes(-1, -2), grad) if need_v else None
        if not (need_q or need_k):
            return None, None, gv
        dp = kernels.matmul(grad, v.swapaxes(-1, -2))
        if self.drop_mask is not None:
            dp *= self.drop_mask
        # Masked scores are constants: a fully masked row's uniform weights must not send
        # gradient to q or k (the fused kernel zeroes them as it writes).
        if kernels.fused(weights):
            ds = kernels.softmax_backward(weights, dp, mask=self.mask)
        else:
            ds = dp
            ds -= (dp * weights).sum(axis=-1, keepdims=True)
            ds *= weights
            if self.mask is not None:
                ds *= self.mask
        gq = kernels.matmul(ds, k, alpha=scale) if need_q else None
        gk = kernels.matmul(ds.swapaxes(-1, -2), q, alpha=scale) if need_k else None
        return gq, gk, gv
