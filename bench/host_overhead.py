"""The framework's own cost per training step: autograd nodes and host milliseconds.

    python bench/host_overhead.py [--steps 30] [--modes float32,bf16,fp16] [--json out.json]

On a GPU a bf16 step of ``base`` is bound by the host, not by the GPU (docs/gpu.md): every
autograd node costs Python time and every array operation in it a kernel launch. This
script measures that cost on the CPU, where it can be measured without a GPU: the paper's
``base`` *structure* (6 + 6 layers, 8 heads, fused projections, shared embeddings, dropout
0.1, label smoothing) at a width so small (d_model 64, d_ff 128, 256-word vocabulary,
4 x 8 tokens) that the arithmetic is negligible and the step time is the framework's:
building the graph, the engine, the ops' Python and NumPy call overhead, Adam.

Reported per precision: autograd nodes of one step (by op), and the median step time.
bf16 on NumPy is emulated (float32 arrays rounded to bf16 at the casts), so its node
count is the GPU's, and its time is the GPU's host work without the launches. Figures
in docs/benchmarks.md ("Host overhead per step").
"""
from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from tinytf import functional as F  # noqa: E402
from tinytf import manual_seed
from tinytf.engine.tensor import _topological_order  # noqa: E402
from tinytf.fast import adam  # noqa: E402
from tinytf.fast.loss_scaler import DynamicLossScaler  # noqa: E402
from tinytf.models.transformer import Transformer, TransformerConfig  # noqa: E402
from tinytf.nn import amp  # noqa: E402


def build(seed: int = 0):
    """The base structure at negligible width, an Adam and one fixed batch."""
    manual_seed(seed)
    cfg = TransformerConfig.preset("base", d_model=64, n_heads=8, d_ff=128, vocab_size=256)
    model = Transformer(cfg).train()
    opt = adam(model.named_parameters(), lr=1e-4)
    g = np.random.default_rng(seed)
    src = g.integers(4, cfg.vocab_size, (4, 8))
    tgt = g.integers(4, cfg.vocab_size, (4, 9))
    return cfg, model, opt, (src, tgt[:, :-1], tgt[:, 1:])


def loss_of(model, cfg, batch):
    """The summed label-smoothed loss of ``batch``."""
    src, tgt_in, tgt_out = batch
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tgt_out.reshape(-1),
                           label_smoothing=cfg.label_smoothing, ignore_index=0,
                           reduction="sum")


def node_counts(mode: str) -> collections.Counter:
    """Autograd nodes of one step's graph under ``mode``, by op class."""
    cfg, model, _, batch = build()
    with amp.autocast(mode):
        loss = loss_of(model, cfg, batch)
    seen, counts = set(), collections.Counter()
    for t in _topological_order(loss):
        if t._ctx is not None and id(t._ctx) not in seen:   # a Split node has several outputs
            seen.add(id(t._ctx))
            counts[type(t._ctx).__name__] += 1
    return counts


def step_times(mode: str, steps: int, warmup: int = 5) -> list:
    """Seconds of each of ``steps`` whole training steps (forward, backward, Adam)."""
    cfg, model, opt, batch = build()
    scaler = DynamicLossScaler(enabled=amp.Policy(mode).loss_scaling)
    times = []
    for i in range(warmup + steps):
        t0 = time.perf_counter()
        with amp.autocast(mode):
            loss = loss_of(model, cfg, batch)
            scaler.scale_loss(loss).backward()
        scaler.step(opt, extra_factor=1.0 / batch[2].size)
        opt.zero_grad()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    return times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--modes", default="float32,bf16")
    ap.add_argument("--json", help="write the figures here as JSON")
    args = ap.parse_args(argv)
    results = {}
    for mode in args.modes.split(","):
        counts = node_counts(mode)
        times = step_times(mode, args.steps)
        results[mode] = {"nodes": sum(counts.values()), "by_op": dict(counts.most_common()),
                         "median_ms": 1e3 * statistics.median(times),
                         "min_ms": 1e3 * min(times)}
        r = results[mode]
        top = ", ".join(f"{k} {v}" for k, v in counts.most_common(6))
        print(f"{mode:8s} nodes {r['nodes']:4d}  step {r['median_ms']:6.1f} ms median "
              f"({r['min_ms']:.1f} min)   {top}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
