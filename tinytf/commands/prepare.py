"""Prepare a run directory ahead of training: learn its BPE model and encode its corpus.

    tinytf-prepare --data DIR --src en --tgt de --out RUNDIR --vocab-size 32000 --workers 16
    python -m tinytf.commands.prepare ...   # the same

Writes what ``train.py --out RUNDIR`` would write before its first update: ``RUNDIR/bpe.json``
(learnt from both training sides when RUNDIR has none, or learnt it from a text that has
changed since and holds no checkpoint; ``RUNDIR/bpe.source.json`` records what it was
learnt from), ``RUNDIR/corpus`` (the training
pairs encoded once, :mod:`tinytf.data.corpus_file`; rebuilt when stale) and, where no run has
started yet, ``RUNDIR/config.json`` with these options. A later ``train.py --out RUNDIR``
with the same --data, --vocab-size and ``train_max_len`` maps them and starts in seconds
(another --vocab-size is refused, as for any BPE already in RUNDIR): prepare on a CPU node,
train on a GPU node. Exit status 0, 2 for a data or usage error (named file and line), 1
for a worker process killed (out of memory?), 128 + N for a stop signal N (Ctrl-C, a
scheduler's SIGTERM or SIGUSR1: what is written is whole, and the next run goes on from it).
See docs/data.md ("The prepared corpus").
"""
import argparse
import signal
import sys
import time

from tinytf.data.batches import DataError
from tinytf.distributed import communicator as distributed
from tinytf.text import BPEFileError
from tinytf.training.config import TrainConfig, TrainError, apply_overrides, read_config_file
from tinytf.training.run_dir import (
    RunLock,
    data_paths,
    has_checkpoint,
    make_run_dir,
    prepared_corpus,
    run_bpe,
    write_run_config,
)
from tinytf.training.signals import StopRequested, StopSignals
from tinytf.utils.workers import WorkerError, signal_words
from tinytf.commands import add_file_pairs, start_process


class _Log:
    """Progress lines to stderr."""

    @staticmethod
    def info(message: str) -> None:
        print(message, file=sys.stderr, flush=True)


def build_parser() -> argparse.ArgumentParser:
    """The command line (the data options mean what train.py's do)."""
    d = TrainConfig()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    add_file_pairs(p, " (as train.py --train)")
    p.add_argument("--data", default=d.data, help=f"instead of the three: a directory with "
                   f"train.SRC, train.TGT, dev.SRC, dev.TGT (default: {d.data})")
    p.add_argument("--src", default=d.src, help=f"source language suffix (default: {d.src})")
    p.add_argument("--tgt", default=d.tgt, help=f"target language suffix (default: {d.tgt})")
    p.add_argument("--out", metavar="RUNDIR", help="run directory (default: train.py's)")
    p.add_argument("--preset", dest="config", default=d.config, metavar="NAME",
                   help=f"model preset, for its default --vocab-size (default: {d.config})")
    p.add_argument("--config", dest="config_file", metavar="FILE",
                   help="the data options of a JSON or TOML file with the keys of a run's "
                        "config.json (train.py --config's); flags given override it")
    p.add_argument("--vocab-size", type=int, metavar="V",
                   help="joint BPE vocabulary (default: the preset's)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="processes that count words and encode (default: the CPUs available)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="train_max_len=N: the longest pair kept (as train.py --set)")
    return p


def main(argv=None) -> int:
    """Run the command line; returns the exit status."""
    start_process()
    args = build_parser().parse_args(argv)
    signals = StopSignals(_Log)
    try:
        # A stop signal stops it at once, as it stops train.py's start: the BPE model is
        # written whole or not at all, and an unfinished corpus is removed.
        with signals.catching(), signals.interrupting():
            _prepare(args)
    except StopRequested as stop:
        number = stop.args[0]
        print("tinytf-prepare: interrupted" if number == signal.SIGINT else
              f"tinytf-prepare: stopped by {signal_words(number)}",
              file=sys.stderr)
        return 128 + number
    except (TrainError, DataError, BPEFileError) as e:
        print(f"tinytf-prepare: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:    # killed (out of memory?): what is written is whole
        print(f"tinytf-prepare: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:   # (a Ctrl-C before the handlers are in place)
        print("tinytf-prepare: interrupted", file=sys.stderr)
        return 128 + 2                  # SIGINT
    return 0


FILE_KEYS = ("data", "src", "tgt", "train_files", "valid_files", "test_files", "out", "config",
             "vocab_size", "workers", "train_max_len")
"""What tinytf-prepare takes from a --config file: the options that decide the BPE model and
the encoded corpus."""


def _prepare(args) -> None:
    """The run directory of ``args``: its BPE model, its corpus and (before any run) its
    config.json, under its lock."""
    options = dict(data=args.data, src=args.src, tgt=args.tgt, train_files=args.train_files,
                   valid_files=args.valid_files, test_files=args.test_files, out=args.out,
                   config=args.config, vocab_size=args.vocab_size, workers=args.workers)
    if args.config_file:
        defaults = vars(build_parser().parse_args([]))
        from_file = read_config_file(args.config_file)
        options.update({k: v for k, v in from_file.items() if k in FILE_KEYS
                        and options.get(k, defaults.get(k)) == defaults.get(k)})
    cfg = apply_overrides(TrainConfig(**options), args.set).resolved()
    paths = data_paths(cfg)
    make_run_dir(cfg.out)
    lock = RunLock(cfg.out)
    try:
        t0 = time.perf_counter()
        comm = distributed.create_communicator()
        _, sha, _ = run_bpe(cfg, comm, _Log, paths["train"])
        corpus = prepared_corpus(cfg, comm, _Log, paths["train"], sha)
        if not has_checkpoint(cfg.out):   # what a run that starts here is checked against
            write_run_config(cfg.out, cfg, comm.size, "cpu")
        _Log.info(f"{cfg.out} is ready: {len(corpus):,} training pairs "
                  f"({time.perf_counter() - t0:.1f}s)")
    finally:
        lock.release()


if __name__ == "__main__":
    sys.exit(main())
