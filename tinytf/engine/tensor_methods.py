"""The PyTorch-style conveniences of :class:`~tinytf.engine.tensor.Tensor`, built on its ops:
reductions over ``dim`` (or NumPy's ``axis``), ``max``/``min`` with their indices, variance,
the shape methods (``transpose`` swaps two dimensions, ``permute`` reorders all), and
comparisons that give boolean masks. Nothing here has a backward of its own: each method is
a composition of the ops in the op table (:mod:`tinytf.engine.dispatch`), so its gradient is
theirs.
"""
from __future__ import annotations

import math
from typing import Any, NamedTuple

from tinytf.engine.dispatch import impl


class TensorMethods:
    """Mixed into ``Tensor``; ``self._constant(array)`` makes a Tensor without gradient."""

    # Comparisons give a boolean Tensor without gradient (a mask). ``==`` and ``!=`` stay
    # identity, so Tensors remain usable as dict keys and in ``in``: use eq / ne.
    def __lt__(self, other): return self._constant(self.data < self.coerce(other).data)
    def __le__(self, other): return self._constant(self.data <= self.coerce(other).data)
    def __gt__(self, other): return self._constant(self.data > self.coerce(other).data)
    def __ge__(self, other): return self._constant(self.data >= self.coerce(other).data)

    def eq(self, other):
        """Elementwise self == other as a boolean Tensor (no gradient)."""
        return self._constant(self.data == self.coerce(other).data)

    def ne(self, other):
        """Elementwise self != other as a boolean Tensor (no gradient)."""
        return self._constant(self.data != self.coerce(other).data)


    # ----- reductions: PyTorch's dim/keepdim, or NumPy's axis/keepdims -------------------
    def sum(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        """Sum over ``dim`` (int, tuple or None for all)."""
        dim, keepdim = _reduce_args(dim, keepdim, axis, keepdims)
        return impl.Sum.apply(self, axis=dim, keepdims=keepdim)

    def mean(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        """Mean over ``dim``: sum / count."""
        dim, keepdim = _reduce_args(dim, keepdim, axis, keepdims)
        return self.sum(dim, keepdim) * (1.0 / _count(self.shape, dim))

    def var(self, dim=None, keepdim=False, correction=1, *, axis=None, keepdims=None):
        """sum((x - mean)^2) / (count - correction) over ``dim``; ``correction=1`` (the
        default, as PyTorch's) is the unbiased estimate, 0 the biased one."""
        dim, keepdim = _reduce_args(dim, keepdim, axis, keepdims)
        centred = self - self.mean(dim, keepdim=True)
        return (centred * centred).sum(dim, keepdim) * \
            (1.0 / max(_count(self.shape, dim) - correction, 0))

    def std(self, dim=None, keepdim=False, correction=1, *, axis=None, keepdims=None):
        """sqrt(var(dim, correction))."""
        return self.var(dim, keepdim, correction, axis=axis, keepdims=keepdims).sqrt()

    def amax(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        """Maximum values over ``dim`` (int, tuple or None); tied maxima share the gradient."""
        dim, keepdim = _reduce_args(dim, keepdim, axis, keepdims)
        return impl.Max.apply(self, axis=dim, keepdims=keepdim)

    def amin(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        """Minimum values over ``dim``: -amax(-x)."""
        return -(-self).amax(dim, keepdim, axis=axis, keepdims=keepdims)

    def max(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        """As PyTorch: the maximum of all elements, or with an int ``dim`` the pair
        (values, indices) along it. With NumPy's ``axis=`` (int or tuple): the values, as
        :meth:`amax`."""
        if axis is not None or dim is None or isinstance(dim, tuple):
            return self.amax(dim, keepdim, axis=axis, keepdims=keepdims)
        return ValuesIndices(self.amax(dim, keepdim), self.argmax(dim, keepdim))

    def min(self, dim=None, keepdim=False, *, axis=None, keepdims=None):
        """As :meth:`max`, for the minimum."""
        if axis is not None or dim is None or isinstance(dim, tuple):
            return self.amin(dim, keepdim, axis=axis, keepdims=keepdims)
        return ValuesIndices(self.amin(dim, keepdim), self.argmin(dim, keepdim))

    def argmax(self, dim=None, keepdim=False):
        """Indices (int64, no gradient) of the first maximum along ``dim`` (of the flattened
        tensor when None)."""
        return self._constant(_arg(self.data.argmax, dim, keepdim))

    def argmin(self, dim=None, keepdim=False):
        """Indices (int64, no gradient) of the first minimum along ``dim``."""
        return self._constant(_arg(self.data.argmin, dim, keepdim))

    # ----- shapes ---------------------------------------------------------------------
    def reshape(self, *shape):
        """Same values in a new shape (one dimension may be -1)."""
        if len(shape) == 1 and isinstance(shape[0], (tuple, list)):
            shape = tuple(shape[0])
        return impl.Reshape.apply(self, shape=shape)

    view = reshape

    def transpose(self, dim0, dim1):
        """Swap dimensions ``dim0`` and ``dim1`` (PyTorch's ``transpose``; :meth:`permute`
        reorders all of them)."""
        axes = list(range(self.ndim))
        axes[dim0], axes[dim1] = axes[dim1], axes[dim0]
        return impl.Transpose.apply(self, axes=tuple(axes))

    def permute(self, *dims):
        """Reorder the dimensions: output dimension i is input dimension ``dims[i]``."""
        if len(dims) == 1 and isinstance(dims[0], (tuple, list)):
            dims = tuple(dims[0])
        if sorted(d % max(self.ndim, 1) for d in dims) != list(range(self.ndim)):
            raise ValueError(f"permute: {dims} is not an order of {self.ndim} dimensions")
        return impl.Transpose.apply(self, axes=dims)

    T = property(lambda self: impl.Transpose.apply(self, axes=None),
                 doc="The tensor with its dimensions reversed (the transpose of a matrix).")

    def squeeze(self, dim=None):
        """Drop dimension ``dim`` if its size is 1 (every size-1 dimension when None)."""
        if dim is None:
            shape = tuple(n for n in self.shape if n != 1)
        else:
            dim = dim % self.ndim
            shape = self.shape if self.shape[dim] != 1 else \
                self.shape[:dim] + self.shape[dim + 1:]
        return self.reshape(shape)

    def unsqueeze(self, dim):
        """Insert a dimension of size 1 at ``dim`` (negative counts from the new end)."""
        dim = dim % (self.ndim + 1)
        return self.reshape(self.shape[:dim] + (1,) + self.shape[dim:])

    def flatten(self, start_dim=0, end_dim=-1):
        """Merge dimensions ``start_dim`` .. ``end_dim`` into one."""
        if self.ndim == 0:
            return self.reshape(1)
        lo, hi = start_dim % self.ndim, end_dim % self.ndim
        return self.reshape(self.shape[:lo] + (-1,) + self.shape[hi + 1:])


class ValuesIndices(NamedTuple):
    """What ``max(dim)`` and ``min(dim)`` return, as PyTorch's: the values and their indices."""

    values: Any      # a Tensor
    indices: Any     # a Tensor of int64


def _reduce_args(dim, keepdim, axis, keepdims):
    """(dimensions, keep) from PyTorch's ``dim``/``keepdim`` or NumPy's ``axis``/``keepdims``."""
    if axis is not None:
        if dim is not None:
            raise TypeError("give dim or axis, not both")
        dim = axis
    if isinstance(dim, list):
        dim = tuple(dim)
    return dim, keepdim if keepdims is None else keepdims


def _count(shape, dim) -> int:
    """How many elements a reduction over ``dim`` combines."""
    axes = range(len(shape)) if dim is None else (dim if isinstance(dim, tuple) else (dim,))
    return math.prod(shape[a] for a in axes)


def _arg(fn, dim, keepdim):
    """``argmax``/``argmin`` of an array (``fn``) along ``dim``, with ``keepdim``."""
    if dim is None:
        out = fn()
        return out.reshape((1,) * len(fn.__self__.shape)) if keepdim else out
    return fn(axis=dim, keepdims=keepdim)
