"""Softmax and log-softmax along one axis, with their closed-form backward passes."""
from __future__ import annotations

from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function


def softmax(x, axis=-1):
    """Numerically stable softmax of array ``x``: subtracting the max keeps exp() finite."""
    xp = get_array_module(x)
    out = x - x.max(axis=axis, keepdims=True)
    xp.exp(out, out=out)
    out /= out.sum(axis=axis, keepdims=True)
    return out


class Softmax(Function):
    """y = exp(x) / sum(exp(x)); dL/dx = y * (g - sum(g * y))."""

    def forward(self, x, axis=-1):
        self.axis = axis
        y = softmax(x, axis)
        self.save_for_backward(y)
        return y

    def backward(self, grad):
        (y,) = self.saved
        return y * (grad - (grad * y).sum(axis=self.axis, keepdims=True))


class LogSoftmax(Function):
    """y = x - logsumexp(x); dL/dx = g - softmax(x) * sum(g)."""

    def forward(self, x, axis=-1):
        xp = get_array_module(x)
        self.axis = axis
        y = x - x.max(axis=axis, keepdims=True)
        y -= xp.log(xp.exp(y).sum(axis=axis, keepdims=True))
        self.save_for_backward(y)
        return y

    def backward(self, grad):
        (y,) = self.saved
        xp = get_array_module(y)
        return grad - xp.exp(y) * grad.sum(axis=self.axis, keepdims=True)
