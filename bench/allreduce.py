"""Data-parallel cost: time in the gradient all-reduce, 1 -> 2 rank scaling, 8-GPU arithmetic.

    python bench/allreduce.py [--preset tiny] [--tokens 600] [--steps 5] [--repeats 2]
                              [--json out.json]

Launches itself under ``mpirun -n 1`` and ``mpirun -n 2``, alternately, ``--repeats`` times
each (``distributed.mpirun_command``; one BLAS thread per rank so that two ranks do not
fight over the cores; the best run of each counts) and reports:

1. ``allreduce_grads`` on gradients shaped like the ``base`` model (bytes per call, ms),
   packed into buckets and in place in Adam's flat buffer;
2. full training steps of ``--preset`` with ``--tokens`` target tokens per rank (weak
   scaling: two ranks process twice the tokens per step): step time, the part of it spent
   in the all-reduce, global tokens/s, and the efficiency
   eff = throughput(2 ranks) / (2 * throughput(1 rank));
3. the arithmetic for 8 GPUs: a ring all-reduce sends and receives 2 (n - 1) / n times
   the gradient bytes per GPU per step, so t = 2 (n - 1) / n * bytes / bus_bandwidth.

Figures and the machine they came from go to docs/benchmarks.md.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

import tinytf  # noqa: E402
from tinytf import optim
from tinytf.distributed import communicator as distributed  # noqa: E402
from tinytf.models.transformer import Transformer, TransformerConfig, label_smoothed_loss  # noqa: E402

# Bus bandwidths (GB/s) for the 8-GPU arithmetic: typical NCCL all-reduce "busbw" figures,
# stated as assumptions, not measured here (this machine has no GPU).
LINKS = {"NVLink 4 / NVSwitch (H100 SXM)": 360.0, "NVLink 3 (A100 SXM)": 230.0,
         "PCIe 4.0 x16, no NVLink": 20.0, "PCIe 3.0 x16 (the paper's P100s)": 10.0}
PAPER_BASE_STEP_S = 12 * 3600 / 100_000   # 100k steps in 12 hours on 8 P100 (section 5.2)


def fake_batch(rng, vocab: int, tokens: int, length: int = 20):
    """Random (src, tgt) with about ``tokens`` target tokens in rows of ``length``."""
    rows = max(1, tokens // length)
    src = rng.integers(4, vocab, (rows, length))
    tgt = rng.integers(4, vocab, (rows, length + 1))
    return src, tgt


def median_ms(comm, call, reps: int) -> float:
    """Median milliseconds of ``reps`` calls of ``call``, the ranks lined up before each."""
    times = []
    for _ in range(reps):
        comm.barrier()
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return 1e3 * float(np.median(times))


def worker(args) -> dict:
    """Run under mpirun: time the all-reduce and the training step on this communicator."""
    comm = distributed.create_communicator()
    out = {"ranks": comm.size, "root": comm.is_root}

    # 1. The base model's gradients, all-reduced alone.
    tinytf.manual_seed(0)
    base = Transformer(TransformerConfig.preset("base"))
    for _, p in base.named_parameters():
        p.grad = np.ones(p.shape, dtype=np.float32)
    comm.allreduce_grads(base)                      # warm-up: plans, buffers, connections
    out["base_params"] = base.num_parameters()
    reduce_base = functools.partial(comm.allreduce_grads, base)
    out["base_allreduce_ms"] = median_ms(comm, reduce_base, args.reduce_reps)
    # The same gradients in Adam's flat buffer (what train.py has): summed in place.
    optim.Adam(base.named_parameters(), lr=0.0).step()   # builds the flat buffers
    comm.allreduce_grads(base)
    out["base_flat_allreduce_ms"] = median_ms(comm, reduce_base, args.reduce_reps)
    if comm.size > 1:  # the MPI call alone on one buffer of the same size
        from mpi4py import MPI  # noqa: PLC0415
        flat = np.ones(base.num_parameters(), dtype=np.float32)
        out["base_mpi_only_ms"] = median_ms(
            comm, functools.partial(comm.comm.Allreduce, MPI.IN_PLACE, flat, op=MPI.SUM),
            args.reduce_reps)
        del flat
    out["base_bytes"] = comm._plan(base.named_parameters()).nbytes if comm.size > 1 else \
        4 * base.num_parameters()
    del base, reduce_base

    # 2. Training steps of the benchmark preset, each rank on its own tokens.
    tinytf.manual_seed(0)
    cfg = TransformerConfig.preset(args.preset, dropout=0.0)
    model = Transformer(cfg)
    comm.broadcast_params(model)
    opt = optim.Adam(model.named_parameters(), lr=1e-4)
    rng = np.random.default_rng(1 + comm.rank)
    step_times, reduce_times, tokens_done = [], [], 0
    for step in range(args.warmup + args.steps):
        src, tgt = fake_batch(rng, cfg.vocab_size, args.tokens)
        comm.barrier()
        start, reduce_before = time.perf_counter(), comm.allreduce_seconds
        opt.zero_grad()
        loss, tokens = label_smoothed_loss(model(src, tgt[:, :-1]), tgt[:, 1:])
        loss.backward()
        total = comm.allreduce_scalars([tokens])[0]
        comm.allreduce_grads(model, scale=1.0 / total)
        optim.clip_grad_norm(model.named_parameters(), 1.0)
        opt.step()
        comm.barrier()
        if step >= args.warmup:
            step_times.append(time.perf_counter() - start)
            reduce_times.append(comm.allreduce_seconds - reduce_before)
            tokens_done += int(total)
    out.update(preset=args.preset, params=model.num_parameters(),
               tokens_per_rank=int(tokens), step_s=float(np.median(step_times)),
               allreduce_s=float(np.median(reduce_times)),
               tokens_per_s=tokens_done / float(np.sum(step_times)))
    return out


def launch(n: int, args) -> dict:
    """Run this file's worker on ``n`` ranks and return rank 0's JSON line (+ the load)."""
    load = os.getloadavg()[0]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    argv = [sys.executable, os.path.abspath(__file__), "--worker", "--preset", args.preset,
            "--tokens", str(args.tokens), "--steps", str(args.steps),
            "--warmup", str(args.warmup), "--reduce-reps", str(args.reduce_reps)]
    proc = subprocess.run(distributed.mpirun_command(n, argv), env=env, capture_output=True,
                          text=True, timeout=1800)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        sys.exit(f"allreduce.py: mpirun -n {n} failed ({proc.returncode}):\n"
                 f"{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    return dict(json.loads(lines[-1]), load=load)


def ring_ms(nbytes: int, n: int, gbps: float) -> float:
    """Milliseconds for a ring all-reduce of ``nbytes`` over ``n`` GPUs at ``gbps`` GB/s."""
    return 1e3 * 2 * (n - 1) / n * nbytes / (gbps * 1e9)


def report(one: dict, two: dict) -> str:
    """The markdown figures for docs/benchmarks.md."""
    eff = two["tokens_per_s"] / (2 * one["tokens_per_s"])
    mb = two["base_bytes"] / 1e6
    busbw = 2 * (2 - 1) / 2 * two["base_bytes"] / (two["base_allreduce_ms"] / 1e3) / 1e9
    lines = [
        f"All-reduce of the base model's gradients ({two['base_params']:,} parameters, "
        f"{mb:.1f} MB of float32 per rank per step), 2 ranks: packed into buckets "
        f"{two['base_allreduce_ms']:.0f} ms (bus bandwidth {busbw:.2f} GB/s), in place in "
        f"Adam's flat buffer {two['base_flat_allreduce_ms']:.0f} ms, MPI's Allreduce alone "
        f"on one buffer of that size {two['base_mpi_only_ms']:.0f} ms; each "
        f"rank sends and receives "
        f"2(n-1)/n x {mb:.0f} MB = {mb:.0f} MB at n = 2, {1.75 * mb:.0f} MB at n = 8.",
        "",
        f"Training steps, preset `{one['preset']}` ({one['params']:,} parameters), "
        f"{one['tokens_per_rank']} target tokens per rank per step:",
        "",
        "| ranks | step (s) | in all-reduce (s) | global tokens/s |",
        "| --- | --- | --- | --- |",
    ]
    for r in (one, two):
        lines.append(f"| {r['ranks']} | {r['step_s']:.3f} | {r['allreduce_s']:.3f} | "
                     f"{r['tokens_per_s']:.0f} |")
    lines += ["", f"Scaling efficiency 1 -> 2 ranks: {eff:.0%} (1-minute load average "
              f"{one['load']:.1f} and {two['load']:.1f} at the start of the two runs, on "
              f"{os.cpu_count()} cores).", "",
              f"8 GPUs, base model, ring all-reduce of {mb:.0f} MB "
              f"(2 x 7/8 x {mb:.0f} = {1.75 * mb:.0f} MB per GPU per step), against the "
              f"paper's {PAPER_BASE_STEP_S:.2f} s step:", "",
              "| link (assumed bus bandwidth) | all-reduce (ms) | share of a 0.43 s step |",
              "| --- | --- | --- |"]
    for name, gbps in LINKS.items():
        t = ring_ms(two["base_bytes"], 8, gbps)
        lines.append(f"| {name}, {gbps:.0f} GB/s | {t:.1f} | "
                     f"{t / 1e3 / PAPER_BASE_STEP_S:.1%} |")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--tokens", type=int, default=600, help="target tokens per rank")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--reduce-reps", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=2, help="launches of each rank count")
    parser.add_argument("--json", help="also write the raw figures here")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        result = worker(args)
        if result.pop("root"):
            print(json.dumps(result), flush=True)
        return
    # Alternate 1 and 2 ranks and keep each one's best run: on a shared machine the load
    # changes from minute to minute, and the ratio of two unlucky runs means nothing.
    ones, twos = [], []
    for _ in range(args.repeats):
        ones.append(launch(1, args))
        twos.append(launch(2, args))
    one = max(ones, key=lambda r: r["tokens_per_s"])
    two = max(twos, key=lambda r: r["tokens_per_s"])
    for key in ("base_allreduce_ms", "base_flat_allreduce_ms", "base_mpi_only_ms"):
        two[key] = min(r[key] for r in twos)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"1": one, "2": two}, f, indent=1)
    print(report(one, two))


if __name__ == "__main__":
    main()
