"""The files a training run reads and writes: the corpus paths under ``--data``, the run's
BPE model in ``RUNDIR/bpe.json`` (learnt once, by rank 0), the training corpus encoded once
into ``RUNDIR/corpus`` (:mod:`tinytf.data.corpus_file`), the run's options and summary
(``config.json``, ``summary.json``), and what a checkpoint must hold to be resumed."""
from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time

from tinytf.data.batches import DataError, check_parallel_files
from tinytf.data.corpus_file import open_corpus, source_identity, stale_reason
from tinytf.data.prepare import prepare_corpus
from tinytf.decoding.translation import TranslationError, bpe_path_of
from tinytf.text import BPE
from tinytf.text.learn import TextError
from tinytf.training import recipes
from tinytf.training.config import BPE_FILE, CORPUS_DIR, TrainConfig, TrainError, apply_overrides
from tinytf.utils import checkpoint
from tinytf.utils.files import open_own
from tinytf.utils.workers import available_cpus


def data_paths(cfg) -> dict:
    """{"train": (src, tgt), "dev": (...), "test": (...) if present}: the files of
    ``--train``/``--valid``/``--test`` when given, else ``train.SRC`` ... under ``--data``; a
    missing file is a :class:`TrainError` naming it."""
    if cfg.train_files:
        paths = {"train": tuple(cfg.train_files), "dev": tuple(cfg.valid_files)}
        if cfg.test_files:
            paths["test"] = tuple(cfg.test_files)
        for split, flag in (("train", "--train"), ("dev", "--valid"), ("test", "--test")):
            for path in paths.get(split, ()):
                problem = _file_problem(path)
                if problem:
                    raise TrainError(f"{path}: {problem} ({flag} SOURCE_FILE TARGET_FILE)")
        return paths
    paths = {}
    for split in ("train", "dev", "test"):
        pair = tuple(os.path.join(cfg.data, f"{split}.{lang}") for lang in (cfg.src, cfg.tgt))
        present = [os.path.isfile(p) for p in pair]
        if all(present):
            paths[split] = pair
        elif split != "test" or any(present):
            missing = [p for p, ok in zip(pair, present) if not ok]
            if cfg.data == TrainConfig.data and not os.path.isdir(cfg.data):
                raise TrainError(f"no {cfg.data} here: the shipped corpus is in tinytf's "
                                 "source checkout (run from it), or give your own files "
                                 "with --train SRC TGT --valid SRC TGT, or --data DIR")
            raise TrainError(f"{missing[0]}: {_file_problem(missing[0])} (--data {cfg.data} "
                             f"must hold train.{cfg.src}, train.{cfg.tgt}, dev.{cfg.src}, "
                             f"dev.{cfg.tgt}; test.* optional; or name the files with "
                             f"--train, --valid and --test)")
    return paths


def _file_problem(path: str) -> str:
    """Why ``path`` cannot be read as a text file, or "" when it can."""
    if os.path.isfile(path):
        return ""
    return ("a directory, not a file" if os.path.isdir(path) else
            "not a regular file (a device, a pipe or a socket)" if os.path.exists(path)
            else "no such file")


def run_bpe(cfg, comm, log, train_pair):
    """(BPE, its file's SHA-256, whether it was learnt now): RUNDIR/bpe.json, learnt from
    both training sides by rank 0 (the others wait) when absent, or, for a new run, when the
    run directory learnt it from other training text (:func:`_why_learn_again`). A new run
    that finds one learnt for another ``--vocab-size`` is refused."""
    path = os.path.join(cfg.out, BPE_FILE)
    # Rank 0 decides: another rank looking later could already see the file rank 0 is
    # about to write, skip the barrier below and leave rank 0 waiting there for ever.
    why = None
    if comm.is_root:
        why = "absent" if not os.path.isfile(path) else \
            None if cfg.resume else _why_learn_again(cfg, path, train_pair)
    why = comm.broadcast_object(why)
    learnt = why is not None
    if learnt:
        if cfg.resume:
            raise TrainError(f"--resume: {path} is missing (the run's BPE model)")
        if comm.is_root:
            if why != "absent":
                log.info(f"{path} was learnt from other training text ({why}): learning it "
                         "again")
            _learn_bpe(cfg, log, train_pair, path)
        comm.barrier()
    bpe = BPE.load(path)
    if not learnt:
        log.info(f"BPE: {path} ({len(bpe):,} pieces)")
    return bpe, checkpoint.sha256_file(path), learnt


BPE_SOURCE_FILE = "bpe.source.json"
"""What the run directory learnt its bpe.json from: the BPE file's SHA-256, the
``--vocab-size`` asked and the two training files (size and head/tail SHA-256)."""


def _learn_bpe(cfg, log, train_pair, path) -> None:
    """Learn the joint BPE of ``train_pair`` into ``path`` (atomically), and beside it
    :data:`BPE_SOURCE_FILE`, the record of what it was learnt from."""
    check_parallel_files(*train_pair)   # before minutes go into learning from them
    t0 = time.perf_counter()
    workers = cfg.workers or available_cpus()
    log.info(f"learning a joint BPE of {cfg.vocab_size} pieces from "
             f"{train_pair[0]} and {train_pair[1]} ({workers} worker(s)) ...")
    try:
        model = BPE.learn(list(train_pair), vocab_size=cfg.vocab_size, workers=workers,
                          progress=lambda line: log.info(f"BPE: {line}"))
    except TextError as e:
        raise DataError(str(e)) from None
    except ValueError as e:
        raise TrainError(f"--vocab-size {cfg.vocab_size}: {e}") from None
    try:
        model.save(path)  # atomic (temporary file + rename)
    except OSError as e:
        raise TrainError(f"{path}: cannot write the BPE model: "
                         f"{checkpoint.why_not_written(e, path, _bpe_size(model))}") from None
    record = {"bpe_sha256": checkpoint.sha256_file(path), "vocab_size": cfg.vocab_size,
              "sources": [_text_identity(p) for p in train_pair]}
    write_json(os.path.join(cfg.out, BPE_SOURCE_FILE), record,
               "the record of what the BPE model was learnt from")
    short = "" if len(model) >= cfg.vocab_size else \
        f", not the {cfg.vocab_size:,} asked: no further pair of pieces occurs twice " \
        "in the training text"
    log.info(f"wrote {path} ({len(model):,} pieces{short}; "
             f"{time.perf_counter() - t0:.1f}s)")


def _bpe_size(model) -> int:
    """About the bytes of ``model``'s file: its pieces, each with JSON's quotes and commas."""
    return sum(len(piece.encode("utf-8")) + 8 for piece in model.pieces)


def write_json(path, doc: dict, what: str) -> None:
    """Write ``doc`` to ``path`` as indented JSON, atomically; a :class:`TrainError` naming
    the file and ``what`` it holds if it cannot be written (a full disk, a quota)."""
    data = (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode("utf-8")
    try:
        checkpoint.atomic_write(path, lambda f: f.write(data))
    except OSError as e:
        raise TrainError(f"{path}: cannot write {what}: "
                         f"{checkpoint.why_not_written(e, path, len(data))}") from None


def _text_identity(path) -> dict:
    """A training file as the BPE's record keeps it: its path, size and head/tail hash
    (not its mtime: a copy of the same text is the same text)."""
    identity = source_identity(path)
    return {key: identity[key] for key in ("path", "size", "head_tail_sha256")}


def _why_learn_again(cfg, path, train_pair) -> str | None:
    """Why a new run learns RUNDIR/bpe.json again: which training file differs from the
    text the run directory learnt it from (its :data:`BPE_SOURCE_FILE`); None to keep it,
    as always for a BPE model the directory did not learn (copied there, or
    ``--init-from``'s), under ``--init-from``, and where checkpoints use it
    (``tinytf-prepare`` in a run's directory). A :class:`TrainError` if it was learnt, or
    prepared, for another ``--vocab-size``."""
    try:
        with open(os.path.join(cfg.out, BPE_SOURCE_FILE), encoding="utf-8") as f:
            record = json.load(f)
        if record["bpe_sha256"] != checkpoint.sha256_file(path) or not all(
                isinstance(source, dict) for source in record["sources"]):
            record = None                     # a record of another BPE file than this one
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        record = None
    earlier = record["vocab_size"] if record else _earlier_vocab_size(cfg.out)
    if earlier is not None and earlier != cfg.vocab_size:
        raise TrainError(f"{path} was learnt for --vocab-size {earlier}, this run asks "
                         f"for {cfg.vocab_size}: remove it, or choose another --out")
    if record is None or cfg.init_from or has_checkpoint(cfg.out):
        return None                           # (checkpoints: the model of a run)
    # The two sides in either order: a joint BPE does not depend on which is the source.
    learnt_from = {(source.get("size"), source.get("head_tail_sha256"))
                   for source in record["sources"]}
    for now in train_pair:
        mine = _text_identity(now)
        if (mine["size"], mine["head_tail_sha256"]) not in learnt_from:
            same_size = any(size == mine["size"] for size, _ in learnt_from)
            return f"{now}: its {'content' if same_size else 'size'} differs"
    return None


def _earlier_vocab_size(run_dir: str):
    """The --vocab-size of the run that last started in ``run_dir``, or that tinytf-prepare
    prepared it for (its config.json)."""
    try:
        with open(os.path.join(run_dir, "config.json"), encoding="utf-8") as f:
            return json.load(f)["options"]["vocab_size"]
    except (OSError, ValueError, KeyError, TypeError, RecursionError):
        return None


def check_same_bpe(ckpt, bpe_sha: str, run_dir: str, what: str = "") -> None:
    """A :class:`TrainError` if ``ckpt`` records another BPE model than RUNDIR/bpe.json's
    (``bpe_sha``); ``what`` prefixes the message (the option that brought the checkpoint)."""
    saved = (ckpt.meta.get("bpe") or {}).get("sha256")
    if saved and saved != bpe_sha:
        raise TrainError(f"{what}{ckpt.path}: trained with another BPE model than "
                         f"{os.path.join(run_dir, BPE_FILE)} (SHA-256 differs)")


def check_resumable(ckpt, bpe_sha: str, run_dir: str) -> None:
    """A :class:`TrainError` unless ``ckpt`` is a training checkpoint of this BPE model."""
    check_same_bpe(ckpt, bpe_sha, run_dir)
    for key in ("model_config", "data_state", "step"):
        if key not in ckpt.meta:
            raise TrainError(f"{ckpt.path}: not a training checkpoint (no {key})")
    if ckpt.optim is None:
        raise TrainError(f"{ckpt.path}: has no optimizer state (an averaged checkpoint "
                         "cannot be resumed)")


def resumed_model_config(ckpt, wanted, bpe_sha: str, run_dir: str, given=()):
    """The model config to resume ``ckpt`` with: its own, once :func:`check_resumable`
    passes; a :class:`TrainError` listing the fields where ``wanted`` (the
    ``TransformerConfig`` that --config and --set ask for) differs from it.

    A field that the checkpoint predates (a model option added later, such as ``qk_norm``)
    has its default, the model the checkpoint trained: a preset that has since changed
    that default is no conflict, a ``--set`` of it (a key in ``given``) is."""
    check_resumable(ckpt, bpe_sha, run_dir)
    stored = ckpt.meta["model_config"]
    saved = type(wanted).from_dict(stored)
    problem = saved.mismatch(ckpt.model)    # before the model is built from it
    if problem:
        raise TrainError(f"{ckpt.path}: {problem}")
    asked = wanted.to_dict()
    diff = {k: (v, asked[k]) for k, v in saved.to_dict().items()
            if asked[k] != v and (k in stored or k in given)}
    if diff:
        raise TrainError(f"{ckpt.path}: the run's model differs from --config/--set "
                         f"(saved, asked): {diff}")
    return saved


RESUME_SENSITIVE = ("seed", "max_tokens", "update_freq", "lr_schedule", "lr", "warmup",
                    "lr_factor", "optimizer", "precision", "dropout_from_epoch")
"""Options that a resumed run may change, at the price of not matching a straight run."""


def resume_warnings(saved: dict, cfg, saved_ranks: int = 1, ranks: int = 1) -> list[str]:
    """The lines that a resume logs where it departs from the checkpoint's run: the
    :data:`RESUME_SENSITIVE` options that differ from its options (``saved``), a new budget
    under the budget-aware ``linear`` schedule, and another number of ranks (the run had
    ``saved_ranks``, this one ``ranks``): an update of the same batches if ``update_freq``
    keeps the batches per update, else a warning with the ``--update-freq`` that would."""
    def changes(keys):
        return ", ".join(f"{k} ({saved[k]} -> {getattr(cfg, k)})" for k in keys
                         if k in saved and saved[k] != getattr(cfg, k))
    lines = []
    per_update = saved.get("update_freq", cfg.update_freq) * saved_ranks   # batches
    same_batches = per_update == cfg.update_freq * ranks
    sensitive = tuple(k for k in RESUME_SENSITIVE
                      if not (k == "update_freq" and saved_ranks != ranks and same_batches))
    changed = changes(sensitive)
    if changed:
        lines.append(f"warning: resuming with changed {changed}: the run will not match an "
                     "uninterrupted one")
    if saved_ranks != ranks:
        moved = (f"resuming on {ranks} rank(s) a run that trained on {saved_ranks}: the epoch "
                 "goes on from the batches its ranks had reached together")
        if same_batches:
            lines.append(f"{moved}, with the same {per_update} batches per update "
                         f"(--update-freq {cfg.update_freq}; dropout draws its masks per rank)")
        else:
            keep = (f"--update-freq {per_update // ranks} keeps them" if per_update % ranks == 0
                    else f"no --update-freq on {ranks} rank(s) keeps them")
            lines.append(f"warning: {moved}, but an update now holds {cfg.update_freq * ranks} "
                         f"batches of --max-tokens where it held {per_update} ({keep})")
    budget = changes(BUDGET_KEYS)
    if budget and cfg.lr_schedule == "linear":
        lines.append(f"warning: resuming with another budget, {budget}: the "
                     "linear schedule follows it from here (its learning rate is the one of "
                     "the share of the new budget spent, and reaches zero at its end)")
    return lines


SCHEDULE_KEYS = ("lr_schedule", "lr", "lr_factor")

BUDGET_KEYS = ("max_steps", "max_minutes", "max_epochs")
"""The run's budget: on resume, giving any replaces all three (those not given: none)."""


def resumed_config(cfg, given, assignments=()):
    """The config to continue a run with: the options stored in its last checkpoint, with
    the options the user gave on the command line (``given``: their TrainConfig names, the
    values in ``cfg``) and the ``--set`` ``assignments`` on top.

    ``cfg.resume`` is "auto" or True: with "auto" and no checkpoint in the run directory
    the result starts a new run (``cfg`` itself, resume off). Giving one of the schedule's
    options replaces all three of them, so the preset's defaults fill in the rest again;
    giving ``--max-steps``, ``--max-minutes`` or ``--max-epochs`` replaces the run's budget
    whole, so that ``--resume --max-steps 3000`` trains on to update 3,000 after a
    time-budgeted run.
    The ``--max-tokens`` that the run's batch was fitted from (the recipe's
    ``fitted_from``) keeps the fitted batch: a job requeued with its first command
    continues as it trained.
    """
    out = cfg.out or dataclasses.replace(cfg, resume=False).resolved().out
    ckpt = newest_checkpoint(out, with_optim=False)[0] if has_checkpoint(out) else None
    if ckpt is None:   # "auto": a new run; True: the Trainer says why not
        return apply_overrides(dataclasses.replace(cfg, out=out, resume=cfg.resume is True),
                               assignments)
    saved = ckpt.meta.get("train_config")
    if not isinstance(saved, dict):
        raise TrainError(f"{ckpt.path}: holds no training options (not a training checkpoint)")
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    options = {k: v for k, v in recipes.from_legacy(saved).items() if k in fields}
    options.setdefault("dropout_from_epoch", 1)  # older runs had their dropout from the start
    options.setdefault("optimizer", "adam")      # ... and Adam without the rectifier
    for keys in (SCHEDULE_KEYS, BUDGET_KEYS):
        if any(k in given for k in keys):
            options.update({k: getattr(cfg, k) for k in keys})
    if "save_interval" in given and "valid_interval" not in given:
        options["valid_interval"] = None
    if "max_tokens" in given and cfg.max_tokens == recipes.fitted_from(options):
        given = set(given) - {"max_tokens"}   # the --max-tokens the run's batch was fitted from
    options.update({k: getattr(cfg, k) for k in given if k in fields})
    if set(given) & set(recipes.OPTION_DEFAULTS):
        options["recipe_options"] = {**options.get("recipe_options", {}), **{
            k: cfg.recipe_options[k] for k in given if k in recipes.OPTION_DEFAULTS}}
    options.update(out=out, resume=True)
    return apply_overrides(TrainConfig(**options), assignments)


LOCK_FILE = "train.lock"


class RunLock:
    """An exclusive lock on a run directory (``fcntl.flock`` on RUNDIR/train.lock, which
    holds the PID of the holder), so that two trainings never write one directory. The
    kernel drops the lock when the process ends, however it ends."""

    def __init__(self, run_dir: str):
        import fcntl  # noqa: PLC0415 - POSIX only; imported where it is used
        self.path = os.path.join(run_dir, LOCK_FILE)
        try:
            self._file = open_own(self.path, "a+")
        except OSError as e:
            raise TrainError(f"{self.path}: cannot open the run's lock: "
                             f"{e.strerror or e}") from None
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise TrainError(f"{run_dir} is in use by another training run (PID {holder}, "
                             f"{self.path}); wait for it to end or choose another --out") \
                from None
        self._file.seek(0)
        self._file.truncate()
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    def release(self) -> None:
        """Give the directory up (closing the file drops the lock)."""
        if not self._file.closed:
            self._file.close()


def claim_run_dir(cfg, comm):
    """``(cfg, lock)`` for a run in ``cfg.out``: ``--resume auto`` settled (continue if the
    directory holds checkpoints, else start), a :class:`TrainError` for ``--resume`` with
    nothing to resume or a fresh start over a run, and on rank 0 the directory created and
    its :class:`RunLock` taken (None on the other ranks). Every rank waits for rank 0."""
    exists = has_checkpoint(cfg.out)
    if cfg.resume == "auto":
        cfg = dataclasses.replace(cfg, resume=exists)
    if cfg.resume and not exists:
        raise TrainError(f"--resume: {os.path.join(cfg.out, checkpoint.LAST)} does not exist "
                         "(nothing to resume)")
    if not cfg.resume and exists:
        raise TrainError(f"{cfg.out} already holds a training run (checkpoints); "
                         "pass --resume to continue it, or choose another --out")
    lock = None
    if comm.is_root:
        make_run_dir(cfg.out)
        lock = RunLock(cfg.out)     # one training per run directory
    comm.barrier()
    return cfg, lock


def make_run_dir(run_dir: str) -> None:
    """Create ``run_dir`` (and its parents) if absent; a :class:`TrainError` naming it if it
    is a file or cannot be made."""
    if os.path.exists(run_dir) and not os.path.isdir(run_dir):
        raise TrainError(f"--out {run_dir}: a file, not a run directory")
    try:
        os.makedirs(run_dir, exist_ok=True)
    except OSError as e:
        raise TrainError(f"--out {run_dir}: cannot make the run directory: {e.strerror}") \
            from None


def has_checkpoint(run_dir: str) -> bool:
    """Whether ``run_dir`` holds a checkpoint of a run (the last, or a numbered one)."""
    return os.path.isfile(os.path.join(run_dir, checkpoint.LAST)) or (
        os.path.isdir(run_dir) and bool(checkpoint.list_checkpoints(run_dir)))


def newest_checkpoint(run_dir: str, with_optim: bool = True):
    """(the newest checkpoint of ``run_dir`` that loads whole and can be resumed, the
    problems met on the way as messages): checkpoint_last.npz unless a numbered checkpoint
    is newer, and the newest loadable numbered one when the last is damaged. None when no
    checkpoint can be resumed."""
    problems, found = [], None
    last = os.path.join(run_dir, checkpoint.LAST)
    numbered = checkpoint.list_checkpoints(run_dir) if os.path.isdir(run_dir) else []
    for path in ([last] if os.path.isfile(last) else []) + numbered[::-1]:
        step = checkpoint.step_of(path)
        if found is not None and step is not None and step <= found.step:
            break                         # numbered, oldest last: nothing newer remains
        try:
            ckpt = checkpoint.load(path, with_optim=with_optim)
        except checkpoint.CheckpointError as e:
            problems.append(str(e))
            continue
        if "data_state" not in ckpt.meta or (with_optim and ckpt.optim is None):
            problems.append(f"{path}: not a checkpoint to resume (no optimizer or data state)")
            continue
        if found is None or ckpt.step > found.step:
            found = ckpt
    return found, problems


def checkpoint_to_resume(run_dir: str, log):
    """The newest checkpoint of the run that loads whole (:func:`newest_checkpoint`), saying
    which in the log, and what was wrong with any newer one."""
    ckpt, problems = newest_checkpoint(run_dir)
    for problem in problems:
        log.info(f"warning: {problem}; skipped")
    if ckpt is None:
        raise TrainError(f"--resume: no checkpoint in {run_dir} can be resumed"
                         + (f" ({problems[0]})" if problems else ""))
    log.info(f"resuming from {ckpt.path} (step {ckpt.step})")
    return ckpt


def write_run_config(run_dir: str, cfg, ranks: int, device: str) -> str:
    """RUNDIR/config.json: the resolved options, the command line, the tinytf version and
    git commit (when the code is a git checkout), the number of ranks and the device; written
    atomically at every start (a resume rewrites it)."""
    from tinytf import __version__  # noqa: PLC0415 - the package's, at run time
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True,
                                text=True, timeout=10).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        commit = None
    doc = {"options": cfg.to_dict(), "command": sys.argv, "tinytf": __version__,
           "git_commit": commit, "ranks": ranks, "device": device,
           "started": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    path = os.path.join(run_dir, "config.json")
    write_json(path, doc, "the run's options")
    return path


SUMMARY_FILE = "summary.json"


def write_summary(run_dir: str, summary: dict) -> str:
    """RUNDIR/summary.json: the summary of a run that finished (its final validation and
    test done; what train.py prints last), written atomically. Returns its path."""
    path = os.path.join(run_dir, SUMMARY_FILE)
    write_json(path, summary, "the run's summary")
    return path


def finished_summary(run_dir: str, step: int) -> dict | None:
    """The summary in RUNDIR/summary.json if the run finished at update ``step``, else None
    (no such file, one of another step, or one that does not read)."""
    try:
        with open(os.path.join(run_dir, SUMMARY_FILE), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError, RecursionError):   # RecursionError: nested too deeply
        return None
    return summary if isinstance(summary, dict) and summary.get("steps") == step else None


def init_checkpoint(cfg, comm, log):
    """``--init-from``: the checkpoint a new run starts from (fine-tuning). Its BPE model
    is copied into the run directory when that has none yet (rank 0; the others wait)."""
    try:
        ckpt = checkpoint.load(checkpoint.resolve(cfg.init_from), with_optim=False)
        source_bpe = bpe_path_of(ckpt, ckpt.path)
    except (checkpoint.CheckpointError, TranslationError) as e:
        raise TrainError(f"--init-from: {e}") from None
    target = os.path.join(cfg.out, BPE_FILE)
    if comm.is_root and not os.path.isfile(target):
        with open(source_bpe, "rb") as f:
            data = f.read()
        checkpoint.atomic_write(target, lambda f: f.write(data))
        log.info(f"--init-from {ckpt.path}: copied its BPE model {source_bpe}")
    comm.barrier()
    return ckpt


def load_init_weights(model, ckpt, bpe_sha: str, run_dir: str, log) -> None:
    """Load ``--init-from``'s weights into a new run's ``model``: same BPE, same shapes."""
    check_same_bpe(ckpt, bpe_sha, run_dir, what="--init-from ")
    mine = {k: v.shape for k, v in model.state_dict().items()}
    theirs = {k: tuple(v.shape) for k, v in ckpt.model.items()}
    if mine != theirs:
        diff = sorted(k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k))
        raise TrainError(f"--init-from {ckpt.path}: the model differs from this run's "
                         f"--config/--set in {len(diff)} parameters, e.g. " + ", ".join(
                             f"{k} {theirs.get(k)} vs {mine.get(k)}" for k in diff[:3]))
    model.load_state_dict(ckpt.model)
    log.info(f"starting from the weights of {ckpt.path} (step {ckpt.step})")


def prepared_corpus(cfg, comm, log, train_pair, bpe_sha: str):
    """The training corpus as memory maps of RUNDIR/corpus (:mod:`tinytf.data.corpus_file`),
    encoded first if it is missing or stale (rank 0 prepares with ``cfg.workers`` processes,
    the others wait and then map the same files). A rank whose own view of the source files
    differs from what rank 0 prepared stops the job with a :class:`TrainError`."""
    path = os.path.join(cfg.out, CORPUS_DIR)
    if comm.is_root:
        reason = stale_reason(path, bpe_sha, train_pair, cfg.train_max_len)
        if reason is not None:
            workers = cfg.workers or available_cpus()
            log.info(f"encoding {train_pair[0]} and {train_pair[1]} into {path} "
                     f"({reason}) with {workers} worker(s) ...")
            prepare_corpus(*train_pair, os.path.join(cfg.out, BPE_FILE), path,
                           cfg.train_max_len, workers=workers, log=log.info)
    comm.barrier()
    if not comm.is_root:   # sizes and contents; a node's own copy may have another mtime
        reason = stale_reason(path, bpe_sha, train_pair, cfg.train_max_len, check_mtime=False)
        if reason is not None:
            raise TrainError(f"rank {comm.rank}: the training corpus {train_pair[0]} / "
                             f"{train_pair[1]} is not the one rank 0 prepared in {path} "
                             f"({reason}); every rank must read the same --data")
    return open_corpus(path, name=f"{train_pair[0]} / {train_pair[1]}")
