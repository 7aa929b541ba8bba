#!/usr/bin/env python
"""Equal steps, equal losses: tinytf's trainer against the PyTorch reference, update by update.

Both start from the same weights (tinytf's initialisation, copied into PyTorch), read the same
token batches in the same order, use the same schedule, the same optimizer (``--optimizer``:
RAdam by default, the tiny preset's, or the paper's Adam(0.9, 0.98, 1e-9)) and label
smoothing, with dropout off (the one source of randomness the two cannot share). Any gap in
the losses is then the frameworks' arithmetic: float32 rounding, which grows slowly as the
trajectories separate. Prints the mean loss of each framework over windows of updates and the
largest relative gap.

    python bench/train_parity.py --steps 300
    python bench/train_parity.py --steps 300 \
        --args "--max-tokens 4096 --lr-schedule noam --lr-factor 1 --warmup 1000"
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--window", type=int, default=50)
    p.add_argument("--args", default="--max-tokens 2048 --lr-schedule linear --lr 2e-3 "
                                     "--warmup 100 --vocab-size 4000",
                   help="recipe options understood by both train.py and torch_train.py")
    p.add_argument("--optimizer", choices=["adam", "radam"], default="radam",
                   help="given to both (default: radam, the tiny preset's; train.py's default "
                        "depends on the preset, torch_train.py's is adam)")
    p.add_argument("--pre-norm", action="store_true")
    p.add_argument("--qk-norm", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args(argv)
    base = args.out or tempfile.mkdtemp(prefix="tinytf-parity-")
    recipe = shlex.split(args.args) + ["--optimizer", args.optimizer]
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", MKL_NUM_THREADS="1")
    tt_out, torch_out = os.path.join(base, "tinytf"), os.path.join(base, "torch")
    os.makedirs(torch_out, exist_ok=True)
    dropout = ["dropout=0", "attention_dropout=0", "relu_dropout=0"]
    tt = [sys.executable, "train.py", "--out", tt_out, "--max-steps", str(args.steps),
          "--log-interval", "1", "--save-interval-updates", str(10 * args.steps), "--set",
          "test_bleu=false", "--set", "valid_bleu_sentences=1", *recipe]
    for item in dropout + [f"pre_norm={str(args.pre_norm).lower()}",
                           f"qk_norm={str(args.qk_norm).lower()}"]:
        tt += ["--set", item]
    ref = [sys.executable, "bench/torch_train.py", "--out", torch_out, "--max-steps",
           str(args.steps), "--dropout", "0", "--log-losses", "--no-test", "--threads", "1",
           *recipe] + (["--pre-norm"] if args.pre_norm else []) + (
               ["--qk-norm"] if args.qk_norm else [])
    procs = [subprocess.Popen(c, cwd=ROOT, env=env, stdout=subprocess.DEVNULL,
                              stderr=open(os.path.join(base, name + ".log"), "w"))
             for name, c in (("tinytf", tt), ("torch", ref))]
    if any(proc.wait() for proc in procs):
        raise SystemExit(f"train_parity.py: a run failed; logs in {base}")
    with open(os.path.join(tt_out, "log.jsonl")) as f:
        tt_losses = [r["loss"] for r in map(json.loads, f) if "loss" in r]
    with open(os.path.join(torch_out, "losses.json")) as f:
        torch_losses = json.load(f)
    n = min(len(tt_losses), len(torch_losses))
    print(f"{'updates':>9} {'tinytf':>8} {'torch':>8} {'rel. gap':>9}")
    worst = 0.0
    for start in range(0, n, args.window):
        a = sum(tt_losses[start:start + args.window]) / len(tt_losses[start:start + args.window])
        b = sum(torch_losses[start:start + args.window]) / len(
            torch_losses[start:start + args.window])
        worst = max(worst, abs(a - b) / b)
        print(f"{start + 1:4d}-{min(start + args.window, n):<4d} {a:8.4f} {b:8.4f} "
              f"{abs(a - b) / b:9.2e}")
    first = abs(tt_losses[0] - torch_losses[0]) / torch_losses[0]
    print(f"update 1: {tt_losses[0]:.6f} vs {torch_losses[0]:.6f} (rel. {first:.1e}); "
          f"largest window gap {worst:.2e} over {n} updates; runs in {base}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
