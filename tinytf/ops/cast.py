"""Conversion between float types, bfloat16 emulated on NumPy included.

NumPy has no bfloat16 type, and a bfloat16 product in NumPy would have no BLAS behind it.
On the CPU, bf16 is therefore *emulated*: float32 arrays whose values are rounded to bf16
(:func:`round_to_bf16`, round-to-nearest-even, the same bit arithmetic as the GPU kernels'
``from_f32<bf16_t>``). That reproduces bf16's rounding at every cast boundary, not its
speed. :data:`EMULATED_BF16` names that "dtype" wherever a real one would go.
"""
from __future__ import annotations

import numpy as np

from tinytf.engine import backend
from tinytf.engine.tensor import Function

EMULATED_BF16 = "emulated-bf16"
"""The compute "dtype" of bf16 on NumPy: float32 storage whose values are bf16's."""


def bf16_bits(x):
    """The bfloat16 bit patterns (uint16) of float32 ``x``, rounded to nearest, ties to even.

    bfloat16 is the top half of a float32 (sign, 8 exponent bits, 7 mantissa bits). To
    round, add 0x7FFF plus the lowest kept bit, then drop the low 16 bits: exactly half an
    ulp rounds to the even neighbour. NaN stays NaN (quiet bit set); overflow gives inf.
    """
    xp = backend.get_array_module(x)
    u = xp.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return xp.where(is_nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_from_bits(bits):
    """float32 values of bfloat16 bit patterns (exact: bf16 is a float32 prefix)."""
    xp = backend.get_array_module(bits)
    return (xp.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x):
    """float32 ``x`` rounded to the nearest bfloat16 value, kept as float32 (emulated bf16)."""
    return bf16_from_bits(bf16_bits(x)).reshape(np.shape(x))


def to_compute(a, dtype):
    """Array ``a`` as an op computing in ``dtype`` reads it: float32 arrays are cast
    (:data:`EMULATED_BF16`: rounded to bf16 values, still float32); others, and None, are
    returned as they are. ``Linear`` casts its operands with this under mixed precision,
    which saves the graph a :class:`Cast` node per input."""
    if a is None or a.dtype != np.float32 or dtype is None:
        return a
    return round_to_bf16(a) if dtype == EMULATED_BF16 else a.astype(dtype)


class Cast(Function):
    """x converted to float type ``dtype``; the gradient is converted back to x's type.

    ``dtype`` :data:`EMULATED_BF16` rounds float32 x to bf16 values, and rounds the incoming
    gradient to bf16 as well: on a GPU that gradient would have been computed, and
    stored, in bf16.
    """

    changes_dtype = True

    def forward(self, x, dtype):
        self.in_dtype = x.dtype
        self.emulated = isinstance(dtype, str) and dtype == EMULATED_BF16
        return round_to_bf16(x) if self.emulated else x.astype(dtype)

    def backward(self, grad):
        if self.emulated:       # a fresh array already
            return round_to_bf16(grad).astype(self.in_dtype, copy=False)
        return grad.astype(self.in_dtype)
