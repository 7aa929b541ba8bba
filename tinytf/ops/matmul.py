"""Matrix products: general (batched, broadcast) matmul and the fused linear layer."""
from __future__ import annotations

from .. import kernels
from ..kernels import matmul
from ..tensor import Function
from .elementwise import sum_to


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
    """

    def forward(self, x, weight, bias=None):
        x2 = x.reshape(-1, x.shape[-1])
        out = matmul(x2, weight.T)
        if bias is not None:
            out += bias
        self.save_for_backward(x2, weight)
        self.in_shape = x.shape
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def backward(self, grad):
        x2, weight = self.saved
        g2 = grad.reshape(-1, weight.shape[0])
        gx = matmul(g2, weight).reshape(self.in_shape) if self.needs_input_grad[0] else None
        gw = matmul(g2.T, x2) if self.needs_input_grad[1] else None
        if len(self.inputs) == 2:
            return gx, gw
        gb = None
        if self.needs_input_grad[2]:
            gb = kernels.bias_grad(g2) if kernels.fused(g2) else g2.sum(axis=0)
        return gx, gw, gb
