"""Max and average pooling over one or two spatial dimensions, on :func:`~tinytf.ops.conv.unfold`'s
windows: y = max (or mean) of each window of x (N, C, *in), no weights.

Max pooling pads with -inf and sends each output's gradient to the first maximum of its
window; average pooling pads with zeros and divides by the whole window, padding included
(PyTorch's ``count_include_pad=True``). Backward is :func:`~tinytf.ops.conv.fold` of the
per-window gradients: windows that overlap add up.
"""
from __future__ import annotations

import math

from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function
from tinytf.ops.conv import fold, unfold


class MaxPool(Function):
    """y = max over each window; dy/dx = 1 at the window's first maximum, 0 elsewhere."""

    def forward(self, x, kernel, stride, padding, dilation=None):
        dilation = dilation or (1,) * len(kernel)
        self.args, self.x_shape = (kernel, stride, padding, dilation), x.shape
        cols = unfold(x, *self.args, pad_value=-float("inf"))    # (N, C, K, *out)
        self.picked = cols.argmax(axis=2)
        return cols.max(axis=2)

    def backward(self, grad):
        xp = get_array_module(grad)
        k = math.prod(self.args[0])
        taps = xp.arange(k).reshape((1, 1, k) + (1,) * (grad.ndim - 2))
        onehot = taps == xp.expand_dims(self.picked, 2)            # (N, C, K, *out)
        return fold(onehot * xp.expand_dims(grad, 2), self.x_shape, *self.args)


class AvgPool(Function):
    """y = mean over each window (padding counted); dy/dx = 1 / K for each of its K taps."""

    def forward(self, x, kernel, stride, padding):
        self.args = (kernel, stride, padding, (1,) * len(kernel))
        self.x_shape = x.shape
        cols = unfold(x, *self.args)
        self.k = cols.shape[2]
        return cols.mean(axis=2)

    def backward(self, grad):
        xp = get_array_module(grad)
        cols = xp.broadcast_to(xp.expand_dims(grad / self.k, 2),
                               grad.shape[:2] + (self.k,) + grad.shape[2:])
        return fold(cols, self.x_shape, *self.args)
