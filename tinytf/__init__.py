"""tinytf: a from-scratch Transformer on NumPy or CuPy with hand-written autograd.

The folders are the layers, lowest first (docs/architecture.md draws them):
:mod:`tinytf.engine` (arrays, the op table, ``Tensor`` and its backward, gradcheck),
:mod:`tinytf.ops` (the reference ops), :mod:`tinytf.nn` (``F`` and the modules),
:mod:`tinytf.optim` (Adam, clipping, learning-rate schedules), :mod:`tinytf.fast` (the
faster variants of the ops, on by default; ``TINYTF_FAST=0`` runs the references),
:mod:`tinytf.distributed`, :mod:`tinytf.models` (the Transformer), :mod:`tinytf.text`
(BPE), :mod:`tinytf.data`, :mod:`tinytf.decoding` (beam search, the translator),
:mod:`tinytf.training` and :mod:`tinytf.commands` (the programs).

Importing tinytf changes nothing in the process (no environment variable, no allocator
setting) and loads nothing heavy: the public names below load their modules when first
used, and the op table loads the ops and their fast variants at the first op. The commands
set up their own process (:mod:`tinytf.commands`); a library user may do the same with
:func:`tinytf.fast.cpu.memory.keep_freed_memory` and ``OPENBLAS_THREAD_TIMEOUT``
(docs/architecture.md).
"""
import importlib as _importlib

from tinytf.engine.dispatch import impl as _impl

__version__ = "0.1.0"


def _load_ops() -> None:
    """Fill the op table: the reference ops, then the fast variants that replace some."""
    _importlib.import_module("tinytf.ops")
    _importlib.import_module("tinytf.fast")


_impl.set_loader(_load_ops)

_PUBLIC = {   # name -> (module, attribute or None for the module itself)
    "Tensor": ("tinytf.engine.tensor", "Tensor"),
    "Function": ("tinytf.engine.tensor", "Function"),
    "tensor": ("tinytf.engine.tensor", "tensor"),
    "no_grad": ("tinytf.engine.tensor", "no_grad"),
    "is_grad_enabled": ("tinytf.engine.tensor", "is_grad_enabled"),
    "manual_seed": ("tinytf.engine.backend", "manual_seed"),
    "cat": ("tinytf.nn.functional", "cat"),
    "split": ("tinytf.nn.functional", "split"),
    "stack": ("tinytf.nn.functional", "stack"),
    "where": ("tinytf.nn.functional", "where"),
    "backend": ("tinytf.engine.backend", None),
    "Translator": ("tinytf.decoding.translation", "Translator"),
    "EnsembleTranslator": ("tinytf.decoding.ensemble", "EnsembleTranslator"),
    "TrainConfig": ("tinytf.training.config", "TrainConfig"),
    "train": ("tinytf.training.api", "train"),
    "gradcheck": ("tinytf.engine.gradcheck", "gradcheck"),
    "gradcheck_module": ("tinytf.engine.gradcheck", "gradcheck_module"),
    **{name: ("tinytf.engine.creation", name) for name in (
        "zeros", "ones", "full", "rand", "randn", "arange", "zeros_like", "ones_like",
        "full_like", "rand_like", "randn_like")},
    "functional": ("tinytf.nn.functional", None),
}

__all__ = ["Tensor", "Function", "tensor", "no_grad", "is_grad_enabled", "manual_seed",
           "cat", "split", "stack", "where", "backend", "functional", "nn", "optim", "__version__",
           "gradcheck", "gradcheck_module", "zeros", "ones", "full", "rand", "randn", "arange",
           "zeros_like", "ones_like", "full_like", "rand_like", "randn_like", "Translator",
           "EnsembleTranslator", "TrainConfig", "train"]


def __getattr__(name: str):
    """The public names, each loaded at its first use (PEP 562); subpackages by name."""
    if name in _PUBLIC:
        module, attribute = _PUBLIC[name]
        value = _importlib.import_module(module)
        value = value if attribute is None else getattr(value, attribute)
    elif not name.startswith("_"):
        try:
            value = _importlib.import_module(f"tinytf.{name}")
        except ModuleNotFoundError as e:
            if e.name != f"tinytf.{name}":
                raise
            raise AttributeError(f"module 'tinytf' has no attribute {name!r}") from None
    else:
        raise AttributeError(f"module 'tinytf' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
