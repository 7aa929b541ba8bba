"""The end of a run: the stop's checkpoint, the final validation and test, the plot and the
summary (what ``train.py`` prints as one JSON line and keeps in RUNDIR/summary.json).

Functions of a :class:`~tinytf.training.trainer.Trainer` ``t``, called by its loop once the
loop has stopped. Under ``mpirun`` only rank 0 validates, tests and writes; every rank
returns the same summary keys that the loop counted.
"""
from __future__ import annotations

import os
import time

from tinytf.training.config import TrainError
from tinytf.training.evaluate import test_scores
from tinytf.training.run_dir import SUMMARY_FILE, finished_summary, write_summary
from tinytf.training.signals import StopRequested
from tinytf.utils.log import format_seconds, log_validation
from tinytf.utils.plot import write_training_plot
from tinytf.utils.workers import thread_budget


def stop_checkpoint(t, stop, saved_step):
    """On a signal stop, the checkpoint of the last update, at once (rank 0; every rank
    stopped at the same update), unless one was just written. Returns the saved step."""
    if stop != "signal" or saved_step == t.step:
        return saved_step
    if t.root:
        t0 = time.perf_counter()
        path = t.save()
        t.log.info(f"wrote {path} ({time.perf_counter() - t0:.1f}s after the last "
                   "update); stopping")
    t.comm.barrier()
    return t.step


def summary(t, stop, progress, saved_step) -> dict:
    """The run's summary; on rank 0 after the final validation, checkpoint and test (after a
    signal, only the checkpoint that :func:`stop_checkpoint` wrote; a signal during them
    ends them as :func:`finish` says), then kept in RUNDIR/summary.json. A resumed run that
    had already finished (no update left, the summary of this step kept) does nothing more
    and returns the kept summary."""
    train_seconds = time.perf_counter() - progress.t_start
    t.log.info(f"stopped ({stop}) at step {t.step} after {format_seconds(train_seconds)}")
    finished = finished_before(t, stop, progress)
    if finished is not None:
        t.log.info(f"the run had already finished at step {t.step}; nothing to do (its "
                   f"summary: {os.path.join(t.run_dir, SUMMARY_FILE)}; translate.py --model "
                   "RUNDIR scores it again)")
        t.close()
        return finished
    tokens = progress.total_tokens
    out = {"steps": t.step, "stopped": stop, "epoch": t.batches.epoch,
           "train_seconds": round(train_seconds, 3),
           "run_train_seconds": round(t.spent_before + train_seconds, 3),
           "valid_seconds": round(progress.valid_seconds, 3), "target_tokens": tokens,
           "target_tokens_per_s": round(
               tokens / max(train_seconds - progress.valid_seconds, 1e-9), 1),
           "skipped_steps": t.skipped, "max_tokens": t.cfg.max_tokens,
           "dropout": t.model_cfg.dropout, "dropout_from_epoch": t.cfg.dropout_from_epoch,
           "ranks": t.comm.size, "precision": t.policy.name,
           "parameters": t.model.num_parameters(), "run_dir": t.run_dir,
           **t.summary_extras()}
    if stop == "signal":
        out["signal"] = t.signals.number
        out["checkpoint"] = os.path.join(t.run_dir, f"checkpoint_{t.step}.npz")
    elif t.root:
        out.update(finish(t, saved_step))
        if out["stopped"] != "signal":
            try:
                write_summary(t.run_dir, out)
            except TrainError as e:   # the run's work is in its checkpoint
                t.log.info(f"warning: {e}; a --resume of this run validates and tests it "
                           "again")
    t.comm.barrier()
    t.close()
    return out


def finished_before(t, stop, progress) -> dict | None:
    """The kept summary if this invocation resumed a run that had finished at this step
    (and so made no update), else None; the same on every rank."""
    if stop == "signal" or not t.cfg.resume or t.step != progress.start_step:
        return None
    return t.comm.broadcast_object(finished_summary(t.run_dir, t.step) if t.root else None)


def finish(t, saved_step) -> dict:
    """Final validation (full dev set), checkpoint, test BLEU and the plot (rank 0).

    A stop signal stops this at once, wherever it is (:meth:`StopSignals.interrupting`), but
    never inside a checkpoint's writing: the last update's checkpoint is written first if it
    was not yet, and ``out["stopped"]`` is ``"signal"``, so the process exits 128 + N and
    ``--resume`` runs what is left of this (the budget is spent)."""
    out = {}
    saved = saved_step == t.step
    try:
        with t.signals.interrupting():
            metrics = t.validate_or_save(0, saved=saved)
            log_validation(t.log, t.step, metrics)
            for key in ("dev_loss", "dev_nll", "dev_ppl", "dev_bleu"):
                out[key] = round(metrics[key], 4)
            # The step's checkpoint with this validation's metrics: written unless it
            # exists, and again where the score is a new best (checkpoint_best.npz: a run
            # resumed to finish this phase has none of this step yet).
            if not saved or t.manager.improves(metrics.get(t.metric_key)):
                t.save(metrics)
                saved = True
            if t.signals.requested:      # it came while the checkpoint was written
                raise StopRequested(t.signals.number)
            if t.cfg.test_bleu and t.test_lines is not None:
                # Forked decoders only in a single process: no MPI state may cross a fork.
                workers = thread_budget() if t.comm.size == 1 else 1
                out.update(test_scores(t.model, t.bpe, t.test_lines, t.log, t.device,
                                       t.policy.name, t.cfg.test_beam,
                                       max(t.cfg.valid_samples, 3), workers))
            path = plot(t)
            if path:
                out["plot"] = path
    except BaseException:
        # A StopRequested, or what the signal broke on its way (decoding workers killed by
        # the same signal): a stop, not a failure. Anything else propagates.
        if not t.signals.requested:
            raise
        if not saved:
            path = t.save()
            t.log.info(f"wrote {path} (the last update's checkpoint); stopping")
        out.update(stopped="signal", signal=t.signals.number)
    out["checkpoint"] = os.path.join(t.run_dir, f"checkpoint_{t.step}.npz")
    return out


def plot(t) -> str | None:
    """RUNDIR/training.svg from the log's records; None (with a warning) if it fails."""
    path = os.path.join(t.run_dir, "training.svg")
    try:
        write_training_plot(path, t.log.records())
    except OSError as e:  # a plot must never cost the run
        t.log.info(f"warning: could not write the plot: {e}")
        return None
    return path
