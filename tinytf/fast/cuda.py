"""The ops on the GPU: fused CUDA kernels and cuBLAS products, each a subclass of the
reference op it replaces.

On CuPy every elementwise step of a reference op is a kernel launch (about 10 us of CPU
time) and a full pass over memory; :mod:`tinytf.fast.kernels` does a whole op in one or two
launches, computing in float32 whatever the storage type (float32, float16, bfloat16),
and runs every product through cuBLAS with an explicit compute type. Each class below
takes the kernel path when ``kernels.fused(...)`` says the arrays are the kernels' (CuPy,
16/32-bit floats, kernels enabled) and otherwise runs its parent's code: on NumPy arrays,
on float64 (gradient checks) and with ``TINYTF_FUSED=0`` they are the reference ops.
``FusedLinear`` also takes a compute dtype (mixed precision, :mod:`tinytf.fast.amp`).

Each is tested against its reference through the kernel source compiled for the CPU
(tests/fast/test_kernels.py) and, with a GPU, on the device (docs/gpu.md).
"""
from __future__ import annotations

import numpy as np

from tinytf.engine.backend import get_array_module
from tinytf.fast import amp, kernels
from tinytf.fast.cpu import (
    BlockedCrossEntropy,
    RowParallelAttention,
    RowParallelDropoutAdd,
    RowParallelLayerNorm,
    RowParallelLinear,
)
from tinytf.ops.dropout import Dropout
from tinytf.ops.elementwise import ReLU
from tinytf.ops.matmul import MatMul
from tinytf.ops.softmax import LogSoftmax, Softmax


class FusedReLU(ReLU):
    """:class:`ReLU`, forward and backward one launch each."""

    def forward(self, x):
        if not kernels.fused(x):
            return super().forward(x)
        out = kernels.relu_forward(x)
        self.save_for_backward(out)
        return out

    def backward(self, grad):
        (y,) = self.saved
        return kernels.relu_backward(y, grad) if kernels.fused(y) else super().backward(grad)


class FusedSoftmax(Softmax):
    """:class:`Softmax`: one launch forward (a warp per row), one backward."""

    def forward(self, x, axis=-1):
        if not kernels.fused(x):
            return super().forward(x, axis)
        self.axis = axis
        y = kernels.softmax_forward(x, axis)
        self.save_for_backward(y)
        return y

    def backward(self, grad):
        (y,) = self.saved
        if kernels.fused(y):
            return kernels.softmax_backward(y, grad, self.axis)
        return super().backward(grad)


class FusedLogSoftmax(LogSoftmax):
    """:class:`LogSoftmax`: one launch forward, one backward."""

    def forward(self, x, axis=-1):
        if not kernels.fused(x):
            return super().forward(x, axis)
        self.axis = axis
        y = kernels.softmax_forward(x, axis, log=True)
        self.save_for_backward(y)
        return y

    def backward(self, grad):
        (y,) = self.saved
        if kernels.fused(y):
            return kernels.softmax_backward(y, grad, self.axis, log=True)
        return super().backward(grad)


class FusedLayerNorm(RowParallelLayerNorm):
    """:class:`LayerNorm`: statistics and output in one launch; backward in one launch plus
    the column sums of the parameter gradients."""

    def forward(self, x, weight=None, bias=None, eps=1e-5):
        if not kernels.fused(x, weight, bias):
            return super().forward(x, weight, bias, eps)
        out, x_hat, rstd = kernels.layer_norm_forward(x, weight, bias, eps)
        self.save_for_backward(x_hat, rstd, weight)
        return out

    def backward(self, grad):
        x_hat, rstd, weight = self.saved
        if not kernels.fused(x_hat):
            return super().backward(grad)
        need = self.needs_input_grad + (False, False)
        return kernels.layer_norm_backward(grad, x_hat, rstd, weight,
                                           *need[:3])[:len(self.inputs)]


class FusedDropout(Dropout):
    """:class:`Dropout`: the random numbers, the mask and the product in one launch."""

    def forward(self, x, p):
        if not kernels.fused(x):
            return super().forward(x, p)
        out, self.mask = kernels.dropout_forward(x, p)
        return out

    def backward(self, grad):
        if kernels.fused(grad, self.mask):
            return kernels.dropout_backward(grad, self.mask)
        return super().backward(grad)


class FusedDropoutAdd(RowParallelDropoutAdd):
    """:class:`DropoutAdd`: residual + dropout(x) in one launch."""

    def forward(self, x, residual, p):
        if x.shape != residual.shape or not kernels.fused(x, residual):
            return super().forward(x, residual, p)
        out, self.mask = kernels.dropout_forward(x, p, residual=residual)
        return out

    def dropped_grad(self, grad):
        if kernels.fused(grad, self.mask):
            return kernels.dropout_backward(grad, self.mask)
        return super().dropped_grad(grad)


class FusedCrossEntropy(BlockedCrossEntropy):
    """:class:`~tinytf.ops.loss.CrossEntropy`: loss, softmax and gradient in one launch
    per row block; on NumPy the blocked CPU version (:class:`BlockedCrossEntropy`)."""

    def forward(self, logits, target, label_smoothing=0.0, ignore_index=None,
                reduction="mean"):
        if not kernels.fused(logits):
            return super().forward(logits, target, label_smoothing, ignore_index, reduction)
        loss, probs, weights = kernels.cross_entropy_forward(
            logits, target, float(label_smoothing), ignore_index)
        return self.reduce(loss, probs, weights, reduction)


class CublasMatMul(MatMul):
    """:class:`MatMul` with every product one cuBLAS call (``kernels.matmul``)."""

    def product(self, a, b):
        return kernels.matmul(a, b)


class FusedAttention(RowParallelAttention):
    """:class:`Attention` with cuBLAS products (1/sqrt(d) as cuBLAS's alpha: no pass of its
    own) and the masked softmax and its backward as single launches."""

    def weights_of(self, q, k, mask):
        if not kernels.fused(q, k):
            return super().weights_of(q, k, mask)
        scores = kernels.matmul(q, k.swapaxes(-1, -2), alpha=self.scale)
        return kernels.softmax_forward(scores, -1, mask=mask)

    def product(self, a, b, alpha: float = 1.0):
        return kernels.matmul(a, b, alpha=alpha)

    def scores_grad(self, weights, dp):
        if kernels.fused(weights):
            if self.drop_mask is not None:
                dp *= self.drop_mask
            return kernels.softmax_backward(weights, dp, mask=self.mask)
        return super().scores_grad(weights, dp)


class FusedLinear(RowParallelLinear):
    """:class:`Linear` with cuBLAS products, the bias (and ReLU) added by one launch, and
    an optional compute dtype for mixed precision.

    ``compute_dtype`` (set under ``amp.autocast``): the op casts its float32 operands to
    it (``amp.to_compute``) and computes in it, so the graph needs no cast nodes. The
    output has the compute dtype. The gradients are written in their inputs' dtypes
    straight from the float32 accumulators (cuBLAS's result type): dW, db and a float32
    x's dx as float32, with no 16-bit rounding and no cast. The float32 bias is added to
    the output as it is (the sum rounded once, to the output's dtype).
    """

    takes_compute_dtype = True   # amp.autocast passes compute_dtype instead of casting

    def forward(self, x, weight, bias=None, activation=None, compute_dtype=None):
        self.compute_dtype = compute_dtype
        self.fast = compute_dtype is not None or kernels.fused(x, weight, bias)
        if not self.fast:
            return super().forward(x, weight, bias, activation)
        if activation not in (None, "relu"):
            raise ValueError(f"Linear: activation must be None or 'relu', got {activation!r}")
        x2 = x.reshape(-1, x.shape[-1])
        if compute_dtype is not None:
            x2, weight = amp.to_compute(x2, compute_dtype), amp.to_compute(weight, compute_dtype)
        out = kernels.matmul(x2, weight.T)
        relu = activation == "relu"
        if bias is not None:
            _add_bias(out, bias, relu)
        elif relu:
            get_array_module(out).maximum(out, 0, out=out)
        self.save_for_backward(x2, weight, out if relu else None)
        self.in_shape = x.shape
        self.param_dtypes = (self.inputs[1].dtype,
                             self.inputs[2].dtype if len(self.inputs) > 2 else None)
        return out.reshape(*x.shape[:-1], weight.shape[0])

    def backward(self, grad):
        if not self.fast:
            return super().backward(grad)
        x2, weight, relu_out = self.saved
        g2 = grad.reshape(-1, weight.shape[0])
        if relu_out is not None:
            g2 = kernels.relu_backward(relu_out, g2) if kernels.fused(relu_out) \
                else g2 * (relu_out > 0)
        w_dtype, b_dtype = self.param_dtypes
        mixed = self.compute_dtype is not None
        gx = gw = gb = None
        if self.needs_input_grad[0]:
            # In x's own dtype straight from the product (float32 for a float32 x: no cast).
            x_dtype = self.inputs[0].dtype if mixed else None
            gx = kernels.matmul(g2, weight, out_dtype=x_dtype).reshape(self.in_shape)
        if self.needs_input_grad[1]:
            gw = kernels.matmul(g2.T, x2, out_dtype=w_dtype if mixed else None)
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
        get_array_module(out).maximum(out, 0, out=out)
