"""Average the parameters of the last K checkpoints of a run, as the paper does (section 6.1:
the last 5 checkpoints, written at 10-minute intervals, for the base model; 20 for big).

    tinytf-average --inputs RUNDIR --num 5 --output RUNDIR/averaged.npz
    tinytf-average --inputs a.npz b.npz c.npz --output avg.npz

The output is an ordinary tinytf checkpoint (model parameters, config and BPE reference, no
optimizer state) that translate.py reads like any other; it may not replace a checkpoint it
averages nor take the name of a run's own checkpoints. translate.py --average K does the same
on the fly.
"""
import argparse
import os
import sys

from tinytf.utils import checkpoint
from tinytf.commands import start_process


def refuse_overwriting(output, paths) -> None:
    """CheckpointError if ``output`` would replace one of the checkpoints averaged
    (``paths``) or take a name that a run gives its own checkpoints (checkpoint_last.npz,
    checkpoint_best.npz, checkpoint_N.npz): the average has no optimizer or data state,
    and in a run directory --resume, translate.py --model and --average read those names."""
    for path in paths:
        if os.path.exists(output) and os.path.samefile(output, path):
            raise checkpoint.CheckpointError(
                f"--output {output} is one of the checkpoints averaged; name another file "
                "(e.g. RUNDIR/averaged.npz)")
    name = os.path.basename(output)
    if name in (checkpoint.LAST, checkpoint.BEST) or checkpoint.step_of(name) is not None:
        raise checkpoint.CheckpointError(
            f"--output {output}: {name} is the name of a run's own checkpoints, which "
            "--resume and translate.py read; name the average otherwise (e.g. "
            "RUNDIR/averaged.npz)")


def build_parser() -> argparse.ArgumentParser:
    """The command line (``tinytf-average --help``)."""
    p = argparse.ArgumentParser(prog="tinytf-average", description=__doc__.split("\n\n")[0])
    p.add_argument("--inputs", nargs="+", required=True,
                   help="a run directory (its numbered checkpoints) or checkpoint files")
    p.add_argument("--num", type=int, default=5,
                   help="with a run directory: average its last NUM numbered checkpoints "
                        "(default: 5)")
    p.add_argument("--output", required=True, help="where to write the averaged checkpoint")
    return p


def main(argv=None) -> int:
    """Run the command line; returns the exit status (0 done, 2 a checkpoint error)."""
    start_process()
    p = build_parser()
    args = p.parse_args(argv)
    if args.num < 1:
        p.error(f"--num must be at least 1, got {args.num}")
    try:
        if len(args.inputs) == 1 and os.path.isdir(args.inputs[0]):
            paths = checkpoint.list_checkpoints(args.inputs[0])
            if len(paths) < args.num:
                raise checkpoint.CheckpointError(
                    f"{args.inputs[0]}: --num {args.num} asks for {args.num} numbered "
                    f"checkpoints, found {len(paths)}")
            paths = paths[-args.num:]
        else:
            paths = args.inputs
        refuse_overwriting(args.output, paths)    # before any is read
        averaged = checkpoint.average(paths)
        meta = dict(averaged.meta)
        bpe = meta.get("bpe") or {}
        if bpe.get("file") and not os.path.isabs(bpe["file"]):
            # The BPE file is recorded relative to the run directory; keep it findable from
            # wherever the output goes.
            source_dir = os.path.dirname(os.path.abspath(paths[-1]))
            out_dir = os.path.dirname(os.path.abspath(args.output))
            if source_dir != out_dir:
                meta["bpe"] = dict(bpe, file=os.path.join(source_dir, bpe["file"]))
        checkpoint.save(args.output, averaged.model, meta=meta)
    except checkpoint.CheckpointError as e:
        print(f"tinytf-average: error: {e}", file=sys.stderr)
        return 2
    print(f"averaged {len(paths)} checkpoints ({', '.join(os.path.basename(p) for p in paths)})"
          f" into {args.output}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
