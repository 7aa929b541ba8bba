"""The fast paths, apart from the reference ops they replace.

:mod:`tinytf.ops` is the mathematics; this package is speed. Each entry of
:data:`FAST_OPS` names a reference op and the subclass that runs instead when the fast
paths are on (the default): the subclass computes the same thing (to float32 rounding)
and falls back to its parent where it does not apply (a CUDA kernel on NumPy arrays, say).

=================  ===================  =====================================================
reference op       runs instead         what is faster
=================  ===================  =====================================================
``CrossEntropy``   ``FusedCrossEntropy``  GPU: one kernel; CPU: ``BlockedCrossEntropy``, a
                                        cache-blocked loop in one reused (N, V) buffer,
                                        its blocks in threads
``Embedding``      ``FlatIndexEmbedding``  CPU backward: ``add.at`` with flat indices (~3x)
``Softmax``,       ``FusedSoftmax``,     GPU: one launch forward, one backward
``LogSoftmax``     ``FusedLogSoftmax``
``LayerNorm``      ``FusedLayerNorm``    GPU: one launch each way (+ column sums); CPU:
                                        rows in threads
``Dropout``,       ``FusedDropout``,     GPU: random numbers, mask, product (and the
``DropoutAdd``     ``FusedDropoutAdd``   residual sum) in one launch; CPU (DropoutAdd):
                                        mask, product and sum by rows in threads
``ReLU``           ``FusedReLU``         GPU: one launch each way
``GELU``           ``RowParallelGELU``   CPU: forward and backward by rows in threads
``MatMul``         ``CublasMatMul``      GPU: one cuBLAS call per product (tensor cores)
``Attention``      ``FusedAttention``    GPU: cuBLAS with the 1/sqrt(d) as alpha, masked
                                        softmax and its backward in one launch each;
                                        CPU: that softmax and backward by rows in threads
``Linear``         ``FusedLinear``       GPU: cuBLAS, bias (+ReLU) in one launch; a compute
                                        dtype under ``amp.autocast`` (no cast nodes);
                                        CPU: the bias/ReLU pass by rows in threads,
                                        and inside a search the product by a
                                        contiguous copy of W.T (fast/transposed.py)
=================  ===================  =====================================================

The CPU's "in threads" is :mod:`tinytf.fast.threads` (``TINYTF_THREADS``), bitwise equal
to one thread; ``FusedAdam`` updates the CPU's flat buffers the same way.
``TINYTF_FAST=0`` in the environment, or :func:`set_enabled` (False), runs the reference
ops everywhere; ``tests/fast/test_fast.py`` proves a whole Transformer step equal either way.
The other fast paths, outside the op table: :mod:`tinytf.fast.kernels` (the CUDA source and its
wrappers), :mod:`tinytf.fast.amp` (mixed precision), :mod:`tinytf.fast.cuda_graph` (step replay),
the flat-buffer Adam in :mod:`tinytf.optim.adam`, and :mod:`tinytf.fast.memory` (glibc keeps
freed memory for the next step: the commands ask for it; ``TINYTF_KEEP_MEMORY=0`` leaves
malloc as it is).
"""
from __future__ import annotations

import os

from tinytf.engine.dispatch import impl
from tinytf.fast.cpu import BlockedCrossEntropy, FlatIndexEmbedding, RowParallelGELU
from tinytf.fast.cuda import (
    CublasMatMul,
    FusedAttention,
    FusedCrossEntropy,
    FusedDropout,
    FusedDropoutAdd,
    FusedLayerNorm,
    FusedLinear,
    FusedLogSoftmax,
    FusedReLU,
    FusedSoftmax,
)
from tinytf.fast.optim import FusedAdam
from tinytf.optim.adam import Adam

__all__ = ["FAST_OPS", "set_enabled", "enabled", "BlockedCrossEntropy", "FlatIndexEmbedding",
           "FusedAdam", "adam"]

FAST_OPS = {
    "CrossEntropy": FusedCrossEntropy,
    "Embedding": FlatIndexEmbedding,
    "Softmax": FusedSoftmax,
    "LogSoftmax": FusedLogSoftmax,
    "LayerNorm": FusedLayerNorm,
    "Dropout": FusedDropout,
    "DropoutAdd": FusedDropoutAdd,
    "ReLU": FusedReLU,
    "GELU": RowParallelGELU,
    "MatMul": CublasMatMul,
    "Attention": FusedAttention,
    "Linear": FusedLinear,
}
"""Reference op name -> the faster subclass that runs instead (the table above)."""

_enabled = False


def set_enabled(flag: bool = True) -> None:
    """Run the fast variants of :data:`FAST_OPS` (True) or the reference ops (False)."""
    global _enabled
    _enabled = bool(flag)
    for name, cls in FAST_OPS.items():
        if _enabled:
            impl.replace(name, cls)
        else:
            impl.restore(name)


def adam(params, **kwargs):
    """The Adam that training uses: :class:`FusedAdam` with the fast paths on, else
    :class:`tinytf.optim.adam.Adam` (same arguments, same state_dict)."""
    return (FusedAdam if _enabled else Adam)(params, **kwargs)


def enabled() -> bool:
    """Whether the fast variants run (``TINYTF_FAST=0`` starts with them off)."""
    return _enabled


set_enabled(os.environ.get("TINYTF_FAST", "1") != "0")
