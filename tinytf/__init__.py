"""tinytf: a from-scratch Transformer on NumPy or CuPy with hand-written autograd.

The folders are the layers, lowest first (docs/architecture.md draws them):
:mod:`tinytf.engine` (arrays, the op table, ``Tensor`` and its backward, gradcheck),
:mod:`tinytf.ops` (the reference ops), :mod:`tinytf.nn` (``F`` and the modules),
:mod:`tinytf.optim` (Adam, clipping, learning-rate schedules), :mod:`tinytf.fast` (the
faster variants of the ops, on by default; ``TINYTF_FAST=0`` runs the references),
:mod:`tinytf.distributed`, :mod:`tinytf.models` (the Transformer), :mod:`tinytf.text`
(BPE), :mod:`tinytf.data`, :mod:`tinytf.decoding` (beam search, the translator),
:mod:`tinytf.training` and :mod:`tinytf.commands` (the programs).
"""
import os as _os
import sys as _sys

if "numpy" not in _sys.modules:
    # OpenBLAS's idle threads spin for 2^28 cycles after each product before they sleep,
    # taking a core from the row-parallel threads of tinytf.fast.threads; at 2^16 they
    # still spin between the products of one batched matmul but sleep during the row ops
    # (docs/architecture.md, "Both cores"). OpenBLAS reads it when NumPy loads it, so it
    # is set only if NumPy is not loaded yet, and never over the user's own setting.
    _os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

# ops first: importing it fills the op table that fast then overrides
from tinytf import ops  # noqa: F401,E402
from tinytf import fast, nn, optim  # noqa: F401,E402
from tinytf.engine import backend  # noqa: F401,E402
from tinytf.engine.backend import manual_seed  # noqa: E402
from tinytf.engine.tensor import Function, Tensor, is_grad_enabled, no_grad, tensor  # noqa: E402
from tinytf.nn import functional  # noqa: F401,E402
from tinytf.nn.functional import cat, split, stack, where  # noqa: E402

__version__ = "0.1.0"

__all__ = ["Tensor", "Function", "tensor", "no_grad", "is_grad_enabled", "manual_seed",
           "cat", "split", "stack", "where", "backend", "functional", "nn", "optim", "__version__"]
