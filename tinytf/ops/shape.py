"""Ops that move values without arithmetic: reshape, transpose, indexing, splitting, joining,
selecting."""
from __future__ import annotations

import numpy as np

from tinytf.engine.backend import get_array_module, scatter_add
from tinytf.engine.tensor import Function
from tinytf.ops.elementwise import sum_to


class Reshape(Function):
    """The same values in a new shape; the gradient is reshaped back."""

    def forward(self, x, shape):
        self.in_shape = x.shape
        return x.reshape(shape)

    def backward(self, grad):
        return grad.reshape(self.in_shape)


class Transpose(Function):
    """Permute axes (``axes=None`` reverses them); backward applies the inverse permutation."""

    def forward(self, x, axes=None):
        self.axes = tuple(range(x.ndim))[::-1] if axes is None else tuple(a % x.ndim for a in axes)
        return x.transpose(self.axes)

    def backward(self, grad):
        inverse = [0] * len(self.axes)
        for i, a in enumerate(self.axes):
            inverse[a] = i
        return grad.transpose(inverse)


def _is_advanced(index) -> bool:
    """Whether ``index`` uses integer/boolean arrays (which may repeat positions)."""
    parts = index if isinstance(index, tuple) else (index,)
    return any(hasattr(p, "shape") or isinstance(p, list) for p in parts)


class GetItem(Function):
    """``x[index]`` for ints, slices, None, Ellipsis and integer arrays.

    Backward scatters the gradient into zeros; with integer arrays it scatter-*adds*, since
    one position may have been picked several times.
    """

    def forward(self, x, index):   # (a Tensor index arrives as its array: Tensor.__getitem__)
        self.index, self.in_shape, self.dtype = index, x.shape, x.dtype
        return x[index]

    def backward(self, grad):
        xp = get_array_module(grad)
        out = xp.zeros(self.in_shape, dtype=self.dtype)
        if _is_advanced(self.index):
            scatter_add(out, self.index, grad)
        else:
            out[self.index] = grad
        return out


class Split(Function):
    """``x`` cut along ``axis`` into consecutive pieces of the given ``sizes``: several outputs.

    The pieces are views of ``x``. Backward writes each piece's gradient into its place in
    one new array (zeros for a piece that got no gradient): one pass over the result. Indexing
    ``x`` once per piece instead (GetItem) would give one zero-padded array of ``x``'s size
    per piece, for the engine to add up.
    """

    def forward(self, x, sizes, axis=0):
        xp = get_array_module(x)
        self.axis, self.in_shape, self.dtype = axis % x.ndim, x.shape, x.dtype
        if sum(sizes) != x.shape[self.axis]:
            raise ValueError(f"split: sizes {list(sizes)} do not add up to the "
                             f"{x.shape[self.axis]} entries of axis {axis}")
        bounds = [sum(sizes[:i + 1]) for i in range(len(sizes) - 1)]
        self.slices = [(lo, lo + n) for lo, n in zip([0] + bounds, sizes)]
        return tuple(xp.split(x, bounds, axis=self.axis))

    def backward(self, grads):
        xp = get_array_module(*(g for g in grads if g is not None))
        out = xp.empty(self.in_shape, dtype=self.dtype)
        for (lo, hi), g in zip(self.slices, grads):
            index = (slice(None),) * self.axis + (slice(lo, hi),)
            out[index] = 0 if g is None else g
        return out


class SplitHeads(Function):
    """(B, T, n*h*d_k), ``n`` projections side by side -> ``n`` views (B, h, T, d_k).

    Multi-head attention's head split of a fused projection (q|k|v, or k|v, or one q) as
    one node, where reshape + split + one transpose per part would be n + 2 (on the GPU the
    parts are contiguous copies, see ``forward``). Backward
    writes the parts' gradients, transposed back, into one (B, T, n*h*d_k) array (zeros
    for a part that got none).
    """

    def forward(self, x, n_heads, parts=1):
        b, t, width = x.shape
        if width % (parts * n_heads):
            raise ValueError(f"split_heads: width {width} is not {parts} parts x "
                             f"{n_heads} heads")
        self.in_shape, self.dtype = x.shape, x.dtype
        self.parts, self.n_heads = parts, n_heads
        split = x.reshape(b, t, parts, n_heads, width // (parts * n_heads))
        views = tuple(split[:, :, i].transpose(0, 2, 1, 3) for i in range(parts))
        if get_array_module(x) is not np:
            # On the GPU each part is copied once, heads first: cuBLAS's strided-batched
            # product needs one stride per batch axis, which a head view of a fused
            # projection lacks, so otherwise every product would copy its operand again
            # (three times forward, three times backward; at every step of decoding for
            # the encoder-decoder keys and values). NumPy's matmul reads the views as
            # they are.
            views = tuple(get_array_module(x).ascontiguousarray(v) for v in views)
        return views if parts > 1 else views[0]

    def backward(self, grads):
        grads = grads if self.parts > 1 else (grads,)
        xp = get_array_module(*(g for g in grads if g is not None))
        b, t, width = self.in_shape
        out = xp.empty((b, t, self.parts, self.n_heads, width // (self.parts * self.n_heads)),
                       dtype=self.dtype)
        for i, g in enumerate(grads):
            out[:, :, i] = 0 if g is None else g.transpose(0, 2, 1, 3)
        return out.reshape(self.in_shape)


class MergeHeads(Function):
    """(B, h, T, d_k) -> (B, T, h*d_k): the Concat(head_1, ..., head_h) of eq. (4), one node.

    A transpose and a copy into heads-side-by-side order; backward is the view back.
    """

    def forward(self, x):
        xp = get_array_module(x)
        b, h, t, dk = x.shape
        return xp.ascontiguousarray(x.transpose(0, 2, 1, 3)).reshape(b, t, h * dk)

    def backward(self, grad):
        b, t, width = grad.shape
        h = self.inputs[0].shape[1]
        return grad.reshape(b, t, h, width // h).transpose(0, 2, 1, 3)


class Concatenate(Function):
    """Join tensors along an existing axis; backward splits the gradient."""

    def forward(self, *xs, axis=0):
        xp = get_array_module(*xs)
        self.axis = axis
        self.sizes = [x.shape[axis] for x in xs]
        return xp.concatenate(xs, axis=axis)

    def backward(self, grad):
        xp = get_array_module(grad)
        bounds = [sum(self.sizes[:i + 1]) for i in range(len(self.sizes) - 1)]
        return tuple(xp.split(grad, bounds, axis=self.axis))


class Stack(Function):
    """Join tensors along a new axis; backward takes the slices apart."""

    def forward(self, *xs, axis=0):
        xp = get_array_module(*xs)
        self.axis = axis % (xs[0].ndim + 1)
        return xp.stack(xs, axis=self.axis)

    def backward(self, grad):
        xp = get_array_module(grad)
        return tuple(xp.take(grad, i, axis=self.axis) for i in range(grad.shape[self.axis]))


class Where(Function):
    """``a`` where ``condition`` is True, else ``b`` (all three broadcast)."""

    def forward(self, a, b, condition):
        xp = get_array_module(a, b)
        self.condition, self.shapes = condition, (a.shape, b.shape)
        return xp.where(condition, a, b)

    def backward(self, grad):
        c = self.condition
        sa, sb = self.shapes
        return (sum_to(grad * c, sa) if self.needs_input_grad[0] else None,
                sum_to(grad * ~c, sb) if self.needs_input_grad[1] else None)


class MaskedFill(Function):
    """``x`` with ``value`` where ``mask`` is True; those positions get no gradient."""

    def forward(self, x, mask, value):
        xp = get_array_module(x)
        self.mask = mask
        out = x.copy() if mask.shape == x.shape else xp.broadcast_to(x, xp.broadcast_shapes(
            x.shape, mask.shape)).copy()
        xp.copyto(out, xp.asarray(value, dtype=x.dtype), where=mask)
        self.in_shape = x.shape
        return out

    def backward(self, grad):
        return sum_to(grad * ~self.mask, self.in_shape)
