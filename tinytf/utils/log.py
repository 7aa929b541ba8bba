"""The training log: human-readable lines and records.

Every line goes to the standard ``logging`` logger ``tinytf.train`` (a program that embeds
tinytf silences, redirects or formats it as any library's: ``logging.getLogger("tinytf")``)
and to RUNDIR/train.log with a timestamp; every record (step, loss, learning rate, ...) to
RUNDIR/log.jsonl, read back for the plot. The command line also hands the Logger a stream
(stderr), written as text lines or, with ``--log-format json``, as one JSON object per line
(lines and records); ``--tensorboard DIR`` adds the records as TensorBoard scalars
(:class:`TensorBoardScalars`, with the optional ``tensorboardX``).
"""
from __future__ import annotations

import json
import logging
import math
import os
import time

from tinytf.utils.files import open_own
from tinytf.utils.streams import note


def count_of(n, unit: str) -> str:
    """``"1 minute"``, ``"2.5 minutes"``, ``"1,000 steps"``: a number and its unit, plural
    unless the number is 1."""
    number = f"{n:,}" if isinstance(n, int) else f"{n:g}"
    return f"{number} {unit}{'' if n == 1 else 's'}"


def format_seconds(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``7s``."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, m, s = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


logging.getLogger("tinytf").addHandler(logging.NullHandler())   # a library's default: quiet

LOG_FORMATS = ("text", "json")


class Logger:
    """Log lines to the ``tinytf.train`` logger, RUNDIR/train.log and the ``stream`` if
    given (text, or JSON with ``fmt="json"``), records to RUNDIR/log.jsonl (and the
    ``tensorboard`` scalars if given); silent on ranks other than 0 (stdout is kept for the
    final JSON summary).

    A log that cannot be written never stops the training: a stream that went away (a
    closed pipe: ``train.py 2>&1 | tee`` whose reader ended, a closed terminal) is left,
    and the lines go on in train.log; a file the disk refuses (full) is warned of once on
    the stream and tried again at every line."""

    def __init__(self, run_dir, enabled=True, stream=None, fmt: str = "text", tensorboard=None):
        self.enabled = enabled
        self.stream = stream
        self.fmt = fmt
        self.tensorboard = tensorboard
        self.logger = logging.getLogger("tinytf.train")
        self.text_path = os.path.join(run_dir, "train.log")
        self.json_path = os.path.join(run_dir, "log.jsonl")
        self._failed = set()        # the files whose last write failed (warned of once)

    def _show(self, message: str, record: dict | None = None):
        """``message`` (or the ``record``) on the stream in its format; the error if the
        stream stopped taking lines, else None."""
        if self.stream is None:
            return None
        if self.fmt == "json":
            doc = record if record is not None else {
                "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "message": message}
            return note(json.dumps(doc, allow_nan=True), self.stream)
        return note(message, self.stream) if record is None else None

    def info(self, message: str) -> None:
        """One human-readable line (in train.log after a local timestamp)."""
        if not self.enabled:
            return
        self.logger.info(message)
        error = self._show(message)
        if error is not None:                       # a closed pipe, or a closed file
            self.stream = None
            self._append(self.text_path, f"{time.strftime('%Y-%m-%d %H:%M:%S')} | the log's "
                         f"stream stopped taking lines ({error}); they go on here only\n")
        self._append(self.text_path, f"{time.strftime('%Y-%m-%d %H:%M:%S')} | {message}\n")

    def record(self, **values) -> None:
        """One machine-readable record (read back by the plot at the end)."""
        if self.enabled:
            self._append(self.json_path, json.dumps(values, allow_nan=True) + "\n")
            if self._show("", values) is not None:
                self.stream = None
            if self.tensorboard is not None:
                self.tensorboard.add(values)

    def _append(self, path: str, text: str) -> None:
        """``text`` at the end of ``path``; a refused write is warned of on the stream, once
        until a write there succeeds again."""
        try:
            with open_own(path, "a") as f:     # never through a link out of the run
                f.write(text)
        except OSError as e:
            if path not in self._failed and self.stream is not None and note(
                    f"warning: cannot write {path} ({e.strerror or e}); the training goes "
                    "on", self.stream) is not None:
                self.stream = None
            self._failed.add(path)
        else:
            self._failed.discard(path)

    def records(self) -> list[dict]:
        """Every record written so far in this run directory (earlier runs included)."""
        if not os.path.isfile(self.json_path):
            return []
        out = []
        with open(self.json_path, encoding="utf-8") as f:
            for line in f:
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue  # a line cut by a crash
        return out


class TensorBoardScalars:
    """The log's records as TensorBoard scalars in ``directory`` (``--tensorboard DIR``):
    ``train/loss``, ``train/lr``, ... and ``valid/dev_loss``, ``valid/dev_bleu`` against the
    update number. Needs the optional ``tensorboardX`` (``pip install tinytf[tensorboard]``)."""

    def __init__(self, directory: str):
        try:
            from tensorboardX import SummaryWriter  # noqa: PLC0415 - optional dependency
        except ImportError:
            raise ImportError("--tensorboard needs tensorboardX: pip install tensorboardX "
                              "(or tinytf[tensorboard])") from None
        self.writer = SummaryWriter(directory)

    def add(self, values: dict) -> None:
        """The numbers of one record, at its ``step``."""
        step = values.get("step")
        if step is None:
            return
        group = "valid" if any(k.startswith("dev_") for k in values) else "train"
        for key, value in values.items():
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                self.writer.add_scalar(f"{group}/{key}", value, step)
        self.writer.flush()

    def close(self) -> None:
        """Write what is left and close the event file."""
        self.writer.close()


def log_window(log: Logger, step: int, epoch: int, window: dict, elapsed: float, eta: float,
               lr: float, loss_scale: float | None = None) -> None:
    """The periodic line (and record): step, epoch, the window's loss per token and
    perplexity, learning rate, mean gradient norm, tokens/s, elapsed and remaining time.
    ``window``: sums since the last line ("loss" (x tokens), "tokens", "steps", "gnorm",
    and "t", the perf_counter time it started)."""
    steps = max(window["steps"], 1)
    loss = window["loss"] / max(window["tokens"], 1)
    tok_s = window["tokens"] / max(time.perf_counter() - window["t"], 1e-9)
    log.info(f"step {step} | epoch {epoch} | loss {loss:.3f} | "
             f"ppl {math.exp(min(loss, 50.0)):.1f} | lr {lr:.2e} | "
             f"gnorm {window['gnorm'] / steps:.3f} | "
             + (f"scale {loss_scale:g} | " if loss_scale is not None else "")
             + f"tok/s {tok_s:,.0f} | elapsed {format_seconds(elapsed)} | "
             f"eta {format_seconds(eta)}")
    log.record(step=step, epoch=epoch, loss=loss, lr=lr, gnorm=window["gnorm"] / steps,
               tokens_per_s=tok_s, elapsed=elapsed)


def log_validation(log: Logger, step: int, m: dict) -> None:
    """The validation line (and record) with a few dev translations."""
    log.info(f"valid step {step} | dev loss {m['dev_loss']:.3f} | dev nll "
             f"{m['dev_nll']:.3f} | dev ppl {m['dev_ppl']:.1f} | dev BLEU {m['dev_bleu']:.2f} "
             f"({m['dev_bleu_sentences']} sentences, greedy) | {m['valid_seconds']:.0f}s")
    log.record(step=step, **{k: m[k] for k in ("dev_loss", "dev_nll", "dev_bleu")})
    log_samples(log, "dev", m.get("samples", []))


def log_samples(log: Logger, name: str, samples) -> None:
    """Source, reference and hypothesis of a few sentences, one line each."""
    for i, (source, reference, hypothesis) in enumerate(samples, 1):
        log.info(f"  {name} sample {i}  source     | {source}")
        log.info(f"  {name} sample {i}  reference  | {reference}")
        log.info(f"  {name} sample {i}  hypothesis | {hypothesis}")


def log_run_start(log: Logger, cfg, mc, data, step: int, *, parameters: int, ranks: int,
                  device: str, precision: str, dev_pairs: int, batches: int,
                  schedule, optimizer, dropout_plan: str = "",
                  budget_spent: float = 0.0, test_pairs: int | None = None) -> None:
    """The first lines of a run: the model (``mc``, its config), processes, device and
    precision; the training ``data`` (a ParallelCorpus) and batches; the schedule, the
    ``optimizer`` (its ``describe()``) and the budget (what is left of a time budget of
    which a resumed run had spent ``budget_spent`` seconds; ``test_pairs`` None: no test
    set, so no test BLEU at the end, or none asked), and a warning when the peak is
    far from the preset's; late dropout, or the ``dropout_plan`` line of a choice still to
    come."""
    graphs = ", CUDA graphs (one per padded batch shape)" if cfg.cuda_graph else ""
    norms = ("pre-LN" if mc.pre_norm else "post-LN") + (", QK-norm" if mc.qk_norm else "")
    log.info(f"{'resuming at step ' + str(step) if step else 'training'} {cfg.config} "
             f"(d_model {mc.d_model}, {mc.n_encoder_layers}+{mc.n_decoder_layers} layers, "
             f"{norms}, {parameters:,} parameters) on {ranks} process"
             f"{'es' if ranks > 1 else ''}, "
             f"device {device}, precision {precision}{graphs}")
    if test_pairs is not None:
        test = f"{test_pairs:,} test pairs"
    else:
        test = "no test BLEU (" + ("test_bleu off" if not cfg.test_bleu else
                                   "no --test files" if cfg.train_files else
                                   f"no test.{cfg.src}, test.{cfg.tgt}") + ")"
    log.info(f"data: {len(data):,} training pairs ({data.n_skipped_long} longer than "
             f"{cfg.train_max_len} tokens and {data.n_skipped_empty} with an empty side "
             f"skipped), {dev_pairs:,} dev pairs, {test}; {batches} batches of <= "
             f"{cfg.max_tokens} tokens per epoch, update_freq {cfg.update_freq}")
    minutes = count_of(cfg.max_minutes, "minute") if cfg.max_minutes else ""
    if minutes and budget_spent:
        left = max(cfg.max_minutes * 60.0 - budget_spent, 0.0)
        minutes += f" in all ({format_seconds(left)} of them left)"
    limits = [count_of(cfg.max_steps, "step") if cfg.max_steps else "",
              minutes,
              count_of(cfg.max_epochs, "epoch") if cfg.max_epochs else ""]
    log.info(f"schedule: {schedule.describe()}; {optimizer.describe()}; stop after "
             f"{' or '.join(x for x in limits if x)}")
    if dropout_plan:
        log.info(dropout_plan)
    elif cfg.dropout_from_epoch > 1 and mc.dropout > 0:
        log.info(f"dropout: none in epochs 1-{cfg.dropout_from_epoch - 1}, "
                 f"{mc.dropout:g} from epoch {cfg.dropout_from_epoch} on (late dropout; "
                 "--set dropout_from_epoch=1 drops from the start)")
    warning = cfg.schedule_warning()
    if warning:
        log.info(warning)
