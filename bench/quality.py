#!/usr/bin/env python
"""BLEU per CPU-minute: tinytf's default recipe against the PyTorch reference, in one run.

For each budget in ``--minutes`` it trains

* **tinytf**: ``train.py`` with its defaults for ``--preset`` (the recipe a user gets), plus
  any ``--tinytf-args``;
* **torch**: ``bench/torch_train.py``, the same architecture in PyTorch with the paper's
  recipe (noam schedule, factor 1, warmup 1000, 4096-token batches, 8k BPE), plus any
  ``--torch-args``; or, with ``--torch-recipe tinytf`` (which needs ``--sequential``), the
  recipe that tinytf's run of the same budget trained with: its resolved options, the batch
  it fitted and the dropout it chose (:func:`mirrored_torch_args`);

for the same wall-clock budget on the same data, then prints dev BLEU (greedy) and test BLEU
(greedy and beam 4, both decoded by tinytf) side by side. By default the two run at the same
time, one thread each (``--parallel``, the fair split of a 2-core machine: both see the same
load); ``--sequential`` runs them one after the other with every core.

    python bench/quality.py --minutes 10 25
    python bench/quality.py --minutes 10 --tinytf-args "--warmup 1000" --seeds 1 2
    python bench/quality.py --minutes 10 --sequential --torch-recipe tinytf
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


def command(framework, minutes, out, seed, extra):
    """The command line that trains one framework for ``minutes``."""
    if framework == "tinytf":
        return [sys.executable, os.path.join(ROOT, "train.py"), "--out", out, "--max-minutes",
                str(minutes), "--seed", str(seed), *extra]
    return [sys.executable, os.path.join(ROOT, "bench", "torch_train.py"), "--out", out,
            "--max-minutes", str(minutes), "--seed", str(seed), *extra]


def mirrored_torch_args(run_dir) -> list:
    """torch_train.py options that train what tinytf's finished run in ``run_dir`` trained:
    its resolved options (``config.json``), the batch it fitted and the dropout it chose
    (``summary.json``). Runs with several batches per update, clipping or other ``--set``
    keys cannot be mirrored."""
    with open(os.path.join(run_dir, "config.json")) as f:
        options = json.load(f)["options"]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    unmirrored = set(options["model_overrides"]) - {"pre_norm", "qk_norm", "dropout"}
    if options["update_freq"] != 1 or options["clip_norm"] or unmirrored:
        raise SystemExit(f"quality.py: torch_train.py cannot mirror the run in {run_dir} "
                         "(--update-freq, --clip-norm or a --set key other than pre_norm, "
                         "qk_norm and dropout)")
    if ROOT not in sys.path:
        sys.path.insert(0, ROOT)
    from tinytf.models.transformer import TransformerConfig
    model = TransformerConfig.preset(options["config"], **options["model_overrides"])
    args = ["--config", options["config"], "--vocab-size", str(options["vocab_size"]),
            "--max-tokens", str(summary["max_tokens"]), "--lr-schedule", options["lr_schedule"],
            "--warmup", str(options["warmup"]), "--optimizer", options["optimizer"],
            "--dropout", str(summary["dropout"]),
            "--dropout-from-epoch", str(summary["dropout_from_epoch"])]
    if options["lr_schedule"] == "noam":
        args += ["--lr-factor", str(options["lr_factor"])]
    else:
        args += ["--lr", str(options["lr"])]
    return args + ["--pre-norm"] * model.pre_norm + ["--qk-norm"] * model.qk_norm


def run_all(jobs, threads, parallel):
    """Run ``jobs`` ([(name, argv, log path)]) and return {name: summary dict}."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OPENBLAS_NUM_THREADS=str(threads),
               MKL_NUM_THREADS=str(threads))
    results, running = {}, []
    for name, argv, log in jobs:
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                                stderr=open(log, "w"), text=True)
        running.append((name, proc, log))
        if not parallel:
            results.update(_collect([running.pop()]))
    results.update(_collect(running))
    return results


def _collect(running):
    results = {}
    for name, proc, log in running:
        out, _ = proc.communicate()
        if proc.returncode != 0:
            raise SystemExit(f"quality.py: {name} failed (exit {proc.returncode}); see {log}")
        results[name] = json.loads(out.strip().splitlines()[-1])
    return results


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, nargs="+", default=[10.0])
    p.add_argument("--seeds", type=int, nargs="+", default=[1])
    p.add_argument("--tinytf-args", default="", help="extra train.py options (one string)")
    p.add_argument("--torch-args", default="", help="extra torch_train.py options")
    p.add_argument("--frameworks", nargs="+", default=["tinytf", "torch"])
    p.add_argument("--torch-recipe", choices=["paper", "tinytf"], default="paper",
                   help="paper: torch_train.py's defaults (the paper's recipe); tinytf: the "
                        "recipe of tinytf's run of the same budget (needs --sequential)")
    p.add_argument("--out", default=None,
                   help="folder for the runs, created if missing; each run's folder in it must "
                        "not hold a run yet (default: a temporary folder)")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--parallel", dest="parallel", action="store_true", default=True,
                      help="run the frameworks at the same time, one thread each (default)")
    mode.add_argument("--sequential", dest="parallel", action="store_false",
                      help="one after the other, every core each")
    args = p.parse_args(argv)
    mirror = args.torch_recipe == "tinytf"
    if mirror and (args.parallel or args.frameworks != ["tinytf", "torch"]):
        p.error("--torch-recipe tinytf needs --sequential and --frameworks tinytf torch")
    base = args.out or tempfile.mkdtemp(prefix="tinytf-quality-")
    os.makedirs(base, exist_ok=True)
    threads = 1 if args.parallel else (os.cpu_count() or 1)
    extra = {"tinytf": shlex.split(args.tinytf_args), "torch": shlex.split(args.torch_args)}
    rows = []

    def job(fw, minutes, seed):
        """(name, argv, log) of one framework's run of this budget."""
        out = os.path.join(base, f"{fw}-{minutes:g}min-seed{seed}")
        options = extra[fw]
        if fw == "torch" and mirror:   # tinytf's run of this budget has finished
            tinytf_run = os.path.join(base, f"tinytf-{minutes:g}min-seed{seed}")
            options = mirrored_torch_args(tinytf_run) + options
        return fw, command(fw, minutes, out, seed, options), out + ".log"

    for minutes in args.minutes:
        for seed in args.seeds:
            if args.parallel:
                results = run_all([job(fw, minutes, seed) for fw in args.frameworks],
                                  threads, True)
            else:   # one at a time, each job made when the one before it has finished
                results = {}
                for fw in args.frameworks:
                    results.update(run_all([job(fw, minutes, seed)], threads, False))
            for fw, result in results.items():
                rows.append((minutes, seed, fw, result))
                print(json.dumps({"minutes": minutes, "seed": seed, "framework": fw,
                                  **{k: v for k, v in result.items() if k != "recipe"}},
                                 sort_keys=True), flush=True)
    print(f"\nruns in {base}; {'parallel, 1 thread each' if args.parallel else 'sequential'}")
    print(f"{'minutes':>7} {'seed':>4} {'framework':>9} {'updates':>7} {'tok/s':>7} "
          f"{'dev BLEU':>8} {'test greedy':>11} {'test beam4':>10}")
    for minutes, seed, fw, r in rows:
        print(f"{minutes:7g} {seed:4d} {fw:>9} {r['steps']:7d} {r['target_tokens_per_s']:7.0f} "
              f"{r.get('dev_bleu', float('nan')):8.2f} "
              f"{r.get('test_bleu_greedy', float('nan')):11.2f} "
              f"{r.get('test_bleu_beam', float('nan')):10.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
