"""Training on a GPU: the same updates as :class:`tinytf.training.trainer.Trainer`, with
one in flight.

On a GPU the host queues work and the device runs it later. The plain loop reads each
update's outcome (its loss and gradient norm, which decide the step count) before it
launches the next one, so the device idles while the host turns the next batch into
kernel launches. :class:`PipelinedTrainer` reads update k's outcome after launching the
forward and backward of update k + 1, so the device always has work queued; it reads it
first whenever a decision needs the exact step count: an update that may complete the run
or land on a validation or checkpoint interval. A non-finite update is skipped on the
device (``Trainer.launch_step``), so nothing waits for that decision either.

With ``--cuda-graph`` the forward and backward of each update are replayed as one CUDA
graph per padded batch shape (:class:`tinytf.fast.cuda.graph.StepGraphs`, docs/gpu.md).

Results equal the plain loop's bitwise (tests/training/test_trainer.py, with the graphs replaced by
eager calls in tests/fast/test_cuda_graph.py).
"""
from __future__ import annotations

import functools

from tinytf.engine import backend
from tinytf.fast.cuda.graph import StepGraphs
from tinytf.models.transformer import label_smoothed_loss
from tinytf.training import finish
from tinytf.training.loop import forever
from tinytf.training.trainer import Trainer


class PipelinedTrainer(Trainer):
    """:class:`~tinytf.training.trainer.Trainer` with one update in flight and optional
    CUDA graphs."""

    def __init__(self, cfg, comm=None, log_stream=None):
        super().__init__(cfg, comm=comm, log_stream=log_stream)
        # The first step, which builds Adam's flat buffers, is eager.
        self.graphs = self.make_step_graphs() if self.cfg.cuda_graph else None
        self._grad_sum = None   # gradient accumulation across graph replays (update_freq > 1)

    def train(self) -> dict:
        """:meth:`TrainingLoop.train` with the outcome of each update read one update later:
        while update k + 1's forward and backward are queued (``launch_step``'s
        ``before_update``)."""
        cfg = self.cfg
        progress = self.start_clock()
        stream = forever(self.batches)
        saved_step = self.step if cfg.resume else None
        checked_step = self.step        # the step count whose interval work is done
        in_flight = None                # the update launched last, outcome not read yet
        with self.signals.catching():
            while True:
                if in_flight is not None and self._decides(self.step + 1):
                    self._account(self.settle(in_flight), progress)
                    in_flight = None
                stop = self.stop_reason(progress)
                if stop is not None:
                    break
                if in_flight is None and self.step != checked_step:
                    checked_step = self.step
                    if self.interval_work(progress):
                        saved_step = self.step
                        continue        # a validation may stop the run (--patience)
                batches = [next(stream) for _ in range(cfg.update_freq)]
                in_flight = self.launch_step(
                    batches, before_update=self._reader(in_flight, progress))
            if in_flight is not None:
                self._account(self.settle(in_flight), progress)
            saved_step = finish.stop_checkpoint(self, stop, saved_step)
            return finish.summary(self, stop, progress, saved_step)

    def _reader(self, update, progress):
        """What reads ``update`` (None: nothing) and accounts for it, for ``launch_step``."""
        if update is None:
            return None
        return lambda: self._account(self.settle(update), progress)

    def _decides(self, step: int) -> bool:
        """Whether reaching ``step`` may end the run or needs validation or a checkpoint
        (then the loop reads the update in flight before launching another)."""
        return bool(self.cfg.max_steps and step >= self.cfg.max_steps) or \
            self.on_interval(step)

    def summary_extras(self) -> dict:
        """``cuda_graphs``: the graphs captured (0 if capturing failed at once), with
        ``--cuda-graph``."""
        if not self.cfg.cuda_graph:
            return {}
        return {"cuda_graphs": self.graphs.captures if self.graphs else 0}

    # ---- CUDA graphs -------------------------------------------------------------------

    def make_step_graphs(self, capture=None) -> StepGraphs:
        """The :class:`fast.cuda.graph.StepGraphs` of ``--cuda-graph`` (``capture``: the graph
        class, ``fast.cuda.graph.EagerReplay`` in the CPU tests). fp16: backward starts from
        loss * S with S read from device memory, so that a replay multiplies by the current
        scale, not the one of its capture."""
        return StepGraphs(self._graph_loss, self.optimizer, self.device, capture=capture,
                          scale=functools.partial(self.scaler.scale_loss, on_device=True),
                          max_len=self.model_cfg.max_len)

    def _graph_loss(self, src, tgt_in, tgt_out):
        """The summed loss of one (padded) batch on device arrays: what a graph captures."""
        logits = self.model(src, tgt_in)
        return label_smoothed_loss(logits, tgt_out, count=0,
                                   eps=self.model_cfg.label_smoothing)[0]

    def run_batches(self, batches, seed: int) -> tuple:
        """:meth:`Trainer.run_batches`, through the CUDA graphs once they are ready.

        Each replay writes its batch's gradient over the flat gradient buffer, so with
        several batches per update they are summed in a second buffer and copied back.
        Dropout is seeded per batch from the step's seed. If a capture fails, the run goes
        on without graphs (with a log line saying why).
        """
        if self.graphs is None or not self.graphs.ready():
            return super().run_batches(batches, seed)
        loss_sum, tokens = None, 0
        for k, batch in enumerate(batches):
            try:
                loss = self.graphs.run(batch, seed=seed * 1_000_003 + k,
                                       variant=self.model.training)
            except Exception as e:  # noqa: BLE001 - any capture failure: fall back, say why
                self.log.info(f"--cuda-graph: capturing or replaying the step failed "
                              f"({type(e).__name__}: {e}); training continues without CUDA "
                              "graphs")
                self.graphs = None
                self.optimizer.zero_grad()
                backend.manual_seed(seed)
                return super().run_batches(batches, seed)
            flat_grad = self.graphs.flat.grad         # the buffer the graphs write
            if len(batches) > 1:
                if k == 0:
                    if self._grad_sum is None or self._grad_sum.shape != flat_grad.shape:
                        self._grad_sum = backend.get_array_module(flat_grad).empty_like(
                            flat_grad)
                    self._grad_sum[...] = flat_grad
                else:
                    self._grad_sum += flat_grad
            # The loss lives in the graphs' shared memory: copy it before the next replay.
            loss_sum = loss.data.copy() if loss_sum is None else loss_sum + loss.data
            tokens += batch.n_tgt_tokens
        if len(batches) > 1:
            flat_grad[...] = self._grad_sum
        return loss_sum, tokens
