"""Softmax and log-softmax along one axis, with their closed-form backward passes."""
from __future__ import annotations

import contextlib

import numpy as np

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


def logsumexp(x, axis=-1, keepdims=False):
    """log sum_j exp(x_j) of array ``x`` along ``axis``, as m + log sum_j exp(x_j - m) with m
    the maximum: never overflows, and a row of -inf gives -inf (without NumPy's warning)."""
    xp = get_array_module(x)
    m = x.max(axis=axis, keepdims=True)
    m = xp.where(xp.isfinite(m), m, 0)
    with np.errstate(divide="ignore") if xp is np else contextlib.nullcontext():
        y = m + xp.log(xp.exp(x - m).sum(axis=axis, keepdims=True))
    return y if keepdims else y.squeeze(axis)


class LogSumExp(Function):
    """y = log sum_j exp(x_j) over ``axis`` (:func:`logsumexp`); dy/dx_j = exp(x_j - y), the
    softmax."""

    def forward(self, x, axis=-1, keepdims=False):
        self.axis, self.keepdims = axis, keepdims
        y = logsumexp(x, axis, keepdims=True)
        self.save_for_backward(x, y)
        return y if keepdims else y.squeeze(axis)

    def backward(self, grad):
        x, y = self.saved
        xp = get_array_module(x)
        g = grad if self.keepdims else xp.expand_dims(grad, self.axis)
        return g * xp.exp(x - y)
