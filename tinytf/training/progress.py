"""What the training loop knows about its own progress: the clock, the share of the budget
spent, the running totals, and the window of updates that each log line reports.

:class:`Progress` is the state of one :meth:`tinytf.training.trainer.Trainer.train` invocation.
The time budget (``--max-minutes``) is the run's, resumes included (as ``--max-steps``):
a resumed run has what its checkpoint had not spent (``spent_before``), so a preempted job
requeued with its first command trains what was left, the budget-aware ``linear`` schedule
(:mod:`tinytf.optim.schedule`) continues where it stopped, and a run that had finished has
nothing left. Validation pauses the clock for tokens/s (:meth:`Progress.pause`) but not
for the budget: a time budget is wall-clock time, validations included.
"""
from __future__ import annotations

import dataclasses
import math
import time

# Fewer in a whole budget: short of updates. At 10 minutes, runs of 267, 530 and 738 updates
# reached 0.29x, 0.70x and 0.67x the BLEU of 1,000-1,900
# (docs/experiments/2026-12-tiny-recipe.md, "Robustness of the alternatives").
FEW_UPDATES = 800


def new_window() -> dict:
    """Sums over the updates since the last log line, and when the window opened."""
    return {"loss": 0.0, "tokens": 0, "steps": 0, "gnorm": 0.0, "t": time.perf_counter()}


@dataclasses.dataclass
class Progress:
    """The running loop's clock and totals, for the log line, the summary and the schedule.

    ``budget``: seconds of training left to this invocation (``inf`` without
    ``--max-minutes``): the run's budget less ``spent_before``, the seconds of it that
    earlier invocations spent up to the checkpoint resumed; ``max_steps``: the run's update
    budget, --max-steps or the updates of --max-epochs (0 without one).
    """
    start_step: int
    budget: float
    max_steps: int = 0
    spent_before: float = 0.0       # seconds of the time budget spent before this invocation
    t_start: float = dataclasses.field(default_factory=time.perf_counter)
    total_tokens: int = 0
    valid_seconds: float = 0.0      # time in validation and checkpoints
    pace_checked: bool = False      # whether the budget's update count was estimated yet
    window: dict = dataclasses.field(default_factory=new_window)

    def elapsed(self) -> float:
        """Seconds since training started (validation included)."""
        return time.perf_counter() - self.t_start

    def time_spent(self) -> float:
        """The fraction of the run's time budget spent, earlier invocations' included (0
        without a budget)."""
        if not math.isfinite(self.budget):
            return 0.0
        return self.budget_seconds_spent() / max(self.spent_before + self.budget, 1e-9)

    def budget_seconds_spent(self) -> float:
        """Seconds of the run's time budget spent so far, earlier invocations' included."""
        return self.spent_before + self.elapsed()

    def pause(self, seconds: float) -> None:
        """Count ``seconds`` of validation or saving: not training time for tokens/s."""
        self.valid_seconds += seconds
        self.window["t"] += seconds

    def add(self, result: dict) -> None:
        """An applied update's loss per token, tokens and gradient norm into the window."""
        w = self.window
        w["loss"] += result["loss"] * result["tokens"]
        w["tokens"] += result["tokens"]
        w["steps"] += 1
        w["gnorm"] += result["gnorm"]

    def take_window(self) -> dict:
        """The window's sums (for a log line); a new window opens."""
        window, self.window = self.window, new_window()
        return window

    def remaining(self, step: int) -> float:
        """Seconds left at ``step``: the time budget's, or the step budget's at the pace so
        far, whichever ends first."""
        elapsed = self.elapsed()
        remaining = [self.budget - elapsed]
        if self.max_steps:
            per_step = elapsed / max(step - self.start_step, 1)
            remaining.append((self.max_steps - step) * per_step)
        return max(min(remaining), 0.0)

    def expected_updates(self, step: int) -> int | None:
        """The updates the run's budget holds: ``max_steps``, or what the time budget holds
        at the pace so far, whichever is fewer (None without a budget or before an update)."""
        done = step - self.start_step
        expected = []
        if self.max_steps:
            expected.append(self.max_steps)
        if math.isfinite(self.budget) and done > 0:
            elapsed = self.elapsed()
            per_step = (elapsed - self.valid_seconds) / done
            expected.append(step + round(max(self.budget - elapsed, 0.0) / per_step))
        return min(expected) if expected else None

    def pace_warning(self, step: int) -> str | None:
        """Once, after 20 updates: a warning when the time budget, at this pace, ends with
        fewer than `FEW_UPDATES` updates, else None. At a fixed budget a larger batch means
        fewer updates, and below a few hundred the model is short of updates, not of
        tokens (docs/experiments/2026-12-tiny-recipe.md, "Robustness of the alternatives")."""
        done = step - self.start_step
        if self.pace_checked or done < 20 or not math.isfinite(self.budget):
            return None
        self.pace_checked = True
        per_step = (self.elapsed() - self.valid_seconds) / done
        expected = self.expected_updates(step)
        if expected == self.max_steps or expected >= FEW_UPDATES:
            return None         # enough updates, or the user's own step budget ends first
        minutes = (self.spent_before + self.budget) / 60      # the run's, as `expected` is
        return (f"warning: at {per_step:.2f} s per update the {round(minutes, 2):g}-minute "
                f"budget ends after about {expected} updates; with so few, a smaller "
                f"--max-tokens (more, smaller updates) or a longer --max-minutes learns more")


def budget_seconds_spent(meta: dict, cfg) -> float:
    """Seconds of the run's time budget that a checkpoint's run had spent (``meta``: its
    metadata), earlier resumes included; for a checkpoint that kept only the fraction
    ``budget_progress``, that fraction of ``cfg.max_minutes`` (0 without a time budget)."""
    if "budget_seconds_spent" in meta:
        return float(meta["budget_seconds_spent"])
    return float(meta.get("budget_progress", 0.0)) * (cfg.max_minutes or 0.0) * 60.0
