"""The trainer: one training run's state, and :meth:`Trainer.train_step`, one update of
section 5 of the paper::

    for each of update_freq batches:            # gradient accumulation
        loss_b = sum_t label_smoothed_ce(t)     # summed, not averaged
        loss_b.backward()                       # gradients add up in .grad
    N = allreduce(target tokens)                # over MPI ranks (1 without mpirun)
    grads = allreduce(grads) / N                # the loss per target token of the union batch
    clip; skip the update if the loss or the gradient norm is not finite
    Adam(0.9, 0.98, 1e-9).step(lr = schedule(step))   # --optimizer radam: times r_t

The loop around the updates (log, validate, save, stop) is :mod:`tinytf.training.loop`, the
end of a run :mod:`tinytf.training.finish`, what the run directory holds
:mod:`tinytf.training.run_dir`, and a recipe's adaptations to the budget come through the hook
of :mod:`tinytf.training.recipes`. On a GPU, :class:`tinytf.training.pipelined.PipelinedTrainer`
runs the same updates with one in flight. ``train.py`` is a thin shell over
:func:`tinytf.training.run.train`.

Under ``mpirun`` only rank 0 logs, validates and writes; stop decisions (time, signals) are
taken collectively so that no rank waits for ever in a collective that the others left.
"""
from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import math
import signal
import time

import numpy as np

from tinytf import fast
from tinytf.data.batches import BatchIterator, ParallelCorpus, read_parallel
from tinytf.distributed import communicator as distributed
from tinytf.engine import backend
from tinytf.fast.loss_scaler import DynamicLossScaler
from tinytf.models.transformer import Transformer, label_smoothed_loss
from tinytf.nn import amp
from tinytf.optim.adam import clip_grad_norm_array, grad_norm_array
from tinytf.training.config import TrainConfig, TrainError, model_config_for
from tinytf.training.loop import TrainingLoop
from tinytf.training.recipes import recipe_for
from tinytf.training.run_dir import (
    checkpoint_to_resume,
    claim_run_dir,
    data_paths,
    init_checkpoint,
    load_init_weights,
    prepared_corpus,
    resumed_model_config,
    run_bpe,
    write_run_config,
)
from tinytf.training.signals import StopRequested, StopSignals
from tinytf.utils import checkpoint
from tinytf.utils.log import Logger, TensorBoardScalars


def step_seed(seed: int, rank: int, update: int) -> int:
    """The dropout seed of ``update`` on ``rank``: a pure function of the three, so a
    resumed run draws the same masks as a straight one, and ranks draw different masks."""
    return int(np.random.SeedSequence([seed, rank, update]).generate_state(1)[0])


@dataclasses.dataclass
class Update:
    """An update launched on the device (:meth:`Trainer.launch_step`) whose outcome the
    host has not read yet: device scalars for the loss and the norm, the host's tokens."""
    loss_sum: object
    norm: object
    tokens: float


def scalars_for(cfg, root: bool):
    """The TensorBoard writer of ``--tensorboard DIR`` on rank 0, else None."""
    if not cfg.tensorboard or not root:
        return None
    try:
        return TensorBoardScalars(cfg.tensorboard)
    except ImportError as e:
        raise TrainError(str(e)) from None


class Trainer(TrainingLoop):
    """Holds the model, optimizer, data and run directory of one training run.

    ``Trainer(cfg).train()`` runs it and returns the summary dict. Build it on every rank:
    ``comm`` is a :mod:`tinytf.distributed` communicator (single-process by default).
    """

    def __init__(self, cfg: TrainConfig, comm=None, log_stream=None):
        cfg = cfg.resolved()
        self.comm = comm or distributed.create_communicator()
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
        self.log = Logger(self.run_dir, enabled=self.root, stream=log_stream,
                          fmt=cfg.log_format, tensorboard=scalars_for(cfg, self.root))
        self.signals = StopSignals(self.log)
        try:
            # A stop signal while the run starts (the BPE learnt, the corpus encoded, the
            # pace timed) stops it at once; what is written is whole, and no update is lost.
            with self.signals.catching(), self.signals.interrupting():
                self._build(self.cfg, paths)
        except StopRequested as stop:
            self.close()
            if stop.args[0] == signal.SIGINT:   # a Ctrl-C, as Python reports its own
                raise KeyboardInterrupt from None
            raise
        except BaseException:
            self.close()                 # a run that fails to start leaves the directory
            raise

    def _build(self, cfg, paths) -> None:
        """Data, BPE, model, optimizer, batches and the resumed state, in that order."""
        # Dev and test are small and read whole; the training text is streamed, checked and
        # encoded once into RUNDIR/corpus (run_dir.prepared_corpus) and then memory-mapped.
        self.dev_lines = read_parallel(*paths["dev"])
        self.test_lines = read_parallel(*paths["test"]) if "test" in paths else None
        init = (init_checkpoint(cfg, self.comm, self.log)
                if cfg.init_from and not cfg.resume else None)
        # A BPE model learnt now is kept whatever follows: the next start reuses it, or
        # learns it again if the training text has changed (run_dir.run_bpe).
        self.bpe, self.bpe_sha, _ = run_bpe(cfg, self.comm, self.log, paths["train"])
        self.train_data = prepared_corpus(cfg, self.comm, self.log, paths["train"], self.bpe_sha)
        resume = checkpoint_to_resume(self.run_dir, self.log) if cfg.resume else None
        self.model_cfg = model_config_for(cfg, len(self.bpe))
        if resume is not None:      # the checkpoint's model (the flags must agree)
            self.model_cfg = resumed_model_config(resume, self.model_cfg, self.bpe_sha,
                                                  self.run_dir, given=cfg.model_overrides)
        self._build_model(init)
        self.recipe = recipe_for(cfg, self.model_cfg)
        self.cfg = cfg = self.recipe.fit(self, cfg)     # (the tiny recipe fits the batch)

        # Dev pairs longer than a batch cannot be scored for loss (BLEU still sees them).
        self.dev_data = ParallelCorpus(*self.dev_lines, self.bpe,
                                       min(self.model_cfg.max_len, cfg.max_tokens),
                                       name=f"{paths['dev'][0]} / {paths['dev'][1]}")
        self.batches = self._train_batches(cfg)
        self.step = 0           # updates applied
        self.bad_in_a_row = 0
        self.skipped = 0        # updates skipped (non-finite, fp16 overflow)
        self.launched = 0       # updates launched: applied + skipped (+ one in flight)
        self.dropout_active = None  # whether the last update trained with dropout
        self.since_best = 0     # validations since the best metric improved (--patience)
        self.schedule = cfg.schedule()
        self.progress = None            # the running loop's clock (train())
        self.warmup_checked = False     # whether the warm-up's length was checked yet
        self.spent_before = 0.0         # seconds of the time budget spent before this invocation
        if resume is not None:
            self.restore(resume)
        self.recipe.plan(self)
        self.manager = checkpoint.CheckpointManager(
            self.run_dir, self.cfg.keep_last, metric=self.metric_key,
            higher_is_better=self.cfg.best_metric == "bleu") if self.root else None
        if self.root:
            write_run_config(self.run_dir, self.cfg, self.comm.size, self.device)

    def _build_model(self, init) -> None:
        """The Transformer (from ``init``'s weights with --init-from), the same on every
        rank, Adam over its parameters and the precision policy."""
        backend.manual_seed(self.cfg.seed)
        self.model = Transformer(self.model_cfg)
        if init is not None:
            load_init_weights(self.model, init, self.bpe_sha, self.run_dir, self.log)
        if self.device != "cpu":
            self.model.to(self.device)
        self.comm.broadcast_params(self.model)
        self.params = self.model.named_parameters()
        self.optimizer = fast.adam(self.params, lr=0.0, betas=(0.9, 0.98), eps=1e-9,
                                   rectify=self.cfg.optimizer == "radam")
        # Mixed precision (docs/gpu.md): float32 master weights and Adam state whatever the
        # policy; a loss scaler only for fp16 (a pass-through otherwise).
        self.policy = amp.Policy(self.cfg.precision)
        self.scaler = DynamicLossScaler(enabled=self.policy.loss_scaling)
        warning = amp.speed_warning(self.policy, self.device)   # before any timed pass
        if warning:
            self.log.info(warning)

    def _train_batches(self, cfg) -> BatchIterator:
        """This rank's token batches of the training pairs at ``cfg.max_tokens``, from the
        start of epoch 1 (a :class:`TrainError` if a pair cannot fit a batch)."""
        try:
            return BatchIterator(self.train_data, cfg.max_tokens, seed=cfg.seed,
                                 rank=self.comm.rank, world_size=self.comm.size)
        except ValueError as e:
            raise TrainError(str(e)) from None

    def measure_pace(self, cfg) -> float:
        """Seconds per update of ``cfg.max_tokens`` (``update_freq`` batches) on this
        machine: the median of a few forward and backward passes, for a recipe that fits
        the run to its budget. The passes change no weight and no random state; rank 0's
        measurement is every rank's."""
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

    def set_config(self, cfg, write: bool = False) -> None:
        """Train on with ``cfg``, a recipe's decision: the model's dropout set to its rate
        where that changed, and with ``write``, config.json rewritten at once (the
        checkpoints keep the choice in any case)."""
        self.cfg = cfg
        p_drop = cfg.model_overrides.get("dropout", self.model_cfg.dropout)
        if p_drop != self.model_cfg.dropout:    # the rate of a long budget
            self.model.set_dropout(p_drop)
            self.model_cfg = self.model.config
        if write and self.root:
            try:
                write_run_config(self.run_dir, cfg, self.comm.size, self.device)
            except TrainError as e:
                self.log.info(f"warning: {e}; the run goes on")

    # ---- one update (section 5) --------------------------------------------------------

    def train_step(self, batches) -> dict:
        """One whole update from ``batches``: :meth:`launch_step`, then :meth:`settle`.
        Returns the step's global loss per token, target tokens, gradient norm and whether
        it was skipped (``"skipped"``) because of an fp16 overflow (``"overflow"``) or
        another non-finite loss or gradient."""
        return self.settle(self.launch_step(batches))

    def launch_step(self, batches, before_update=None) -> Update:
        """One update of section 5 on the device, nothing read back: forward and backward of
        ``update_freq`` batches, the all-reduce, clipping, and the Adam update at the
        scheduled rate, skipped if the loss on any rank or the gradient norm is not finite.
        ``before_update`` runs between the backward and the all-reduce (PipelinedTrainer
        reads the previous update there, while this one's backward is queued)."""
        # 5.4 dropout: masks seeded from (seed, rank, update number), skipped updates
        # counted (restored on resume, so masks repeat exactly); on from the recipe's epoch.
        self.launched += 1
        seed = step_seed(self.cfg.seed, self.comm.rank, self.launched)
        backend.manual_seed(seed)
        self.recipe.before_update(self)
        self.set_dropout(self.batches.epoch >= self.cfg.dropout_from_epoch)
        # 5.1, 5.4: forward and backward of each batch, the label-smoothed loss summed over
        # its target tokens; the gradients add up in .grad.
        with amp.training_autocast(self.policy):
            loss_sum, tokens = self.run_batches(batches, seed)
        tokens = self.comm.allreduce_scalars(float(tokens))     # known on the host: no wait
        if before_update is not None:
            before_update()
        with amp.training_autocast(self.policy):
            # Every rank decides alike without talking: 0 * loss (NaN unless the loss is
            # finite) added to one gradient entry makes the summed gradients, and so every
            # rank's norm, non-finite where any rank's loss is. (A view of the first entry:
            # an integer index would make NumPy read the value back.)
            first = next(p.grad for _, p in self.params if p.grad is not None)
            with np.errstate(invalid="ignore"):      # 0 * inf is the point
                first[(slice(0, 1),) * first.ndim] += (loss_sum * 0).astype(first.dtype)
            # The gradient of the loss per target token of the union batch (all ranks).
            scale = self.scaler.scale if self.scaler.enabled else 1.0
            self.comm.allreduce_grads(self.model, scale=1.0 / (tokens * scale))
            if self.cfg.clip_norm > 0:
                norm = clip_grad_norm_array(self.params, self.cfg.clip_norm)
            else:
                norm = grad_norm_array(self.params)
            # Skip a non-finite update on the device (fp16: the loss scale backs off).
            xp = backend.get_array_module(loss_sum)
            skip = (~xp.isfinite(norm)).astype(np.int32).reshape(1)
            self.scaler.update_on_device(skip)
            # 5.3: Adam at the scheduled learning rate.
            self.optimizer.lr = self.lr(self.step + 1)
            self.optimizer.step(skip=skip)
            self.optimizer.zero_grad()
        return Update(loss_sum=loss_sum, norm=norm, tokens=tokens)

    def set_dropout(self, on: bool) -> None:
        """Train this update's batches with the model's dropout or without it (evaluation
        mode, which differs only there); the log says when that changes."""
        if on != self.dropout_active:
            if self.dropout_active is not None and self.root and self.model_cfg.dropout > 0:
                self.log.info(f"epoch {self.batches.epoch}: dropout "
                              f"{self.model_cfg.dropout:g} from here on")
            self.dropout_active = on
        self.model.train(on)

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

    def settle(self, update: Update) -> dict:
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

    # ---- the budget --------------------------------------------------------------------

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
        if self.progress is not None:
            spent.append(self.progress.time_spent())
        return min(max(spent, default=0.0), 1.0)

    def close(self) -> None:
        """Release the run directory (done by :meth:`train` at its end)."""
        if self.log.tensorboard is not None:
            self.log.tensorboard.close()
            self.log.tensorboard = None
        if self.lock is not None:
            self.lock.release()
