"""Reductions: sum and max over axes, with keepdims."""
from __future__ import annotations

from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function


def _normalize_axes(axis, ndim):
    """``axis`` (None, int or tuple, negative allowed) as a sorted tuple of ints."""
    if axis is None:
        return tuple(range(ndim))
    axes = axis if isinstance(axis, (tuple, list)) else (axis,)
    return tuple(sorted(a % ndim if ndim else a for a in axes))


def _expand(grad, in_shape, axes, keepdims):
    """Put back the reduced axes of ``grad`` (as size 1) so it broadcasts to ``in_shape``."""
    if not keepdims:
        shape = list(in_shape)
        for a in axes:
            shape[a] = 1
        grad = grad.reshape(shape)
    return grad


class Sum(Function):
    """Sum over axes; the gradient is broadcast back to every summed element."""

    def forward(self, x, axis=None, keepdims=False):
        self.in_shape, self.axes, self.keepdims = x.shape, _normalize_axes(axis, x.ndim), keepdims
        return x.sum(axis=self.axes, keepdims=keepdims)

    def backward(self, grad):
        xp = get_array_module(grad)
        return xp.broadcast_to(_expand(grad, self.in_shape, self.axes, self.keepdims),
                               self.in_shape)


class Max(Function):
    """Maximum over axes; tied maxima share the gradient equally (like ``torch.amax``)."""

    def forward(self, x, axis=None, keepdims=False):
        self.axes, self.keepdims = _normalize_axes(axis, x.ndim), keepdims
        out = x.max(axis=self.axes, keepdims=True)
        self.save_for_backward(x, out)
        return out if keepdims else out.reshape([n for i, n in enumerate(x.shape)
                                                 if i not in self.axes])

    def backward(self, grad):
        x, out = self.saved
        mask = (x == out).astype(x.dtype)
        mask /= mask.sum(axis=self.axes, keepdims=True)
        return mask * _expand(grad, x.shape, self.axes, self.keepdims)
