"""The training loop as a library: ``train.py`` is a thin command-line shell over :func:`train`.

One step (section 5 of the paper, docs/training.md)::

    for each of update_freq batches:            # gradient accumulation
        loss_b = sum_t label_smoothed_ce(t)     # summed, not averaged
        loss_b.backward()                       # gradients add up in .grad
    N = allreduce(target tokens)                # over MPI ranks (1 without mpirun)
    grads = allreduce(grads) / N                # the loss per target token of the union batch
    lr = factor * d_model^-0.5 * min(step^-0.5, step * warmup^-1.5)
    Adam(beta1 0.9, beta2 0.98, eps 1e-9).step()

Around it: the joint BPE is learnt into the run directory once; token-based batches come from
:class:`tinytf.data.BatchIterator`; every ``log_interval`` steps a log line; every
``valid_interval`` steps dev loss and dev BLEU (greedy); every ``save_interval`` steps an
atomic checkpoint (:mod:`tinytf.checkpoint`) that holds everything needed to continue
*exactly*: parameters, Adam moments, the step, the batch iterator's position, the RNG state
(and dropout is re-seeded from ``(seed, rank, update number)`` at every update, as fairseq
re-seeds from the step, so the masks never depend on how the run got there), the config, and
the BPE file's SHA-256. The loop keeps one update in flight: it reads update k's outcome
after launching update k + 1's forward and backward (:meth:`Trainer.train`). At the end:
final validation, test BLEU, ``RUNDIR/training.svg``, and a summary dict (train.py prints it
as one JSON line).

Under ``mpirun`` only rank 0 logs, validates and writes; stop decisions (time, signals) are
taken collectively so that no rank waits for ever in a collective that the others left.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time

import numpy as np

from . import amp, backend, checkpoint, distributed, fast
from .bpe import BOS_ID, BPE, EOS_ID, PAD_ID
from .cuda_graph import StepGraphs
from .data import BatchIterator, ParallelCorpus, read_parallel
from .optim import clip_grad_norm_array, grad_norm_array
from .schedule import SCHEDULES, Schedule
from .search import greedy_search
from .tensor import no_grad
from .translation import BANNED_IDS, SearchOptions, Translator, one_line
from .transformer import Transformer, TransformerConfig, label_smoothed_loss

BPE_FILE = "bpe.json"


class TrainError(RuntimeError):
    """A problem the user can fix (bad option, run directory, resume mismatch, divergence);
    train.py prints the message without a traceback."""


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------

@dataclasses.dataclass
class TrainConfig:
    """Every option of a training run; stored in full in each checkpoint.

    Options left at None are filled in by :meth:`resolved` from ``PRESET_DEFAULTS`` (the
    ``tiny`` preset gets settings that learn something in 10 minutes on 2 CPU cores; the
    others get the paper's). ``model_overrides`` holds ``--set`` keys of
    :class:`TransformerConfig`.
    """

    data: str = "data/ende"
    src: str = "en"
    tgt: str = "de"
    out: str | None = None            # default: runs/<data dir name>-<config>
    config: str = "tiny"              # preset of TransformerConfig
    model_overrides: dict = dataclasses.field(default_factory=dict)
    max_tokens: int | None = None     # padded tokens per batch and side, per rank
    update_freq: int = 1              # batches accumulated per update
    max_steps: int | None = None      # stop after this many updates (0/None: no limit)
    max_minutes: float | None = None  # stop after this wall time (0/None: no limit)
    lr_schedule: str | None = None    # noam | inverse_sqrt | linear (tinytf.schedule)
    lr: float | None = None           # peak learning rate (inverse_sqrt, linear)
    warmup: int | None = None
    lr_factor: float | None = None    # factor of the paper's schedule (noam)
    vocab_size: int | None = None     # joint BPE pieces (specials and 256 bytes included)
    seed: int = 1
    resume: bool = False
    device: str = "cpu"
    precision: str = "float32"        # float32 | tf32 | bf16 | fp16 (tinytf.amp)
    cuda_graph: bool = False          # replay steps as CUDA graphs (GPU; cuda_graph.StepGraphs)
    log_interval: int = 10
    save_interval: int | None = None  # steps between checkpoints
    valid_interval: int | None = None  # steps between validations (default: save_interval)
    keep_last: int = 5
    clip_norm: float = 0.0            # 0: no clipping (the paper clips nothing)
    train_max_len: int = 128          # pairs with a longer side (tokens + </s>) are skipped
    valid_bleu_sentences: int = 200   # periodic dev BLEU on the first N dev pairs (0: all)
    test_bleu: bool = True            # decode test.SRC at the end if it exists
    test_beam: int = 4                # beam size of the final test decoding (1: greedy only)
    valid_samples: int = 3            # sample translations logged at every validation
    max_bad_steps: int = 5            # stop after this many non-finite steps in a row

    PRESET_DEFAULTS = {
        # Measured on 2 CPU cores and the shipped corpus (docs/training.md, "The tiny
        # recipe"): warm up to 2e-3 over 200 updates or 30 % of the budget, then decay to
        # zero at its end; 2,048-token batches; a 4k BPE (and the tiny preset's pre-LN).
        "tiny": dict(max_tokens=2048, lr_schedule="linear", lr=2e-3, warmup=200,
                     vocab_size=4000, save_interval=200),
        # The paper: warmup 4000, factor 1 (its batches held ~25k tokens per side).
        "default": dict(max_tokens=4096, lr_schedule="noam", lr_factor=1.0, warmup=4000,
                        vocab_size=8000, save_interval=1000),
    }

    def resolved(self) -> "TrainConfig":
        """A copy with every None default filled in (preset-dependent) and checked."""
        defaults = self.preset_defaults()
        cfg = dataclasses.replace(self, model_overrides=dict(self.model_overrides))
        cfg._resolve_schedule(defaults)
        for key, value in defaults.items():
            if getattr(cfg, key) is None and key not in ("lr", "lr_factor"):
                setattr(cfg, key, value)
        if cfg.out is None:
            cfg.out = os.path.join("runs", f"{os.path.basename(os.path.normpath(cfg.data))}-"
                                           f"{cfg.config}")
        if cfg.valid_interval is None:
            cfg.valid_interval = cfg.save_interval
        if not cfg.max_steps and not cfg.max_minutes:
            cfg.max_minutes = 10.0  # never run unbounded by accident; documented in --help
        cfg.check()
        return cfg

    def preset_defaults(self) -> dict:
        """The training defaults of this run's preset."""
        return self.PRESET_DEFAULTS.get(self.config, self.PRESET_DEFAULTS["default"])

    def _resolve_schedule(self, defaults: dict) -> None:
        """Choose the schedule from what the user set: ``--lr-factor`` alone asks for the
        paper's schedule (noam), ``--lr`` alone for a schedule with that peak (the preset's
        own, or inverse_sqrt where the preset's is noam); otherwise the preset's."""
        if self.lr_schedule is None:
            if self.lr_factor is not None and self.lr is not None:
                raise TrainError("--lr (a peak) and --lr-factor (the factor of the paper's "
                                 "schedule) exclude each other; pass --lr-schedule too to say "
                                 "which schedule is meant")
            if self.lr_factor is not None:
                self.lr_schedule = "noam"
            elif self.lr is not None and defaults["lr_schedule"] == "noam":
                self.lr_schedule = "inverse_sqrt"
            else:
                self.lr_schedule = defaults["lr_schedule"]
        if self.lr_schedule not in SCHEDULES:
            raise TrainError(f"--lr-schedule {self.lr_schedule!r}: choose from "
                             f"{', '.join(SCHEDULES)}")
        if self.lr_schedule == "noam":
            if self.lr is not None:
                raise TrainError("--lr sets the peak of inverse_sqrt or linear; the paper's "
                                 "schedule (noam) takes --lr-factor")
            if self.lr_factor is None:
                self.lr_factor = defaults.get("lr_factor", 1.0)
        else:
            if self.lr_factor is not None:
                raise TrainError(f"--lr-factor is the factor of the paper's schedule (noam); "
                                 f"--lr-schedule {self.lr_schedule} takes its peak as --lr")
            if self.lr is None:
                self.lr = defaults["lr"] if "lr" in defaults else self.tuned_peak()

    def _preset_d_model(self) -> int:
        return {**TransformerConfig.PRESETS.get(self.config, {}),
                **self.model_overrides}.get("d_model", TransformerConfig.d_model)

    def tuned_peak(self) -> float:
        """The peak learning rate that this preset's defaults give (what it was tuned for)."""
        d = self.preset_defaults()
        if d["lr_schedule"] == "noam":
            return d["lr_factor"] * (self._preset_d_model() * d["warmup"]) ** -0.5
        return d["lr"]

    def schedule(self) -> Schedule:
        """The :class:`tinytf.schedule.Schedule` of this (resolved) config."""
        if self.lr_schedule == "noam":
            return Schedule("noam", self.warmup, factor=self.lr_factor,
                            d_model=self._preset_d_model())
        return Schedule(self.lr_schedule, self.warmup, peak=self.lr)

    def schedule_warning(self) -> str | None:
        """A warning when the peak is far (over 3x) from what the preset was tuned for."""
        peak, tuned = self.schedule().peak_lr, self.tuned_peak()
        if tuned / 3 <= peak <= tuned * 3:
            return None
        how = (" (the paper's schedule ties its peak to --warmup and d_model; --lr "
               "sets a peak directly)" if self.lr_schedule == "noam" else "")
        return (f"warning: peak learning rate {peak:.2e} is {peak / tuned:.2g}x the "
                f"{tuned:.2e} that the {self.config} preset was tuned for{how}")

    def check(self) -> None:
        """Raise TrainError for values that cannot work."""
        if self.config not in TransformerConfig.PRESETS:
            raise TrainError(f"--config {self.config!r}: choose from "
                             f"{sorted(TransformerConfig.PRESETS)}")
        if self.device not in ("cpu", "gpu"):
            raise TrainError(f"--device {self.device!r}: choose cpu or gpu")
        if self.precision not in amp.PRECISIONS:
            raise TrainError(f"--precision {self.precision!r}: choose from "
                             f"{', '.join(amp.PRECISIONS)}")
        if self.cuda_graph and self.device != "gpu":
            raise TrainError("--cuda-graph replays steps as CUDA graphs: it needs --device gpu")
        positive = ("max_tokens", "update_freq", "warmup", "vocab_size", "log_interval",
                    "save_interval", "valid_interval", "train_max_len", "max_bad_steps")
        for key in positive:
            if getattr(self, key) is not None and getattr(self, key) < 1:
                raise TrainError(f"{key} must be at least 1, got {getattr(self, key)}")
        for key in ("lr_factor", "lr"):
            if getattr(self, key) is not None and not getattr(self, key) > 0:
                raise TrainError(f"{key} must be positive, got {getattr(self, key)}")
        for key in ("max_steps", "max_minutes", "clip_norm", "keep_last",
                    "valid_bleu_sentences", "valid_samples", "test_beam"):
            if getattr(self, key) is not None and getattr(self, key) < 0:
                raise TrainError(f"{key} must not be negative, got {getattr(self, key)}")

    def to_dict(self) -> dict:
        """JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)


def _parse_value(text: str, current, key: str):
    """Parse ``--set`` text to the type of the field's current value."""
    if isinstance(current, bool):
        low = text.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise TrainError(f"--set {key}={text}: expected true or false")
    try:
        if isinstance(current, int):
            return int(text)
        if isinstance(current, float):
            return float(text)
    except ValueError:
        kind = "an integer" if isinstance(current, int) else "a number"
        raise TrainError(f"--set {key}={text}: expected {kind}") from None
    return text


def apply_overrides(cfg: TrainConfig, assignments) -> TrainConfig:
    """Apply ``--set key=value`` assignments: model keys (TransformerConfig fields) go to
    ``cfg.model_overrides``, other TrainConfig fields are set directly; an unknown key is an
    error listing the known ones (a typo must never be silently ignored)."""
    model_fields = {f.name: f for f in dataclasses.fields(TransformerConfig)}
    train_fields = {f.name for f in dataclasses.fields(TrainConfig)} - {"model_overrides"}
    base_model = TransformerConfig()
    cfg = dataclasses.replace(cfg, model_overrides=dict(cfg.model_overrides))
    for item in assignments:
        key, sep, text = item.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise TrainError(f"--set {item!r}: expected key=value")
        if key in model_fields:
            cfg.model_overrides[key] = _parse_value(text, getattr(base_model, key), key)
        elif key in train_fields:
            current = getattr(cfg, key)
            if current is None:  # an unresolved default: take the type from the preset value
                current = TrainConfig.PRESET_DEFAULTS["default"].get(key, 0.0 if key in (
                    "max_minutes", "lr") else 0)
            setattr(cfg, key, _parse_value(text, current, key))
        else:
            raise TrainError(f"--set {key}: unknown key; model keys are "
                             f"{sorted(model_fields)}, training keys are {sorted(train_fields)}")
    return cfg


def model_config_for(cfg: TrainConfig, vocab_size: int) -> TransformerConfig:
    """The preset with ``--set`` overrides, sized to the BPE vocabulary (and long enough for
    the longest training pair)."""
    overrides = {"vocab_size": vocab_size, **cfg.model_overrides}
    try:
        model_cfg = TransformerConfig.preset(cfg.config, **overrides)
    except (ValueError, TypeError) as e:
        raise TrainError(str(e)) from None
    if model_cfg.vocab_size < vocab_size:
        raise TrainError(f"--set vocab_size={model_cfg.vocab_size} is smaller than the BPE "
                         f"model's {vocab_size} pieces")
    if model_cfg.max_len < cfg.train_max_len:
        raise TrainError(f"model max_len={model_cfg.max_len} is shorter than "
                         f"train_max_len={cfg.train_max_len}")
    return model_cfg


# --------------------------------------------------------------------------------------
# Evaluation
# --------------------------------------------------------------------------------------

def greedy_translate(model, bpe, lines, device="cpu", batch_size=100,
                     max_len_b=50) -> list[str]:
    """Translate raw text lines greedily (beam 1), in input order; the encoder runs once per
    batch and the decoder step by step with its key/value caches. Output length is at most
    ``len(source) + max_len_b`` tokens (the paper's limit). An empty line gives ""."""
    max_src = model.config.max_len - 1
    sources = [bpe.encode(line.strip())[:max_src] for line in lines]
    outputs = [""] * len(lines)
    todo = sorted((i for i, s in enumerate(sources) if s), key=lambda i: len(sources[i]))
    was_training = model.training
    model.eval()
    try:
        with no_grad():
            for start in range(0, len(todo), batch_size):
                rows = todo[start:start + batch_size]
                lengths = np.array([len(sources[i]) for i in rows], dtype=np.int64)
                src = np.full((len(rows), int(lengths.max()) + 1), PAD_ID, dtype=np.int64)
                for r, i in enumerate(rows):
                    src[r, :lengths[r]] = sources[i]
                    src[r, lengths[r]] = EOS_ID
                src = backend.to_device(src, device)
                state = model.start_decoding(model.encode(src), src)
                max_lens = np.minimum(lengths + max_len_b, model.config.max_len - 1)
                hyps = greedy_search(model.decode_step, state, len(rows), max_lens,
                                     bos_id=BOS_ID, eos_id=EOS_ID, banned_ids=BANNED_IDS)
                for i, hyp in zip(rows, hyps):
                    outputs[i] = one_line(bpe.decode(list(hyp.tokens))) if hyp else ""
    finally:
        model.train(was_training)
    return outputs


def bleu(hypotheses, references) -> float:
    """sacrebleu corpus BLEU (13a tokenisation, mixed case) of detokenised text."""
    import sacrebleu  # noqa: PLC0415 - a runtime dependency, imported where it is used
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def evaluate_loss(model, corpus, max_tokens, label_smoothing, device="cpu") -> dict:
    """Dev loss on ``corpus`` in eval mode: the label-smoothed loss per target token (what
    training minimises, so the two curves compare) and the plain NLL per token and its
    perplexity."""
    batches = BatchIterator(corpus, max_tokens, shuffle=False, drop_uneven=False)
    total = {"loss": 0.0, "nll": 0.0, "tokens": 0}
    was_training = model.training
    model.eval()
    try:
        with no_grad():
            for batch in batches:
                src = backend.to_device(batch.src, device)
                tgt_in = backend.to_device(batch.tgt_in, device)
                logits = model(src, tgt_in)
                loss, n = label_smoothed_loss(logits, batch.tgt_out, eps=label_smoothing)
                nll, _ = label_smoothed_loss(logits, batch.tgt_out, eps=0.0)
                total["loss"] += float(loss.item())
                total["nll"] += float(nll.item())
                total["tokens"] += n
    finally:
        model.train(was_training)
    n = max(total["tokens"], 1)
    return {"dev_loss": total["loss"] / n, "dev_nll": total["nll"] / n,
            "dev_ppl": math.exp(min(total["nll"] / n, 50.0))}


# --------------------------------------------------------------------------------------
# Logging
# --------------------------------------------------------------------------------------

def format_seconds(seconds: float) -> str:
    """``1h02m03s`` / ``2m03s`` / ``7s``."""
    if seconds is None or not math.isfinite(seconds):
        return "?"
    s = int(round(seconds))
    h, m, s = s // 3600, s % 3600 // 60, s % 60
    return f"{h}h{m:02d}m{s:02d}s" if h else (f"{m}m{s:02d}s" if m else f"{s}s")


class Logger:
    """Log lines to stderr and RUNDIR/train.log, records to RUNDIR/log.jsonl; silent on
    ranks other than 0 (stdout is kept for the final JSON summary)."""

    def __init__(self, run_dir, enabled=True, stream=None):
        self.enabled = enabled
        self.stream = stream or sys.stderr
        self.text_path = os.path.join(run_dir, "train.log")
        self.json_path = os.path.join(run_dir, "log.jsonl")

    def info(self, message: str) -> None:
        """One human-readable line."""
        if not self.enabled:
            return
        print(message, file=self.stream, flush=True)
        with open(self.text_path, "a", encoding="utf-8") as f:
            f.write(message + "\n")

    def record(self, **values) -> None:
        """One machine-readable record (read back by the plot at the end)."""
        if self.enabled:
            with open(self.json_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(values, allow_nan=True) + "\n")

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


# --------------------------------------------------------------------------------------
# The trainer
# --------------------------------------------------------------------------------------

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


@dataclasses.dataclass
class _Progress:
    """The training loop's running totals: for the log line, the summary and the clock."""
    start_step: int
    budget: float
    t_start: float = dataclasses.field(default_factory=time.perf_counter)
    total_tokens: int = 0
    valid_seconds: float = 0.0
    window: dict = dataclasses.field(default_factory=lambda: _Progress.new_window())

    @staticmethod
    def new_window() -> dict:
        """Sums over the updates since the last log line."""
        return {"loss": 0.0, "tokens": 0, "steps": 0, "gnorm": 0.0, "t": time.perf_counter()}

    def elapsed(self) -> float:
        """Seconds since training started (validation included)."""
        return time.perf_counter() - self.t_start


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
        self.cfg = cfg = cfg.resolved()
        self.comm = comm or distributed.init()
        self.root = self.comm.is_root
        self.run_dir = cfg.out
        self.device = cfg.device
        paths = self._data_paths()
        last = os.path.join(self.run_dir, checkpoint.LAST)
        if cfg.resume and not os.path.isfile(last):
            raise TrainError(f"--resume: {last} does not exist (nothing to resume)")
        if not cfg.resume and os.path.isfile(last):
            raise TrainError(f"{self.run_dir} already holds a training run ({last}); pass "
                             "--resume to continue it, or choose another --out")
        if self.root:
            os.makedirs(self.run_dir, exist_ok=True)
        self.comm.barrier()
        self.log = Logger(self.run_dir, enabled=self.root, stream=log_stream)
        self.start_time = time.perf_counter()

        # Data: read and check the text first, so a bad file is reported by name and line
        # before minutes go into learning a BPE model from it.
        train_src, train_tgt = read_parallel(paths["train"][0], paths["train"][1])
        dev_src, dev_tgt = read_parallel(*paths["dev"])
        self.dev_lines = (dev_src, dev_tgt)
        self.test_lines = read_parallel(*paths["test"]) if "test" in paths else None
        self.bpe, self.bpe_sha = self._bpe(paths["train"])

        resume = checkpoint.load(last) if cfg.resume else None
        if resume is not None:
            self._check_resume(resume)
            self.model_cfg = TransformerConfig.from_dict(resume.meta["model_config"])
            wanted = model_config_for(cfg, len(self.bpe))
            diff = {k: (v, wanted.to_dict()[k]) for k, v in self.model_cfg.to_dict().items()
                    if wanted.to_dict()[k] != v}
            if diff:
                raise TrainError(f"{last}: the run's model differs from --config/--set "
                                 f"(saved, asked): {diff}")
        else:
            self.model_cfg = model_config_for(cfg, len(self.bpe))

        backend.manual_seed(cfg.seed)
        self.model = Transformer(self.model_cfg)
        if self.device != "cpu":
            self.model.to(self.device)
        self.comm.broadcast_params(self.model)
        self.params = self.model.named_parameters()
        self.optimizer = fast.adam(self.params, lr=0.0, betas=(0.9, 0.98), eps=1e-9)
        # Mixed precision (docs/gpu.md): float32 master weights and Adam state whatever the
        # policy; a loss scaler only for fp16 (a pass-through otherwise).
        self.policy = amp.Policy(cfg.precision)
        self.scaler = amp.DynamicLossScaler(enabled=self.policy.loss_scaling)
        # --cuda-graph: forward and backward replayed as one CUDA graph per padded batch
        # shape (docs/gpu.md); the first step, which builds Adam's flat buffers, is eager.
        self.graphs = self.make_step_graphs() if cfg.cuda_graph else None
        self._grad_sum = None   # gradient accumulation across graph replays (update_freq > 1)

        self.train_data = ParallelCorpus(train_src, train_tgt, self.bpe, cfg.train_max_len,
                                         name=f"{paths['train'][0]} / {paths['train'][1]}")
        # Dev pairs longer than a batch cannot be scored for loss (BLEU still sees them).
        self.dev_data = ParallelCorpus(dev_src, dev_tgt, self.bpe,
                                       min(self.model_cfg.max_len, cfg.max_tokens),
                                       name=f"{paths['dev'][0]} / {paths['dev'][1]}")
        try:
            self.batches = BatchIterator(self.train_data, cfg.max_tokens, seed=cfg.seed,
                                         rank=self.comm.rank, world_size=self.comm.size)
        except ValueError as e:
            raise TrainError(str(e)) from None

        self.step = 0           # updates applied
        self.bad_in_a_row = 0
        self.skipped = 0        # updates skipped (non-finite, fp16 overflow)
        self.launched = 0       # updates launched: applied + skipped + the one in flight
        self.best_dev_loss = None
        self.schedule = cfg.schedule()
        self._progress = None           # the running loop's clock (train())
        self._progress_at_start = 0.0   # budget fraction spent before this invocation
        if resume is not None:
            self._restore(resume)
        self.manager = checkpoint.CheckpointManager(self.run_dir, cfg.keep_last) \
            if self.root else None
        self._describe(paths)

    # ---- setup helpers -----------------------------------------------------------------

    def _data_paths(self) -> dict:
        cfg = self.cfg
        paths = {}
        for split in ("train", "dev", "test"):
            pair = tuple(os.path.join(cfg.data, f"{split}.{lang}") for lang in (cfg.src, cfg.tgt))
            present = [os.path.isfile(p) for p in pair]
            if all(present):
                paths[split] = pair
            elif split != "test" or any(present):
                missing = [p for p, ok in zip(pair, present) if not ok]
                raise TrainError(f"{missing[0]}: no such file (--data {cfg.data} must hold "
                                 f"train.{cfg.src}, train.{cfg.tgt}, dev.{cfg.src}, "
                                 f"dev.{cfg.tgt}; test.* optional)")
        return paths

    def _bpe(self, train_pair):
        """Load RUNDIR/bpe.json, learning it from both training sides first if absent."""
        path = os.path.join(self.run_dir, BPE_FILE)
        # Rank 0 decides: another rank looking later could already see the file rank 0 is
        # about to write, skip the barrier below and leave rank 0 waiting there for ever.
        if not self.comm.broadcast_object(os.path.isfile(path) if self.root else None):
            if self.cfg.resume:
                raise TrainError(f"--resume: {path} is missing (the run's BPE model)")
            if self.root:
                t0 = time.perf_counter()
                self.log.info(f"learning a joint BPE of {self.cfg.vocab_size} pieces from "
                              f"{train_pair[0]} and {train_pair[1]} ...")
                try:
                    model = BPE.learn(list(train_pair), vocab_size=self.cfg.vocab_size)
                except ValueError as e:
                    raise TrainError(f"--vocab-size {self.cfg.vocab_size}: {e}") from None
                model.save(path)  # atomic (temporary file + rename)
                self.log.info(f"wrote {path} ({len(model)} pieces, "
                              f"{time.perf_counter() - t0:.1f}s)")
            self.comm.barrier()
        return BPE.load(path), checkpoint.sha256_file(path)

    def _check_resume(self, ckpt):
        saved = ckpt.meta.get("bpe", {}).get("sha256")
        if saved and saved != self.bpe_sha:
            raise TrainError(f"{ckpt.path}: trained with another BPE model than "
                             f"{os.path.join(self.run_dir, BPE_FILE)} (SHA-256 differs)")
        for key in ("model_config", "data_state", "step"):
            if key not in ckpt.meta:
                raise TrainError(f"{ckpt.path}: not a training checkpoint (no {key})")
        if ckpt.optim is None:
            raise TrainError(f"{ckpt.path}: has no optimizer state (an averaged checkpoint "
                             "cannot be resumed)")

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
        self.best_dev_loss = ckpt.meta.get("best_dev_loss")
        self._progress_at_start = float(ckpt.meta.get("budget_progress", 0.0))
        if self.cfg.lr_schedule == "linear" and self._progress_at_start >= 1.0:
            self.log.info("warning: the linear schedule of this run had already decayed to "
                          "zero; resumed updates have learning rate 0")
        old = ckpt.meta.get("train_config", {})
        changed = [k for k in ("seed", "max_tokens", "update_freq", "lr_schedule", "lr",
                                "warmup", "lr_factor", "precision")
                   if k in old and old[k] != getattr(self.cfg, k)]
        if changed:
            self.log.info("warning: resuming with changed " + ", ".join(
                f"{k} ({old[k]} -> {getattr(self.cfg, k)})" for k in changed) +
                ": the run will not match an uninterrupted one")

    def _describe(self, paths):
        cfg, data = self.cfg, self.train_data
        mc = self.model_cfg
        self.log.info(
            f"{'resuming at step ' + str(self.step) if self.step else 'training'} "
            f"{cfg.config} (d_model {mc.d_model}, {mc.n_encoder_layers}+{mc.n_decoder_layers} "
            f"layers, {self.model.num_parameters():,} parameters) on {self.comm.size} "
            f"process{'es' if self.comm.size > 1 else ''}, device {self.device}, "
            f"precision {self.policy.name}"
            f"{', CUDA graphs (one per padded batch shape)' if self.graphs else ''}")
        self.log.info(
            f"data: {len(data):,} training pairs ({data.n_skipped_long} longer than "
            f"{cfg.train_max_len} tokens and {data.n_skipped_empty} with an empty side "
            f"skipped), {len(self.dev_data):,} dev pairs; {self.batches.n_batches} batches of "
            f"<= {cfg.max_tokens} tokens per epoch, update_freq {cfg.update_freq}")
        limits = [f"{cfg.max_steps} steps" if cfg.max_steps else "",
                  f"{cfg.max_minutes:g} minutes" if cfg.max_minutes else ""]
        self.log.info(f"schedule: {self.schedule.describe()}; stop after "
                      f"{' or '.join(x for x in limits if x)}")
        warning = cfg.schedule_warning()
        if warning:
            self.log.info(warning)

    # ---- the step ----------------------------------------------------------------------

    def lr(self, step: int) -> float:
        """The learning rate of update ``step`` (counting from 1)."""
        return self.schedule(step, self.budget_progress(step))

    def budget_progress(self, step: int) -> float:
        """The fraction of the run's budget spent when update ``step`` starts, for the
        linear schedule: (step - 1) / max_steps, or the time of this invocation's training
        over --max-minutes (continuing from the fraction a resumed checkpoint had spent),
        whichever is further on."""
        spent = [(step - 1) / self.cfg.max_steps] if self.cfg.max_steps else []
        clock = self._progress
        if clock is not None and math.isfinite(clock.budget):
            spent.append(self._progress_at_start
                         + (1.0 - self._progress_at_start) * clock.elapsed() / clock.budget)
        return min(max(spent, default=0.0), 1.0)

    def train_step(self, batches) -> dict:
        """One whole update from ``batches``, synchronously: :meth:`forward_backward`,
        :meth:`launch_update`, :meth:`settle`. Returns the step's global loss per token,
        target tokens, gradient norm and whether it was skipped (``"skipped"``) because of
        an fp16 overflow (``"overflow"``) or another non-finite loss or gradient.

        :meth:`train` runs the same three parts with one step in flight instead: it reads
        update k's outcome after launching the forward and backward of update k + 1, so
        the GPU never waits for the host between steps (docs/training.md).
        """
        return self.settle(self.launch_update(*self.forward_backward(batches)))

    def forward_backward(self, batches) -> tuple:
        """Forward and backward of one update's ``batches`` (``update_freq`` of them, their
        gradients summed in ``.grad``), dropout seeded from (seed, rank, update number).
        Returns (this rank's summed loss as a device scalar, global target tokens).

        The update number counts every launched update, skipped ones too, since when the
        next update's masks are drawn the host does not know yet whether the previous one
        was skipped; it is restored on resume, so masks still repeat exactly.
        """
        self.launched += 1
        seed = _step_seed(self.cfg.seed, self.comm.rank, self.launched)
        backend.manual_seed(seed)
        self.model.train()
        with amp.autocast(self.policy):
            if self.graphs is not None and self.graphs.ready():
                loss_sum, tokens = self._replay_batches(batches, seed)
            else:
                loss_sum, tokens = self._run_batches(batches)
        # The token counts are known on the host: their sum needs no wait for the GPU.
        return loss_sum, self.comm.allreduce_scalars(float(tokens))

    def launch_update(self, loss_sum, tokens: float) -> "_Update":
        """All-reduce the gradients, scale them by 1 / (tokens * S), clip, and launch the
        Adam update, skipped *on the device* if the loss on any rank or the gradient norm
        is not finite. Nothing here waits for the GPU; :meth:`settle` reads the outcome.

        Every rank decides alike without talking: 0 * loss (0 if the loss is finite, NaN
        if not) is added to one gradient entry before the all-reduce, so a bad loss
        anywhere makes the summed gradients, and so every rank's norm, non-finite. Under
        fp16 an overflow also lowers the device copy of the loss scale at once, so the
        next backward, launched before the host knows, already uses the lowered scale.
        """
        xp = backend.get_array_module(loss_sum)
        with amp.autocast(self.policy):
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

    def settle(self, update: "_Update") -> dict:
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
            self.optimizer.step_count -= 1      # Adam counted the update the device skipped
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

    def _run_batches(self, batches) -> tuple:
        """Forward and backward of ``batches``, gradients summed in ``.grad``: (summed loss
        as a device array, target tokens)."""
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

    def make_step_graphs(self, capture=None) -> StepGraphs:
        """The :class:`cuda_graph.StepGraphs` of ``--cuda-graph`` (``capture``: the graph
        class, ``cuda_graph.EagerReplay`` in the CPU tests). fp16: backward starts from
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

    def _replay_batches(self, batches, seed: int) -> tuple:
        """:meth:`_run_batches` through the CUDA graphs (``--cuda-graph``).

        Each replay writes its batch's gradient over the flat gradient buffer, so with
        several batches per update they are summed in a second buffer and copied back.
        Dropout is seeded per batch from the step's seed. If a capture fails, the run goes
        on without graphs (with a log line saying why).
        """
        loss_sum, tokens = None, 0
        for k, batch in enumerate(batches):
            try:
                loss = self.graphs.run(batch, seed=seed * 1_000_003 + k)
            except Exception as e:  # noqa: BLE001 - any capture failure: fall back, say why
                self.log.info(f"--cuda-graph: capturing or replaying the step failed "
                              f"({type(e).__name__}: {e}); training continues without CUDA "
                              "graphs")
                self.graphs = None
                self.optimizer.zero_grad()
                backend.manual_seed(seed)
                return self._run_batches(batches)
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

    # ---- validation and checkpoints ----------------------------------------------------

    def validate(self, bleu_sentences: int | None = None) -> dict:
        """Dev loss and greedy dev BLEU (on the first ``bleu_sentences`` pairs; all if 0)."""
        t0 = time.perf_counter()
        with amp.autocast(self.policy):
            metrics = evaluate_loss(self.model, self.dev_data, self.cfg.max_tokens,
                                    self.model_cfg.label_smoothing, self.device)
            src, ref = self.dev_lines
            if bleu_sentences:
                src, ref = src[:bleu_sentences], ref[:bleu_sentences]
            hyps = greedy_translate(self.model, self.bpe, src, self.device)
        metrics["dev_bleu"] = bleu(hyps, ref)
        metrics["dev_bleu_sentences"] = len(src)
        metrics["valid_seconds"] = time.perf_counter() - t0
        metrics["samples"] = list(zip(src, ref, hyps))[:self.cfg.valid_samples]
        return metrics

    def save(self, metrics=None) -> str:
        """Write checkpoint_<step>.npz (+ last, + best if the dev loss improved)."""
        dev_loss = (metrics or {}).get("dev_loss")
        if dev_loss is not None and (self.best_dev_loss is None or dev_loss <
                                     self.best_dev_loss):
            self.best_dev_loss = dev_loss
        meta = {
            "data_state": self.batches.state_dict(),
            "rng_state": backend.get_rng_state(),
            "model_config": self.model_cfg.to_dict(),
            "train_config": self.cfg.to_dict(),
            "bpe": {"file": BPE_FILE, "sha256": self.bpe_sha},
            "skipped_steps": self.skipped,
            "loss_scaler": self.scaler.state_dict(),
            "best_dev_loss": self.best_dev_loss,
            "budget_progress": self.budget_progress(self.step + 1),
            "metrics": {k: v for k, v in (metrics or {}).items() if k != "samples"},
            "world_size": self.comm.size,
        }
        return self.manager.save(self.step, self.model.state_dict(),
                                 self.optimizer.state_dict(), meta, dev_loss=dev_loss)

    # ---- the loop ----------------------------------------------------------------------

    def train(self) -> dict:
        """Train until ``max_steps`` / ``max_minutes`` (or Ctrl-C / SIGTERM, which stop at the
        next step boundary after a checkpoint), validate, test, plot; returns the summary.

        One step in flight: the outcome of update k (its loss and gradient norm, which decide
        the step count) is read after the forward and backward of update k + 1 have been
        launched, so on a GPU the device always has work queued while the host waits. The
        outcome is read before launching more whenever a decision needs the exact step
        count: an update that may complete the run or land on a validation or checkpoint
        interval. Results equal :meth:`train_step` called in a loop (tests/test_train.py).
        """
        cfg, comm = self.cfg, self.comm
        budget = cfg.max_minutes * 60.0 if cfg.max_minutes else math.inf
        stream = _forever(self.batches)
        progress = self._progress = _Progress(start_step=self.step, budget=budget)
        saved_step = self.step if cfg.resume else None
        checked_step = self.step        # the step count whose interval work is done
        in_flight = None                # the update launched last, outcome not read yet
        stop = None
        previous_handlers = self._install_signal_handlers()
        try:
            while True:
                if in_flight is not None and self._decides(self.step + 1):
                    self._account(self.settle(in_flight), progress)
                    in_flight = None
                if cfg.max_steps and self.step >= cfg.max_steps:
                    stop = "max_steps"
                # Collective: rank 0's clock and any rank's signal decide for everyone.
                elif comm.any((comm.is_root and progress.elapsed() >= budget)
                              or self._signalled):
                    stop = "signal" if self._signalled else "max_minutes"
                if stop is not None:
                    break  # _finish validates and saves the last step
                if in_flight is None and self.step != checked_step:
                    checked_step = self.step
                    if self._interval_work(progress):
                        saved_step = self.step
                loss_sum, tokens = self.forward_backward(
                    [next(stream) for _ in range(cfg.update_freq)])
                if in_flight is not None:   # read update k while update k + 1 computes
                    self._account(self.settle(in_flight), progress)
                in_flight = self.launch_update(loss_sum, tokens)
            if in_flight is not None:
                self._account(self.settle(in_flight), progress)
        finally:
            self._restore_signal_handlers(previous_handlers)
        t_start, total_tokens = progress.t_start, progress.total_tokens
        valid_seconds = progress.valid_seconds
        train_seconds = time.perf_counter() - t_start
        self.log.info(f"stopped ({stop}) at step {self.step} after "
                      f"{format_seconds(train_seconds)}")
        summary = {"steps": self.step, "stopped": stop, "epoch": self.batches.epoch,
                   "train_seconds": round(train_seconds, 3),
                   "valid_seconds": round(valid_seconds, 3), "target_tokens": total_tokens,
                   "target_tokens_per_s": round(
                       total_tokens / max(train_seconds - valid_seconds, 1e-9), 1),
                   "skipped_steps": self.skipped, "ranks": comm.size,
                   "precision": self.policy.name,
                   "parameters": self.model.num_parameters(), "run_dir": self.run_dir}
        if self.cfg.cuda_graph:   # graphs captured (0 if capturing failed at once)
            summary["cuda_graphs"] = self.graphs.captures if self.graphs else 0
        if self.root:
            summary.update(self._finish(saved_step))
        comm.barrier()
        return summary

    def _decides(self, step: int) -> bool:
        """Whether reaching ``step`` may end the run or needs validation or a checkpoint
        (then the loop reads the update in flight before launching another)."""
        return bool(self.cfg.max_steps and step >= self.cfg.max_steps) or \
            self._on_interval(step)

    def _on_interval(self, step: int) -> bool:
        """Whether ``step`` is due a validation or a checkpoint."""
        return step % self.cfg.valid_interval == 0 or step % self.cfg.save_interval == 0

    def _interval_work(self, progress) -> bool:
        """Validate and/or save if the step count is on an interval (nothing in flight);
        True if a checkpoint was written. The pause is not counted as training time."""
        cfg = self.cfg
        if not self._on_interval(self.step):
            return False
        validate = self.step % cfg.valid_interval == 0
        t_pause = time.perf_counter()
        if self.root:
            metrics = self.validate(cfg.valid_bleu_sentences) if validate else None
            if metrics:
                self._log_validation(metrics)
            self.save(metrics)
        self.comm.barrier()
        paused = time.perf_counter() - t_pause
        progress.valid_seconds += paused
        progress.window["t"] += paused  # tokens/s measures training, not validation
        return True

    def _account(self, result: dict, progress) -> None:
        """The host's side of one settled update: its tokens, a line for a skipped one
        (TrainError after ``max_bad_steps`` bad ones in a row), the periodic log line."""
        cfg = self.cfg
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
            if self.bad_in_a_row >= cfg.max_bad_steps:
                raise TrainError(
                    f"stopping: {self.bad_in_a_row} updates in a row had a non-finite "
                    f"loss or gradient (training diverged at step {self.step + 1}); "
                    f"the last good checkpoint is in {self.run_dir}; try a lower "
                    "--lr-factor, a longer --warmup or --clip-norm 1")
            return
        window = progress.window
        window["loss"] += result["loss"] * result["tokens"]
        window["tokens"] += result["tokens"]
        window["steps"] += 1
        window["gnorm"] += result["gnorm"]
        if self.step % cfg.log_interval == 0:
            self._log_window(window, progress.elapsed(), progress.budget,
                             progress.start_step)
            progress.window = _Progress.new_window()

    def _finish(self, saved_step) -> dict:
        """Final validation (full dev set), checkpoint, test BLEU and the plot (rank 0)."""
        out = {}
        metrics = self.validate(0)
        self._log_validation(metrics)
        for key in ("dev_loss", "dev_nll", "dev_ppl", "dev_bleu"):
            out[key] = round(metrics[key], 4)
        if saved_step != self.step:
            out["checkpoint"] = self.save(metrics)
        else:
            out["checkpoint"] = os.path.join(self.run_dir, f"checkpoint_{self.step}.npz")
        if self.cfg.test_bleu and self.test_lines is not None:
            out.update(self._test())
        try:
            from .plot import write_training_plot  # noqa: PLC0415
            path = os.path.join(self.run_dir, "training.svg")
            write_training_plot(path, self.log.records())
            out["plot"] = path
        except OSError as e:  # a plot must never cost the run
            self.log.info(f"warning: could not write the plot: {e}")
        return out

    def _test(self) -> dict:
        """Test BLEU, greedy and (``test_beam`` > 1) with the paper's beam search; logs a
        few of the translations."""
        src, ref = self.test_lines
        out = {}
        t0 = time.perf_counter()
        with amp.autocast(self.policy):
            hyps = greedy_translate(self.model, self.bpe, src, self.device)
        out["test_bleu_greedy"] = round(bleu(hyps, ref), 2)
        self.log.info(f"test BLEU {out['test_bleu_greedy']:.2f} (greedy, "
                      f"{len(hyps)} sentences, {time.perf_counter() - t0:.0f}s)")
        if self.cfg.test_beam > 1:
            t0 = time.perf_counter()
            options = SearchOptions(beam_size=self.cfg.test_beam)
            translator = Translator(self.model, self.bpe, self.device, self.policy.name)
            hyps = [nbest[0][0] for nbest in translator.translate_lines(src, options)]
            out["test_bleu_beam"] = round(bleu(hyps, ref), 2)
            self.log.info(f"test BLEU {out['test_bleu_beam']:.2f} (beam {options.beam_size}, "
                          f"alpha {options.alpha}, {len(hyps)} sentences, "
                          f"{time.perf_counter() - t0:.0f}s)")
        out["test_bleu"] = out.get("test_bleu_beam", out["test_bleu_greedy"])
        self._log_samples("test", list(zip(src, ref, hyps))[:max(self.cfg.valid_samples, 3)])
        return out

    def _log_samples(self, name, samples) -> None:
        """Source, reference and hypothesis of a few sentences, one line each."""
        for i, (source, reference, hypothesis) in enumerate(samples, 1):
            self.log.info(f"  {name} sample {i}  source     | {source}")
            self.log.info(f"  {name} sample {i}  reference  | {reference}")
            self.log.info(f"  {name} sample {i}  hypothesis | {hypothesis}")

    def _log_window(self, window, elapsed, budget, start_step):
        cfg = self.cfg
        steps = max(window["steps"], 1)
        loss = window["loss"] / max(window["tokens"], 1)
        seconds = time.perf_counter() - window["t"]
        tok_s = window["tokens"] / max(seconds, 1e-9)
        per_step = elapsed / max(self.step - start_step, 1)
        remaining = [budget - elapsed]
        if cfg.max_steps:
            remaining.append((cfg.max_steps - self.step) * per_step)
        eta = max(min(remaining), 0.0)
        lr = self.optimizer.lr
        self.log.info(
            f"step {self.step} | epoch {self.batches.epoch} | loss {loss:.3f} | "
            f"ppl {math.exp(min(loss, 50.0)):.1f} | lr {lr:.2e} | "
            f"gnorm {window['gnorm'] / steps:.3f} | "
            + (f"scale {self.scaler.scale:g} | " if self.scaler.enabled else "")
            + f"tok/s {tok_s:,.0f} | "
            f"elapsed {format_seconds(elapsed)} | eta {format_seconds(eta)}")
        self.log.record(step=self.step, epoch=self.batches.epoch, loss=loss, lr=lr,
                        gnorm=window["gnorm"] / steps, tokens_per_s=tok_s, elapsed=elapsed)

    def _log_validation(self, m):
        self.log.info(
            f"valid step {self.step} | dev loss {m['dev_loss']:.3f} | dev nll "
            f"{m['dev_nll']:.3f} | dev ppl {m['dev_ppl']:.1f} | dev BLEU {m['dev_bleu']:.2f} "
            f"({m['dev_bleu_sentences']} sentences, greedy) | {m['valid_seconds']:.0f}s")
        self.log.record(step=self.step, **{k: m[k] for k in ("dev_loss", "dev_nll", "dev_bleu")})
        self._log_samples("dev", m.get("samples", []))

    # ---- signals: stop at a step boundary, never mid-update ----------------------------

    _signalled = False

    def _install_signal_handlers(self):
        import threading  # noqa: PLC0415
        if threading.current_thread() is not threading.main_thread():
            return None
        self._signalled = False

        def handler(signum, frame):
            if self._signalled:  # a second Ctrl-C: stop at once
                raise KeyboardInterrupt
            self._signalled = True
            self.log.info(f"received signal {signum}: saving a checkpoint after this step "
                          "(again to stop at once)")
        previous = {}
        for sig in (signal.SIGINT, signal.SIGTERM):
            previous[sig] = signal.signal(sig, handler)
        return previous

    def _restore_signal_handlers(self, previous):
        for sig, handler in (previous or {}).items():
            signal.signal(sig, handler)


def train(cfg: TrainConfig, comm=None, log_stream=None) -> dict:
    """Run ``cfg`` to the end and return the summary (see :class:`Trainer`)."""
    return Trainer(cfg, comm=comm, log_stream=log_stream).train()
