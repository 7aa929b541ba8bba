"""Functional interface, mirroring ``torch.nn.functional`` where a counterpart exists.

Arguments that are integer ids or boolean masks may be arrays or Tensors; they never get
a gradient. Every op is called through the op table (:mod:`tinytf.engine.dispatch`): the reference
class of :mod:`tinytf.ops`, or the faster one that :mod:`tinytf.fast` installed for the
inputs' device. Under :func:`tinytf.nn.amp.autocast` the products and the range-sensitive
ops cast their inputs here, in the open (``amp.compute_dtype``, ``amp.cast_inputs``).
"""
from __future__ import annotations

import math

from tinytf.engine import backend
from tinytf.engine.dispatch import impl
from tinytf.engine.tensor import Tensor, array_of
from tinytf.nn import amp
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
    return impl.Linear.apply(*inputs, activation=activation,
                             compute_dtype=amp.compute_dtype("linear", x))


def relu(x: Tensor) -> Tensor:
    """max(x, 0)."""
    return impl.ReLU.apply(x)


def gelu(x: Tensor) -> Tensor:
    """0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))), the tanh form of GELU (PyTorch's
    ``gelu(x, approximate="tanh")``)."""
    return impl.GELU.apply(x)


def sigmoid(x: Tensor) -> Tensor:
    """1 / (1 + e^-x)."""
    return impl.Sigmoid.apply(x)


def tanh(x: Tensor) -> Tensor:
    """(e^x - e^-x) / (e^x + e^-x)."""
    return impl.Tanh.apply(x)


def softplus(x: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:
    """log(1 + e^(beta x)) / beta; x itself where beta x > threshold (as PyTorch)."""
    return impl.Softplus.apply(x, beta=beta, threshold=threshold)


def silu(x: Tensor) -> Tensor:
    """x * sigmoid(x) (swish)."""
    return impl.SiLU.apply(x)


def logsumexp(x: Tensor, dim: int = -1, keepdim: bool = False) -> Tensor:
    """log sum_j exp(x_j) along ``dim``, without overflow."""
    return impl.LogSumExp.apply(x, axis=dim, keepdims=keepdim)


def softmax(x: Tensor, axis: int = -1, *, dim: int | None = None) -> Tensor:
    """exp(x_i) / sum_j exp(x_j) along ``axis`` (or PyTorch's ``dim``)."""
    return impl.Softmax.apply(*amp.cast_inputs("softmax", x), axis=axis if dim is None else dim)


def log_softmax(x: Tensor, axis: int = -1, *, dim: int | None = None) -> Tensor:
    """x_i - log sum_j exp(x_j) along ``axis`` (or PyTorch's ``dim``)."""
    return impl.LogSoftmax.apply(*amp.cast_inputs("log_softmax", x),
                                 axis=axis if dim is None else dim)


def layer_norm(x: Tensor, weight: Tensor | None = None, bias: Tensor | None = None,
               eps: float = 1e-5) -> Tensor:
    """(x - mean) / sqrt(var + eps) * weight + bias over the last axis (biased variance)."""
    inputs = [x] + [t for t in (weight, bias) if t is not None]
    if weight is None and bias is not None:
        raise ValueError("layer_norm: a bias without a weight is not supported")
    return impl.LayerNorm.apply(*amp.cast_inputs("layer_norm", *inputs), eps=eps)


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
    """Cross-entropy of logits (..., V) against integer targets (...), as in PyTorch but
    with the classes last (PyTorch's (N, C, d1, ...) puts them second).

    Smoothing eps puts 1 - eps on the target and eps / V on every class; rows whose target
    equals ``ignore_index`` are skipped, and "mean" divides by the number of the others
    (when every row is ignored, "mean" returns 0 where PyTorch returns NaN: an empty
    batch should not poison a sum of losses). "none" gives the loss of each row, shaped
    like ``target``.
    """
    target = _int_tensor(target)
    lead = logits.shape[:-1]
    if target.shape != lead:
        raise ValueError(f"cross_entropy: logits {logits.shape} want targets of shape {lead}, "
                         f"got {target.shape}")
    if logits.ndim != 2:
        logits, target = logits.reshape(-1, logits.shape[-1]), target.reshape(-1)
    loss = impl.CrossEntropy.apply(*amp.cast_inputs("cross_entropy", logits, target),
                                   label_smoothing=label_smoothing, ignore_index=ignore_index,
                                   reduction=reduction)
    return loss.reshape(lead) if reduction == "none" and len(lead) != 1 else loss


def nll_loss(log_probs: Tensor, target, ignore_index: int | None = None,
             reduction: str = "mean") -> Tensor:
    """-log_probs[..., target]: the negative log-likelihood of integer targets (...) under
    log-probabilities (..., C) (classes last); "mean" over the rows not ``ignore_index``."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    t = array_of(target)
    lead = log_probs.shape[:-1]
    if tuple(t.shape) != lead:
        raise ValueError(f"nll_loss: log_probs {log_probs.shape} want targets of shape {lead}, "
                         f"got {tuple(t.shape)}")
    xp = backend.get_array_module(log_probs.data)
    flat, t = log_probs.reshape(-1, log_probs.shape[-1]), xp.asarray(t).reshape(-1)
    keep = xp.ones(t.shape, dtype=bool) if ignore_index is None else t != ignore_index
    picked = flat[xp.arange(t.size), xp.where(keep, t, 0)]
    loss = -(picked * Tensor(keep.astype(flat.dtype)))
    if reduction == "none":
        return loss.reshape(lead)
    total = loss.sum()
    return total if reduction == "sum" else total * (1.0 / max(int(keep.sum()), 1))


def mse_loss(input: Tensor, target, reduction: str = "mean") -> Tensor:  # noqa: A002
    """(input - target)^2, averaged ("mean"), summed ("sum") or per element ("none")."""
    d = input - target
    return _reduced(d * d, reduction)


def binary_cross_entropy_with_logits(logits: Tensor, target, reduction: str = "mean") -> Tensor:
    """-[y log s(x) + (1 - y) log(1 - s(x))], s the sigmoid, computed from the logits x
    without overflow; targets y in [0, 1] of the logits' shape."""
    target = target if isinstance(target, Tensor) else logits.coerce(target)
    return impl.BinaryCrossEntropyWithLogits.apply(logits, target, reduction=reduction)


def _reduced(loss: Tensor, reduction: str) -> Tensor:
    """``loss`` itself, its sum or its mean."""
    if reduction not in ("none", "sum", "mean"):
        raise ValueError(f"reduction must be 'mean', 'sum' or 'none', got {reduction!r}")
    return loss if reduction == "none" else (loss.sum() if reduction == "sum" else loss.mean())


# ----- convolution and pooling (ops/conv.py, ops/pool.py) ----------------------------------

def as_tuple(value, d: int, name: str) -> tuple:
    """An int or a d-tuple as a d-tuple of ints."""
    values = tuple(value) if isinstance(value, (tuple, list)) else (value,) * d
    if len(values) != d or not all(isinstance(v, int) for v in values):
        raise ValueError(f"{name} must be an int or {d} ints, got {value!r}")
    return values


def _padding(padding, kernel, dilation, d: int) -> tuple:
    """``padding`` as a d-tuple; "valid" is 0 and "same" keeps the length at stride 1."""
    if padding == "valid":
        return (0,) * d
    if padding == "same":
        total = [dl * (k - 1) for k, dl in zip(kernel, dilation)]
        if any(t % 2 for t in total):
            raise ValueError("padding='same' needs an odd (dilated) kernel here: padding is "
                             "symmetric")
        return tuple(t // 2 for t in total)
    return as_tuple(padding, d, "padding")


def _conv(x, weight, bias, stride, padding, dilation, groups, d):
    """conv1d / conv2d: checks the ranks and settles the tuples."""
    if x.ndim != d + 2 or weight.ndim != d + 2:
        raise ValueError(f"conv{d}d wants input (N, C, {'L' if d == 1 else 'H, W'}) and weight "
                         f"of {d + 2} dimensions, got {x.shape} and {weight.shape}")
    dilation = as_tuple(dilation, d, "dilation")
    padding = _padding(padding, weight.shape[2:], dilation, d)
    inputs = (x, weight) if bias is None else (x, weight, bias)
    return impl.Conv.apply(*inputs, stride=as_tuple(stride, d, "stride"), padding=padding,
                           dilation=dilation, groups=groups)


def conv1d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1) -> Tensor:
    """1-D convolution (cross-correlation) of x (N, C, L) with weight (O, C/groups, k),
    plus bias (O,); ``padding`` an int, "valid" or "same"."""
    return _conv(x, weight, bias, stride, padding, dilation, groups, 1)


def conv2d(x: Tensor, weight: Tensor, bias: Tensor | None = None, stride=1, padding=0,
           dilation=1, groups: int = 1) -> Tensor:
    """2-D convolution of x (N, C, H, W) with weight (O, C/groups, kh, kw), plus bias (O,)."""
    return _conv(x, weight, bias, stride, padding, dilation, groups, 2)


def _pool(op, x, kernel_size, stride, padding, d, **extra):
    """max / avg pooling over the last d dimensions; ``stride`` defaults to the kernel."""
    if x.ndim != d + 2:
        raise ValueError(f"{op.__name__.lower()}{d}d wants an input of {d + 2} dimensions "
                         f"(N, C, ...), got {x.shape}")
    kernel = as_tuple(kernel_size, d, "kernel_size")
    stride = kernel if stride is None else as_tuple(stride, d, "stride")
    padding = as_tuple(padding, d, "padding")
    if any(2 * p > k for p, k in zip(padding, kernel)):
        raise ValueError(f"padding {padding} must be at most half the kernel {kernel}")
    return op.apply(x, kernel=kernel, stride=stride, padding=padding, **extra)


def max_pool1d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1) -> Tensor:
    """The maximum of each window of x (N, C, L)."""
    return _pool(impl.MaxPool, x, kernel_size, stride, padding, 1,
                 dilation=as_tuple(dilation, 1, "dilation"))


def max_pool2d(x: Tensor, kernel_size, stride=None, padding=0, dilation=1) -> Tensor:
    """The maximum of each window of x (N, C, H, W)."""
    return _pool(impl.MaxPool, x, kernel_size, stride, padding, 2,
                 dilation=as_tuple(dilation, 2, "dilation"))


def avg_pool1d(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """The mean of each window of x (N, C, L), padding counted."""
    return _pool(impl.AvgPool, x, kernel_size, stride, padding, 1)


def avg_pool2d(x: Tensor, kernel_size, stride=None, padding=0) -> Tensor:
    """The mean of each window of x (N, C, H, W), padding counted."""
    return _pool(impl.AvgPool, x, kernel_size, stride, padding, 2)


def attention(q: Tensor, k: Tensor, v: Tensor, mask=None, dropout: float = 0.0,
              training: bool = False, return_weights: bool = False):
    """softmax(q k^T / sqrt(d_k), masked) v for q (B, h, Tq, d), k and v (B, h, Tk, d).

    ``mask``: boolean, broadcastable to (B, h, Tq, Tk), True where attending is allowed.
    With ``return_weights`` also returns the attention weights array (no gradient).
    """
    mask = array_of(mask)
    out = impl.Attention.apply(*amp.cast_inputs("attention", q, k, v), mask=mask,
                               dropout=dropout if training else 0.0)
    if not return_weights:
        return out
    return out, attention_weights(q.data, k.data, mask, 1.0 / math.sqrt(q.shape[-1]))


def split(x: Tensor, sizes, axis: int = 0, *, dim: int | None = None) -> tuple:
    """``x`` cut along ``axis`` into pieces (views), as ``torch.split``.

    ``sizes`` is an int (every piece that long, the last one shorter if need be) or a list
    of lengths that add up to ``x.shape[axis]``. One node with several outputs: backward
    writes the pieces' gradients into one array.
    """
    axis = axis if dim is None else dim
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


def cat(tensors, axis: int = 0, *, dim: int | None = None) -> Tensor:
    """Concatenate tensors along an existing axis (or PyTorch's ``dim``)."""
    return impl.Concatenate.apply(*tensors, axis=axis if dim is None else dim)


def stack(tensors, axis: int = 0, *, dim: int | None = None) -> Tensor:
    """Stack tensors along a new axis (or PyTorch's ``dim``)."""
    return impl.Stack.apply(*tensors, axis=axis if dim is None else dim)


def where(condition, a, b) -> Tensor:
    """``a`` where ``condition`` is True, else ``b`` (broadcasting)."""
    a = a if isinstance(a, Tensor) else (b.coerce(a) if isinstance(b, Tensor) else Tensor(a))
    b = b if isinstance(b, Tensor) else a.coerce(b)
    return impl.Where.apply(a, b, condition=array_of(condition))
