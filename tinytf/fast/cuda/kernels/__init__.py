"""Fused GPU kernels for the hot paths: the functions that :mod:`tinytf.fast.cuda.ops` calls.

The reference ops in :mod:`tinytf.ops` are written once against ``xp``. On CuPy each
elementwise step of that code is a kernel launch (about 10 us of CPU time) and a full pass
over memory; the functions here do a whole op in one or two launches, computing in
float32 whatever the storage type (float32, float16 or bfloat16).

The op variants of :mod:`tinytf.fast.cuda.ops` (subclasses of the reference ops) test
``fused`` and otherwise run their parent's code (see docs/gpu.md for each op)::

    def forward(self, x, axis=-1):
        if not kernels.fused(x):
            return super().forward(x, axis)
        ... one kernel launch ...

``fused`` is False for NumPy arrays, for float64 (gradient checks), and when
``TINYTF_FUSED=0``, so CPU runs never come here. Importing this package never imports
CuPy; the CUDA source (:mod:`.sources`) is compiled the first time a kernel runs.

Every function returns what the NumPy op computes, to float32 rounding, in the same dtype
the NumPy op would give, so the op's backward and the rest of the graph do not change.
"""
from __future__ import annotations

import os

import numpy as np

from tinytf.engine import backend
from tinytf.fast.cuda.kernels import _runtime
from tinytf.fast.cuda.kernels.gemm import matmul, set_tf32, tf32_enabled
from tinytf.fast.cuda.kernels.sources import ELEMENTWISE_THREADS, ROWS_PER_BLOCK

__all__ = ["fused", "use_fused_kernels", "softmax_forward", "softmax_backward",
           "layer_norm_forward",
           "layer_norm_backward", "dropout_forward", "dropout_backward", "cross_entropy_forward",
           "relu_forward", "relu_backward", "add_bias_", "bias_grad", "unscale_", "adam_step",
           "matmul", "set_tf32", "tf32_enabled", "calls"]

_enabled = os.environ.get("TINYTF_FUSED", "1") != "0"

calls = _runtime.calls
"""How many times each fused function ran (benchmarks print it to show the hooks are wired)."""

_COLUMN_CHUNK = 256       # rows per block in the layer-norm parameter-gradient sums


def use_fused_kernels(flag: bool) -> None:
    """Turn the fused kernels on or off (default on; ``TINYTF_FUSED=0`` starts off). (Not
    :func:`tinytf.fast.set_enabled`, which swaps the op table's fast classes in or out.)"""
    global _enabled
    _enabled = bool(flag)


def fused(*arrays) -> bool:
    """Whether the fused kernels handle ``arrays``: all CuPy (or None) and float16/bf16/32."""
    if not _enabled:
        return False
    for a in arrays:
        if a is None:
            continue
        # NumPy arrays only while tests run the kernels on the CPU (kernels.host).
        if backend.get_array_module(a) is np and _runtime._host_executor is None:
            return False
        if _runtime.storage(a.dtype) is None:
            return False
    return True


def _rows_grid(rows: int) -> tuple:
    return (max(1, -(-rows // ROWS_PER_BLOCK)),), (32 * ROWS_PER_BLOCK,)


def _flat_grid(n: int) -> tuple:
    # Grid-stride loops: a few blocks per multiprocessor is enough to saturate memory.
    return (max(1, min(-(-n // ELEMENTWISE_THREADS), 4096)),), (ELEMENTWISE_THREADS,)


def _promote(*dtypes):
    """NumPy's promotion among float32/float16/bfloat16: equal types stay, others -> f32."""
    kinds = {np.dtype(d) for d in dtypes if d is not None}
    return kinds.pop() if len(kinds) == 1 else np.dtype(np.float32)


def _f32(xp, a):
    return None if a is None else xp.ascontiguousarray(a, dtype=np.float32)


# ----- softmax and log-softmax ---------------------------------------------------------

def _mask_view(xp, mask, shape):
    """``mask`` as a boolean 4-D view broadcast against ``shape`` (stride 0 = broadcast).

    The kernel reads element (b, h, q, k) at b*sb + h*sh + q*sq + k*sk from the view's
    first element; the view stays alive (and with it the memory) during the launch.
    """
    m = xp.asarray(mask)
    if m.dtype != np.bool_:
        m = m.astype(np.bool_)
    m = xp.broadcast_to(m, shape)
    if m.ndim > 4:  # the kernel splits a row index into at most three axes
        m = xp.ascontiguousarray(m).reshape(-1, shape[-1])
    return m.reshape((1,) * (4 - m.ndim) + m.shape)


def softmax_forward(x, axis: int = -1, mask=None, log: bool = False):
    """softmax(x) (or log_softmax with ``log``) along ``axis``.

    ``mask`` (optional, softmax over the last axis only): boolean, broadcastable to x,
    True = keep. Masked elements get weight exactly 0 and a fully masked row is uniform,
    as when the NumPy code fills masked scores with the dtype's most negative value.
    """
    xp = backend.get_array_module(x)
    axis = axis % x.ndim
    if axis != x.ndim - 1:
        if mask is not None:
            raise ValueError("kernels: a masked softmax runs over the last axis only")
        y = softmax_forward(xp.moveaxis(x, axis, -1), -1, None, log)
        return xp.moveaxis(y, -1, axis)
    _runtime.count("softmax_forward")
    xc = xp.ascontiguousarray(x)
    n = x.shape[-1]
    rows = x.size // max(n, 1)
    y = xp.empty_like(xc)
    if x.size == 0:
        return y
    m, mask_args = _mask_args(xp, mask, x.shape)
    grid, block = _rows_grid(rows)
    _runtime.launch("softmax_fwd", [_runtime.storage(x.dtype)], grid, block,
                    (xc, y, rows, n, *mask_args, int(log)))
    return y


def _mask_args(xp, mask, shape):
    """(view, (address, mH, mQ, sb, sh, sq, sk)): how a row kernel reads ``mask`` (or
    nothing when it is None) against rows of ``shape``; keep the view alive while it runs."""
    if mask is None:
        return None, (0, 1, 1, 0, 0, 0, 0)
    m = _mask_view(xp, mask, shape)
    strides = tuple(s if k > 1 else 0 for s, k in zip(m.strides, m.shape))
    return m, (_runtime.address(m), m.shape[1], m.shape[2], *strides)


def softmax_backward(y, grad, axis: int = -1, log: bool = False, mask=None):
    """dL/dx from the saved output y: y * (g - sum(g * y)); log: g - exp(y) * sum(g).

    ``mask`` (last axis only): the forward's mask; masked elements get gradient 0.
    """
    xp = backend.get_array_module(y)
    axis = axis % y.ndim
    if axis != y.ndim - 1:
        if mask is not None:
            raise ValueError("kernels: a masked softmax runs over the last axis only")
        gx = softmax_backward(xp.moveaxis(y, axis, -1), xp.moveaxis(grad, axis, -1), -1, log)
        return xp.moveaxis(gx, -1, axis)
    _runtime.count("softmax_backward")
    yc = xp.ascontiguousarray(y)
    gc = xp.ascontiguousarray(grad, dtype=y.dtype)
    dx = xp.empty_like(yc)
    n = y.shape[-1]
    rows = y.size // max(n, 1)
    if y.size:
        m, mask_args = _mask_args(xp, mask, y.shape)
        grid, block = _rows_grid(rows)
        _runtime.launch("softmax_bwd", [_runtime.storage(y.dtype)], grid, block,
                        (yc, gc, dx, rows, n, *mask_args, int(log)))
    return dx


# ----- layer norm ------------------------------------------------------------------------

def layer_norm_forward(x, weight=None, bias=None, eps: float = 1e-5):
    """(y, x_hat, rstd) of layer norm over the last axis; the op saves x_hat and rstd.

    y and x_hat have the dtype NumPy would give x * weight + bias; rstd is float32 of
    shape (..., 1). The weight and bias are read as float32.
    """
    _runtime.count("layer_norm_forward")
    xp = backend.get_array_module(x)
    out_dtype = _promote(x.dtype, None if weight is None else weight.dtype,
                         None if bias is None else bias.dtype)
    xc = xp.ascontiguousarray(x)
    d = x.shape[-1]
    rows = x.size // max(d, 1)
    w, b = _f32(xp, weight), _f32(xp, bias)
    y = xp.empty(x.shape, dtype=out_dtype)
    x_hat = xp.empty(x.shape, dtype=out_dtype)
    rstd = xp.empty(x.shape[:-1] + (1,), dtype=np.float32)
    if x.size:
        grid, block = _rows_grid(rows)
        _runtime.launch("layer_norm_fwd", [_runtime.storage(x.dtype), _runtime.storage(out_dtype)],
                        grid, block, (xc, _runtime.address(w), _runtime.address(b), y, x_hat,
                                      rstd, rows, d, eps))
    return y, x_hat, rstd


def layer_norm_backward(grad, x_hat, rstd, weight=None, need_x=True, need_weight=True,
                        need_bias=True):
    """(dx, dweight, dbias) from the saved x_hat and rstd; unneeded ones are None.

    dx = rstd * (dxh - mean(dxh) - x_hat * mean(dxh * x_hat)), dxh = g * w;
    dweight = sum over rows of g * x_hat, dbias = sum over rows of g.
    """
    _runtime.count("layer_norm_backward")
    xp = backend.get_array_module(x_hat)
    storage = _runtime.storage(x_hat.dtype)
    g = xp.ascontiguousarray(grad, dtype=x_hat.dtype)
    h = xp.ascontiguousarray(x_hat)
    d = x_hat.shape[-1]
    rows = x_hat.size // max(d, 1)
    dx = dw = db = None
    if need_x:
        dx = xp.empty_like(h)
        if rows:
            w = _f32(xp, weight)
            r = xp.ascontiguousarray(rstd, dtype=np.float32)
            grid, block = _rows_grid(rows)
            _runtime.launch("layer_norm_bwd", [storage], grid, block,
                            (g, h, r, _runtime.address(w), dx, rows, d))
    if need_weight or need_bias:
        # The parameter gradient has the dtype NumPy gives (g * x_hat).sum(rows).
        dw, db = _column_sums(xp, g, h if need_weight else None, out_dtype=x_hat.dtype)
        db = db if need_bias else None
    return dx, dw, db


def _column_sums(xp, g, h=None, out_dtype=np.float32):
    """(sum over rows of g * h or None, sum over rows of g), for 2-D-viewable contiguous g.

    Float32 sums in two launches: partial sums per chunk of rows, then the chunks' sums
    in order (deterministic), stored as ``out_dtype``. No CuPy reduction: each of those
    costs more host time than both launches together, and a step needs ~100 of these.
    """
    storage = _runtime.storage(g.dtype)
    d = g.shape[-1]
    rows = g.size // max(d, 1)
    db = xp.empty(d, dtype=out_dtype)
    dw = xp.empty(d, dtype=out_dtype) if h is not None else None
    if not rows or not d:
        db[...] = 0
        if dw is not None:
            dw[...] = 0
        return dw, db
    chunks = -(-rows // _COLUMN_CHUNK)
    db_part = xp.empty((chunks, d), dtype=np.float32)
    dw_part = xp.empty((chunks, d), dtype=np.float32) if h is not None else None
    _runtime.launch("column_sums", [storage], (-(-d // 32), chunks), (32, 8),
                    (g, _runtime.address(h), _runtime.address(dw_part), db_part, rows, d,
                     _COLUMN_CHUNK))
    _runtime.launch("column_sums_finish", [_runtime.storage(np.dtype(out_dtype))],
                    (max(1, min(-(-d // 256), 1024)),), (256,),
                    (_runtime.address(dw_part), db_part, chunks, d, _runtime.address(dw), db))
    return dw, db


def bias_grad(grad, out_dtype=None):
    """grad summed over every axis but the last (a bias's gradient), in ``out_dtype``
    (default grad's dtype).

    One pass with float32 sums, whatever the storage type.
    """
    _runtime.count("bias_grad")
    xp = backend.get_array_module(grad)
    _, db = _column_sums(xp, xp.ascontiguousarray(grad),
                         out_dtype=grad.dtype if out_dtype is None else out_dtype)
    return db


# ----- dropout (+ residual) --------------------------------------------------------------

def dropout_forward(x, p: float, residual=None, uniform=None):
    """(out, mask): mask = (u >= p) / (1 - p) in x's dtype, out = x * mask (+ residual).

    ``u`` is drawn in the kernel from ``backend.counter_stream`` (a hash of the seed and
    the element's offset) unless ``uniform`` (float32, x's shape) is given; the op saves
    ``mask`` and its backward stays ``grad * mask``.
    With a ``residual`` (broadcastable to x), out has NumPy's dtype of residual + x * mask:
    a bf16 sub-layer output added to the float32 residual stream gives float32, in the
    same launch.
    """
    _runtime.count("dropout_forward")
    xp = backend.get_array_module(x)
    out_dtype = x.dtype if residual is None else _promote(x.dtype, residual.dtype)
    stream = backend.counter_stream(xp)
    offset = stream.take(x.size) if uniform is None else 0
    xc = xp.ascontiguousarray(x)
    u = None if uniform is None else xp.ascontiguousarray(uniform, dtype=np.float32)
    res = None if residual is None else xp.ascontiguousarray(xp.broadcast_to(residual, x.shape))
    if res is not None and res.dtype != out_dtype:
        res = res.astype(out_dtype)
    out = xp.empty(x.shape, dtype=out_dtype)
    mask = xp.empty_like(xc)
    if x.size:
        grid, block = _flat_grid(x.size)
        _runtime.launch("dropout_fwd", [_runtime.storage(x.dtype), _runtime.storage(out_dtype)],
                        grid, block,
                        (xc, _runtime.address(u), stream.seed, offset, _runtime.address(res),
                         out, mask, x.size, p, 1.0 / (1.0 - p)))
    return out, mask


def dropout_backward(grad, mask):
    """grad * mask in the mask's dtype (x's): one launch where NumPy's product of a float32
    gradient and a 16-bit mask, then the cast to x's dtype, take two."""
    _runtime.count("dropout_backward")
    xp = backend.get_array_module(mask)
    g = xp.ascontiguousarray(grad)
    dx = xp.empty(mask.shape, dtype=mask.dtype)
    if mask.size:
        grid, block = _flat_grid(mask.size)
        _runtime.launch("dropout_bwd", [_runtime.storage(g.dtype), _runtime.storage(mask.dtype)],
                        grid, block, (g, xp.ascontiguousarray(mask), dx, mask.size))
    return dx


# ----- label-smoothed cross-entropy ------------------------------------------------------

def cross_entropy_forward(logits, target, label_smoothing: float = 0.0, ignore_index=None):
    """(loss, dlogits, weights) for logits (N, V) and integer targets (N,).

    loss (N,) float32 = -(1-eps) logp[t] - (eps/V) sum_j logp[j], 0 on ignored rows;
    dlogits (N, V) in the logits' dtype = softmax - eps/V - (1-eps) onehot(t), unweighted,
    exactly the buffer the NumPy op keeps; weights (N,) float32 = 0 on ignored rows.
    A target outside [0, V) gives a NaN loss (the NumPy op raises IndexError).
    """
    _runtime.count("cross_entropy_forward")
    xp = backend.get_array_module(logits)
    n, v = logits.shape
    x = xp.ascontiguousarray(logits)
    t = xp.ascontiguousarray(xp.asarray(target), dtype=np.int64)
    loss = xp.empty(n, dtype=np.float32)
    weights = xp.empty(n, dtype=np.float32)
    dlogits = xp.empty_like(x)
    if n:
        grid, block = _rows_grid(n)
        _runtime.launch("xent_fwd", [_runtime.storage(x.dtype)], grid, block,
                        (x, t, loss, dlogits, weights, n, v, float(label_smoothing),
                         0 if ignore_index is None else int(ignore_index),
                         int(ignore_index is not None)))
    return loss, dlogits, weights


# ----- ReLU (+ bias) ---------------------------------------------------------------------

def relu_forward(x, bias=None):
    """max(x + bias, 0) in x's dtype (bias over the last axis, read as float32)."""
    _runtime.count("relu_forward")
    xp = backend.get_array_module(x)
    xc = xp.ascontiguousarray(x)
    y = xp.empty_like(xc)
    if x.size:
        b = _f32(xp, bias)
        grid, block = _flat_grid(x.size)
        _runtime.launch("bias_relu_fwd", [_runtime.storage(x.dtype)], grid, block,
                        (xc, _runtime.address(b), y, x.size, x.shape[-1]))
    return y


def add_bias_(y, bias, relu: bool = False) -> None:
    """y += bias in place over the last axis (bias read as float32, y any storage type);
    with ``relu`` then y = max(y, 0) in the same pass (a linear layer with a ReLU).

    NumPy's ``y += bias`` for a 16-bit y and a float32 bias: the sum in float32, stored
    rounded to y's dtype. One launch; no cast of the bias, no temporary.
    """
    _runtime.count("add_bias")
    xp = backend.get_array_module(y)
    if not y.flags.c_contiguous:
        raise ValueError("add_bias_: y must be C-contiguous")
    if y.size:
        grid, block = _flat_grid(y.size)
        _runtime.launch("add_bias", [_runtime.storage(y.dtype)], grid, block,
                        (y, _f32(xp, bias), y.size, y.shape[-1], int(relu)))


def relu_backward(y, grad):
    """grad where the saved output y is positive, else 0 (one pass, no bool temporary)."""
    _runtime.count("relu_backward")
    xp = backend.get_array_module(y)
    yc = xp.ascontiguousarray(y)
    g = xp.ascontiguousarray(grad, dtype=y.dtype)
    dx = xp.empty_like(yc)
    if y.size:
        grid, block = _flat_grid(y.size)
        _runtime.launch("relu_bwd", [_runtime.storage(y.dtype)], grid, block, (yc, g, dx, y.size))
    return dx


# ----- mixed precision: gradient unscaling and Adam --------------------------------------

def unscale_(grads, scale: float, found_inf=None):
    """Multiply every gradient by ``scale`` in place; flag inf/NaN in a device int32 (1,).

    Returns the flag array (created when ``found_inf`` is None): nonzero when any gradient
    held an inf or NaN. Reading it (``bool(flag[0])``) is the step's one host sync.
    """
    _runtime.count("unscale_")
    grads = [g for g in grads if g is not None]
    xp = backend.get_array_module(grads[0]) if grads else np
    if found_inf is None:
        found_inf = xp.zeros(1, dtype=np.int32)
    for g in grads:
        if g.size:
            grid, block = _flat_grid(g.size)
            _runtime.launch("unscale_check", [_runtime.storage(g.dtype)], grid, block,
                            (g, g.size, scale, found_inf))
    return found_inf


def adam_step(param, grad, exp_avg, exp_avg_sq, lr: float, betas, eps: float, step: int,
              grad_scale: float = 1.0, found_inf=None) -> None:
    """One Adam update in place, as :class:`tinytf.optim.adam.Adam` (float32 param and moments).

    ``grad`` may be float16/bfloat16/float32 and is multiplied by ``grad_scale`` first;
    with ``found_inf`` (from :func:`unscale_`) set, the kernel changes nothing, so a
    skipped step costs no host round trip.
    """
    _runtime.count("adam_step")
    b1, b2 = betas
    if param.size == 0:
        return
    grid, block = _flat_grid(param.size)
    _runtime.launch("adam_step", [_runtime.storage(grad.dtype)], grid, block,
                    (param, grad, exp_avg, exp_avg_sq, param.size, lr / (1 - b1 ** step), b1, b2,
                     1.0 / (1 - b2 ** step) ** 0.5, eps, grad_scale,
                     _runtime.address(found_inf)))
