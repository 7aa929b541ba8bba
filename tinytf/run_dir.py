"""The files a training run reads and writes: the corpus paths under ``--data``, the run's
BPE model in ``RUNDIR/bpe.json`` (learnt once, by rank 0), and what a checkpoint must hold
to be resumed."""
from __future__ import annotations

import os
import time

from . import checkpoint
from .bpe import BPE
from .train_config import BPE_FILE, TrainError


def data_paths(cfg) -> dict:
    """{"train": (src, tgt), "dev": (...), "test": (...) if present} under ``cfg.data``; a
    missing file is a :class:`TrainError` naming it."""
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


def run_bpe(cfg, comm, log, train_pair):
    """(BPE, its file's SHA-256): RUNDIR/bpe.json, learnt from both training sides first if
    absent (by rank 0; the others wait)."""
    path = os.path.join(cfg.out, BPE_FILE)
    # Rank 0 decides: another rank looking later could already see the file rank 0 is
    # about to write, skip the barrier below and leave rank 0 waiting there for ever.
    if not comm.broadcast_object(os.path.isfile(path) if comm.is_root else None):
        if cfg.resume:
            raise TrainError(f"--resume: {path} is missing (the run's BPE model)")
        if comm.is_root:
            t0 = time.perf_counter()
            log.info(f"learning a joint BPE of {cfg.vocab_size} pieces from "
                     f"{train_pair[0]} and {train_pair[1]} ...")
            try:
                model = BPE.learn(list(train_pair), vocab_size=cfg.vocab_size)
            except ValueError as e:
                raise TrainError(f"--vocab-size {cfg.vocab_size}: {e}") from None
            model.save(path)  # atomic (temporary file + rename)
            log.info(f"wrote {path} ({len(model)} pieces, {time.perf_counter() - t0:.1f}s)")
        comm.barrier()
    return BPE.load(path), checkpoint.sha256_file(path)


def check_resumable(ckpt, bpe_sha: str, run_dir: str) -> None:
    """A :class:`TrainError` unless ``ckpt`` is a training checkpoint of this BPE model."""
    saved = ckpt.meta.get("bpe", {}).get("sha256")
    if saved and saved != bpe_sha:
        raise TrainError(f"{ckpt.path}: trained with another BPE model than "
                         f"{os.path.join(run_dir, BPE_FILE)} (SHA-256 differs)")
    for key in ("model_config", "data_state", "step"):
        if key not in ckpt.meta:
            raise TrainError(f"{ckpt.path}: not a training checkpoint (no {key})")
    if ckpt.optim is None:
        raise TrainError(f"{ckpt.path}: has no optimizer state (an averaged checkpoint "
                         "cannot be resumed)")


RESUME_SENSITIVE = ("seed", "max_tokens", "update_freq", "lr_schedule", "lr", "warmup",
                    "lr_factor", "precision")
"""Options that a resumed run may change, at the price of not matching a straight run."""


def changed_on_resume(saved: dict, cfg) -> str | None:
    """The warning for :data:`RESUME_SENSITIVE` options that differ from the checkpoint's."""
    changed = [k for k in RESUME_SENSITIVE if k in saved and saved[k] != getattr(cfg, k)]
    if not changed:
        return None
    return ("warning: resuming with changed " + ", ".join(
        f"{k} ({saved[k]} -> {getattr(cfg, k)})" for k in changed) +
        ": the run will not match an uninterrupted one")
