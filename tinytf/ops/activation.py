"""Smooth activations: sigmoid, softplus and SiLU, each with its closed-form derivative.

All three are built on the logistic function s(x) = 1 / (1 + e^-x), whose derivative is
s(x) (1 - s(x)); :func:`sigmoid` computes it without overflow for any x.
"""
from __future__ import annotations

from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function


def sigmoid(x):
    """1 / (1 + e^-x) of array ``x``, from e^-|x| (never overflows): 1 / (1 + e) for
    x >= 0 and e / (1 + e) below."""
    xp = get_array_module(x)
    e = xp.exp(-xp.abs(x))
    return xp.where(x >= 0, 1 / (1 + e), e / (1 + e)).astype(x.dtype, copy=False)


class Sigmoid(Function):
    """y = s(x) = 1 / (1 + e^-x); dy/dx = y (1 - y)."""

    def forward(self, x):
        y = sigmoid(x)
        self.save_for_backward(y)
        return y

    def backward(self, grad):
        (y,) = self.saved
        return grad * y * (1 - y)


class Softplus(Function):
    """y = log(1 + e^(beta x)) / beta, and y = x where beta x > threshold (as PyTorch's
    ``softplus(x, beta=1, threshold=20)``); dy/dx = s(beta x), 1 past the threshold.

    Computed as (max(bx, 0) + log1p(e^-|bx|)) / beta, which never overflows."""

    def forward(self, x, beta=1.0, threshold=20.0):
        xp = get_array_module(x)
        bx = x * beta
        self.beta, self.linear = beta, bx > threshold
        self.save_for_backward(bx)
        y = (xp.maximum(bx, 0) + xp.log1p(xp.exp(-xp.abs(bx)))) / beta
        return xp.where(self.linear, x, y).astype(x.dtype, copy=False)

    def backward(self, grad):
        (bx,) = self.saved
        return grad * get_array_module(bx).where(self.linear, 1, sigmoid(bx))


class SiLU(Function):
    """y = x s(x) (the swish of Ramachandran et al. 2017); dy/dx = s(x) (1 + x (1 - s(x)))."""

    def forward(self, x):
        s = sigmoid(x)
        self.save_for_backward(x, s)
        return x * s

    def backward(self, grad):
        x, s = self.saved
        return grad * s * (1 + x * (1 - s))
