"""Optimisers and what drives them: Adam (with RAdam's rectifier), gradient clipping and
the flat-buffer helpers in :mod:`tinytf.optim.adam`; the learning-rate schedules in
:mod:`tinytf.optim.schedule`."""
from tinytf.optim import schedule  # noqa: F401
from tinytf.optim.adam import (  # noqa: F401
                               Adam,
                               FlatParameters,
                               adam_update,
                               clip_grad_norm,
                               clip_grad_norm_array,
                               flat_gradient,
                               flat_parameters,
                               grad_norm,
                               grad_norm_array,
                               gradient_arrays,
                               noam_lr,
                               radam_rectifier,
)

__all__ = ["Adam", "FlatParameters", "adam_update", "clip_grad_norm", "clip_grad_norm_array",
           "flat_gradient", "flat_parameters", "grad_norm", "grad_norm_array", "gradient_arrays",
           "noam_lr", "radam_rectifier", "schedule"]
