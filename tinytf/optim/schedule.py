"""Learning-rate schedules: the paper's, fairseq's ``inverse_sqrt``, and linear decay to zero.

Every schedule maps (update number, budget progress) to a learning rate and states its peak:

=============  =========================================================================
``noam``       lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
               (Vaswani et al. 5.3). The peak, factor * (d_model * warmup)^-0.5, moves
               when warmup or d_model changes: that is the paper's definition.
``inverse_sqrt`` lr = peak * step / warmup during warmup, then peak * sqrt(warmup / step)
               (fairseq's ``--lr-scheduler inverse_sqrt``): the same curve as ``noam``, but
               the peak is given, so changing warmup no longer changes it.
``linear``     lr = peak * min(warm, 1, (1 - progress) / (1 - p_w)), warm = max(step /
               warmup, progress / 0.3), p_w = min(0.3, warmup * progress / step), where
               progress in [0, 1] is the fraction of the run's budget spent (updates over
               ``--max-steps`` or the updates of ``--max-epochs``, or training seconds over
               ``--max-minutes``): warm up for
               ``warmup`` updates or 30 % of the budget, whichever ends first, then decay
               linearly to zero exactly when the budget ends (budget-aware linear decay:
               Li et al., "Budgeted Training", 2020). p_w is where the warm-up ends, as a
               fraction of the budget: exact for a step budget, and at the run's average
               pace for a time budget (no state to save). The cap keeps a warm-up longer
               than the run (a paper-sized ``--warmup 4000`` in a 10-minute run) from
               eating it: the schedule is then a triangle, up for 30 %, down for 70 %.
=============  =========================================================================

``step`` counts from 1. ``progress`` matters only to ``linear``.
"""

from __future__ import annotations

import dataclasses
import math

SCHEDULES = ("noam", "inverse_sqrt", "linear")


def noam_lr(step: int, d_model: int, warmup: int = 4000, factor: float = 1.0) -> float:
    """lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5) (Vaswani et al. 5.3).

    Rises linearly for ``warmup`` steps, peaks at factor * (d_model * warmup)^-0.5, then
    decays with the inverse square root of the step. ``step`` counts from 1.
    """
    step = max(int(step), 1)
    return factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)


def inverse_sqrt_lr(step: int, peak: float, warmup: int) -> float:
    """peak * step / warmup for step <= warmup, then peak * sqrt(warmup / step)."""
    step = max(int(step), 1)
    return peak * min(step / warmup, math.sqrt(warmup / step))


LINEAR_WARMUP_CAP = 0.3  # linear: the warm-up ends, and the decay starts, by this fraction


def linear_lr(step: int, peak: float, warmup: int, progress: float) -> float:
    """peak * min(warm, 1, (1 - progress) / (1 - p_w)), warm = max(step / warmup, progress /
    0.3), p_w = min(0.3, warmup * progress / step); never < 0."""
    step = max(int(step), 1)
    cap = LINEAR_WARMUP_CAP
    warm = max(step / warmup, progress / cap)
    warm_end = min(cap, warmup * progress / step)   # p_w: the budget spent when warm-up ends
    return peak * max(0.0, min(warm, 1.0, (1.0 - progress) / (1.0 - warm_end)))


@dataclasses.dataclass(frozen=True)
class Schedule:
    """One schedule with its settings: ``kind`` in :data:`SCHEDULES`, ``warmup`` updates, and
    either ``peak`` (inverse_sqrt, linear) or ``factor`` and ``d_model`` (noam)."""

    kind: str
    warmup: int
    peak: float | None = None
    factor: float | None = None
    d_model: int | None = None

    def __post_init__(self):
        if self.kind not in SCHEDULES:
            raise ValueError(f"unknown schedule {self.kind!r}: choose from {', '.join(SCHEDULES)}")
        if self.kind == "noam" and (self.factor is None or self.d_model is None):
            raise ValueError("the noam schedule needs factor and d_model")
        if self.kind != "noam" and self.peak is None:
            raise ValueError(f"the {self.kind} schedule needs its peak learning rate")

    @property
    def peak_lr(self) -> float:
        """The highest learning rate of the run (at the end of warmup)."""
        if self.kind == "noam":
            return self.factor * (self.d_model * self.warmup) ** -0.5
        return self.peak

    def __call__(self, step: int, progress: float = 0.0) -> float:
        """The learning rate of update ``step`` (from 1) at budget ``progress`` (0..1)."""
        if self.kind == "noam":
            return noam_lr(step, self.d_model, self.warmup, self.factor)
        if self.kind == "inverse_sqrt":
            return inverse_sqrt_lr(step, self.peak, self.warmup)
        return linear_lr(step, self.peak, self.warmup, progress)

    def describe(self) -> str:
        """The formula with its numbers, for the run's first log lines."""
        if self.kind == "noam":
            return (f"noam: lr = {self.factor:g} * {self.d_model}^-0.5 * min(step^-0.5, step * "
                    f"{self.warmup}^-1.5), peak {self.peak_lr:.2e} at step {self.warmup}")
        if self.kind == "inverse_sqrt":
            return (f"inverse_sqrt: lr = {self.peak:.2e} * min(step / {self.warmup}, "
                    f"sqrt({self.warmup} / step)), peak {self.peak:.2e} at step {self.warmup}")
        return (f"linear: warm up to {self.peak:.2e} over {self.warmup} updates or "
                f"{LINEAR_WARMUP_CAP:.0%} of the budget, whichever is first, then decay "
                f"linearly to zero at the end of the budget")
