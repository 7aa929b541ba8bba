"""Training speed: forward + backward + Adam step, target tokens/s, tinytf vs PyTorch CPU eager.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/train_speed.py [--configs tiny,small]

Both frameworks train the same architecture (tinytf/models/transformer.py and its PyTorch twin
bench/torch_transformer.py, same weights) on the same batches, in the same process, on the
same number of threads (``--threads``, default 2, set before NumPy and torch load their BLAS).
Timed steps alternate between the two in rounds, so load on a shared machine hits both alike,
and each round starts with the next of them, so neither always runs first; the figure is the
median step time. The batch is ``--tokens`` target tokens (default 4096)
as sentences of ``--length`` tokens (default 25: 163 sentences; ``--length 25,64,128`` gives
a row per length, short and long sentences), random ids over
``--vocab`` (8000, the BPE default), or with ``--corpus`` the shipped data/ende sentences
(word-level ids, length-sorted batches of ~``--tokens`` padded tokens).

Then one more tinytf step runs with every op timed, to split the step into its GEMMs
(replayed alone with the recorded shapes: the pure matrix-multiply time) and everything else.
Unset OPENBLAS_CORETYPE / OPENBLAS_L2_SIZE for this command only (docs/benchmarks.md,
shared/NOTES.md): they pin OpenBLAS to an older kernel and halve NumPy's GEMM speed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--configs", default="tiny,small", help="comma-separated presets")
    p.add_argument("--tokens", type=int, default=4096, help="target tokens per batch")
    p.add_argument("--length", default="25",
                   help="sentence length of the synthetic batches; comma-separated for one "
                        "row per length, e.g. 25,64,128 (short and long sentences)")
    p.add_argument("--vocab", type=int, default=8000)
    p.add_argument("--corpus", action="store_true", help="batches from data/ende")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5, help="timed rounds (each framework)")
    p.add_argument("--steps", type=int, default=2, help="steps per round")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-torch", action="store_true")
    p.add_argument("--torch-attention", choices=["sdpa", "explicit"], default="sdpa")
    p.add_argument("--dropout", type=float, default=None, help="override the preset's")
    p.add_argument("--profile-steps", type=int, default=3,
                   help="instrumented tinytf steps (0: no per-op breakdown)")
    p.add_argument("--torch-profile", action="store_true",
                   help="also print PyTorch's own op breakdown (torch.profiler)")
    p.add_argument("--one-thread-rows", action="store_true",
                   help="also time tinytf with its row-parallel ops on one thread, alternately")
    p.add_argument("--json", action="store_true", help="also print one JSON line per config")
    return p.parse_args(argv)


ARGS = parse_args()
for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(ARGS.threads)   # must precede the BLAS libraries' loading
os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")  # as the commands set it

import numpy as np  # noqa: E402

sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))
import tinytf  # noqa: E402
import tinytf.fast.cpu.memory  # noqa: E402

tinytf.fast.cpu.memory.keep_by_default()   # as the commands do: freed memory kept
from tinytf import fast, ops, optim  # noqa: E402
from tinytf.engine.dispatch import impl  # noqa: E402
from tinytf.fast.cpu import threads as fast_threads  # noqa: E402
from tinytf.models.transformer import PAD_ID, Transformer, TransformerConfig, label_smoothed_loss  # noqa: E402

try:
    if ARGS.no_torch:
        raise ImportError("--no-torch")
    import torch  # noqa: E402
    torch.set_num_threads(ARGS.threads)
    import torch_transformer as tt  # noqa: E402
except ImportError as e:
    torch = None
    print(f"# PyTorch comparison skipped ({e})")


# ----------------------------------------------------------------------------------------
# batches
# ----------------------------------------------------------------------------------------

def synthetic_batch(rng, tokens, length, vocab):
    """(src, tgt_in, gold) of B = tokens // length sentences, all of ``length`` tokens."""
    b = max(1, tokens // length)
    src = rng.integers(4, vocab, size=(b, length))
    tgt = rng.integers(4, vocab, size=(b, length + 1))
    tgt[:, 0] = 1  # <s>
    return src, tgt[:, :-1].copy(), tgt[:, 1:].copy()


def corpus_batches(tokens, vocab, n=8):
    """Length-sorted batches of the shipped corpus, word ids (most frequent words first)."""
    def read(path):
        with open(path, encoding="utf-8") as f:
            return [line.split() for line in f]
    src = read(os.path.join(ROOT, "data", "ende", "train.en"))
    tgt = read(os.path.join(ROOT, "data", "ende", "train.de"))
    counts = defaultdict(int)
    for sent in src + tgt:
        for w in sent:
            counts[w] += 1
    ids = {w: i + 4 for i, w in enumerate(sorted(counts, key=counts.get, reverse=True)[:vocab - 4])}
    pairs = sorted(zip(src, tgt), key=lambda p: (len(p[1]), len(p[0])))
    batches, start = [], len(pairs) // 3  # from the middle of the length distribution
    while len(batches) < n and start < len(pairs):
        t_len = len(pairs[start][1]) + 1
        b = max(1, tokens // t_len)
        chunk = pairs[start:start + b]
        start += b
        s_len = max(len(s) for s, _ in chunk)
        t_len = max(len(t) for _, t in chunk) + 1
        s = np.zeros((len(chunk), s_len), dtype=np.int64)
        g = np.zeros((len(chunk), t_len), dtype=np.int64)
        ti = np.zeros((len(chunk), t_len), dtype=np.int64)
        for i, (ws, wt) in enumerate(chunk):
            s[i, :len(ws)] = [ids.get(w, 3) for w in ws]
            seq = [ids.get(w, 3) for w in wt] + [2]
            g[i, :len(seq)] = seq
            ti[i, 0] = 1
            ti[i, 1:len(seq)] = seq[:-1]
        batches.append((s, ti, g))
    return batches


# ----------------------------------------------------------------------------------------
# one training step in each framework
# ----------------------------------------------------------------------------------------

def tinytf_step(model, opt, batch, eps):
    src, tgt_in, gold = batch
    loss, n = label_smoothed_loss(model(src, tgt_in), gold, eps)
    opt.zero_grad()
    (loss * (1.0 / n)).backward()
    opt.step()
    return n


def torch_step(model, opt, batch, eps):
    src, tgt_in, gold = batch
    loss = tt.label_smoothed_loss(model(src, tgt_in), gold, eps)
    n = int((gold != PAD_ID).sum())
    opt.zero_grad(set_to_none=True)
    (loss / n).backward()
    opt.step()
    return n


def timed(step, k):
    t = time.perf_counter()
    n = sum(step() for _ in range(k))
    return (time.perf_counter() - t) / k, n / k


# ----------------------------------------------------------------------------------------
# where the time goes
# ----------------------------------------------------------------------------------------

class OpTimer:
    """Times every op's forward and backward (class-level wrappers) and records GEMM shapes."""

    def __init__(self):
        self.times = defaultdict(float)
        self.gemms = []   # (kind, shapes) replayed later without the framework around them
        self._saved = []

    def __enter__(self):
        # The classes that run on the CPU (the op table's: fast variants where they are on),
        # each timed under its reference op's name; a variant's call of its parent's code
        # is inside its own time.
        for name in ops.__all__:
            if not isinstance(getattr(ops, name), type):
                continue
            cls = getattr(impl, name).cpu
            for meth in ("forward", "backward"):
                orig = getattr(cls, meth)
                self._saved.append((cls, meth, vars(cls).get(meth)))
                setattr(cls, meth, self._wrap(name, meth, orig))
        adam = fast.FusedAdam if fast.enabled() else optim.Adam
        self._saved.append((adam, "step", vars(adam).get("step")))
        adam.step = self._wrap("Adam", "step", adam.step)
        return self

    def __exit__(self, *exc):
        for cls, meth, orig in reversed(self._saved):
            if orig is None:
                delattr(cls, meth)          # the class inherited it: inherit it again
            else:
                setattr(cls, meth, orig)

    def _wrap(self, name, meth, orig):
        timer = self

        def wrapper(ctx, *args, **kwargs):
            if name == "Linear":
                timer._record_linear(ctx, meth, args)
            elif name in ("Attention", "MatMul"):
                timer._record_batched(ctx, name, meth, args)
            t = time.perf_counter()
            out = orig(ctx, *args, **kwargs)
            timer.times[f"{name}.{meth}"] += time.perf_counter() - t
            return out
        return wrapper

    def _record_linear(self, ctx, meth, args):
        if meth == "forward":
            x, w = args[0], args[1]
            n = int(np.prod(x.shape[:-1]))
            self.gemms.append(("mm", (n, x.shape[-1]), (w.shape[1], w.shape[0]), x.dtype))
        else:
            x2, w = ctx.saved[0], ctx.saved[1]
            n, d_in, d_out = x2.shape[0], w.shape[1], w.shape[0]
            if ctx.needs_input_grad[0]:
                self.gemms.append(("mm", (n, d_out), (d_out, d_in), x2.dtype))
            self.gemms.append(("mm", (d_out, n), (n, d_in), x2.dtype))

    def _record_batched(self, ctx, name, meth, args):
        if name == "MatMul":
            if meth == "forward":
                self.gemms.append(("bmm", args[0].shape, args[1].shape, args[0].dtype))
            return
        if meth == "forward":
            q, k = args[0], args[1]
            b, h, tq, d = q.shape
            tk = k.shape[2]
            self.gemms.append(("bmm", (b, h, tq, d), (b, h, d, tk), q.dtype))   # q k^T
            self.gemms.append(("bmm", (b, h, tq, tk), (b, h, tk, d), q.dtype))  # P v
        else:
            qs, k = ctx.saved[0], ctx.saved[1]
            b, h, tq, d = qs.shape
            tk = k.shape[2]
            for a, c in [((b, h, tk, tq), (b, h, tq, d)),    # dV = P^T g
                         ((b, h, tq, d), (b, h, d, tk)),     # dP = g V^T
                         ((b, h, tq, tk), (b, h, tk, d)),    # dQ = dS K
                         ((b, h, tk, tq), (b, h, tq, d))]:   # dK = dS^T Q
                self.gemms.append(("bmm", a, c, qs.dtype))

    def gemm_seconds(self, repeats=3):
        """Best-of-``repeats`` time of all recorded GEMMs run back to back on fresh arrays."""
        rng = np.random.default_rng(0)
        arrays = [(rng.standard_normal(a).astype(dt), rng.standard_normal(b).astype(dt))
                  for _, a, b, dt in self.gemms]
        best = float("inf")
        for _ in range(repeats):
            t = time.perf_counter()
            for a, b in arrays:
                a @ b
            best = min(best, time.perf_counter() - t)
        flops = sum(2 * np.prod(a.shape) * b.shape[-1] for a, b in arrays)
        torch_best = None
        if torch is not None:  # the same GEMMs through PyTorch's BLAS
            t_arrays = [(torch.from_numpy(a), torch.from_numpy(b)) for a, b in arrays]
            torch_best = float("inf")
            for _ in range(repeats):
                t = time.perf_counter()
                for a, b in t_arrays:
                    torch.matmul(a, b)
                torch_best = min(torch_best, time.perf_counter() - t)
        return best, flops, torch_best


def torch_breakdown(step, k):
    """PyTorch's own per-op self CPU time for ``k`` steps (ms per step), largest first."""
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(k):
            step()
    rows = [(e.key, e.self_cpu_time_total / 1e3 / k) for e in prof.key_averages()]
    return dict(sorted(rows, key=lambda kv: -kv[1])[:16])


# ----------------------------------------------------------------------------------------

def blas_info():
    try:
        cfg = np.show_config(mode="dicts")
        blas = cfg["Build Dependencies"]["blas"]
        return f"{blas.get('name')} {blas.get('version')}"
    except Exception:  # noqa: BLE001 - informational only
        return "unknown BLAS"


def bench_config(name, batches):
    overrides = {"vocab_size": ARGS.vocab, "max_len": 1024}
    if ARGS.dropout is not None:
        overrides["dropout"] = ARGS.dropout
    cfg = TransformerConfig.preset(name, **overrides)
    tinytf.manual_seed(0)
    model = Transformer(cfg).train()
    opt = fast.adam(model.named_parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    eps = cfg.label_smoothing
    it = iter(range(10 ** 9))

    def next_batch():
        return batches[next(it) % len(batches)]

    def tf_step():
        return tinytf_step(model, opt, next_batch(), eps)

    results = {"config": name, "params": model.num_parameters(),
               "batch": list(batches[0][1].shape)}
    t_model = None
    if torch is not None:
        torch.manual_seed(0)
        t_model = tt.TorchTransformer(cfg, sdpa=ARGS.torch_attention == "sdpa").train()
        tt.load_tinytf_state(t_model, model.state_dict())
        t_opt = torch.optim.Adam(t_model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
        t_batches = [tuple(torch.from_numpy(a) for a in b) for b in batches]
        t_it = iter(range(10 ** 9))

        def th_step():
            return torch_step(t_model, t_opt, t_batches[next(t_it) % len(t_batches)], eps)

    for _ in range(ARGS.warmup):
        tf_step()
        if t_model is not None:
            th_step()
    tf_times, th_times, one_times, tokens = [], [], [], 0
    runs = [(tf_step, tf_times, None)]   # (step, its times, row threads: None = the default)
    if t_model is not None:
        runs.append((th_step, th_times, None))
    if ARGS.one_thread_rows:
        runs.append((tf_step, one_times, 1))
    for r in range(ARGS.rounds):
        # Each round starts with the next contestant: which one runs first (after the
        # other's memory traffic, or with OpenBLAS's threads still awake) does not favour one.
        for step, times, row_threads in runs[r % len(runs):] + runs[:r % len(runs)]:
            fast_threads.set_threads(row_threads)
            s, n = timed(step, ARGS.steps)
            fast_threads.set_threads(None)
            times.append(s)
            if times is tf_times:
                tokens = n
    tf_s = statistics.median(tf_times)
    results.update(tokens=tokens, tinytf_step_s=tf_s, tinytf_tok_s=tokens / tf_s)
    if one_times:
        results.update(one_thread_rows_step_s=statistics.median(one_times))
    if th_times:
        th_s = statistics.median(th_times)
        results.update(torch_step_s=th_s, torch_tok_s=tokens / th_s, ratio=th_s / tf_s)

    # instrumented steps: per-op times and the GEMMs replayed alone (per-step averages)
    k = ARGS.profile_steps
    if k <= 0:
        return results
    with OpTimer() as timer:
        t = time.perf_counter()
        for _ in range(k):
            tf_step()
        step_s = (time.perf_counter() - t) / k
    timer.times = {name: v / k for name, v in timer.times.items()}
    timer.gemms = timer.gemms[:len(timer.gemms) // k]
    gemm_s, flops, torch_gemm_s = timer.gemm_seconds()
    if t_model is not None and ARGS.torch_profile:
        results["torch_ops"] = torch_breakdown(th_step, k)
    results.update(torch_gemm_s=torch_gemm_s, profiled_step_s=step_s, gemm_s=gemm_s,
                   gemm_share=gemm_s / step_s,
                   gemm_gflop=flops / 1e9, gemm_gflops=flops / gemm_s / 1e9,
                   ops={k: v for k, v in sorted(timer.times.items(), key=lambda kv: -kv[1])})
    return results


def report(r):
    print(f"\n== {r['config']}: {r['params'] / 1e6:.1f}M parameters, batch {r['batch']} "
          f"({r['tokens']:.0f} target tokens)")
    line = (f"tinytf   {r['tinytf_step_s'] * 1e3:8.1f} ms/step  "
            f"{r['tinytf_tok_s']:8.0f} target tok/s")
    print(line)
    if "one_thread_rows_step_s" in r:
        one = r["one_thread_rows_step_s"]
        print(f"tinytf   {one * 1e3:8.1f} ms/step  with its row ops on one thread "
              f"(tinytf.fast.cpu.threads): the {fast_threads.threads()} threads are "
              f"{one / r['tinytf_step_s']:.2f}x faster")
    if "torch_step_s" in r:
        print(f"pytorch  {r['torch_step_s'] * 1e3:8.1f} ms/step  {r['torch_tok_s']:8.0f} "
              f"target tok/s  ({ARGS.torch_attention} attention)")
        print(f"ratio tinytf/pytorch speed: {r['ratio']:.2f}x")
    if "ops" not in r:   # --profile-steps 0
        return
    print(f"instrumented step {r['profiled_step_s'] * 1e3:.1f} ms: GEMMs alone "
          f"{r['gemm_s'] * 1e3:.1f} ms = {100 * r['gemm_share']:.0f}% "
          f"({r['gemm_gflop']:.1f} GFLOP at {r['gemm_gflops']:.0f} GFLOP/s); "
          f"everything else {100 * (1 - r['gemm_share']):.0f}%")
    if r.get("torch_gemm_s"):
        print(f"the same GEMMs through torch.matmul: {r['torch_gemm_s'] * 1e3:.1f} ms "
              f"({r['gemm_gflop'] / r['torch_gemm_s']:.0f} GFLOP/s)")
    if "torch_step_s" in r:
        # With everything but the products free, tinytf's step would take its GEMMs' time.
        print(f"bound: PyTorch's step / tinytf's GEMMs alone = "
              f"{r['torch_step_s'] / r['gemm_s']:.2f}x (the most any change outside the "
              f"products can reach)")
    total = r["profiled_step_s"]
    shown = 0.0
    for k, v in list(r["ops"].items())[:14]:
        shown += v
        print(f"  {k:<26s} {v * 1e3:8.1f} ms {100 * v / total:5.1f}%")
    print(f"  {'(engine, Python, rest)':<26s} {(total - sum(r['ops'].values())) * 1e3:8.1f} ms "
          f"{100 * (total - sum(r['ops'].values())) / total:5.1f}%")
    if "torch_ops" in r:
        print("  PyTorch's own breakdown (self CPU ms per step):")
        for k, v in r["torch_ops"].items():
            print(f"    {k:<40s} {v:8.1f} ms")


def main():
    print(f"# threads {ARGS.threads}; numpy {np.__version__} ({blas_info()}); "
          f"torch {torch.__version__ if torch else 'absent'}; "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}; "
          f"freed memory kept for both frameworks: {tinytf.fast.cpu.memory.kept()}")
    import json
    lengths = [None] if ARGS.corpus else [int(n) for n in ARGS.length.split(",")]
    for length in lengths:
        if ARGS.corpus:
            batches = corpus_batches(ARGS.tokens, ARGS.vocab)
        else:
            rng = np.random.default_rng(0)
            batches = [synthetic_batch(rng, ARGS.tokens, length, ARGS.vocab) for _ in range(4)]
        for name in ARGS.configs.split(","):
            r = bench_config(name.strip(), batches)
            report(r)
            if ARGS.json:
                print(json.dumps(r))


if __name__ == "__main__":
    main()
