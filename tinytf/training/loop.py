"""The training loop (section 5 of the paper), read top to bottom in :meth:`TrainingLoop.train`:
get the batches of one update, run :meth:`~tinytf.training.trainer.Trainer.train_step`,
account for it (the log line), and on the intervals validate and save; stop on the budget,
a signal or ``--patience``. The end of the run is :mod:`tinytf.training.finish`.

:class:`TrainingLoop` is the base of :class:`~tinytf.training.trainer.Trainer`, which holds
the run's state and the step; this file holds what happens around the steps.
"""
from __future__ import annotations

import math
import time

from tinytf.engine import backend
from tinytf.training import finish
from tinytf.training.config import BPE_FILE, TrainError
from tinytf.training.evaluate import validate
from tinytf.training.progress import Progress, budget_seconds_spent
from tinytf.training.run_dir import resume_warnings
from tinytf.training.signals import StopRequested
from tinytf.utils import checkpoint
from tinytf.utils.log import log_run_start, log_validation, log_window


def forever(iterator):
    """Yield the batches of ``iterator`` epoch after epoch (it resumes from its position)."""
    while True:
        yield from iterator


class TrainingLoop:
    """The loop around the updates of a :class:`~tinytf.training.trainer.Trainer`."""

    def train(self) -> dict:
        """Train until the budget ends (``max_steps``, ``max_epochs``, ``max_minutes``), a
        stop signal or ``--patience``, then validate, save, test and plot; returns the
        summary. SIGINT, SIGTERM or SIGUSR1 stop the run after the update in progress: the
        checkpoint is written at once, with nothing else after it (``summary["stopped"] ==
        "signal"``, ``summary["signal"]`` its number)."""
        cfg = self.cfg
        progress = self.start_clock()
        stream = forever(self.batches)
        saved_step = self.step if cfg.resume else None
        checked_step = self.step        # the step count whose interval work is done
        with self.signals.catching():
            while (stop := self.stop_reason(progress)) is None:
                if self.step != checked_step:
                    checked_step = self.step
                    if self.interval_work(progress):
                        saved_step = self.step
                        continue        # a validation may stop the run (--patience)
                batches = [next(stream) for _ in range(cfg.update_freq)]
                self._account(self.train_step(batches), progress)
            saved_step = finish.stop_checkpoint(self, stop, saved_step)
            return finish.summary(self, stop, progress, saved_step)

    def start_clock(self) -> Progress:
        """The first log lines, then this invocation's :class:`Progress` (its clock starts)."""
        log_run_start(self.log, self.cfg, self.model_cfg, self.train_data, self.step,
                      parameters=self.model.num_parameters(), ranks=self.comm.size,
                      device=self.device, precision=self.policy.name,
                      dev_pairs=len(self.dev_data), batches=self.batches.n_batches,
                      test_pairs=(len(self.test_lines[0]) if self.test_lines and
                                  self.cfg.test_bleu else None),
                      schedule=self.schedule, optimizer=self.optimizer,
                      dropout_plan=self.recipe.pending(self), budget_spent=self.spent_before)
        seconds = self.cfg.max_minutes * 60.0 if self.cfg.max_minutes else math.inf
        self.progress = Progress(start_step=self.step, budget=seconds - self.spent_before,
                                 max_steps=self.step_budget(), spent_before=self.spent_before)
        return self.progress

    def stop_reason(self, progress) -> str | None:
        """Why the run must stop now ("max_steps", "max_epochs", "signal", "max_minutes",
        "patience"), else None. Collective: any rank's signal and rank 0's clock and
        validations decide for everyone, and every rank returns the same reason."""
        cfg = self.cfg
        if cfg.max_steps and self.step >= cfg.max_steps:
            return "max_steps"
        if cfg.max_epochs and self.epochs_done() >= cfg.max_epochs:
            return "max_epochs"
        reason = None
        if self.root and progress.elapsed() >= progress.budget:
            reason = "max_minutes"
        elif self.root and cfg.patience and self.since_best >= cfg.patience:
            reason = "patience"
        # One collective per update: how many ranks were signalled, whether rank 0 stops.
        signalled, root_stops = self.comm.allreduce_scalars(
            [float(self.signals.requested), float(reason is not None)])
        if signalled:
            return "signal"
        if root_stops:
            return self.comm.broadcast_object(reason)
        return None

    def on_interval(self, step: int) -> bool:
        """Whether ``step`` is due a validation or a checkpoint."""
        return step % self.cfg.valid_interval == 0 or step % self.cfg.save_interval == 0

    def interval_work(self, progress) -> bool:
        """Validate and/or save if the step count is on an interval; True if a checkpoint
        was written. The pause is not counted as training time. A stop signal during the
        validation ends it: the checkpoint is written (without its metrics) and the loop
        stops at its next check."""
        if not self.on_interval(self.step):
            return False
        t_pause = time.perf_counter()
        if self.root:
            metrics = None
            if self.step % self.cfg.valid_interval == 0:
                try:            # a stop signal ends the validation at once (no update lost)
                    with self.signals.interrupting():
                        metrics = self.validate_or_save(self.cfg.valid_bleu_sentences)
                    log_validation(self.log, self.step, metrics)
                except StopRequested:
                    metrics = None          # the checkpoint, then the loop stops
            self.save(metrics)
            if metrics:
                finish.plot(self)   # redrawn at every validation: a killed run has one too
        self.comm.barrier()
        progress.pause(time.perf_counter() - t_pause)  # tokens/s measures training alone
        return True

    def _account(self, result: dict, progress) -> None:
        """The host's side of one settled update: its tokens, a line for a skipped one
        (TrainError after ``max_bad_steps`` bad ones in a row), the periodic log line."""
        progress.total_tokens += result["tokens"]
        if result["overflow"]:
            self.log.info(f"step {self.step + 1}: fp16 gradients overflowed; update "
                          f"skipped, loss scale lowered to {self.scaler.scale:g}")
            return
        if result["skipped"]:
            self.log.info(
                f"step {self.step + 1}: non-finite loss ({result['loss']:.4g}) or "
                f"gradient norm ({result['gnorm']:.4g}); update skipped "
                f"({self.bad_in_a_row} in a row)")
            if self.bad_in_a_row >= self.cfg.max_bad_steps:
                saved = checkpoint.list_checkpoints(self.run_dir)
                where = (f"the last good checkpoint is {saved[-1]}" if saved else
                         f"no checkpoint was written yet in {self.run_dir}")
                raise TrainError(
                    f"stopping: {self.bad_in_a_row} updates in a row had a non-finite "
                    f"loss or gradient (training diverged at step {self.step + 1}); "
                    f"{where}; try a lower peak learning rate (--lr, --lr-factor), a "
                    "longer --warmup or --clip-norm 1")
            return
        progress.add(result)
        if self.step % self.cfg.log_interval == 0:
            log_window(self.log, self.step, self.batches.epoch, progress.take_window(),
                       progress.elapsed(), progress.remaining(self.step), self.optimizer.lr,
                       self.scaler.scale if self.scaler.enabled else None)
            warning = progress.pace_warning(self.step)
            if warning:
                self.log.info(warning)
            if not self.warmup_checked and self.step - progress.start_step >= 20:
                self.warmup_checked = True      # once, when the pace sizes a time budget
                warning = self.cfg.warmup_warning(progress.expected_updates(self.step))
                if warning and self.step < self.cfg.warmup:     # not once it is over
                    self.log.info(warning)

    def validate(self, bleu_sentences: int | None = None) -> dict:
        """Dev loss and greedy dev BLEU (on the first ``bleu_sentences`` pairs; all if 0),
        with the log's sample translations (:func:`tinytf.training.evaluate.validate`)."""
        return validate(self.model, self.bpe, self.dev_data, self.dev_lines,
                        max_tokens=self.cfg.max_tokens,
                        label_smoothing=self.model_cfg.label_smoothing, device=self.device,
                        precision=self.policy.name, bleu_sentences=bleu_sentences or 0,
                        samples=self.cfg.valid_samples)

    def validate_or_save(self, bleu_sentences: int, saved: bool = False) -> dict:
        """:meth:`validate`; should it raise (a broken sacrebleu, no memory for decoding,
        Ctrl-C under a debugger), the update's checkpoint is written before the error
        propagates, unless ``saved``: a failed validation costs no training, and
        ``--resume`` goes on from it."""
        try:
            return self.validate(bleu_sentences)
        except StopRequested:
            raise               # a stop signal: the caller writes the checkpoint
        except BaseException as error:
            if not saved:
                path = self.save()
                self.log.info(f"validation at step {self.step} failed "
                              f"({type(error).__name__}: {error}); wrote {path} before stopping")
            raise

    @property
    def metric_key(self) -> str:
        """The validation metric that picks checkpoint_best.npz and drives --patience."""
        return "dev_bleu" if self.cfg.best_metric == "bleu" else "dev_loss"

    def save(self, metrics=None) -> str:
        """Write checkpoint_<step>.npz (+ last, + best if the chosen dev metric improved):
        everything that continues the run exactly (docs/checkpoints.md)."""
        score = (metrics or {}).get(self.metric_key)
        if score is not None:   # the manager keeps the best score (in checkpoint_best.npz)
            self.since_best = 0 if self.manager.improves(score) else self.since_best + 1
        meta = {
            "data_state": self.batches.state_dict(),
            "rng_state": backend.get_rng_state(),
            "model_config": self.model_cfg.to_dict(),
            "train_config": self.cfg.to_dict(),
            "bpe": {"file": BPE_FILE, "sha256": self.bpe_sha},
            "skipped_steps": self.skipped,
            "loss_scaler": self.scaler.state_dict(),
            "best_metric": self.cfg.best_metric,
            "validations_since_best": self.since_best,
            "budget_progress": self.budget_progress(self.step + 1),
            "budget_seconds_spent": (self.progress.budget_seconds_spent()
                                     if self.progress else self.spent_before),
            "metrics": {k: v for k, v in (metrics or {}).items() if k != "samples"},
            "world_size": self.comm.size,
        }
        with self.signals.deferred():       # a stop signal cannot cut a checkpoint short
            return self.manager.save(self.step, self.model.state_dict(),
                                     self.optimizer.state_dict(), meta, score=score)

    def restore(self, ckpt):
        """Continue from ``ckpt`` exactly: parameters, Adam, step, batches, RNG."""
        self.model.load_state_dict(ckpt.model)
        self.optimizer.load_state_dict(ckpt.optim)
        try:
            self.batches.load_state_dict(ckpt.meta["data_state"])
        except (ValueError, KeyError) as e:
            raise TrainError(f"{ckpt.path}: {e}") from None
        if "rng_state" in ckpt.meta:
            backend.set_rng_state(ckpt.meta["rng_state"])
        self.step = ckpt.step
        self.skipped = int(ckpt.meta.get("skipped_steps", 0))
        self.launched = self.step + self.skipped
        if self.scaler.enabled and ckpt.meta.get("loss_scaler", {}).get("enabled"):
            self.scaler.load_state_dict(ckpt.meta["loss_scaler"])
        if ckpt.meta.get("best_metric", "loss") == self.cfg.best_metric:
            self.since_best = int(ckpt.meta.get("validations_since_best", 0))
        self.spent_before = budget_seconds_spent(ckpt.meta, self.cfg)
        saved_ranks = int(ckpt.meta["data_state"].get("world_size", self.comm.size))
        for line in resume_warnings(ckpt.meta.get("train_config", {}), self.cfg, saved_ranks,
                                    self.comm.size):
            self.log.info(line)

    def epochs_done(self) -> int:
        """Whole passes over the training data so far."""
        b = self.batches
        return b.epoch - 1 + (1 if b.index >= len(b) else 0)

    def summary_extras(self) -> dict:
        """Keys that a subclass adds to the summary (kept in summary.json with the rest)."""
        return {}
