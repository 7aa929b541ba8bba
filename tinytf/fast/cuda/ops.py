"""The ops on the GPU: fused CUDA kernels and cuBLAS products, each a subclass of the
reference op it replaces.

On CuPy every elementwise step of a reference op is a kernel launch (about 10 us of CPU
time) and a full pass over memory; :mod:`tinytf.fast.cuda.kernels` does a whole op in one or
two launches, computing in float32 whatever the storage type (float32, float16, bfloat16),
and runs every product through cuBLAS with an explicit compute type. Each class below
takes the kernel path when ``kernels.fused(...)`` says the arrays are the kernels' (CuPy,
16/32-bit floats, kernels enabled) and otherwise runs its parent's code: on NumPy arrays,
on float64 (gradient checks) and with ``TINYTF_FUSED=0`` they are the reference ops.
Under mixed precision (:mod:`tinytf.nn.amp`) the ops marked ``reads_16_bit`` take 16-bit
inputs as they are, since their kernels compute in float32 anyway.

Each is tested against its reference through the kernel source compiled for the CPU
(tests/fast/test_kernels.py) and, with a GPU, on the device (docs/gpu.md).
"""
from __future__ import annotations

import numpy as np

from tinytf.engine.backend import get_array_module
from tinytf.fast.cuda import kernels
from tinytf.ops.attention import Attention
from tinytf.ops.dropout import Dropout, DropoutAdd
from tinytf.ops.elementwise import ReLU
from tinytf.ops.loss import CrossEntropy
from tinytf.ops.matmul import Linear, MatMul
from tinytf.ops.norm import LayerNorm
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

    reads_16_bit = staticmethod(kernels.fused)   # autocast leaves 16-bit inputs 16-bit

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

    reads_16_bit = staticmethod(kernels.fused)   # autocast leaves 16-bit inputs 16-bit

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


class FusedLayerNorm(LayerNorm):
    """:class:`LayerNorm`: statistics and output in one launch; backward in one launch plus
    the column sums of the parameter gradients."""

    reads_16_bit = staticmethod(kernels.fused)   # autocast leaves 16-bit inputs 16-bit

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


class FusedDropoutAdd(DropoutAdd):
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


class FusedCrossEntropy(CrossEntropy):
    """:class:`CrossEntropy`: loss, softmax and gradient in one launch per row block; the
    backward scales that (N, V) gradient in place rather than allocating another."""

    reads_16_bit = staticmethod(kernels.fused)   # autocast leaves 16-bit inputs 16-bit

    def forward(self, logits, target, label_smoothing=0.0, ignore_index=None,
                reduction="mean"):
        if not kernels.fused(logits):
            return super().forward(logits, target, label_smoothing, ignore_index, reduction)
        loss, probs, weights = kernels.cross_entropy_forward(
            logits, target, float(label_smoothing), ignore_index)
        return self.reduce(loss, probs, weights, reduction)

    def backward(self, grad):
        # The node is freed after this single backward: its buffer can be scaled in place.
        probs, self.probs = self.probs, None
        probs *= self.row_scale(grad).astype(probs.dtype, copy=False)[:, None]
        return probs, None


class CublasMatMul(MatMul):
    """:class:`MatMul` with every product one cuBLAS call (``kernels.matmul``)."""

    def product(self, a, b):
        return kernels.matmul(a, b)


class FusedAttention(Attention):
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


class FusedLinear(Linear):
    """:class:`Linear` with cuBLAS products (float32 accumulators written straight to a
    float32 gradient under mixed precision), and the bias (with the ReLU), the ReLU's
    backward and the bias's gradient one launch each."""

    def forward(self, x, weight, bias=None, activation=None, compute_dtype=None):
        self.fast = compute_dtype is not None or kernels.fused(x, weight, bias)
        return super().forward(x, weight, bias, activation, compute_dtype)

    def product(self, x2, weight):
        return kernels.matmul(x2, weight.T) if self.fast else super().product(x2, weight)

    def grad_product(self, a, b, out_dtype=None):
        if not self.fast:
            return super().grad_product(a, b, out_dtype)
        return kernels.matmul(a, b, out_dtype=out_dtype)

    def add_bias(self, out, bias, relu: bool) -> None:
        if bias is not None and kernels.fused(out, bias):
            kernels.add_bias_(out, bias, relu=relu)
        elif bias is not None and bias.dtype != out.dtype and get_array_module(out) is not np:
            super().add_bias(out, bias.astype(out.dtype), relu)   # CuPy, no fused kernels
        else:
            super().add_bias(out, bias, relu)

    def relu_grad(self, relu_out, grad):
        if kernels.fused(relu_out):
            return kernels.relu_backward(relu_out, grad)
        return super().relu_grad(relu_out, grad)

    def bias_grad(self, grad, out_dtype=None):
        if kernels.fused(grad):
            return kernels.bias_grad(grad, out_dtype=out_dtype)
        return super().bias_grad(grad, out_dtype)
