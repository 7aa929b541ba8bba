"""Dynamic loss scaling for float16 training (Micikevicius et al. 2018; PyTorch's
GradScaler): float16's 5 exponent bits flush small gradients to zero, so the loss is
multiplied by a large factor S before backward and the gradients divided by S after;
a step whose gradients hold inf/NaN is skipped. bfloat16 has float32's exponent range
and needs none. On the GPU the unscaling and the inf/NaN check are one fused launch.
"""
from __future__ import annotations

import math

import numpy as np

from tinytf.engine import backend
from tinytf.engine.tensor import Tensor
from tinytf.fast.cuda import kernels
from tinytf.optim.adam import gradient_arrays


class DynamicLossScaler:
    """Dynamic loss scaling for float16 training (Micikevicius et al. 2018; as torch's GradScaler).

    Per step: backward on ``scale_loss(loss)`` = loss * S; ``found_inf = unscale_(params)``
    multiplies every gradient by 1/S and reports whether any was inf/NaN; the optimizer
    steps only if not; ``update(found_inf)`` then halves S after an overflow (the step is
    skipped) or doubles it after ``growth_interval`` overflow-free steps in a row.
    S below ``min_scale`` means the gradients are inf/NaN at any scale (the run has
    diverged): FloatingPointError. ``enabled=False`` (bf16, float32) makes every method a
    pass-through, so one training loop serves all precisions.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 2.0 ** -16, enabled: bool = True):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1
                and init_scale > 0):
            raise ValueError("loss_scaler: DynamicLossScaler needs growth_factor > 1, "
                             "0 < backoff_factor < 1, growth_interval >= 1, init_scale > 0")
        self._device_scale = None   # S as a device scalar, for captured graphs (scale_loss)
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = int(growth_interval), float(min_scale)
        self.enabled = bool(enabled)
        self.growth_tracker = 0     # overflow-free steps since the last change of scale
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        """The current loss scale S."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = float(value)
        if self._device_scale is not None:      # one fill launch; a graph reads it next
            self._device_scale.fill(self._scale)

    def scale_loss(self, loss: Tensor, on_device: bool = False) -> Tensor:
        """loss * S (the loss itself when disabled).

        ``on_device``: S is read from a device scalar that the scaler keeps equal to
        :attr:`scale`, instead of being a constant of the product. A CUDA graph that
        captures this product then multiplies by each step's S when replayed
        (``train.py --cuda-graph --precision fp16``).
        """
        if not self.enabled:
            return loss
        if not on_device:
            return loss * self.scale
        xp = backend.get_array_module(loss.data)
        if self._device_scale is None or backend.get_array_module(self._device_scale) is not xp:
            self._device_scale = xp.full((), self._scale, dtype=np.float32)
        return loss * Tensor(self._device_scale)

    def unscale_(self, params, extra_factor: float = 1.0) -> bool:
        """Multiply every gradient by extra_factor / S in place; True if any was inf/NaN.

        ``extra_factor`` folds another scaling into the same pass (1 / global token count
        in train.py). Disabled: multiplies by ``extra_factor`` and returns False unchecked.
        On CuPy the check costs one host sync per step (one flag for all gradients).
        """
        grads = gradient_arrays(params)   # the flat buffer if any: one pass, one launch
        factor = extra_factor / self.scale if self.enabled else extra_factor
        if not self.enabled:
            if factor != 1.0:
                for g in grads:
                    g *= factor
            return False
        if not grads:
            return False
        if kernels.fused(*grads):
            return bool(kernels.unscale_(grads, factor)[0])
        xp = backend.get_array_module(grads[0])
        finite = xp.stack([xp.isfinite(g).all() for g in grads]).all()  # before scaling
        for g in grads:
            g *= factor
        return not bool(finite)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            if self.scale < self.min_scale:
                raise FloatingPointError(
                    f"loss_scaler: loss scale fell to {self.scale:g} < min_scale "
                    f"{self.min_scale:g}: the gradients are inf/NaN at every scale")
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def update_on_device(self, found_inf) -> None:
        """Move the device scale (:meth:`scale_loss` with ``on_device``) to where
        :meth:`update` will move :attr:`scale`, without reading ``found_inf``, a flag on
        the device: S * backoff_factor if it is set, else S, or S * growth_factor when this
        step completes a growth interval. The next backward can then be launched before the
        host knows whether this step overflowed; the host's own state follows when the
        caller learns the outcome and calls :meth:`update` (one step in flight,
        docs/training.md).
        """
        if not self.enabled or self._device_scale is None:
            return
        xp = backend.get_array_module(self._device_scale)
        grown = self.growth_tracker + 1 >= self.growth_interval
        clean = self._scale * self.growth_factor if grown else self._scale
        self._device_scale[...] = xp.where(found_inf.reshape(()) != 0,
                                           np.float32(self._scale * self.backoff_factor),
                                           np.float32(clean))

    def step(self, optimizer, params=None, extra_factor: float = 1.0) -> bool:
        """unscale_, then ``optimizer.step()`` unless inf/NaN, then update; True if stepped.

        ``params`` defaults to ``optimizer.params``. Gradients are not cleared.
        """
        params = optimizer.params if params is None else params
        found_inf = self.unscale_(params, extra_factor)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict:
        """JSON-serialisable state (scale, counters and settings)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped_steps": self.skipped_steps, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "min_scale": self.min_scale, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (KeyError naming a missing key)."""
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise KeyError(f"loss_scaler: loss-scaler state is missing {missing}")
        self.scale = float(state["scale"])
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"loss_scaler: loss-scaler state has scale {self.scale}")
        self.growth_tracker, self.skipped_steps = int(state["growth_tracker"]), \
            int(state["skipped_steps"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), \
            float(state["backoff_factor"])
        self.growth_interval, self.min_scale = int(state["growth_interval"]), \
            float(state["min_scale"])
        self.enabled = bool(state["enabled"])
