"""Tensors made from nothing, as PyTorch's creation functions: ``zeros``, ``ones``, ``full``,
``rand``, ``randn``, ``arange`` and the ``*_like`` forms.

Floating tensors are float32 unless ``dtype`` says otherwise; ``device`` is "cpu" (NumPy) or
"gpu" (CuPy); ``requires_grad=True`` makes a leaf that learns. Random values come from
tinytf's seeded generator (``tinytf.manual_seed``), drawn on the CPU and then moved, so a seed
gives the same numbers on either device.
"""
from __future__ import annotations

import numpy as np

from tinytf.engine import backend
from tinytf.engine.tensor import Tensor


def _shape(size) -> tuple:
    """``zeros(2, 3)`` and ``zeros((2, 3))`` alike."""
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = size[0]
    return tuple(int(n) for n in size)


def _made(array, dtype, device, requires_grad) -> Tensor:
    """A leaf Tensor of ``array`` cast to ``dtype`` (float32 when None) on ``device``."""
    array = backend.to_device(np.asarray(array, dtype=dtype or np.float32), device)
    return Tensor(array, requires_grad=requires_grad)


def zeros(*size, dtype=None, device="cpu", requires_grad=False) -> Tensor:
    """A tensor of zeros of shape ``size``."""
    xp = backend.array_module(device)
    return Tensor(xp.zeros(_shape(size), dtype=dtype or np.float32), requires_grad=requires_grad)


def ones(*size, dtype=None, device="cpu", requires_grad=False) -> Tensor:
    """A tensor of ones of shape ``size``."""
    xp = backend.array_module(device)
    return Tensor(xp.ones(_shape(size), dtype=dtype or np.float32), requires_grad=requires_grad)


def full(size, fill_value, dtype=None, device="cpu", requires_grad=False) -> Tensor:
    """A tensor of shape ``size`` filled with ``fill_value``."""
    xp = backend.array_module(device)
    return Tensor(xp.full(_shape((size,)), fill_value, dtype=dtype or np.float32),
                  requires_grad=requires_grad)


def rand(*size, dtype=None, device="cpu", requires_grad=False) -> Tensor:
    """Uniform random values in [0, 1) of shape ``size``."""
    return _made(backend.rng(np).random(_shape(size)), dtype, device, requires_grad)


def randn(*size, dtype=None, device="cpu", requires_grad=False) -> Tensor:
    """Standard normal random values of shape ``size``."""
    return _made(backend.rng(np).standard_normal(_shape(size)), dtype, device, requires_grad)


def arange(start, end=None, step=1, dtype=None, device="cpu", requires_grad=False) -> Tensor:
    """start, start + step, ... below ``end`` (``arange(n)``: 0 .. n - 1). int64 when every
    argument is an integer, else float32, unless ``dtype`` says."""
    if end is None:
        start, end = 0, start
    if dtype is None:
        integral = all(isinstance(v, (int, np.integer)) for v in (start, end, step))
        dtype = np.int64 if integral else np.float32
    xp = backend.array_module(device)
    return Tensor(xp.arange(start, end, step, dtype=dtype), requires_grad=requires_grad)


def _like(t: Tensor, dtype, device):
    """(shape, dtype, device) of ``t`` unless overridden."""
    return t.shape, dtype or t.dtype, device or t.device


def zeros_like(t: Tensor, dtype=None, device=None, requires_grad=False) -> Tensor:
    """Zeros of ``t``'s shape, dtype and device."""
    shape, dtype, device = _like(t, dtype, device)
    return zeros(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def ones_like(t: Tensor, dtype=None, device=None, requires_grad=False) -> Tensor:
    """Ones of ``t``'s shape, dtype and device."""
    shape, dtype, device = _like(t, dtype, device)
    return ones(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def full_like(t: Tensor, fill_value, dtype=None, device=None, requires_grad=False) -> Tensor:
    """``fill_value`` in ``t``'s shape, dtype and device."""
    shape, dtype, device = _like(t, dtype, device)
    return full(shape, fill_value, dtype=dtype, device=device, requires_grad=requires_grad)


def rand_like(t: Tensor, dtype=None, device=None, requires_grad=False) -> Tensor:
    """Uniform [0, 1) values in ``t``'s shape, dtype and device."""
    shape, dtype, device = _like(t, dtype, device)
    return rand(shape, dtype=dtype, device=device, requires_grad=requires_grad)


def randn_like(t: Tensor, dtype=None, device=None, requires_grad=False) -> Tensor:
    """Standard normal values in ``t``'s shape, dtype and device."""
    shape, dtype, device = _like(t, dtype, device)
    return randn(shape, dtype=dtype, device=device, requires_grad=requires_grad)
