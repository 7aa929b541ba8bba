"""The training loop as a library: ``train.py`` is a thin command-line shell over it
(:func:`tinytf.run.train`).

One update (section 5 of the paper, docs/training.md), :meth:`Trainer.train`::

    for each of update_freq batches:            # gradient accumulation
        loss_b = sum_t label_smoothed_ce(t)     # summed, not averaged
        loss_b.backward()                       # gradients add up in .grad
    N = allreduce(target tokens)                # over MPI ranks (1 without mpirun)
    grads = allreduce(grads) / N                # the loss per target token of the union batch
    clip; skip the update if the loss or the gradient norm is not finite
    Adam(0.9, 0.98, 1e-9).step(lr = schedule(step))   # --optimizer radam: times r_t
    every few updates: log, validate, save

Around it: the joint BPE is learnt into the run directory once (:mod:`tinytf.run_dir`);
token-based batches come from :class:`tinytf.data.BatchIterator` (with ``--min-updates``,
their size is first fitted to the time budget at the machine's measured pace, and the epoch
that dropout starts from and its rate are set by the epochs the budget holds:
:mod:`tinytf.budget`); the clock and the log line's sums are
:class:`tinytf.train_progress.Progress`; every ``log_interval`` steps a log line
(:mod:`tinytf.train_log`); every ``valid_interval`` steps dev loss and dev BLEU (greedy,
:mod:`tinytf.evaluate`); every ``save_interval`` steps an atomic checkpoint
(:mod:`tinytf.checkpoint`) that holds everything needed to continue *exactly*: parameters,
Adam moments, the step, the batch iterator's position, the RNG state (and dropout is
re-seeded from ``(seed, rank, update number)`` at every update, as fairseq re-seeds from
the step, so the masks never depend on how the run got there), the config, and the BPE
file's SHA-256. At the end: final validation, test BLEU, ``RUNDIR/training.svg``, and a
summary dict (train.py prints it as one JSON line). The options are
:class:`tinytf.train_config.TrainConfig`.

On a GPU, :class:`tinytf.pipelined.PipelinedTrainer` runs the same updates with one in
flight (and ``--cuda-graph`` replay); :func:`tinytf.run.train` picks it for ``--device gpu``.

Under ``mpirun`` only rank 0 logs, validates and writes; stop decisions (time, signals) are
taken collectively so that no rank waits for ever in a collective that the others left.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import os
import signal
import time

import numpy as np

from . import amp, backend, budget, checkpoint, distributed, fast
from .data import BatchIterator, ParallelCorpus, read_parallel
from .evaluate import test_scores, validate
from .optim import clip_grad_norm_array, grad_norm_array
from .plot import write_training_plot
from .run_dir import (SUMMARY_FILE, checkpoint_to_resume, claim_run_dir, data_paths,
                      finished_summary, init_checkpoint, load_init_weights, prepared_corpus,
                      resume_warnings, resumed_model_config, run_bpe, write_run_config,
                      write_summary)
from .stop_signals import StopRequested, StopSignals
# (TrainConfig and apply_overrides are also re-exported: callers import them from here.)
from .train_config import (BPE_FILE, TrainConfig, TrainError, apply_overrides,  # noqa: F401
                           model_config_for)
from .train_log import (Logger, count_of, format_seconds, log_run_start, log_validation,
                        log_window)
from .train_progress import Progress
from .transformer import Transformer, label_smoothed_loss
from .workers import thread_budget


def _step_seed(seed: int, rank: int, step: int) -> int:
    """The dropout seed of update ``step`` on ``rank``: a pure function of the three, so a
    resumed run draws the same masks as a straight one, and ranks draw different masks."""
    return int(np.random.SeedSequence([seed, rank, step]).generate_state(1)[0])


@dataclasses.dataclass
class _Update:
    """An update launched on the device (:meth:`Trainer.launch_update`) whose outcome the
    host has not read yet: device scalars for the loss and the norm, the host's tokens."""
    loss_sum: object
    norm: object
    tokens: float


def _forever(iterator):
    """Yield the batches of ``iterator`` epoch after epoch (it resumes from its position)."""
    while True:
        yield from iterator


class Trainer:
    """Holds the model, optimizer, data and run directory of one training run.

    ``Trainer(cfg).train()`` runs it and returns the summary dict. Build it on every rank:
    ``comm`` is a :mod:`tinytf.distributed` communicator (single-process by default).
    """

    def __init__(self, cfg: TrainConfig, comm=None, log_stream=None):
        cfg = cfg.resolved()
        self.comm = comm or distributed.init()
        self.root = self.comm.is_root
        self.run_dir = cfg.out
        self.device = cfg.device
        if importlib.util.find_spec("sacrebleu") is None:   # not after the training
            raise TrainError("sacrebleu is not installed: the dev and test BLEU need it "
                             "(pip install sacrebleu, or pip install -e . in the project)")
        problem = backend.gpu_unusable() if self.device == "gpu" else None   # nor later
        if problem is not None:
            raise TrainError(f"--device gpu {problem}")
        paths = data_paths(cfg)     # (a missing file fails before the directory is made)
        self.cfg, self.lock = claim_run_dir(cfg, self.comm)  # --resume settled, locked
        cfg = self.cfg
        self.log = Logger(self.run_dir, enabled=self.root, stream=log_stream)
        self.signals = StopSignals(self.log)
        try:
            # A stop signal while the run starts (the BPE learnt, the corpus encoded, the
            # pace timed) stops it at once; what is written is whole, and no update is lost.
            with self.signals.catching(), self.signals.interrupting():
                self._start(cfg, paths)
        except StopRequested as stop:
            self.close()
            if stop.args[0] == signal.SIGINT:   # a Ctrl-C, as Python reports its own
                raise KeyboardInterrupt from None
            raise
        except BaseException:
            self.close()                 # a run that fails to start leaves the directory
            raise

    def _start(self, cfg, paths) -> None:
        """Read the data, get the BPE, build the rest."""
        # Dev and test are small and read whole; the training text is streamed, checked and
        # encoded once into RUNDIR/corpus (run_dir.prepared_corpus) and then memory-mapped.
        self.dev_lines = read_parallel(*paths["dev"])
        self.test_lines = read_parallel(*paths["test"]) if "test" in paths else None
        self.init = (init_checkpoint(cfg, self.comm, self.log)
                     if cfg.init_from and not cfg.resume else None)
        # A BPE model learnt now is kept whatever follows: the next start reuses it, or
        # learns it again if the training text has changed (run_dir.run_bpe).
        self.bpe, self.bpe_sha, _ = run_bpe(cfg, self.comm, self.log, paths["train"])
        self._build(cfg, paths)

    def _build(self, cfg, paths) -> None:
        """The rest of the set-up, after the BPE: model, optimizer, data, resume state."""
        self.train_data = prepared_corpus(cfg, self.comm, self.log, paths["train"], self.bpe_sha)
        resume = checkpoint_to_resume(self.run_dir, self.log) if cfg.resume else None
        self.model_cfg = model_config_for(self.cfg, len(self.bpe))
        if resume is not None:      # the checkpoint's model (the flags must agree)
            self.model_cfg = resumed_model_config(resume, self.model_cfg, self.bpe_sha,
                                                  self.run_dir, given=cfg.model_overrides)

        backend.manual_seed(cfg.seed)
        self.model = Transformer(self.model_cfg)
        if self.init is not None:
            load_init_weights(self.model, self.init, self.bpe_sha, self.run_dir, self.log)
        if self.device != "cpu":
            self.model.to(self.device)
        self.comm.broadcast_params(self.model)
        self.params = self.model.named_parameters()
        self.optimizer = fast.adam(self.params, lr=0.0, betas=(0.9, 0.98), eps=1e-9,
                                   rectify=cfg.optimizer == "radam")
        # Mixed precision (docs/gpu.md): float32 master weights and Adam state whatever the
        # policy; a loss scaler only for fp16 (a pass-through otherwise).
        self.policy = amp.Policy(cfg.precision)
        self.scaler = amp.DynamicLossScaler(enabled=self.policy.loss_scaling)
        warning = amp.speed_warning(self.policy, self.device)   # before any timed pass
        if warning:
            self.log.info(warning)
        # The tiny preset's dropout depends on the passes the budget holds: a step budget's
        # are counted now, a time budget's at the pace of its first epochs, when they are
        # over (also in a resumed part); a resumed run keeps what was decided.
        drops_late = budget.drops_late(cfg, self.model_cfg)
        defers = drops_late and budget.defers_dropout(cfg)
        decide_now = drops_late and not defers and not cfg.resume
        per_update = None   # seconds per update at cfg.max_tokens, where measured
        if cfg.max_minutes and (cfg.fits_batch() or decide_now):
            per_update = self._pace(cfg)
        if cfg.fits_batch():
            self.cfg = cfg = budget.fit_batch_to_budget(cfg, per_update, self.log)
            per_update *= cfg.max_tokens / (cfg.fitted_from or cfg.max_tokens)

        # Dev pairs longer than a batch cannot be scored for loss (BLEU still sees them).
        self.dev_data = ParallelCorpus(*self.dev_lines, self.bpe,
                                       min(self.model_cfg.max_len, cfg.max_tokens),
                                       name=f"{paths['dev'][0]} / {paths['dev'][1]}")
        self.batches = self._train_batches(cfg)
        self.dropout_decided_at = None  # the epoch whose first update decides dropout
        if decide_now:
            self._set_dropout_plan(budget.dropout_for_budget(
                cfg, self.model_cfg.dropout,
                budget.upfront_epochs(cfg, per_update, len(self.batches)), self.log))
            cfg = self.cfg
        elif defers:
            self.dropout_decided_at = cfg.long_dropout_from_epoch

        self.step = 0           # updates applied
        self.bad_in_a_row = 0
        self.skipped = 0        # updates skipped (non-finite, fp16 overflow)
        self.launched = 0       # updates launched: applied + skipped (+ one in flight)
        self._dropout = None    # whether the last update trained with dropout
        self.since_best = 0             # validations since the best metric improved (--patience)
        self.schedule = cfg.schedule()
        self._progress = None           # the running loop's clock (train())
        self._warmup_checked = False    # whether the warm-up's length was checked yet
        self._spent_before = 0.0        # seconds of the time budget spent before this invocation
        if resume is not None:
            self._restore(resume)
            if self.dropout_decided_at and self.batches.epoch >= self.dropout_decided_at:
                self.dropout_decided_at = None  # past it: late dropout (older code), kept
        self.manager = checkpoint.CheckpointManager(
            self.run_dir, cfg.keep_last, metric=self.metric_key,
            higher_is_better=cfg.best_metric == "bleu") if self.root else None
        if self.root:
            write_run_config(self.run_dir, cfg, self.comm.size, self.device)

    def _set_dropout_plan(self, cfg) -> None:
        """Train on with ``cfg``, whose dropout :func:`budget.dropout_for_budget` decided,
        and the model at its rate where that raised it."""
        self.cfg = cfg
        p_drop = cfg.model_overrides.get("dropout", self.model_cfg.dropout)
        if p_drop != self.model_cfg.dropout:    # the rate of a long budget
            self.model.set_dropout(p_drop)
            self.model_cfg = self.model.config

    def _decide_dropout_at_pace(self) -> None:
        """At the first update of epoch ``dropout_decided_at``: decide dropout for the
        passes the time budget holds at the pace of the epochs before it (rank 0's clock,
        so every rank decides alike); the run's options (config.json, the checkpoints)
        keep the choice."""
        done = self.dropout_decided_at - 1
        spent = self.comm.broadcast_object(self._progress.time_spent())
        epochs = budget.epochs_at_pace(self.cfg, done, spent, len(self.batches))
        took = format_seconds(60 * spent * self.cfg.max_minutes)
        pace = f" at the pace of epochs 1-{done} ({took} of " \
               f"{count_of(self.cfg.max_minutes, 'minute')})"
        self.dropout_decided_at = None
        self._set_dropout_plan(budget.dropout_for_budget(
            self.cfg, self.model_cfg.dropout, epochs, self.log, pace=pace))
        if self.root:
            try:
                write_run_config(self.run_dir, self.cfg, self.comm.size, self.device)
            except TrainError as e:     # the checkpoints keep the choice as well
                self.log.info(f"warning: {e}; the run goes on")

    def _train_batches(self, cfg) -> BatchIterator:
        """This rank's token batches of the training pairs at ``cfg.max_tokens``, from the
        start of epoch 1 (a :class:`TrainError` if a pair cannot fit a batch)."""
        try:
            return BatchIterator(self.train_data, cfg.max_tokens, seed=cfg.seed,
                                 rank=self.comm.rank, world_size=self.comm.size)
        except ValueError as e:
            raise TrainError(str(e)) from None

    def _pace(self, cfg) -> float:
        """Seconds per update of ``cfg.max_tokens`` (``update_freq`` batches) on this
        machine: the median of a few forward and backward passes. The passes change no
        weight and no random state; rank 0's measurement is every rank's."""
        probe = self._train_batches(cfg)
        rng = backend.get_rng_state()
        self.model.train()
        seconds = []
        for batch in itertools.islice(probe, 4):
            t0 = time.perf_counter()
            with amp.training_autocast(self.policy):
                loss_sum, _ = Trainer.run_batches(self, [batch], seed=cfg.seed)  # eager
            float(loss_sum)                         # (waits for a GPU)
            seconds.append(time.perf_counter() - t0)
        self.optimizer.zero_grad()
        backend.set_rng_state(rng)
        # The first pass allocates; an update is update_freq passes.
        return self.comm.broadcast_object(float(np.median(seconds[1:] or seconds))
                                          * cfg.update_freq)

    def _restore(self, ckpt):
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
        self._spent_before = budget.budget_seconds_spent(ckpt.meta, self.cfg)
        saved_ranks = int(ckpt.meta["data_state"].get("world_size", self.comm.size))
        for line in resume_warnings(ckpt.meta.get("train_config", {}), self.cfg, saved_ranks,
                                    self.comm.size):
            self.log.info(line)

    def describe(self) -> None:
        """The run's first log lines: model, processes, data, schedule and budget."""
        log_run_start(self.log, self.cfg, self.model_cfg, self.train_data, self.step,
                      parameters=self.model.num_parameters(), ranks=self.comm.size,
                      device=self.device, precision=self.policy.name,
                      dev_pairs=len(self.dev_data), batches=self.batches.n_batches,
                      test_pairs=(len(self.test_lines[0]) if self.test_lines and
                                  self.cfg.test_bleu else None),
                      schedule=self.schedule, optimizer=self.optimizer,
                      dropout_plan=budget.pending_dropout_plan(
                          self.cfg, self.model_cfg.dropout) if self.dropout_decided_at else "",
                      budget_spent=self._spent_before)

    # ---- the loop (section 5) ----------------------------------------------------------

    def train(self) -> dict:
        """Train until ``max_steps`` / ``max_minutes``, then validate, save, test and plot;
        returns the summary. SIGINT, SIGTERM or SIGUSR1 stop the run after the update in
        progress: the checkpoint is written at once, with nothing else after it
        (``summary["stopped"] == "signal"``, ``summary["signal"]`` its number).

        Each iteration is one update: ``update_freq`` batches of about ``max_tokens``
        target tokens (5.1), their forward and backward (the label-smoothed loss, 5.4),
        the all-reduce, clipping, the skip of a non-finite update and Adam at the
        scheduled learning rate (5.3), then the log line; when the step count lands on
        an interval, validation and a checkpoint.
        """
        cfg = self.cfg
        progress = self._start_clock()
        stream = _forever(self.batches)
        saved_step = self.step if cfg.resume else None
        checked_step = self.step        # the step count whose interval work is done
        with self.signals.catching():
            while (stop := self._stop_reason(progress)) is None:
                if self.step != checked_step:
                    checked_step = self.step
                    if self._interval_work(progress):
                        saved_step = self.step
                        continue        # a validation may stop the run (--patience)
                batches = [next(stream) for _ in range(cfg.update_freq)]
                self._account(self.train_step(batches), progress)
            saved_step = self._stop_checkpoint(stop, saved_step)
            return self._summary(stop, progress, saved_step)

    def train_step(self, batches) -> dict:
        """One whole update from ``batches``: :meth:`forward_backward`, then
        :meth:`launch_update` and :meth:`settle`. Returns the step's global loss per token,
        target tokens, gradient norm and whether it was skipped (``"skipped"``) because of
        an fp16 overflow (``"overflow"``) or another non-finite loss or gradient."""
        return self.settle(self.launch_update(*self.forward_backward(batches)))

    def forward_backward(self, batches) -> tuple:
        """Forward and backward of one update's ``batches`` (``update_freq`` of them, their
        gradients summed in ``.grad``), dropout seeded from (seed, rank, update number)
        and on from epoch ``dropout_from_epoch`` (:meth:`dropout_on`).
        Returns (this rank's summed loss as a device scalar, global target tokens).

        The update number counts every launched update, skipped ones too (on a GPU the
        next update's masks are drawn before the host knows whether the previous one was
        skipped); it is restored on resume, so masks still repeat exactly.
        """
        self.launched += 1
        seed = _step_seed(self.cfg.seed, self.comm.rank, self.launched)
        backend.manual_seed(seed)
        if (self.dropout_decided_at and self._progress is not None
                and self.batches.epoch >= self.dropout_decided_at):
            self._decide_dropout_at_pace()
        dropout = self.dropout_on()
        if dropout != self._dropout:
            if self._dropout is not None and self.root and self.model_cfg.dropout > 0:
                self.log.info(f"epoch {self.batches.epoch}: dropout "
                              f"{self.model_cfg.dropout:g} from here on")
            self._dropout = dropout
        self.model.train(dropout)
        with amp.training_autocast(self.policy):
            loss_sum, tokens = self.run_batches(batches, seed)
        # The token counts are known on the host: their sum needs no wait for the GPU.
        return loss_sum, self.comm.allreduce_scalars(float(tokens))

    def run_batches(self, batches, seed: int) -> tuple:
        """Forward and backward of ``batches``, gradients summed in ``.grad``: (summed loss
        as a device array, target tokens). ``seed``: the update's dropout seed, already set
        (PipelinedTrainer's graph replays draw from it)."""
        loss_sum, tokens = None, 0
        for batch in batches:
            # All three arrays go to the device first, through pinned memory on a GPU
            # (asynchronous copies); the token count is the batch's, from the host.
            src, tgt_in, tgt_out = (backend.to_device_pinned(a, self.device)
                                    for a in (batch.src, batch.tgt_in, batch.tgt_out))
            logits = self.model(src, tgt_in)
            loss, n = label_smoothed_loss(logits, tgt_out, count=batch.n_tgt_tokens,
                                          eps=self.model_cfg.label_smoothing)
            self.scaler.scale_loss(loss, on_device=True).backward()
            loss_sum = loss.data if loss_sum is None else loss_sum + loss.data
            tokens += n
        return loss_sum, tokens

    def launch_update(self, loss_sum, tokens: float) -> _Update:
        """All-reduce the gradients, scale them by 1 / (tokens * S), clip, and run the Adam
        update, skipped if the loss on any rank or the gradient norm is not finite; on a GPU
        that is decided on the device and nothing here waits. :meth:`settle` reads it.

        Every rank decides alike without talking: 0 * loss (0 if the loss is finite, NaN
        if not) is added to one gradient entry before the all-reduce, so a bad loss
        anywhere makes the summed gradients, and so every rank's norm, non-finite. Under
        fp16 an overflow also lowers the device copy of the loss scale at once.
        """
        xp = backend.get_array_module(loss_sum)
        with amp.training_autocast(self.policy):
            first = next(p.grad for _, p in self.params if p.grad is not None)
            with np.errstate(invalid="ignore"):      # 0 * inf is the point
                # (A view of the first entry, whatever the layout: an integer index would
                # make NumPy read the value back.)
                first[(slice(0, 1),) * first.ndim] += (loss_sum * 0).astype(first.dtype)
            scale = self.scaler.scale if self.scaler.enabled else 1.0
            self.comm.allreduce_grads(self.model, scale=1.0 / (tokens * scale))
            if self.cfg.clip_norm > 0:
                norm = clip_grad_norm_array(self.params, self.cfg.clip_norm)
            else:
                norm = grad_norm_array(self.params)
            skip = (~xp.isfinite(norm)).astype(np.int32).reshape(1)
            self.scaler.update_on_device(skip)
            self.optimizer.lr = self.lr(self.step + 1)
            self.optimizer.step(skip=skip)
            self.optimizer.zero_grad()
        return _Update(loss_sum=loss_sum, norm=norm, tokens=tokens)

    def settle(self, update: _Update) -> dict:
        """Read the outcome of a launched ``update`` (the loss and the gradient norm: the
        step's one wait for the GPU) and account for it on the host: the step count, the
        loss scaler, skipped and bad steps. Returns :meth:`train_step`'s dict."""
        norm = float(update.norm)
        loss = self.comm.allreduce_scalars(float(update.loss_sum)) / update.tokens
        result = {"loss": loss, "tokens": int(update.tokens), "gnorm": norm,
                  "skipped": False, "overflow": False}
        finite = math.isfinite(norm)       # what the device decided (the loss is in it)
        if self.scaler.enabled:
            try:
                self.scaler.update(found_inf=not finite)
            except FloatingPointError as e:
                raise TrainError(f"fp16: {e}; the forward pass overflows float16 at "
                                 "any loss scale: train with --precision bf16") from None
        if not finite:
            # Every rank saw the same summed gradients, so every rank skipped together.
            self.optimizer.step_count -= 1      # Adam counted the update that was skipped
            result["skipped"] = True
            if self.scaler.enabled:
                result["overflow"] = True
            else:
                self.bad_in_a_row += 1
            self.skipped += 1
            return result
        self.bad_in_a_row = 0
        self.step += 1
        return result

    def lr(self, step: int) -> float:
        """The learning rate of update ``step`` (counting from 1)."""
        return self.schedule(step, self.budget_progress(step))

    def step_budget(self) -> int:
        """The run's update budget: --max-steps, or the updates that --max-epochs holds
        (``update_freq`` of this rank's batches each), whichever is fewer; 0 for neither."""
        budgets = [self.cfg.max_steps] if self.cfg.max_steps else []
        if self.cfg.max_epochs:
            budgets.append(-(-self.cfg.max_epochs * len(self.batches) // self.cfg.update_freq))
        return min(budgets, default=0)

    def budget_progress(self, step: int) -> float:
        """The fraction of the run's budget spent when update ``step`` starts, for the
        linear schedule: (step - 1) over the :meth:`step_budget`, or the run's training time
        (earlier invocations' included) over --max-minutes, whichever is further on."""
        steps = self.step_budget()
        spent = [(step - 1) / steps] if steps else []
        if self._progress is not None:
            spent.append(self._progress.time_spent())
        return min(max(spent, default=0.0), 1.0)

    # ---- around the updates ------------------------------------------------------------

    def _start_clock(self) -> Progress:
        """The first log lines, then this invocation's :class:`Progress` (its clock starts)."""
        self.describe()
        seconds = self.cfg.max_minutes * 60.0 if self.cfg.max_minutes else math.inf
        self._progress = Progress(start_step=self.step, budget=seconds - self._spent_before,
                                  max_steps=self.step_budget(),
                                  spent_before=self._spent_before)
        return self._progress

    def _stop_reason(self, progress) -> str | None:
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

    def _on_interval(self, step: int) -> bool:
        """Whether ``step`` is due a validation or a checkpoint."""
        return step % self.cfg.valid_interval == 0 or step % self.cfg.save_interval == 0

    def _interval_work(self, progress) -> bool:
        """Validate and/or save if the step count is on an interval; True if a checkpoint
        was written. The pause is not counted as training time. A stop signal during the
        validation ends it: the checkpoint is written (without its metrics) and the loop
        stops at its next check."""
        if not self._on_interval(self.step):
            return False
        t_pause = time.perf_counter()
        if self.root:
            metrics = None
            if self.step % self.cfg.valid_interval == 0:
                try:            # a stop signal ends the validation at once (no update lost)
                    with self.signals.interrupting():
                        metrics = self._validate_or_save(self.cfg.valid_bleu_sentences)
                    log_validation(self.log, self.step, metrics)
                except StopRequested:
                    metrics = None          # the checkpoint, then the loop stops
            self.save(metrics)
            if metrics:
                self._plot()        # redrawn at every validation: a killed run has one too
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
            if not self._warmup_checked and self.step - progress.start_step >= 20:
                self._warmup_checked = True     # once, when the pace sizes a time budget
                warning = self.cfg.warmup_warning(progress.expected_updates(self.step))
                if warning and self.step < self.cfg.warmup:     # not once it is over
                    self.log.info(warning)

    def validate(self, bleu_sentences: int | None = None) -> dict:
        """Dev loss and greedy dev BLEU (on the first ``bleu_sentences`` pairs; all if 0),
        with the log's sample translations (:func:`tinytf.evaluate.validate`)."""
        return validate(self.model, self.bpe, self.dev_data, self.dev_lines,
                        max_tokens=self.cfg.max_tokens,
                        label_smoothing=self.model_cfg.label_smoothing, device=self.device,
                        precision=self.policy.name, bleu_sentences=bleu_sentences or 0,
                        samples=self.cfg.valid_samples)

    def _validate_or_save(self, bleu_sentences: int, saved: bool = False) -> dict:
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
        """Write checkpoint_<step>.npz (+ last, + best if the chosen dev metric improved)."""
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
            "budget_seconds_spent": (self._progress.budget_seconds_spent()
                                     if self._progress else self._spent_before),
            "metrics": {k: v for k, v in (metrics or {}).items() if k != "samples"},
            "world_size": self.comm.size,
        }
        with self.signals.deferred():       # a stop signal cannot cut a checkpoint short
            return self.manager.save(self.step, self.model.state_dict(),
                                     self.optimizer.state_dict(), meta, score=score)

    def dropout_on(self) -> bool:
        """Whether this update's batches train with the model's dropout: those of epoch
        ``dropout_from_epoch`` and later ("late dropout", docs/training.md). Without
        dropout, ``model.train(False)`` is evaluation mode, which differs only there."""
        return self.batches.epoch >= self.cfg.dropout_from_epoch

    def epochs_done(self) -> int:
        """Whole passes over the training data so far."""
        b = self.batches
        return b.epoch - 1 + (1 if b.index >= len(b) else 0)

    def _stop_checkpoint(self, stop, saved_step):
        """On a signal stop, the checkpoint of the last update, at once (rank 0; every rank
        stopped at the same update), unless one was just written. Returns the saved step."""
        if stop != "signal" or saved_step == self.step:
            return saved_step
        if self.root:
            t0 = time.perf_counter()
            path = self.save()
            self.log.info(f"wrote {path} ({time.perf_counter() - t0:.1f}s after the last "
                          "update); stopping")
        self.comm.barrier()
        return self.step

    def _summary(self, stop, progress, saved_step) -> dict:
        """The run's summary; on rank 0 after the final validation, checkpoint and test
        (after a signal, only the checkpoint that :meth:`_stop_checkpoint` wrote; a signal
        during them ends them as :meth:`_finish` says), then kept in RUNDIR/summary.json.
        A resumed run that had already finished (no update left, the summary of this step
        kept) does nothing more and returns the kept summary."""
        train_seconds = time.perf_counter() - progress.t_start
        self.log.info(f"stopped ({stop}) at step {self.step} after "
                      f"{format_seconds(train_seconds)}")
        finished = self._finished_before(stop, progress)
        if finished is not None:
            self.log.info(f"the run had already finished at step {self.step}; nothing to "
                          f"do (its summary: {os.path.join(self.run_dir, SUMMARY_FILE)}; "
                          "translate.py --model RUNDIR scores it again)")
            self.close()
            return finished
        tokens = progress.total_tokens
        summary = {"steps": self.step, "stopped": stop, "epoch": self.batches.epoch,
                   "train_seconds": round(train_seconds, 3),
                   "run_train_seconds": round(self._spent_before + train_seconds, 3),
                   "valid_seconds": round(progress.valid_seconds, 3), "target_tokens": tokens,
                   "target_tokens_per_s": round(
                       tokens / max(train_seconds - progress.valid_seconds, 1e-9), 1),
                   "skipped_steps": self.skipped, "max_tokens": self.cfg.max_tokens,
                   "dropout": self.model_cfg.dropout,
                   "dropout_from_epoch": self.cfg.dropout_from_epoch, "ranks": self.comm.size,
                   "precision": self.policy.name,
                   "parameters": self.model.num_parameters(), "run_dir": self.run_dir,
                   **self._summary_extras()}
        if stop == "signal":
            summary["signal"] = self.signals.number
            summary["checkpoint"] = os.path.join(self.run_dir, f"checkpoint_{self.step}.npz")
        elif self.root:
            summary.update(self._finish(saved_step))
            if summary["stopped"] != "signal":
                try:
                    write_summary(self.run_dir, summary)
                except TrainError as e:   # the run's work is in its checkpoint
                    self.log.info(f"warning: {e}; a --resume of this run validates and "
                                  "tests it again")
        self.comm.barrier()
        self.close()
        return summary

    def _summary_extras(self) -> dict:
        """Keys that a subclass adds to the summary (kept in summary.json with the rest)."""
        return {}

    def _finished_before(self, stop, progress) -> dict | None:
        """The kept summary if this invocation resumed a run that had finished at this
        step (and so made no update), else None; the same on every rank."""
        if stop == "signal" or not self.cfg.resume or self.step != progress.start_step:
            return None
        return self.comm.broadcast_object(
            finished_summary(self.run_dir, self.step) if self.root else None)

    def close(self) -> None:
        """Release the run directory (done by :meth:`train` at its end)."""
        if self.lock is not None:
            self.lock.release()

    def _finish(self, saved_step) -> dict:
        """Final validation (full dev set), checkpoint, test BLEU and the plot (rank 0).

        A stop signal stops this at once, wherever it is (:meth:`StopSignals.interrupting`),
        but never inside a checkpoint's writing: the last update's checkpoint is written
        first if it was not yet, and ``out["stopped"]`` is ``"signal"``, so the process
        exits 128 + N and ``--resume`` runs what is left of this (the budget is spent)."""
        out = {}
        saved = saved_step == self.step
        try:
            with self.signals.interrupting():
                metrics = self._validate_or_save(0, saved=saved)
                log_validation(self.log, self.step, metrics)
                for key in ("dev_loss", "dev_nll", "dev_ppl", "dev_bleu"):
                    out[key] = round(metrics[key], 4)
                # The step's checkpoint with this validation's metrics: written unless it
                # exists, and again where the score is a new best (checkpoint_best.npz: a
                # run resumed to finish this phase has none of this step yet).
                if not saved or self.manager.improves(metrics.get(self.metric_key)):
                    self.save(metrics)
                    saved = True
                if self.signals.requested:      # it came while the checkpoint was written
                    raise StopRequested(self.signals.number)
                if self.cfg.test_bleu and self.test_lines is not None:
                    # Forked decoders only in a single process: no MPI state may cross a fork.
                    workers = thread_budget() if self.comm.size == 1 else 1
                    out.update(test_scores(self.model, self.bpe, self.test_lines, self.log,
                                           self.device, self.policy.name, self.cfg.test_beam,
                                           max(self.cfg.valid_samples, 3), workers))
                path = self._plot()
                if path:
                    out["plot"] = path
        except BaseException:
            # A StopRequested, or what the signal broke on its way (decoding workers killed
            # by the same signal): a stop, not a failure. Anything else propagates.
            if not self.signals.requested:
                raise
            if not saved:
                path = self.save()
                self.log.info(f"wrote {path} (the last update's checkpoint); stopping")
            out.update(stopped="signal", signal=self.signals.number)
        out["checkpoint"] = os.path.join(self.run_dir, f"checkpoint_{self.step}.npz")
        return out

    def _plot(self) -> str | None:
        """RUNDIR/training.svg from the log's records; None (with a warning) if it fails."""
        path = os.path.join(self.run_dir, "training.svg")
        try:
            write_training_plot(path, self.log.records())
        except OSError as e:  # a plot must never cost the run
            self.log.info(f"warning: could not write the plot: {e}")
            return None
        return path
