"""Learning-rate schedulers that drive any optimizer's parameter groups, as
``torch.optim.lr_scheduler``: each group's learning rate is its initial one (``base_lr``)
times a factor of the scheduler's step count ``t``, set at construction (t = 0) and at each
:meth:`LRScheduler.step` (t = 1, 2, ...; call it after ``optimizer.step()``)::

    LambdaLR            factor = lr_lambda(t)
    StepLR              factor = gamma ** (t // step_size)
    LinearLR            factor = start + (end - start) * min(t, total_iters) / total_iters
                        (a linear warm-up with start < 1 = end)
    CosineAnnealingLR   lr = eta_min + (base_lr - eta_min) (1 + cos(pi t / T_max)) / 2
    ScheduleLR          factor = schedule(t + 1) / schedule.peak_lr, for the Transformer's
                        schedules (:class:`tinytf.optim.schedule.Schedule`: noam,
                        inverse_sqrt, linear), whose update numbers count from 1

The factors are computed in closed form (PyTorch computes StepLR, LinearLR and cosine
recursively, equal to round-off).
"""
from __future__ import annotations

import math

from tinytf.optim.schedule import Schedule


class LRScheduler:
    """Base class: :meth:`factor` of step ``t``, or :meth:`value` for a form that is not a
    factor; sets every group's ``lr`` at construction and at each :meth:`step`."""

    def __init__(self, optimizer):
        self.optimizer = optimizer
        for group in optimizer.param_groups:
            group.setdefault("initial_lr", group["lr"])
        self.base_lrs = [group["initial_lr"] for group in optimizer.param_groups]
        self.last_epoch = 0
        self._apply()

    def factor(self, t: int) -> float:  # pragma: no cover - abstract
        """The multiple of each group's base learning rate at step ``t``."""
        raise NotImplementedError

    def value(self, base_lr: float, t: int) -> float:
        """A group's learning rate at step ``t``: base_lr * factor(t) unless overridden."""
        return base_lr * self.factor(t)

    def _apply(self) -> None:
        for group, base in zip(self.optimizer.param_groups, self.base_lrs):
            group["lr"] = self.value(base, self.last_epoch)

    def step(self) -> None:
        """Advance one step and set the groups' learning rates."""
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list:
        """Every group's learning rate as last set."""
        return [group["lr"] for group in self.optimizer.param_groups]

    def state_dict(self) -> dict:
        """{"last_epoch", "base_lrs"}: enough to continue (the settings are the code's)."""
        return {"last_epoch": self.last_epoch, "base_lrs": list(self.base_lrs)}

    def load_state_dict(self, state: dict) -> None:
        """Restore what :meth:`state_dict` returned and set the learning rates."""
        self.last_epoch, self.base_lrs = int(state["last_epoch"]), list(state["base_lrs"])
        self._apply()


class LambdaLR(LRScheduler):
    """factor = lr_lambda(t)."""

    def __init__(self, optimizer, lr_lambda):
        self.lr_lambda = lr_lambda
        super().__init__(optimizer)

    def factor(self, t: int) -> float:
        return self.lr_lambda(t)


class StepLR(LRScheduler):
    """factor = gamma ** (t // step_size): the rate times gamma every step_size steps."""

    def __init__(self, optimizer, step_size: int, gamma: float = 0.1):
        self.step_size, self.gamma = step_size, gamma
        super().__init__(optimizer)

    def factor(self, t: int) -> float:
        return self.gamma ** (t // self.step_size)


class LinearLR(LRScheduler):
    """factor from ``start_factor`` to ``end_factor`` linearly over ``total_iters`` steps,
    then constant: a linear warm-up."""

    def __init__(self, optimizer, start_factor: float = 1 / 3, end_factor: float = 1.0,
                 total_iters: int = 5):
        if not 0 < start_factor <= 1 or not 0 <= end_factor <= 1:
            raise ValueError("LinearLR: start_factor must be in (0, 1], end_factor in [0, 1]")
        self.start, self.end, self.total = start_factor, end_factor, total_iters
        super().__init__(optimizer)

    def factor(self, t: int) -> float:
        return self.start + (self.end - self.start) * min(t, self.total) / self.total


class CosineAnnealingLR(LRScheduler):
    """lr = eta_min + (base_lr - eta_min) (1 + cos(pi t / T_max)) / 2 (Loshchilov & Hutter
    2017, without restarts): from base_lr down to eta_min at step T_max."""

    def __init__(self, optimizer, T_max: int, eta_min: float = 0.0):  # noqa: N803 - PyTorch's name
        self.T_max, self.eta_min = T_max, eta_min
        super().__init__(optimizer)

    def value(self, base_lr: float, t: int) -> float:
        cosine = (1 + math.cos(math.pi * t / self.T_max)) / 2
        return self.eta_min + (base_lr - self.eta_min) * cosine


class ScheduleLR(LRScheduler):
    """One of the Transformer's schedules (``Schedule``: noam, inverse_sqrt, linear) for any
    optimizer: factor = schedule(t + 1, progress) / schedule.peak_lr, so each group peaks at
    its own learning rate. ``progress`` (for ``linear``): a function of t giving the budget
    spent in [0, 1]; by default t / total_steps when ``total_steps`` is given."""

    def __init__(self, optimizer, schedule: Schedule, total_steps: int | None = None,
                 progress=None):
        self.schedule = schedule
        if progress is None:
            progress = (lambda t: min(t / total_steps, 1.0)) if total_steps else (lambda t: 0.0)
        self.progress = progress
        super().__init__(optimizer)

    def factor(self, t: int) -> float:
        return self.schedule(t + 1, self.progress(t + 1)) / self.schedule.peak_lr
