"""Functional interface, mirroring ``torch.nn.functional`` where a counterpart exists.

Arguments that are integer ids or boolean masks may be arrays or Tensors; they never get
a gradient. Every op is called through the op table (:mod:`tinytf.engine.dispatch`): the reference
class of :mod:`tinytf.ops`, or what :mod:`tinytf.fast` or ``amp.autocast`` put in its place.
"""
from __future__ import annotations

import math

from tinytf.engine.dispatch import impl
from tinytf.engine.tensor import Tensor, array_of
from tinytf.ops.attention import attention_weights


def _int_tensor(x) -> Tensor:
    """Integer ids as a Tensor (no gradient)."""
    return x if isinstance(x, Tensor) else Tensor(x)


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None,
           activation: str | None = None) -> Tensor:
    """x @ weight.T + bias, weight of shape (out, in); one 2-D GEMM whatever x's rank.

    ``activation="relu"`` gives relu(x @ weight.T + bias) as one node (the feed-forward
    network's first layer), equal to ``relu(linear(x, weight, bias))``.
    """
    inputs = (x, weight) if bias is None else (x, weight, bias)
    return impl.Linear.apply(*inputs, activation=activation)


def relu(x: Tensor) -> Tensor:
    """max(x, 0)."""
    return impl.ReLU.apply(x)


def gelu(x: Tensor) -> Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the tanh form of GELU."""
    return impl.GELU.apply(x)


def softmax(x: Tensor, axis: int = -1) -> Tensor:
    """exp(x_i) / sum_j exp(x_j) along ``axis``."""
    return impl.Softmax.apply(x, axis=axis)


def log_softmax(x: Tensor, axis: int = -1) -> Tensor:
    """x_i - log sum_j exp(x_j) along ``axis``."""
    return impl.LogSoftmax.apply(x, axis=axis)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance)."""
    inputs = [x] + [t for t in (weight, bias) if t is not None]
    if weight is None and bias is not None:
        raise ValueError("layer_norm: a bias without a weight is not supported")
    return impl.LayerNorm.apply(*inputs, eps=eps)


def dropout(x: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """Zero elements with probability ``p`` and scale the rest by 1/(1-p) (training only)."""
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return x
    if p == 1.0:  # everything dropped, as in PyTorch
        return x * 0.0
    return impl.Dropout.apply(x, p=p)


def dropout_add(x: Tensor, residual: Tensor, p: float = 0.5, training: bool = True) -> Tensor:
    """residual + dropout(x, p): a residual connection's sum as one node (same shapes).

    Equal to ``residual + dropout(x, p, training)``, drawing the same random mask.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return residual + x
    if p == 1.0:
        return residual + x * 0.0
    return impl.DropoutAdd.apply(x, residual, p=p)


def embedding(ids, weight: Tensor) -> Tensor:
    """weight[ids]: rows of the embedding matrix; repeated ids accumulate gradient."""
    return impl.Embedding.apply(weight, _int_tensor(ids))


def masked_fill(x: Tensor, mask, value: float) -> Tensor:
    """``value`` where the boolean ``mask`` is True, ``x`` elsewhere."""
    return impl.MaskedFill.apply(x, mask=array_of(mask), value=value)


def cross_entropy(logits: Tensor, target, label_smoothing: float = 0.0,
                  ignore_index: int | None = None, reduction: str = "mean") -> Tensor:
    """Cross-entropy of logits (N, V) against integer targets (N,), as in PyTorch.

    Smoothing eps puts 1 - eps on the target and eps / V on every class; rows whose target
    equals ``ignore_index`` are skipped, and "mean" divides by the number of the others
    (when every row is ignored, "mean" returns 0 where PyTorch returns NaN: an empty
    batch should not poison a sum of losses).
    """
    return impl.CrossEntropy.apply(logits, _int_tensor(target), label_smoothing=label_smoothing,
                                   ignore_index=ignore_index, reduction=reduction)


def attention(q: Tensor, k: Tensor, v: Tensor, mask=None, dropout: float = 0.0,
              training: bool = False, return_weights: bool = False):
    """softmax(q k^T / sqrt(d_k), masked) v for q (B, h, Tq, d), k and v (B, h, Tk, d).

    ``mask``: boolean, broadcastable to (B, h, Tq, Tk), True where attending is allowed.
    With ``return_weights`` also returns the attention weights array (no gradient).
    """
    mask = array_of(mask)
    out = impl.Attention.apply(q, k, v, mask=mask, dropout=dropout if training else 0.0)
    if not return_weights:
        return out
    return out, attention_weights(q.data, k.data, mask, 1.0 / math.sqrt(q.shape[-1]))


def split(x: Tensor, sizes, axis: int = 0) -> tuple:
    """``x`` cut along ``axis`` into pieces (views), as ``torch.split``.

    ``sizes`` is an int (every piece that long, the last one shorter if need be) or a list
    of lengths that add up to ``x.shape[axis]``. One node with several outputs: backward
    writes the pieces' gradients into one array.
    """
    n = x.shape[axis]
    if isinstance(sizes, int):
        if sizes < 1:
            raise ValueError(f"split: a piece size must be >= 1, got {sizes}")
        sizes = [min(sizes, n - lo) for lo in range(0, n, sizes)] or [0]
    return impl.Split.apply(x, sizes=list(sizes), axis=axis)


def split_heads(x: Tensor, n_heads: int, parts: int = 1):
    """(B, T, parts*h*d_k) -> ``parts`` tensors (B, h, T, d_k), views of ``x``; one
    tensor when ``parts`` is 1.

    For a fused projection such as [Q | K | V] (parts=3): each part cut into its heads,
    heads before positions, as attention wants them. One node (see ``impl.SplitHeads``).
    """
    return impl.SplitHeads.apply(x, n_heads=n_heads, parts=parts)


def merge_heads(x: Tensor) -> Tensor:
    """(B, h, T, d_k) -> (B, T, h*d_k): the heads side by side again (eq. 4's Concat)."""
    return impl.MergeHeads.apply(x)


def cat(tensors, axis: int = 0) -> Tensor:
    """Concatenate tensors along an existing axis."""
    return impl.Concatenate.apply(*tensors, axis=axis)


def stack(tensors, axis: int = 0) -> Tensor:
    """Stack tensors along a new axis."""
    return impl.Stack.apply(*tensors, axis=axis)


def where(condition, a, b) -> Tensor:
    """``a`` where ``condition`` is True, else ``b`` (broadcasting)."""
    a = a if isinstance(a, Tensor) else (b.coerce(a) if isinstance(b, Tensor) else Tensor(a))
    b = b if isinstance(b, Tensor) else a.coerce(b)
    return impl.Where.apply(a, b, condition=array_of(condition))
