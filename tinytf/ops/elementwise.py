"""Elementwise ops. Binary ops broadcast; their backward un-broadcasts with :func:`sum_to`."""
from __future__ import annotations

from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function


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


class GELU(Function):
    """y = 0.5 x (1 + t), t = tanh(u), u = sqrt(2/pi) (x + 0.044715 x^3): the Gaussian error
    linear unit in the tanh form of Hendrycks & Gimpel (2016), as BERT and GPT-2 use it.
    dy/dx = 0.5 (1 + t) + 0.5 x (1 - t^2) du/dx, du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2).
    Unlike ReLU's, its gradient is not 0 for x < 0: a unit pushed below 0 can come back.
    (docs/autograd.md builds this op step by step; here the arithmetic runs in place.)"""

    def forward(self, x):
        xp = get_array_module(x)
        t, y = xp.empty_like(x), xp.empty_like(x)
        gelu_(x, t, y)
        self.save_for_backward(x, t)
        return y

    def backward(self, grad):
        x, t = self.saved
        out = get_array_module(x).empty_like(grad)
        gelu_grad_(x, t, grad, out)
        return out


GELU_C = 0.7978845608028654     # sqrt(2 / pi), a Python float: no float64 upcast
GELU_A = 0.044715


def gelu_(x, t, y) -> None:
    """Into t and y: t = tanh(u), u = C x (1 + A x^2), and y = 0.5 x (1 + t); one
    temporary-free pass per operation."""
    xp = get_array_module(x)
    xp.multiply(x, x, out=t)
    t *= GELU_A
    t += 1
    t *= x
    t *= GELU_C
    xp.tanh(t, out=t)
    xp.add(t, 1, out=y)
    y *= x
    y *= 0.5


def gelu_grad_(x, t, grad, out) -> None:
    """Into out: grad * (0.5 (1 + t) + 0.5 x (1 - t^2) C (1 + 3 A x^2)), t = tanh(u)."""
    xp = get_array_module(x)
    one_minus_t2 = xp.multiply(t, t, out=xp.empty_like(t))   # an array also when 0-d
    xp.subtract(1, one_minus_t2, out=one_minus_t2)
    xp.multiply(x, x, out=out)
    out *= 3 * GELU_A
    out += 1
    out *= GELU_C                   # du/dx
    out *= x
    out *= one_minus_t2             # x (1 - t^2) du/dx
    out += t
    out += 1
    out *= 0.5
    out *= grad


def relu_grad(y, grad):
    """ReLU's backward from its output ``y``: ``grad`` where y > 0, else 0. Also used by
    ``Linear`` with its ReLU."""
    return grad * (y > 0)


class Abs(Function):
    """|x|; d/dx = sign(x), 0 at 0 (as PyTorch)."""

    def forward(self, x):
        self.save_for_backward(x)
        return get_array_module(x).abs(x)

    def backward(self, grad):
        return grad * get_array_module(grad).sign(self.saved[0])


class Clamp(Function):
    """min(max(x, low), high), either bound optional; the gradient passes where
    low <= x <= high (bounds included, as PyTorch)."""

    def forward(self, x, low=None, high=None):
        xp = get_array_module(x)
        if low is None and high is None:
            raise ValueError("clamp: give min, max or both")
        self.save_for_backward(x)
        self.low, self.high = low, high
        return xp.clip(x, low, high).astype(x.dtype, copy=False)

    def backward(self, grad):
        (x,) = self.saved
        inside = True
        if self.low is not None:
            inside = x >= self.low
        if self.high is not None:
            inside = inside & (x <= self.high)
        return grad * inside
