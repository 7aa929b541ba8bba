"""tinytf: a from-scratch Transformer on NumPy or CuPy with hand-written autograd.

Quick map: :mod:`tinytf.tensor` (Tensor, autograd engine), :mod:`tinytf.ops` (the
reference ops), :mod:`tinytf.functional` (``F``), :mod:`tinytf.nn` (modules),
:mod:`tinytf.optim` (Adam), :mod:`tinytf.schedule` (learning rates), :mod:`tinytf.backend`
(NumPy or CuPy), :mod:`tinytf.fast` (the faster variants of the ops, on by default;
``TINYTF_FAST=0`` runs the reference ops). docs/architecture.md has the layers.
"""
from . import backend, ops  # noqa: I001 - ops first: importing it fills the op table
from . import fast, functional, nn, optim
from .backend import manual_seed
from .functional import cat, split, stack, where
from .tensor import Function, Tensor, is_grad_enabled, no_grad, tensor

__version__ = "0.1.0"

__all__ = ["Tensor", "Function", "tensor", "no_grad", "is_grad_enabled", "manual_seed",
           "cat", "split", "stack", "where", "backend", "functional", "nn", "optim", "__version__"]
