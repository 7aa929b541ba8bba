"""Train a Transformer (Vaswani et al. 2017) on parallel text.

A thin shell over :func:`tinytf.training.run.train`:

    python train.py                        # tiny preset, shipped en->de corpus, ~10 min on a CPU
    python train.py --data DIR --src en --tgt de --out RUNDIR --config base --max-steps 100000
    python train.py --out RUNDIR --resume  # continue exactly where the run stopped
    python train.py ... --resume auto      # continue if RUNDIR has a checkpoint, else start
    mpirun -n 8 python train.py ...        # data-parallel over MPI ranks (docs/distributed.md)

Log lines go to stderr (and RUNDIR/train.log); stdout gets one JSON line summarising the run.
Exit status: 0 done, 1 internal error, 2 usage or data error, 128 + N stopped by signal N
(SIGINT 130, SIGUSR1 138, SIGTERM 143) after writing its checkpoint, or before the first
update with nothing to save. See docs/training.md.
"""
import argparse
import json
import os
import signal
import sys

from tinytf.commands import device_default, start_process
from tinytf.data.batches import DataError
from tinytf.distributed import communicator as distributed
from tinytf.engine import backend
from tinytf.optim.schedule import SCHEDULES
from tinytf.text import BPEFileError
from tinytf.training.config import FLAGS, OPTIMIZERS, TrainConfig, TrainError, apply_overrides
from tinytf.training.run import train
from tinytf.training.run_dir import resumed_config
from tinytf.training.signals import StopRequested
from tinytf.utils.checkpoint import CheckpointError
from tinytf.utils.streams import drop_stdout
from tinytf.utils.workers import WorkerError, signal_words

USER_ERRORS = (TrainError, DataError, CheckpointError, BPEFileError)


def preset_defaults_text(options) -> str:
    """The per-preset training defaults as --help lines (from TrainConfig.PRESET_DEFAULTS):
    ``--max-tokens 2048`` for a key with an option of its own (its name in ``options``),
    ``--set dropout_from_epoch=5`` for one without."""
    def flag(key, value):
        value = f"{value:g}" if isinstance(value, float) else value
        return (f"--{key.replace('_', '-')} {value}" if key in options else
                f"--set {key}={value}")

    lines = []
    for name, defaults in TrainConfig.PRESET_DEFAULTS.items():
        label = "tiny" if name == "tiny" else "small, base, big"
        flags = " ".join(flag(k, v) for k, v in defaults.items())
        peak = TrainConfig(config="tiny" if name == "tiny" else "base").tuned_peak()
        lines.append(f"  {label + ':':17s} {flags} (peak lr {peak:.2e}"
                     f"{' for base' if name != 'tiny' else ''})\n")
    return "".join(lines)


def _data_options(p, d: TrainConfig) -> None:
    """The training data and its BPE."""
    p.add_argument("--data", default=d.data, help="directory with train.SRC, train.TGT, "
                   f"dev.SRC, dev.TGT and optionally test.SRC, test.TGT (default: {d.data})")
    p.add_argument("--src", default=d.src, help=f"source language suffix (default: {d.src})")
    p.add_argument("--tgt", default=d.tgt, help=f"target language suffix (default: {d.tgt})")
    p.add_argument("--vocab-size", type=int, metavar="V",
                   help="joint BPE vocabulary, learnt when RUNDIR has none "
                        "(default: tiny 4000, others 8000)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="processes that learn the BPE and encode the training text into "
                        "RUNDIR/corpus when it is missing or stale (default: the CPUs this "
                        "process may use)")


def _budget_options(p, d: TrainConfig) -> None:
    """What one update holds and when the run stops."""
    p.add_argument("--config", default=d.config,
                   help=f"model preset: tiny, small, base, big (default: {d.config})")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="padded tokens per batch and side, per rank (the largest batch: "
                        "see --min-updates)")
    p.add_argument("--min-updates", type=int, metavar="N",
                   help="with --max-minutes: time a few batches of --max-tokens first and "
                        "halve the batch (to 1024 tokens at least) while the budget at that "
                        "pace holds fewer than N updates (default: tiny 1500, the others 0: "
                        "off; 0 keeps --max-tokens as given)")
    p.add_argument("--update-freq", type=int, default=d.update_freq, metavar="K",
                   help="batches accumulated into one update (default: 1)")
    p.add_argument("--max-steps", type=int, metavar="N",
                   help="stop after N updates (counting the whole run)")
    p.add_argument("--max-minutes", type=float, metavar="M",
                   help="stop after M minutes of training (counting the whole run)")
    p.add_argument("--max-epochs", type=int, metavar="E",
                   help="stop after E passes over the training data")
    p.add_argument("--patience", type=int, default=d.patience, metavar="N",
                   help="stop when --best-metric has not improved for N validations "
                        "(default: 0, never)")
    p.add_argument("--best-metric", choices=["loss", "bleu"], default=d.best_metric,
                   help="the dev metric that picks checkpoint_best.npz and drives --patience "
                        f"(default: {d.best_metric})")


def _optimizer_options(p, d: TrainConfig) -> None:
    """Adam or RAdam, the learning rate and its schedule."""
    p.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="adam: Adam(0.9, 0.98, 1e-9), the paper's; radam: the same with "
                        "RAdam's rectifier of its early steps (Liu et al. 2020), which warms "
                        "up by itself. Default: the preset's")
    p.add_argument("--lr-schedule", choices=SCHEDULES,
                   help="noam (the paper's: peak = factor * (d_model * warmup)^-0.5), "
                        "inverse_sqrt (fairseq's, peak --lr), linear (warm up to --lr, then "
                        "decay to zero at the end of --max-steps / --max-minutes). Default: "
                        "the preset's; --lr-factor alone means noam, --lr alone the preset's "
                        "schedule or, for a noam preset, inverse_sqrt")
    p.add_argument("--lr", type=float, metavar="PEAK",
                   help="peak learning rate (inverse_sqrt, linear)")
    p.add_argument("--warmup", type=int, metavar="N", help="warm-up updates of the schedule")
    p.add_argument("--lr-factor", type=float, metavar="F",
                   help="factor of the paper's schedule (noam)")
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, metavar="X",
                   help="clip the gradient norm to X (default: 0, no clipping)")
    p.add_argument("--seed", type=int, default=d.seed, help=f"(default: {d.seed})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override a model key (dropout=0.3, pre_norm=true, qk_norm=false, "
                        "activation=gelu, ...) or a training key without its own option "
                        "(train_max_len, valid_bleu_sentences, test_bleu, max_bad_steps, "
                        "dropout_from_epoch: tiny 5, others 1; full_dropout_epochs: tiny 8, "
                        "others 0, a budget of that many epochs or more starts dropout at "
                        "long_dropout_from_epoch: tiny 3, its rate raised by "
                        "dropout_per_epoch, tiny 0.02, for each epoch past "
                        "dropout_rises_after, tiny 10, up to 0.3); repeatable")


def _run_options(p, d: TrainConfig) -> None:
    """Where the run lives, how it continues, how often it logs and saves."""
    p.add_argument("--out", metavar="RUNDIR", help="run directory: BPE model, checkpoints, "
                   "logs (default: runs/<name of --data>-<config>, e.g. runs/ende-tiny)")
    p.add_argument("--resume", nargs="?", const=True, choices=[True, "auto"], metavar="auto",
                   help="continue exactly from RUNDIR/checkpoint_last.npz, with the run's own "
                        "options (options given here override them; --max-steps, "
                        "--max-minutes or --max-epochs replaces the run's budget whole); "
                        "'--resume auto': "
                        "continue if that checkpoint exists, else start a new run (one "
                        "command for the first job and every requeue)")
    p.add_argument("--init-from", metavar="RUNDIR|CHECKPOINT",
                   help="start a new run from another run's weights (fine-tuning): the same "
                        "model shape, and its BPE model (copied into RUNDIR)")
    p.add_argument("--log-interval", type=int, default=d.log_interval, metavar="N",
                   help=f"steps per log line (default: {d.log_interval})")
    p.add_argument("--save-interval", type=int, metavar="N", help="steps between checkpoints")
    p.add_argument("--valid-interval", type=int, metavar="N",
                   help="steps between validations (default: the save interval)")
    p.add_argument("--keep-last", type=int, default=d.keep_last, metavar="K",
                   help=f"numbered checkpoints kept, 0 for all (default: {d.keep_last})")
    p.add_argument("--valid-samples", type=int, default=d.valid_samples, metavar="K",
                   help=f"translations logged at every validation (default: {d.valid_samples})")


def _device_options(p, d: TrainConfig) -> None:
    """NumPy or CuPy, and the arithmetic."""
    p.add_argument("--device", choices=["cpu", "gpu"], default=device_default(),
                   help="NumPy or CuPy; a resumed run keeps its own unless this is given "
                        "(default: $TINYTF_DEVICE or cpu)")
    p.add_argument("--precision", choices=["float32", "tf32", "bf16", "fp16"],
                   default=d.precision,
                   help="float32; tf32 (float32 products on TF32 tensor cores); bf16 or fp16 "
                        "(16-bit products, float32 master weights; fp16 with dynamic loss "
                        "scaling). On the CPU bf16 is emulated (right numerics, no speed-up) "
                        "and fp16 runs NumPy's float16, which has no BLAS: about 80x slower "
                        f"than float32, for checking fp16's numerics (default: {d.precision})")
    p.add_argument("--cuda-graph", action="store_true",
                   help="with --device gpu: replay each step's forward and backward as a CUDA "
                        "graph, one per padded batch shape (no launch cost per op; batches "
                        "padded to lengths in multiples of 8)")


def build_parser() -> argparse.ArgumentParser:
    """The command line, in groups; options without a default here are filled in per
    preset (``TrainConfig.resolved``)."""
    d = TrainConfig()
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter)
    for title, add in (("data", _data_options), ("batches and budget", _budget_options),
                       ("optimizer and schedule", _optimizer_options),
                       ("run directory", _run_options), ("device", _device_options)):
        add(p.add_argument_group(title), d)
    options = vars(p.parse_args([]))    # every option's TrainConfig name, at its default
    p.epilog = ("Without --max-steps, --max-minutes or --max-epochs, training stops after 10 "
                "minutes.\n"
                "Per-preset defaults:\n" + preset_defaults_text(options)
                + "See docs/training.md.")
    return p


def given_options(argv) -> set:
    """The TrainConfig names of the options that ``argv`` sets explicitly."""
    parser, unset = build_parser(), object()
    parser.set_defaults(**{name: unset for name in vars(parser.parse_args([])) if name != "set"})
    given = {k for k, v in vars(parser.parse_args(argv)).items() if v is not unset}
    return given - {"set", "resume"}


def config_from_args(args, given=frozenset()) -> TrainConfig:
    """TrainConfig from parsed arguments, with --set applied and every value checked; with
    --resume, the run's stored options with the ``given`` ones on top."""
    cfg = TrainConfig(**{key: getattr(args, key) for key in FLAGS})   # each flag's option
    if args.resume:
        return resumed_config(cfg, given, args.set).resolved()
    return apply_overrides(cfg, args.set).resolved()


def _prog() -> str:
    """The program's name for messages: ``train.py`` or ``tinytf-train``, as it was called."""
    return os.path.basename(sys.argv[0]) or "train.py"


def _gpu_of_a_resumed_run(comm) -> None:
    """A run resumed without ``--device gpu`` that trains on the GPU (its checkpoint's
    device): the check that ``--device gpu`` has before any work, and under mpirun each
    rank's own GPU, which ``distributed.init`` chose only where ``--device gpu`` or
    ``TINYTF_DEVICE=gpu`` said so (else every rank would train on the node's first GPU)."""
    problem = backend.gpu_unusable()
    if problem is not None:
        raise TrainError(f"--device gpu (the resumed run's) {problem}")
    os.environ["TINYTF_DEVICE"] = "gpu"
    if comm.size > 1:
        comm.select_gpu()


def main(argv=None) -> int:
    """Run the command line; returns the exit status (0 done, 1 a worker process killed,
    2 usage or data error, 128 + N stopped by signal N with its checkpoint, or before the
    first update)."""
    start_process()
    args = build_parser().parse_args(argv)
    given = given_options(sys.argv[1:] if argv is None else argv)
    if args.device == "gpu":  # read by tinytf.engine.backend and by distributed.init (GPU choice)
        problem = backend.gpu_unusable()    # before mpirun's ranks choose their GPUs
        if problem is not None:
            print(f"{_prog()}: error: --device gpu {problem}", file=sys.stderr)
            return 2
        os.environ["TINYTF_DEVICE"] = "gpu"
    comm = distributed.init()
    with comm.guard():
        try:
            cfg = config_from_args(args, given)
            if cfg.device == "gpu" and args.device != "gpu":
                _gpu_of_a_resumed_run(comm)
            summary = train(cfg, comm=comm, process_exits=True)
        except USER_ERRORS as e:
            if comm.size > 1:
                comm.abort(f"{_prog()}: error: {e}", code=2)
            print(f"{_prog()}: error: {e}", file=sys.stderr)
            return 2
        except WorkerError as e:        # killed (out of memory?); what is written is whole
            if comm.size > 1:
                comm.abort(f"{_prog()}: error: {e}", code=1)
            print(f"{_prog()}: error: {e}", file=sys.stderr)
            return 1
        except KeyboardInterrupt:
            # Ctrl-C before the first update or after the last one: the stop signals are
            # the run's own from the first update to the summary (tinytf.training.signals).
            if comm.size > 1:
                raise                   # comm.guard() ends every rank
            print(f"{_prog()}: interrupted; no update to save", file=sys.stderr)
            return 128 + signal.SIGINT
        except StopRequested as stop:   # SIGTERM or SIGUSR1 while the run started
            if comm.size > 1:
                raise
            number = stop.args[0]
            print(f"{_prog()}: stopped by {signal_words(number)} before the first update; no "
                  "update to save", file=sys.stderr)
            return 128 + number
        if comm.is_root:
            try:
                print(json.dumps(summary, sort_keys=True), flush=True)
            except BrokenPipeError:     # its reader went away; RUNDIR/summary.json has it
                drop_stdout()
    if summary["stopped"] == "signal":   # the requeue's cue: 128 + the signal's number
        return 128 + (summary.get("signal") or signal.SIGTERM)
    return 0


if __name__ == "__main__":
    sys.exit(main())
