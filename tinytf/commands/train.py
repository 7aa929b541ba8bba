"""Train a Transformer (Vaswani et al. 2017) on parallel text.

A thin shell over :func:`tinytf.training.run.train`:

    python train.py                        # tiny preset, shipped en->de corpus, ~10 min on a CPU
    python train.py --train corpus.en corpus.de --valid dev.en dev.de --out RUNDIR
    python train.py --data DIR --src en --tgt de --out RUNDIR --preset base --max-steps 100000
    python train.py --config RUNDIR/config.json --out RUNDIR2   # an equal run, from a file
    python train.py --out RUNDIR --resume  # continue exactly where the run stopped
    python train.py ... --resume auto      # continue if RUNDIR has a checkpoint, else start
    mpirun -n 8 python train.py ...        # data-parallel over MPI ranks (docs/distributed.md)

Log lines go to stderr (and RUNDIR/train.log); stdout gets one JSON line summarising the run.
Exit status: 0 done, 1 internal error, 2 usage or data error, 128 + N stopped by signal N
(SIGINT 130, SIGUSR1 138, SIGTERM 143) after writing its checkpoint, or before the first
update with nothing to save. See docs/training.md.
"""
import argparse
import dataclasses
import json
import os
import signal
import sys
import textwrap

from tinytf.commands import add_file_pairs, device_default, start_process
from tinytf.data.batches import DataError
from tinytf.distributed import communicator as distributed
from tinytf.engine import backend
from tinytf.optim.schedule import SCHEDULES
from tinytf.text import BPEFileError
from tinytf.models.transformer import TransformerConfig
from tinytf.training.config import (
    FLAGS,
    OPTIMIZERS,
    TrainConfig,
    TrainError,
    apply_overrides,
    option_of,
    read_config_file,
)
from tinytf.training import recipes
from tinytf.training.run import train
from tinytf.training.run_dir import has_checkpoint, resumed_config
from tinytf.training.signals import StopRequested
from tinytf.utils.checkpoint import CheckpointError
from tinytf.utils.streams import drop_stdout
from tinytf.utils.workers import WorkerError, signal_words

USER_ERRORS = (TrainError, DataError, CheckpointError, BPEFileError)


def preset_defaults_text(options) -> str:
    """The per-preset training defaults as --help lines (from TrainConfig.PRESET_DEFAULTS),
    wrapped: ``--max-tokens 2048`` for a key with an option of its own (its name in
    ``options``), ``--set dropout_from_epoch=5`` for one without."""
    def flag(key, value):
        value = f"{value:g}" if isinstance(value, float) else value
        return (f"{option_of(key)} {value}" if key in options else f"--set {key}={value}")

    lines = []
    for name, defaults in TrainConfig.PRESET_DEFAULTS.items():
        label = "tiny" if name == "tiny" else "small, base, big"
        peak = TrainConfig(config="tiny" if name == "tiny" else "base").tuned_peak()
        flat = {k: v for k, v in defaults.items() if k != "recipe"}
        flat.update(defaults.get("recipe", {}))     # the recipe's options, set the same way
        text = " ".join(flag(k, v) for k, v in flat.items()) + \
            f" (peak lr {peak:.2e}{' for base' if name != 'tiny' else ''})"
        lines.append(textwrap.fill(text, 88, initial_indent=f"  {label + ':':18s}",
                                   subsequent_indent=" " * 20, break_on_hyphens=False))
    return "\n".join(lines) + "\n"


class Renamed(argparse.Action):
    """An option that was renamed because another tool's option of that name means
    something else: a usage error naming the new flag."""

    def __init__(self, option_strings, dest, new, why, **kwargs):
        self.new, self.why = new, why
        super().__init__(option_strings, dest, nargs="?", help=argparse.SUPPRESS, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        parser.error(f"{option_string} is now {self.new}: {self.why}")


def _data_options(p, d: TrainConfig) -> None:
    """The training data and its BPE."""
    add_file_pairs(p, " (raw text, one sentence per line)")
    p.add_argument("--data", default=d.data, metavar="DIR",
                   help="instead of the three: DIR/train.SRC, DIR/dev.SRC, ... "
                        f"(default: {d.data})")
    p.add_argument("--src", default=d.src, help=f"source suffix in --data (default: {d.src})")
    p.add_argument("--tgt", default=d.tgt, help=f"target suffix in --data (default: {d.tgt})")
    p.add_argument("--vocab-size", type=int, metavar="V",
                   help="joint BPE vocabulary, learnt when RUNDIR has none "
                        "(default: tiny 4000, others 8000)")
    p.add_argument("--workers", type=int, metavar="N",
                   help="processes that learn the BPE and encode the text (default: the CPUs)")


def _budget_options(p, d: TrainConfig) -> None:
    """What one update holds and when the run stops."""
    p.add_argument("--preset", dest="config", default=None, metavar="NAME",
                   help=f"model and recipe: tiny, small, base, big (default: {d.config})")
    p.add_argument("--config", dest="config_file", metavar="FILE",
                   help="options from a JSON or TOML file with the keys of a run's "
                        "config.json (flags given override it)")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="padded tokens per batch and side, per rank; kept as given "
                        "(default: the preset's, tiny 2048, others 4096)")
    p.add_argument("--budget-min-updates", dest="min_updates", type=int, metavar="N",
                   help="halve the preset's batch while --max-minutes holds fewer than N "
                        "updates (default: tiny 1500, others 0)")
    p.add_argument("--update-freq", type=int, default=d.update_freq, metavar="K",
                   help="batches accumulated into one update (default: 1)")
    p.add_argument("--max-steps", type=int, metavar="N",
                   help="stop after N updates, counting the whole run")
    p.add_argument("--max-minutes", type=float, metavar="M",
                   help="stop after M minutes of training (default without a budget: 10)")
    p.add_argument("--max-epochs", type=int, metavar="E",
                   help="stop after E passes over the training data")
    p.add_argument("--patience", type=int, default=d.patience, metavar="N",
                   help="stop after N validations without a better --best-metric (default: 0, "
                        "never)")
    p.add_argument("--best-metric", choices=["loss", "bleu"], default=d.best_metric,
                   help=f"the dev metric of checkpoint_best.npz (default: {d.best_metric})")
    p.add_argument("--min-updates", action=Renamed, new="--budget-min-updates",
                   why="it halves the batch under a time budget (Sockeye's --min-updates is "
                       "a minimum before stopping)")


def _optimizer_options(p, d: TrainConfig) -> None:
    """Adam or RAdam, the learning rate and its schedule."""
    p.add_argument("--optimizer", choices=OPTIMIZERS,
                   help="adam: Adam(0.9, 0.98, 1e-9); radam: with RAdam's rectifier "
                        "(default: the preset's)")
    p.add_argument("--lr-schedule", choices=SCHEDULES,
                   help="noam, inverse_sqrt or linear (docs/training.md; default: the preset's)")
    p.add_argument("--lr", type=float, metavar="PEAK",
                   help="peak learning rate (inverse_sqrt, linear; default: the preset's)")
    p.add_argument("--warmup", type=int, metavar="N",
                   help="warm-up updates of the schedule (default: 4000)")
    p.add_argument("--lr-factor", type=float, metavar="F",
                   help="factor of the paper's noam schedule (default: 1)")
    p.add_argument("--clip-norm", type=float, default=d.clip_norm, metavar="X",
                   help="clip the gradient norm to X (default: 0, no clipping)")
    p.add_argument("--seed", type=int, default=d.seed,
                   help=f"seed of the weights, dropout and batch order (default: {d.seed})")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="any other model or training key: dropout=0.3, pre_norm=true, "
                        "train_max_len=100, ... (docs/training.md lists them); repeatable")


def _run_options(p, d: TrainConfig) -> None:
    """Where the run lives, how it continues, how often it logs and saves."""
    p.add_argument("--out", metavar="RUNDIR",
                   help="run directory: BPE, checkpoints, logs (default: runs/<data>-<preset>)")
    p.add_argument("--resume", nargs="?", const=True, choices=[True, "auto"], metavar="auto",
                   help="continue RUNDIR's run exactly; 'auto': continue if it has a "
                        "checkpoint, else start (docs/checkpoints.md)")
    p.add_argument("--init-from", metavar="RUNDIR|CHECKPOINT",
                   help="start a new run from another run's weights and BPE (fine-tuning)")
    p.add_argument("--log-interval", type=int, default=d.log_interval, metavar="N",
                   help=f"updates per log line (default: {d.log_interval})")
    p.add_argument("--log-format", choices=("text", "json"), default=d.log_format,
                   help="progress on stderr as text lines or JSON objects (default: text)")
    p.add_argument("--tensorboard", metavar="DIR",
                   help="also write the curves as TensorBoard scalars (needs tensorboardX)")
    p.add_argument("--save-interval-updates", dest="save_interval", type=int, metavar="N",
                   help="updates between checkpoints (default: tiny 200, others 1000)")
    p.add_argument("--validate-interval-updates", dest="valid_interval", type=int, metavar="N",
                   help="updates between validations (default: the save interval)")
    p.add_argument("--keep-last", type=int, default=d.keep_last, metavar="K",
                   help=f"numbered checkpoints kept, 0 for all (default: {d.keep_last})")
    p.add_argument("--valid-samples", type=int, default=d.valid_samples, metavar="K",
                   help=f"translations logged at every validation (default: {d.valid_samples})")
    p.add_argument("--save-interval", action=Renamed, new="--save-interval-updates",
                   why="it counts updates (fairseq's --save-interval counts epochs)")
    p.add_argument("--valid-interval", action=Renamed, new="--validate-interval-updates",
                   why="it counts updates, as fairseq's --validate-interval-updates")


def _device_options(p, d: TrainConfig) -> None:
    """NumPy or CuPy, and the arithmetic."""
    p.add_argument("--device", choices=["cpu", "gpu"], default=device_default(),
                   help="NumPy or CuPy; a resumed run keeps its own unless this is given "
                        "(default: $TINYTF_DEVICE or cpu)")
    p.add_argument("--precision", choices=["float32", "tf32", "bf16", "fp16"],
                   default=d.precision,
                   help="the products' arithmetic, float32 weights (docs/gpu.md; default: "
                        f"{d.precision})")
    p.add_argument("--cuda-graph", action="store_true",
                   help="with --device gpu: replay each step as a CUDA graph (docs/gpu.md)")


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
                "minutes.\nPer-preset defaults:\n" + preset_defaults_text(options)
                + "See docs/training.md and docs/your-data.md.")
    return p


def given_options(argv) -> set:
    """The TrainConfig names of the options that ``argv`` sets explicitly."""
    parser, unset = build_parser(), object()
    parser.set_defaults(**{name: unset for name in vars(parser.parse_args([])) if name != "set"})
    given = {k for k, v in vars(parser.parse_args(argv)).items() if v is not unset}
    return given - {"set", "resume", "config_file"}


def config_from_args(args, given=frozenset(), notice=None) -> TrainConfig:
    """TrainConfig from parsed arguments: the ``--config`` file's options, the flags
    ``given`` on top, then ``--set``, every value checked; with --resume, the run's stored
    options with the ``given`` ones on top. ``notice(text)`` hears of a preset name given
    to ``--config``."""
    values = {key: getattr(args, key) for key in FLAGS}    # each flag's option
    recipe_flags = {} if args.min_updates is None else {"min_updates": args.min_updates}
    if values["config"] is None:
        values["config"] = TrainConfig.config
    if "data" in given and {"train_files", "valid_files"} & set(given):
        raise TrainError("give --data DIR or --train/--valid files, not both")
    extra = {}
    if args.config_file:
        if args.config_file in TransformerConfig.PRESETS and not os.path.exists(args.config_file):
            if notice:
                notice(f"--config {args.config_file}: a preset name; --preset "
                       f"{args.config_file} is its flag (--config reads a JSON or TOML file)")
            if "config" not in given:
                values["config"] = args.config_file
        else:
            from_file = read_config_file(args.config_file)
            if "max_tokens" in given and "recipe_options" in from_file:
                from_file["recipe_options"] = recipes.for_new_run(   # the user's is kept
                    from_file["recipe_options"], users_batch=True)
            for key, value in from_file.items():
                if key not in given:
                    (values if key in values else extra)[key] = value
    extra["recipe_options"] = {**extra.get("recipe_options", {}), **recipe_flags}
    cfg = TrainConfig(**values, **extra)
    if args.resume:
        return resumed_config(cfg, given, args.set).resolved()
    return apply_overrides(cfg, args.set).resolved()


def fresh_default_out(cfg: TrainConfig, given, notice) -> TrainConfig:
    """A new run whose run directory was not named (``--out``) and whose default one already
    holds a run: the next free ``RUNDIR-2``, ``RUNDIR-3``, ..., and ``notice`` says which and
    what the old run holds (the README's main job run twice trains twice)."""
    if "out" in given or cfg.resume or not has_checkpoint(cfg.out):
        return cfg
    number = 2
    while os.path.exists(f"{cfg.out}-{number}"):
        number += 1
    summary = os.path.join(cfg.out, "summary.json")
    held = "a finished run (its result: " + summary + ")" if os.path.isfile(summary) \
        else "a run that did not finish (--out " + cfg.out + " --resume continues it)"
    if notice:
        notice(f"{cfg.out} holds {held}; this new run goes to {cfg.out}-{number}")
    return dataclasses.replace(cfg, out=f"{cfg.out}-{number}")


def _prog() -> str:
    """The program's name for messages: ``train.py`` or ``tinytf-train``, as it was called."""
    return os.path.basename(sys.argv[0]) or "train.py"


def _gpu_of_a_resumed_run(comm) -> None:
    """A run resumed without ``--device gpu`` that trains on the GPU (its checkpoint's
    device): the check that ``--device gpu`` has before any work, and under mpirun each
    rank's own GPU, which ``distributed.create_communicator`` chose only where ``--device gpu`` or
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
    if args.device == "gpu":  # read by engine.backend and distributed.create_communicator
        problem = backend.gpu_unusable()    # before mpirun's ranks choose their GPUs
        if problem is not None:
            print(f"{_prog()}: error: --device gpu {problem}", file=sys.stderr)
            return 2
        os.environ["TINYTF_DEVICE"] = "gpu"
    comm = distributed.create_communicator()
    with comm.guard():
        try:
            notice = (lambda text: print(f"{_prog()}: {text}", file=sys.stderr)) \
                if comm.is_root else None
            cfg = config_from_args(args, given, notice=notice)
            out = comm.broadcast_object(fresh_default_out(cfg, given, notice).out
                                        if comm.is_root else None)   # rank 0's choice
            cfg = dataclasses.replace(cfg, out=out)
            if cfg.device == "gpu" and args.device != "gpu":
                _gpu_of_a_resumed_run(comm)
            summary = train(cfg, comm=comm, log_stream=sys.stderr, process_exits=True)
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
