"""The fast paths, apart from the reference ops they replace.

:mod:`tinytf.ops` is the mathematics; this package is speed. It holds one table per
device, :data:`CPU_OPS` (NumPy arrays) and :data:`GPU_OPS` (CuPy arrays), each naming a
reference op and the subclass of it that runs instead on that device when the fast paths
are on (the default). The subclass computes the same thing (to float32 rounding) and falls
back to the reference where it does not apply (float64 gradient checks, an odd shape).
``impl.describe("LayerNorm")`` prints what runs on each device.

=================  ==========================  ============================================
reference op       CPU (:mod:`.cpu.ops`)       GPU (:mod:`.cuda.ops`)
=================  ==========================  ============================================
``CrossEntropy``   ``BlockedCrossEntropy``:    ``FusedCrossEntropy``: loss, softmax and
                   one reused (N, V) buffer,   gradient in one launch per row block
                   64 rows at a time, blocks
                   in threads
``Embedding``      ``FlatIndexEmbedding``:     (reference: CuPy's scatter-add)
                   ``add.at`` on flat indices
``Softmax``,       (reference)                 ``FusedSoftmax``, ``FusedLogSoftmax``: one
``LogSoftmax``                                 launch forward, one backward
``LayerNorm``      ``RowParallelLayerNorm``:   ``FusedLayerNorm``: one launch each way
                   rows in threads             (+ the parameter gradients' column sums)
``Dropout``        (reference)                 ``FusedDropout``: random numbers, mask and
                                               product in one launch
``DropoutAdd``     ``RowParallelDropoutAdd``:  ``FusedDropoutAdd``: the same and the
                   mask, product, sum by rows  residual sum in one launch
``ReLU``           (reference)                 ``FusedReLU``: one launch each way
``GELU``           ``RowParallelGELU``: rows   (reference)
``MatMul``         (reference)                 ``CublasMatMul``: one cuBLAS call each
``Attention``      ``RowParallelAttention``:   ``FusedAttention``: cuBLAS with 1/sqrt(d) as
                   small products and masked   alpha, masked softmax and its backward in
                   softmax by sentences        one launch each
``Linear``         ``RowParallelLinear``:      ``FusedLinear``: cuBLAS, bias (+ReLU) in one
                   bias/ReLU by rows; in a     launch; a compute dtype under
                   search W.T copied once      ``amp.autocast`` (no cast nodes)
=================  ==========================  ============================================

The folders are the devices: ``cpu/`` (:mod:`.cpu.ops`, the rows of NumPy passes in threads
of :mod:`.cpu.threads` (``TINYTF_THREADS``), bitwise equal to one thread, W.T copied once per
search in :mod:`.cpu.transposed`, and :mod:`.cpu.memory`: glibc keeps freed memory for the
next step, which the commands ask for; ``TINYTF_KEEP_MEMORY=0`` leaves malloc as it is) and
``cuda/`` (:mod:`.cuda.ops`, the CUDA source and its wrappers in :mod:`.cuda.kernels`, step
replay in :mod:`.cuda.graph`). Beside them, for both: ``FusedAdam`` (:mod:`.optim`, the
flat-buffer Adam of :mod:`tinytf.optim.adam` with its rows in threads or one kernel) and
float16's loss scaling (:mod:`.loss_scaler`). ``TINYTF_FAST=0`` in the environment, or
:func:`set_enabled` (False), runs the reference ops everywhere; ``tests/fast/test_fast.py``
proves a whole Transformer step equal either way.
"""
from __future__ import annotations

import os

from tinytf.engine.dispatch import impl
from tinytf.fast.cpu.ops import (
    BlockedCrossEntropy,
    FlatIndexEmbedding,
    RowParallelAttention,
    RowParallelDropoutAdd,
    RowParallelGELU,
    RowParallelLayerNorm,
    RowParallelLinear,
)
from tinytf.fast.cuda.ops import (
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

__all__ = ["CPU_OPS", "GPU_OPS", "set_enabled", "enabled", "BlockedCrossEntropy",
           "FlatIndexEmbedding", "FusedAdam", "adam"]

CPU_OPS = {
    "CrossEntropy": BlockedCrossEntropy,
    "Embedding": FlatIndexEmbedding,
    "LayerNorm": RowParallelLayerNorm,
    "DropoutAdd": RowParallelDropoutAdd,
    "GELU": RowParallelGELU,
    "Attention": RowParallelAttention,
    "Linear": RowParallelLinear,
}
"""Reference op name -> the subclass that runs instead on NumPy arrays (the table above)."""

GPU_OPS = {
    "CrossEntropy": FusedCrossEntropy,
    "Softmax": FusedSoftmax,
    "LogSoftmax": FusedLogSoftmax,
    "LayerNorm": FusedLayerNorm,
    "Dropout": FusedDropout,
    "DropoutAdd": FusedDropoutAdd,
    "ReLU": FusedReLU,
    "MatMul": CublasMatMul,
    "Attention": FusedAttention,
    "Linear": FusedLinear,
}
"""Reference op name -> the subclass that runs instead on CuPy arrays (the table above)."""


def set_enabled(flag: bool = True) -> None:
    """Install the fast variants of :data:`CPU_OPS` and :data:`GPU_OPS` in the op table
    (True), or put the reference ops back on both devices (False)."""
    impl.uninstall()
    if flag:
        impl.install("cpu", CPU_OPS)
        impl.install("gpu", GPU_OPS)


def enabled() -> bool:
    """Whether the fast variants run (``TINYTF_FAST=0`` starts with them off)."""
    return bool(impl.installed("cpu") or impl.installed("gpu"))


def adam(params, **kwargs):
    """The Adam that training uses: :class:`FusedAdam` with the fast paths on, else
    :class:`tinytf.optim.adam.Adam` (same arguments, same state_dict)."""
    return (FusedAdam if enabled() else Adam)(params, **kwargs)


set_enabled(os.environ.get("TINYTF_FAST", "1") != "0")
