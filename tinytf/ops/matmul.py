"""Matrix products: general (batched, broadcast) matmul and the linear layer as one GEMM."""
from __future__ import annotations

import numpy as np

from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function
from tinytf.ops.cast import to_compute
from tinytf.ops.elementwise import relu_grad, sum_to


class MatMul(Function):
    """a @ b with NumPy semantics (1-D operands, batched and broadcast leading dims).

    dL/da = g @ b^T and dL/db = a^T @ g, summed over broadcast batch dimensions.
    """

    def forward(self, a, b):
        self.save_for_backward(a, b)
        return self.product(a, b)

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
            ga = sum_to(self.product(g, b2.swapaxes(-1, -2)), a2.shape).reshape(a.shape)
        if self.needs_input_grad[1]:
            gb = sum_to(self.product(a2.swapaxes(-1, -2), g), b2.shape).reshape(b.shape)
        return ga, gb

    def product(self, a, b):
        """a @ b (the step a faster variant replaces: tinytf.fast.cuda.ops.CublasMatMul)."""
        return a @ b


class Linear(Function):
    """y = x @ W^T + b with W of shape (out, in), as one 2-D GEMM.

    ``x`` (..., in) is viewed as (N, in): a single GEMM is much faster than the per-slice
    GEMMs that ``matmul`` on a 3-D array does. Backward: dx = g @ W, dW = g^T @ x,
    db = sum of g over rows.

    ``activation="relu"``: y = max(x @ W^T + b, 0), the ReLU applied in place to the
    product; backward first zeroes the gradient where y is not positive, then proceeds as
    above. One node for the feed-forward network's first layer instead of two, and one
    pass over its (N, d_ff) output fewer.

    ``compute_dtype`` (mixed precision: ``F.linear`` passes it under ``amp.autocast``):
    float32 x and W are cast to it (:func:`~tinytf.ops.cast.to_compute`) and multiplied in
    it, so the graph needs no cast nodes; the output has that dtype, the float32 bias
    added to it as it is. Each gradient is formed in its input's own dtype straight from
    the product (float32 for float32 master weights, as cuBLAS's float32 result type
    gives it), with no 16-bit rounding on the way.
    """

    def forward(self, x, weight, bias=None, activation=None, compute_dtype=None):
        if activation not in (None, "relu"):
            raise ValueError(f"Linear: activation must be None or 'relu', got {activation!r}")
        x2 = x.reshape(-1, x.shape[-1])
        self.compute_dtype = compute_dtype
        if compute_dtype is not None:
            x2, weight = to_compute(x2, compute_dtype), to_compute(weight, compute_dtype)
        out = self.product(x2, weight)
        relu = activation == "relu"
        self.add_bias(out, bias, relu)
        # With the ReLU, its output too: the gradient passes where it is positive.
        self.save_for_backward(x2, weight, out if relu else None)
        self.in_shape = x.shape
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def backward(self, grad):
        x2, weight, relu_out = self.saved
        g2 = grad.reshape(-1, weight.shape[0])
        if relu_out is not None:
            g2 = self.relu_grad(relu_out, g2)
        # Under mixed precision each gradient in its input's dtype, else the product's.
        mixed = self.compute_dtype is not None
        dtypes = [t.dtype if mixed else None for t in self.inputs]
        need = self.needs_input_grad
        gx = self.grad_product(g2, weight, dtypes[0]).reshape(self.in_shape) if need[0] else None
        gw = self.grad_product(g2.T, x2, dtypes[1]) if need[1] else None
        if len(self.inputs) == 2:
            return gx, gw
        return gx, gw, (self.bias_grad(g2, dtypes[2]) if need[2] else None)

    # The products and the row passes a faster variant replaces
    # (tinytf.fast.cpu.ops.RowParallelLinear, tinytf.fast.cuda.ops.FusedLinear).
    def product(self, x2, weight):
        """x2 @ weight.T, the forward's GEMM."""
        return x2 @ weight.T

    def grad_product(self, a, b, out_dtype=None):
        """a @ b, the backward's GEMMs; with ``out_dtype``, taken in that dtype."""
        if out_dtype is None or out_dtype == np.result_type(a.dtype, b.dtype):
            return a @ b
        return a.astype(out_dtype, copy=False) @ b.astype(out_dtype, copy=False)

    def add_bias(self, out, bias, relu: bool) -> None:
        """out += bias, then out = max(out, 0) with the ReLU, in place."""
        if bias is not None:
            out += bias
        if relu:
            get_array_module(out).maximum(out, 0, out=out)

    def relu_grad(self, relu_out, grad):
        """The gradient where the ReLU's output is positive, else 0."""
        return relu_grad(relu_out, grad)

    def bias_grad(self, grad, out_dtype=None):
        """The bias's gradient: ``grad`` summed over rows (in ``out_dtype`` if given)."""
        return grad.sum(axis=0, dtype=out_dtype)
