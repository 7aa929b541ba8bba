"""The tiny recipe's budget rules: a run adapted to what its budget holds on this machine.

Two choices, each measured on the shipped corpus (docs/training.md, "The tiny recipe"; the
runs behind them in docs/experiments/2026-12-tiny-recipe.md):

- **The batch** (``--budget-min-updates`` N, the ``tiny`` preset's 1,500): a run with a time
  budget and the preset's batch times a few passes of it and halves the batch while the
  budget at that pace would hold fewer than N updates (:func:`fit_batch_to_budget`): below
  about a thousand updates a small model is short of updates, not of tokens. A
  ``--max-tokens`` the user gives is kept; the log says when the budget holds fewer than N
  updates of it, and what the preset would have chosen (:func:`warn_user_batch`).
- **Dropout** (``full_dropout_epochs`` and its companions): the preset's late dropout (none
  in the first epochs, while the data is still new) gives way to dropout from epoch
  ``long_dropout_from_epoch`` where the budget holds ``full_dropout_epochs`` passes or more,
  at a rate that grows with the passes (``dropout_per_epoch`` for each past
  ``dropout_rises_after``, up to :data:`MAX_BUDGET_DROPOUT`; :func:`dropout_for_budget`): a
  long budget overfits without it. A time budget's passes are counted by the run's own first
  epochs, validation and checkpoints included, at the first update of epoch
  ``long_dropout_from_epoch``; a step budget's before the first update.

:class:`TinyRecipe` applies them through the trainer's recipe hook
(:mod:`tinytf.training.recipes`); the functions below are the rules themselves.
"""
from __future__ import annotations

import dataclasses
import math

from tinytf.training.recipes.base import Recipe
from tinytf.utils.log import count_of, format_seconds


@dataclasses.dataclass(frozen=True)
class TinyOptions:
    """The recipe's options, a run's ``recipe_options``: each default turns its rule off (the
    paper's presets); the ``tiny`` preset's values are in :mod:`.presets`."""

    min_updates: int = 0              # --budget-min-updates: halve the preset's batch while
                                      # a time budget holds fewer updates of it (0: off)
    full_dropout_epochs: int = 0      # a budget of this many epochs or more drops ...
    long_dropout_from_epoch: int = 1  # ... from this epoch on ...
    dropout_per_epoch: float = 0.0    # ... raising P_drop this much per epoch ...
    dropout_rises_after: int = 0      # ... of the budget's past this many
    fit_batch: bool = False           # the batch is the preset's, so it may be fitted
    fitted_from: int = 0              # the batch the run's was fitted from (0: not fitted)

    SETTABLE = ("min_updates", "full_dropout_epochs", "long_dropout_from_epoch",
                "dropout_per_epoch", "dropout_rises_after")
    """The options a user sets (the last two are the recipe's record of the run)."""

    @classmethod
    def resolved(cls, cfg, preset: dict) -> dict:
        """The options of the unresolved run ``cfg``: these defaults, the ``preset``'s, then
        the run's own ``recipe_options``. Only the preset's batch is fitted (a --max-tokens
        the user gave is never replaced), and a ``dropout_from_epoch`` the user gave holds
        whatever the budget."""
        given = dict(cfg.recipe_options)
        options = {**dataclasses.asdict(cls()), **preset, **given}
        if "fit_batch" not in given:
            options["fit_batch"] = cfg.max_tokens is None
        if cfg.dropout_from_epoch is not None and "full_dropout_epochs" not in given:
            options["full_dropout_epochs"] = 0
        return options

    @classmethod
    def problem(cls, options: dict) -> tuple | None:
        """(key, what is wrong with its value) for the first bad entry of ``options``, or
        None: an unknown key, a value of the wrong type or out of range."""
        fields = {f.name: f.default for f in dataclasses.fields(cls)}
        least = {"long_dropout_from_epoch": 1}
        for key, value in options.items():
            if key not in fields:
                return key, f"is not an option of the tiny recipe ({', '.join(fields)})"
            kind = type(fields[key])
            ok = (isinstance(value, bool) if kind is bool else
                  isinstance(value, (int, float)) and not isinstance(value, bool)
                  and (kind is float or isinstance(value, int)))
            if not ok:
                return key, (f"must be {'true or false' if kind is bool else kind.__name__}, "
                             f"got {value!r}")
            if kind is not bool and value < least.get(key, 0):
                bound = least.get(key, 0)
                return key, (f"must be at least {bound}, got {value}" if bound else
                             f"must not be negative, got {value}")
        return None


def options(cfg) -> TinyOptions:
    """The tiny recipe's options of the resolved run ``cfg``."""
    return TinyOptions(**cfg.recipe_options)


def with_options(cfg, **changes):
    """``cfg`` with ``changes`` to its recipe options."""
    return dataclasses.replace(cfg, recipe_options={**cfg.recipe_options, **changes})


MIN_FITTED_TOKENS = 1024
"""The smallest batch that fitting a batch to a budget chooses (docs/training.md)."""

MAX_BUDGET_DROPOUT = 0.3
"""The highest P_drop that a long budget raises the model's to (the paper's big model's;
docs/experiments/2026-12-tiny-recipe.md, "The rate of a long budget")."""


def can_halve(max_tokens: int) -> bool:
    """Whether fitting may halve a batch of ``max_tokens``: not below MIN_FITTED_TOKENS."""
    return max_tokens // 2 >= MIN_FITTED_TOKENS


def fitted_max_tokens(max_tokens: int, seconds_per_update: float, budget_seconds: float,
                      min_updates: int, max_steps: int = 0) -> int:
    """The batch for a time budget (``--budget-min-updates``): ``max_tokens``, halved while the
    budget, at ``seconds_per_update`` for batches of ``max_tokens`` (an update's time taken
    as proportional to its tokens), holds fewer than ``min_updates`` updates, and never
    below :data:`MIN_FITTED_TOKENS`. Unchanged when ``max_steps`` ends the run first.

    At a fixed budget a smaller batch makes more updates of fewer tokens each; below about
    a thousand updates the tiny model is short of updates rather than of tokens
    (docs/training.md, "The batch and the budget")."""
    tokens, updates = max_tokens, budget_seconds / max(seconds_per_update, 1e-9)
    while (updates < min_updates and can_halve(tokens)
           and not (max_steps and max_steps <= updates)):
        tokens, updates = tokens // 2, updates * 2
    return tokens


def budget_epochs(updates: float | None, update_freq: int, batches_per_epoch: int,
                  max_epochs: int | None = None) -> float | None:
    """The passes over the training data that a budget of ``updates`` updates (None: not
    known) of ``update_freq`` batches holds, at most ``max_epochs``; None if neither."""
    epochs = [updates * update_freq / max(batches_per_epoch, 1)] if updates else []
    if max_epochs:
        epochs.append(max_epochs)
    return min(epochs) if epochs else None


def fit_batch_to_budget(cfg, per_update: float, log):
    """``cfg`` (a :class:`~tinytf.training.config.TrainConfig`) with its batch fitted to the
    time budget: at ``per_update`` seconds for an update of ``--max-tokens`` (the preset's
    or the user's, the largest batch the fit keeps) :func:`fitted_max_tokens` halves the
    batch while the budget holds fewer than ``--budget-min-updates`` updates (of ``--update-freq``
    batches each). The choice and its reason go to ``log.info``; a fitted config records
    the size it was fitted from (``fitted_from``). Under MPI every rank passes rank 0's
    pace (:meth:`~tinytf.training.trainer.Trainer.measure_pace`), so every rank fits the same
    batch."""
    o = options(cfg)
    fitted = fitted_max_tokens(cfg.max_tokens, per_update, cfg.max_minutes * 60.0,
                               o.min_updates, cfg.max_steps or 0)
    updates = cfg.max_minutes * 60.0 / per_update
    size = (f"{cfg.max_tokens:,}" if cfg.update_freq == 1 else
            f"{cfg.update_freq} x {cfg.max_tokens:,}")
    pace = (f"an update of {size} tokens takes about {per_update:.2f} s here: about "
            f"{updates:,.0f} in {count_of(cfg.max_minutes, 'minute')}")
    if fitted == cfg.max_tokens:
        log.info(f"batch: {fitted:,} tokens: {pace} (--budget-min-updates {o.min_updates})")
        return cfg
    log.info(f"batch: {fitted:,} tokens, fitted to the budget: {pace}, fewer than "
             f"--budget-min-updates {o.min_updates} (docs/training.md, \"The batch and "
             f"the budget\"; --max-tokens {cfg.max_tokens:,} keeps it)")
    return with_options(dataclasses.replace(cfg, max_tokens=fitted), fitted_from=cfg.max_tokens)


def drops_late(cfg, model_cfg) -> bool:
    """Whether the preset's late dropout may give way to an earlier start where the budget
    is long (``full_dropout_epochs``), and the model (``model_cfg``) has dropout at all."""
    o = options(cfg)
    return bool(cfg.dropout_from_epoch > o.long_dropout_from_epoch
                and o.full_dropout_epochs
                and max(model_cfg.dropout, model_cfg.attention_dropout,
                        model_cfg.relu_dropout) > 0)


def budget_dropout(p_drop: float, per_epoch: float, rises_after: float,
                   epochs: float) -> float:
    """The P_drop for a budget of ``epochs`` passes over the data: the model's ``p_drop``
    raised by ``per_epoch`` for each epoch past ``rises_after``, rounded to two decimals, at
    most :data:`MAX_BUDGET_DROPOUT` (and never lowering a ``p_drop`` above it)."""
    raised = round(p_drop + per_epoch * max(0.0, epochs - rises_after), 2)
    return max(p_drop, min(MAX_BUDGET_DROPOUT, raised))


def upfront_epochs(cfg, per_update: float | None, batches_per_epoch: int) -> float | None:
    """The passes over the training data that the budget holds, counted before the first
    update: the updates of ``--max-steps``, or of ``--max-minutes`` at ``per_update``
    seconds each (a few timed passes), whichever are fewer, or ``--max-epochs``."""
    updates = [cfg.max_steps] if cfg.max_steps else []
    if cfg.max_minutes and per_update:
        updates.append(cfg.max_minutes * 60.0 / per_update)
    return budget_epochs(min(updates, default=None), cfg.update_freq, batches_per_epoch,
                         cfg.max_epochs)


def defers_dropout(cfg) -> bool:
    """Whether the choice of :func:`dropout_for_budget` waits for the start of epoch
    ``long_dropout_from_epoch``, where the run's own pace over the epochs before it counts
    a time budget's passes (:func:`epochs_at_pace`): a time budget, and epochs before it."""
    return bool(cfg.max_minutes and options(cfg).long_dropout_from_epoch > 1)


def epochs_at_pace(cfg, epochs_done: int, spent: float, batches_per_epoch: int) -> float:
    """The passes over the training data that the budget holds at the pace of the run's
    first ``epochs_done`` epochs, which took the fraction ``spent`` of ``--max-minutes``
    (validation and checkpoints included, as the budget counts them): ``epochs_done /
    spent``, or fewer where ``--max-steps`` or ``--max-epochs`` end the run first."""
    timed = epochs_done / max(spent, 1e-9)
    steps = upfront_epochs(cfg, None, batches_per_epoch)    # --max-steps, --max-epochs
    return timed if steps is None else min(timed, steps)


def pending_dropout_plan(cfg, p_drop: float) -> str:
    """The first log lines' dropout plan while :func:`defers_dropout` waits."""
    o = options(cfg)
    first, late = o.long_dropout_from_epoch, cfg.dropout_from_epoch
    rate = (f" (at {p_drop:g}, {o.dropout_per_epoch:g} more for each epoch past "
            f"{o.dropout_rises_after}, at most {MAX_BUDGET_DROPOUT:g})"
            if o.dropout_per_epoch else "")
    return (f"dropout: none in epochs 1-{first - 1}; then, at the pace of those epochs, "
            f"from epoch {first}{rate} if the budget holds full_dropout_epochs "
            f"{o.full_dropout_epochs} epochs or more, else {p_drop:g} from epoch {late} "
            f"(late dropout; docs/training.md, \"Late dropout\"; --set dropout_from_epoch=1 "
            f"drops from the start)")


def epochs_text(epochs: float, decimals: int = 1) -> str:
    """``epochs`` to ``decimals`` places, rounded down, so that a count just under a whole
    threshold never prints as the threshold (7.97 as "7.9", not "8.0")."""
    scale = 10 ** decimals
    return f"{math.floor(epochs * scale) / scale:.{decimals}f}"


def dropout_for_budget(cfg, p_drop: float, epochs: float | None, log, pace: str = ""):
    """``cfg`` with its dropout decided for a budget of ``epochs`` passes over the training
    data (None: not known): from epoch ``long_dropout_from_epoch`` where they are
    ``full_dropout_epochs`` or more, at the rate :func:`budget_dropout` gives the model's
    ``p_drop`` for them (in ``model_overrides``; unless the user set ``dropout``); else the
    preset's late dropout, kept whatever the budget from then on (``full_dropout_epochs``
    0). Late dropout pays where the budget is mostly first passes; a long one overfits
    without dropout in its first epochs, and the more so the more passes it makes.
    ``pace``: how the epochs were counted, for the log line (which a decision before the
    first update writes only for the long budget: the run's first lines state late
    dropout)."""
    o = options(cfg)
    if epochs is None or epochs < o.full_dropout_epochs:
        if pace:    # (a choice at the pace of the first epochs: always a count)
            log.info(f"dropout: {p_drop:g} from epoch {cfg.dropout_from_epoch} (late "
                     f"dropout): the budget holds about {epochs_text(epochs)} epochs{pace}, fewer "
                     f"than full_dropout_epochs {o.full_dropout_epochs} (docs/training.md, "
                     f"\"Late dropout\")")
        return with_options(cfg, full_dropout_epochs=0)
    first = o.long_dropout_from_epoch
    when = "the first epoch" if first == 1 else f"epoch {first}"
    overrides = dict(cfg.model_overrides)
    rate = p_drop if "dropout" in overrides else budget_dropout(
        p_drop, o.dropout_per_epoch, o.dropout_rises_after, epochs)
    at = why = keep = ""
    if rate != p_drop:
        overrides["dropout"] = rate
        at = f" at {rate:g}"
        why = (f", and {o.dropout_per_epoch:g} more for each past "
               f"{o.dropout_rises_after}, at most {MAX_BUDGET_DROPOUT:g}")
        keep = f"--set dropout={p_drop:g} keeps the model's rate, "
    log.info(f"dropout: from {when}{at}: the budget holds about "
             f"{epochs_text(epochs, 1 if pace else 0)} epochs{pace}, at least "
             f"full_dropout_epochs {o.full_dropout_epochs}{why} "
             f"(docs/training.md, \"Late dropout\"; {keep}--set "
             f"dropout_from_epoch={cfg.dropout_from_epoch} keeps late dropout)")
    return dataclasses.replace(cfg, dropout_from_epoch=first, model_overrides=overrides)


def fits_batch(cfg) -> bool:
    """Whether a new run of the resolved ``cfg`` fits its batch to its time budget: only the
    preset's batch (a --max-tokens the user gave is kept), and not when it is already too
    small to halve."""
    o = options(cfg)
    return bool(o.fit_batch and o.min_updates and cfg.max_minutes and not cfg.resume
                and can_halve(cfg.max_tokens))


def checks_user_batch(cfg) -> bool:
    """Whether a new run keeps the user's --max-tokens under a time budget that the preset
    would fit its batch to: then the pace is timed, to say if the budget holds few updates."""
    o = options(cfg)
    return bool(not o.fit_batch and o.min_updates and cfg.max_minutes and not cfg.resume)


def warn_user_batch(cfg, per_update: float, log) -> None:
    """The first log lines' word on a user's --max-tokens that leaves the time budget fewer
    than --budget-min-updates updates, and the batch the preset would have chosen."""
    o = options(cfg)
    updates = cfg.max_minutes * 60.0 / per_update
    if updates >= o.min_updates:
        log.info(f"batch: {cfg.max_tokens:,} tokens (--max-tokens): about {updates:,.0f} "
                 f"updates in {count_of(cfg.max_minutes, 'minute')} at this machine's pace")
        return
    preset = cfg.preset_defaults()["max_tokens"]
    chosen = fitted_max_tokens(preset, per_update * preset / cfg.max_tokens,
                               cfg.max_minutes * 60.0, o.min_updates, cfg.max_steps or 0)
    log.info(f"warning: batch {cfg.max_tokens:,} tokens (--max-tokens, kept as given): an "
             f"update takes about {per_update:.2f} s here, about {updates:,.0f} updates in "
             f"{count_of(cfg.max_minutes, 'minute')}, fewer than the preset's "
             f"--budget-min-updates {o.min_updates}; the {cfg.config} preset would train "
             f"with {chosen:,}-token batches here (leave --max-tokens out to let it)")


class TinyRecipe(Recipe):
    """The budget rules above, applied through the trainer's hook. ``decided_at``: the epoch
    whose first update decides dropout at the pace of the epochs before it (None: decided,
    or nothing to decide)."""

    @staticmethod
    def applies(cfg, model_cfg) -> bool:
        """Whether ``cfg`` asks for either rule (the ``tiny`` preset's defaults do)."""
        return fits_batch(cfg) or checks_user_batch(cfg) or drops_late(cfg, model_cfg)

    def __init__(self, cfg, model_cfg):
        late = drops_late(cfg, model_cfg)
        self.defers = late and defers_dropout(cfg)
        self.decide_now = late and not self.defers and not cfg.resume
        self.per_update = None      # seconds per update at cfg.max_tokens, where measured
        self.decided_at = None

    def fit(self, trainer, cfg):
        """Time the machine's pace where a rule needs it; the batch fitted to the budget."""
        if cfg.max_minutes and (fits_batch(cfg) or checks_user_batch(cfg) or self.decide_now):
            self.per_update = trainer.measure_pace(cfg)
        if checks_user_batch(cfg):
            warn_user_batch(cfg, self.per_update, trainer.log)
        if fits_batch(cfg):
            cfg = fit_batch_to_budget(cfg, self.per_update, trainer.log)
            self.per_update *= cfg.max_tokens / (options(cfg).fitted_from or cfg.max_tokens)
        return cfg

    def plan(self, trainer) -> None:
        """A step budget's dropout now; a time budget's waits for epoch
        ``long_dropout_from_epoch`` (unless a resumed run is past it: kept as it was)."""
        cfg = trainer.cfg
        o = options(cfg)
        if self.decide_now:
            epochs = upfront_epochs(cfg, self.per_update, len(trainer.batches))
            trainer.set_config(dropout_for_budget(cfg, trainer.model_cfg.dropout, epochs,
                                                  trainer.log))
        elif self.defers and trainer.batches.epoch < o.long_dropout_from_epoch:
            self.decided_at = o.long_dropout_from_epoch

    def before_update(self, trainer) -> None:
        """At the first update of epoch ``decided_at``: dropout for the passes the time
        budget holds at the pace of the epochs before it (rank 0's clock, so every rank
        decides alike)."""
        if (self.decided_at is None or trainer.progress is None
                or trainer.batches.epoch < self.decided_at):
            return
        cfg, done = trainer.cfg, self.decided_at - 1
        spent = trainer.comm.broadcast_object(trainer.progress.time_spent())
        epochs = epochs_at_pace(cfg, done, spent, len(trainer.batches))
        took = format_seconds(60 * spent * cfg.max_minutes)
        pace = f" at the pace of epochs 1-{done} ({took} of " \
               f"{count_of(cfg.max_minutes, 'minute')})"
        self.decided_at = None
        trainer.set_config(dropout_for_budget(cfg, trainer.model_cfg.dropout, epochs,
                                              trainer.log, pace=pace), write=True)

    def pending(self, trainer) -> str:
        """The dropout plan while the choice waits for the run's pace."""
        return (pending_dropout_plan(trainer.cfg, trainer.model_cfg.dropout)
                if self.decided_at else "")
