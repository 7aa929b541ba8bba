"""Elementwise ops. Binary ops broadcast; their backward un-broadcasts with :func:`sum_to`."""
from __future__ import annotations

from ..backend import get_array_module
from ..tensor import Function


def sum_to(grad, shape):
    """Sum ``grad`` over the axes that broadcasting added or stretched, to get ``shape``.

    The gradient of a broadcast is a sum: if ``x`` of shape (1, 3) was broadcast to (4, 3),
    each element of ``x`` fed 4 outputs, so its gradient is the sum of those 4.
    """
    if grad.shape == tuple(shape):
        return grad
    lead = grad.ndim - len(shape)
    axes = tuple(range(lead)) + tuple(
        lead + i for i, n in enumerate(shape) if n == 1 and grad.shape[lead + i] != 1)
    return grad.sum(axis=axes, keepdims=True).reshape(shape)


class Add(Function):
    """a + b."""

    def forward(self, a, b):
        self.shapes = a.shape, b.shape
        return a + b

    def backward(self, grad):
        sa, sb = self.shapes
        return (sum_to(grad, sa) if self.needs_input_grad[0] else None,
                sum_to(grad, sb) if self.needs_input_grad[1] else None)


class Mul(Function):
    """a * b; d/da = b, d/db = a."""

    def forward(self, a, b):
        self.save_for_backward(a, b)
        return a * b

    def backward(self, grad):
        a, b = self.saved
        return (sum_to(grad * b, a.shape) if self.needs_input_grad[0] else None,
                sum_to(grad * a, b.shape) if self.needs_input_grad[1] else None)


class Neg(Function):
    """-x."""

    def forward(self, x):
        return -x

    def backward(self, grad):
        return -grad


class Pow(Function):
    """x ** p for a Python number p; d/dx = p * x ** (p - 1)."""

    def forward(self, x, exponent):
        if not isinstance(exponent, (int, float)) and getattr(exponent, "ndim", None) != 0:
            raise TypeError("pow takes a Python number as exponent, got "
                            f"{type(exponent).__name__}")
        exponent = float(exponent)  # a NumPy float64 scalar would upcast float32 inputs
        self.exponent = exponent
        self.save_for_backward(x)
        return x ** exponent

    def backward(self, grad):
        (x,) = self.saved
        p = self.exponent
        return grad * (p * x ** (p - 1))


class Exp(Function):
    """e ** x; the output is its own derivative, so it is what we save."""

    def forward(self, x):
        out = get_array_module(x).exp(x)
        self.save_for_backward(out)
        return out

    def backward(self, grad):
        return grad * self.saved[0]


class Log(Function):
    """ln x; d/dx = 1 / x."""

    def forward(self, x):
        self.save_for_backward(x)
        return get_array_module(x).log(x)

    def backward(self, grad):
        return grad / self.saved[0]


class Sqrt(Function):
    """sqrt(x); d/dx = 1 / (2 sqrt(x))."""

    def forward(self, x):
        out = get_array_module(x).sqrt(x)
        self.save_for_backward(out)
        return out

    def backward(self, grad):
        return grad / (2 * self.saved[0])


class Tanh(Function):
    """tanh(x); d/dx = 1 - tanh(x)**2."""

    def forward(self, x):
        out = get_array_module(x).tanh(x)
        self.save_for_backward(out)
        return out

    def backward(self, grad):
        out = self.saved[0]
        return grad * (1 - out * out)


class ReLU(Function):
    """max(x, 0); the gradient passes where the output is positive."""

    def forward(self, x):
        out = get_array_module(x).maximum(x, 0)
        self.save_for_backward(out)
        return out

    def backward(self, grad):
        return relu_grad(self.saved[0], grad)


def relu_grad(y, grad):
    """ReLU's backward from its output ``y``: ``grad`` where y > 0, else 0. Also used by
    ``Linear`` with its ReLU."""
    return grad * (y > 0)


class Cast(Function):
    """x converted to another float dtype; the gradient is converted back."""

    def forward(self, x, dtype):
        self.in_dtype = x.dtype
        return x.astype(dtype)

    def backward(self, grad):
        return grad.astype(self.in_dtype)
