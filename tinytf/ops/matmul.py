"""Matrix products: general (batched, broadcast) matmul and the fused linear layer."""
from __future__ import annotations

import numpy as np

from .. import amp, kernels
from ..backend import get_array_module
from ..kernels import matmul
from ..tensor import Function
from .elementwise import relu_grad, sum_to


class MatMul(Function):
    """a @ b with NumPy semantics (1-D operands, batched and broadcast leading dims).

    dL/da = g @ b^T and dL/db = a^T @ g, summed over broadcast batch dimensions.
    """

    def forward(self, a, b):
        self.save_for_backward(a, b)
        return matmul(a, b)

    def backward(self, grad):
        a, b = self.saved
        # Promote 1-D operands to matrices so one formula covers every case.
        a2 = a[None, :] if a.ndim == 1 else a
        b2 = b[:, None] if b.ndim == 1 else b
        g = grad
        if b.ndim == 1:  # first: for 1-D @ 1-D the 0-d grad becomes (1,), then (1, 1)
            g = g[..., None]
        if a.ndim == 1:
            g = g[..., None, :]
        ga = gb = None
        if self.needs_input_grad[0]:
            ga = sum_to(matmul(g, b2.swapaxes(-1, -2)), a2.shape).reshape(a.shape)
        if self.needs_input_grad[1]:
            gb = sum_to(matmul(a2.swapaxes(-1, -2), g), b2.shape).reshape(b.shape)
        return ga, gb


class Linear(Function):
    """y = x @ W^T + b with W of shape (out, in), as one 2-D GEMM.

    ``x`` (..., in) is viewed as (N, in): a single GEMM is much faster than the per-slice
    GEMMs that ``matmul`` on a 3-D array does. Backward: dx = g @ W, dW = g^T @ x,
    db = sum of g over rows.

    ``compute_dtype`` (mixed precision, set by ``F.linear`` under ``amp.autocast``): the op
    casts its float32 operands to it (``amp.to_compute``) and computes in it, so the graph
    needs no cast nodes. The output has the compute dtype. The gradients are written in
    their inputs' dtypes straight from the float32 accumulators (cuBLAS's result type):
    dW, db and a float32 x's dx as float32, with no 16-bit rounding and no cast. The
    float32 bias is added to the output as it is (the sum rounded once, to the output's
    dtype).

    ``activation="relu"``: y = max(x @ W^T + b, 0), the ReLU applied in place to the
    product (on the GPU in the same pass as the bias); backward first zeroes the gradient
    where y is not positive, then proceeds as above. One node for the feed-forward
    network's first layer instead of two, and one pass over its (N, d_ff) output fewer.
    """

    def forward(self, x, weight, bias=None, compute_dtype=None, activation=None):
        if activation not in (None, "relu"):
            raise ValueError(f"Linear: activation must be None or 'relu', got {activation!r}")
        x2 = x.reshape(-1, x.shape[-1])
        self.compute_dtype = compute_dtype
        if compute_dtype is not None:
            x2, weight = amp.to_compute(x2, compute_dtype), amp.to_compute(weight, compute_dtype)
        out = matmul(x2, weight.T)
        relu = activation == "relu"
        if bias is not None:
            _add_bias(out, bias, relu)
        elif relu:
            _relu_(out)
        # With the ReLU, its output too: the gradient passes where it is positive.
        self.save_for_backward(x2, weight, out if relu else None)
        self.in_shape = x.shape
        self.param_dtypes = (self.inputs[1].dtype,
                             self.inputs[2].dtype if len(self.inputs) > 2 else None)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def backward(self, grad):
        x2, weight, relu_out = self.saved
        g2 = grad.reshape(-1, weight.shape[0])
        if relu_out is not None:
            g2 = relu_grad(relu_out, g2)
        w_dtype, b_dtype = self.param_dtypes
        mixed = self.compute_dtype is not None
        gx = gw = gb = None
        if self.needs_input_grad[0]:
            # In x's own dtype straight from the product (float32 for a float32 x: no cast).
            x_dtype = self.inputs[0].dtype if mixed else None
            gx = matmul(g2, weight, out_dtype=x_dtype).reshape(self.in_shape)
        if self.needs_input_grad[1]:
            gw = matmul(g2.T, x2, out_dtype=w_dtype if mixed else None)
        if len(self.inputs) == 2:
            return gx, gw
        if self.needs_input_grad[2]:
            if kernels.fused(g2):
                gb = kernels.bias_grad(g2, out_dtype=b_dtype)
            else:
                gb = g2.sum(axis=0, dtype=b_dtype if mixed else None)
        return gx, gw, gb


def _add_bias(out, bias, relu: bool = False) -> None:
    """out += bias in place, bias over the last axis; out keeps its dtype. With ``relu``
    then out = max(out, 0), in the same launch on the GPU."""
    if kernels.fused(out, bias):
        kernels.add_bias_(out, bias, relu=relu)
        return
    if bias.dtype == out.dtype or get_array_module(out) is np:
        out += bias                     # NumPy: the sum in the wider type, stored as out's
    else:
        out += bias.astype(out.dtype)   # CuPy without the fused kernels
    if relu:
        _relu_(out)


def _relu_(out) -> None:
    """out = max(out, 0) in place (NaN stays NaN)."""
    get_array_module(out).maximum(out, 0, out=out)
