"""Contiguous copies of the weights' transposes, for the small products of a search.

A linear layer computes ``x @ W.T`` with ``W`` stored (out, in). For the thousands of rows
of a training step the transposed view costs nothing, but a search step multiplies a few
hundred rows or fewer, and there OpenBLAS is slower with the view than with a contiguous
copy of ``W.T``: up to 1.3x at 64 rows, 5-8 % at 256 (docs/decoding.md, "Cores").
The copy is only right while ``W`` does not change, so it is made for a block of code that
promises that, a search over fixed weights::

    with transposed_weights(model):
        ...   # every Linear by one of the model's weights multiplies by its copy

``RowParallelLinear.product`` (tinytf.fast.cpu.ops) looks its weight up with :func:`transposed`.
Only NumPy matrices are copied (cuBLAS is handed the transposed operand as it is), and the
copies are dropped when the block that made them ends.
"""
from __future__ import annotations

import contextlib

import numpy as np

_COPIES: dict[int, tuple[np.ndarray, np.ndarray]] = {}
"""id(W) -> (W, contiguous W.T) for the weights of the blocks now open."""


@contextlib.contextmanager
def transposed_weights(model):
    """Inside the block, :func:`transposed` gives a contiguous copy of ``W.T`` for each
    2-D NumPy parameter ``W`` of ``model`` (a :class:`tinytf.nn.modules.Module`). The parameters
    must not change inside the block."""
    made = []
    for w in (p.data for p in model.parameters()):
        if isinstance(w, np.ndarray) and w.ndim == 2 and id(w) not in _COPIES:
            _COPIES[id(w)] = (w, np.ascontiguousarray(w.T))
            made.append(id(w))
    try:
        yield
    finally:
        for key in made:
            del _COPIES[key]


def transposed(weight):
    """``weight.T``: the contiguous copy inside :func:`transposed_weights`, else the view."""
    entry = _COPIES.get(id(weight))
    return entry[1] if entry is not None and entry[0] is weight else weight.T
