"""Optimisers and what drives them, as ``torch.optim``: the :class:`Optimizer` base with
parameter groups (:mod:`.optimizer`), :class:`SGD` (:mod:`.sgd`), :class:`Adam` (with RAdam's
rectifier), :class:`AdamW`, gradient clipping and the flat-buffer helpers (:mod:`.adam`); the
Transformer's learning-rate schedules (:mod:`.schedule`) and schedulers for any optimizer's
groups (:mod:`.lr_scheduler`)."""
from tinytf.optim import lr_scheduler, schedule  # noqa: F401
from tinytf.optim.adam import (  # noqa: F401
    Adam,
    AdamW,
    FlatParameters,
    adam_update,
    clip_grad_norm,
    clip_grad_norm_array,
    clip_grad_value_,
    flat_gradient,
    flat_parameters,
    grad_norm,
    grad_norm_array,
    gradient_arrays,
    noam_lr,
    radam_rectifier,
)
from tinytf.optim.optimizer import Optimizer  # noqa: F401
from tinytf.optim.sgd import SGD  # noqa: F401

clip_grad_norm_ = clip_grad_norm
"""PyTorch's name for :func:`clip_grad_norm` (``torch.nn.utils.clip_grad_norm_``)."""

__all__ = ["Optimizer", "SGD", "Adam", "AdamW", "FlatParameters", "adam_update",
           "clip_grad_norm", "clip_grad_norm_", "clip_grad_value_", "clip_grad_norm_array",
           "flat_gradient", "flat_parameters", "grad_norm", "grad_norm_array", "gradient_arrays",
           "noam_lr", "radam_rectifier", "schedule", "lr_scheduler"]
