"""Convolution over one or two spatial dimensions, as im2col and one matrix product.

For an input x (N, C, *in) and weights w (O, C/G, *k) in G groups, every output position
sees a window of x: for each kernel offset o (k_1 ... k_d of them) the positions
``o * dilation + stride * j`` of the zero-padded input. :func:`unfold` copies those windows
into columns (N, C, K, *out), K = prod(k), one strided slice per offset, so that

    y[n, g, :, l] = W_g @ cols[n, g, :, l] + b,   W_g = w[group g] as (O/G, C/G * K),

is one batched product over the groups with N * L columns (L = prod(out)). Backward is two
more products, dW_g = dy_g @ cols_g^T and dcols_g = W_g^T @ dy_g, and :func:`fold`, which adds
each offset's slice of dcols back where :func:`unfold` took it (im2col's adjoint, col2im).
The output length along a dimension is floor((n + 2 p - d (k - 1) - 1) / s) + 1, as PyTorch's.
The pools of :mod:`tinytf.ops.pool` reuse :func:`unfold` and :func:`fold`.
"""
from __future__ import annotations

import itertools
import math

from tinytf.engine.backend import get_array_module
from tinytf.engine.tensor import Function


def out_size(n: int, k: int, stride: int, padding: int, dilation: int) -> int:
    """The output length of a window of ``k`` taps over ``n`` positions."""
    return (n + 2 * padding - dilation * (k - 1) - 1) // stride + 1


def _offsets(kernel, stride, dilation, out):
    """For each kernel offset (C order), the index of the padded input it reads."""
    for offset in itertools.product(*(range(k) for k in kernel)):
        yield (slice(None), slice(None)) + tuple(
            slice(o * d, o * d + s * (n - 1) + 1, s)
            for o, d, s, n in zip(offset, dilation, stride, out))


def unfold(x, kernel, stride, padding, dilation, pad_value=0.0):
    """im2col: the windows of ``x`` (N, C, *in) as (N, C, K, *out), K = prod(kernel)."""
    xp = get_array_module(x)
    out = tuple(out_size(n, k, s, p, d) for n, k, s, p, d in
                zip(x.shape[2:], kernel, stride, padding, dilation))
    if min(out) < 1:
        raise ValueError(f"window {tuple(kernel)} (dilation {tuple(dilation)}) is larger "
                         f"than the padded input {tuple(x.shape[2:])}")
    if any(padding):
        width = ((0, 0), (0, 0)) + tuple((p, p) for p in padding)
        x = xp.pad(x, width, constant_values=pad_value)
    return xp.stack([x[i] for i in _offsets(kernel, stride, dilation, out)], axis=2)


def fold(cols, in_shape, kernel, stride, padding, dilation):
    """col2im, :func:`unfold`'s adjoint: each window's values added back into an array
    of ``in_shape`` (overlapping windows add up)."""
    xp = get_array_module(cols)
    padded = in_shape[:2] + tuple(n + 2 * p for n, p in zip(in_shape[2:], padding))
    x = xp.zeros(padded, dtype=cols.dtype)
    for j, i in enumerate(_offsets(kernel, stride, dilation, cols.shape[3:])):
        x[i] += cols[:, :, j]     # one offset's positions are distinct: no repeated index
    crop = (slice(None), slice(None)) + tuple(slice(p, p + n) for p, n in
                                              zip(padding, in_shape[2:]))
    return x[crop]


class Conv(Function):
    """y = conv(x, w) + b over the last d = w.ndim - 2 dimensions of x (N, C, *in), w (O, C/G,
    *k), b (O,) or None; ``stride``, ``padding``, ``dilation`` are d-tuples, ``groups`` G
    divides C and O. Cross-correlation, as every deep-learning library computes it."""

    def forward(self, x, w, b=None, stride=(1,), padding=(0,), dilation=(1,), groups=1):
        xp = get_array_module(x)
        n, c = x.shape[:2]
        o, kernel = w.shape[0], w.shape[2:]
        if c != w.shape[1] * groups or o % groups:
            raise ValueError(f"conv: input has {c} channels, weight {tuple(w.shape)} with "
                             f"{groups} groups wants {w.shape[1] * groups} (and O % groups == 0)")
        self.args = kernel, stride, padding, dilation
        self.x_shape, self.groups = x.shape, groups
        cols = unfold(x, *self.args)                          # (N, C, K, *out)
        self.out = cols.shape[3:]
        k, length = math.prod(kernel), math.prod(self.out)
        cols = cols.reshape(n, groups, (c // groups) * k, length)
        cols = xp.ascontiguousarray(cols.transpose(1, 2, 0, 3)).reshape(
            groups, (c // groups) * k, n * length)            # (G, C/G*K, N*L)
        weight = w.reshape(groups, o // groups, -1)           # (G, O/G, C/G*K)
        y = weight @ cols                                     # (G, O/G, N*L): the product
        self.save_for_backward(cols, weight)
        y = y.reshape(groups, o // groups, n, length).transpose(2, 0, 1, 3).reshape(
            (n, o) + self.out)
        if b is not None:
            y = y + b.reshape((o,) + (1,) * len(kernel))
        return xp.ascontiguousarray(y)

    def backward(self, grad):
        cols, weight = self.saved
        n, c = self.x_shape[:2]
        g, length = self.groups, cols.shape[2] // n
        dy = grad.reshape(n, g, -1, length).transpose(1, 2, 0, 3).reshape(g, -1, n * length)
        gx = gw = gb = None
        if self.needs_input_grad[0]:
            dcols = weight.transpose(0, 2, 1) @ dy                # (G, C/G*K, N*L)
            dcols = dcols.reshape(g, c // g, -1, n, length).transpose(3, 0, 1, 2, 4)
            gx = fold(dcols.reshape((n, c, -1) + self.out), self.x_shape, *self.args)
        if self.needs_input_grad[1]:
            gw = (dy @ cols.transpose(0, 2, 1)).reshape(self.inputs[1].shape)
        if len(self.inputs) > 2 and self.needs_input_grad[2]:
            gb = grad.sum(axis=(0,) + tuple(range(2, grad.ndim)))
        return (gx, gw) if len(self.inputs) == 2 else (gx, gw, gb)
