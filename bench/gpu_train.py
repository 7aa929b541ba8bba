"""Training tokens/s and MFU of the ``base`` Transformer on one GPU, and decoding sentences/s,
for tinytf on CuPy and, when importable, PyTorch eager on the same GPU and the same model.

    PYTHONPATH=. python bench/gpu_train.py [--modes float32,tf32,bf16] [--tokens 25000]
                                           [--length 32] [--steps 10] [--json out.json]

Batches are synthetic: B = tokens // length sentence pairs of exactly ``length`` source and
``length`` target tokens (no padding, so every FLOP counted is useful), random ids, the
paper's base model (d 512, 6+6 layers, 8k joint vocabulary), dropout 0.1, label smoothing
0.1, Adam. One step = forward, backward, Adam. tokens/s counts target tokens (the
paper's convention for batch size is ~25k source + ~25k target tokens).

MFU = model FLOPs / time / peak, with model FLOPs = 3 x the forward pass's matrix-product
FLOPs (backward does two products per forward product) and peaks of the H200 datasheet
(dense): float32 67, tf32 494.5, bf16 and fp16 989.5 TFLOP/s (``--peak`` overrides).

Nothing here is tinytf's test suite: bench/gpu_check.sh runs the tests first.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.join(HERE, ".."), HERE]   # tinytf, and torch_transformer beside this

PEAK_TFLOPS = {"float32": 67.0, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5}


def forward_flops(cfg, batch: int, src_len: int, tgt_len: int) -> float:
    """Matrix-product FLOPs of one forward pass (2 per multiply-add)."""
    d, f, v = cfg.d_model, cfg.d_ff, cfg.vocab_size
    s_tok, t_tok = batch * src_len, batch * tgt_len
    enc = cfg.n_encoder_layers * (s_tok * 2 * d * (4 * d + 2 * f)      # qkv, out, ffn
                                  + s_tok * 4 * src_len * d)           # q k^T and p v
    dec = cfg.n_decoder_layers * (t_tok * 2 * d * (4 * d + 2 * d + 2 * f)  # self, cross q/out, ffn
                                  + s_tok * 2 * d * 2 * d                  # cross k, v of memory
                                  + t_tok * 4 * tgt_len * d                # self-attention
                                  + t_tok * 4 * src_len * d)               # cross-attention
    out = t_tok * 2 * d * v                                                # logits
    return float(enc + dec + out)


def synthetic_batch(xp, batch: int, length: int, vocab: int, seed: int = 0):
    """(src, tgt_in, tgt_out) int64 (batch, length) with ids in [4, vocab): no pads, no EOS."""
    g = np.random.default_rng(seed)
    src = g.integers(4, vocab, (batch, length))
    tgt = g.integers(4, vocab, (batch, length))
    tgt_in = np.concatenate([np.ones((batch, 1), np.int64), tgt[:, :-1]], axis=1)  # <s> = 1
    return xp.asarray(src), xp.asarray(tgt_in), xp.asarray(tgt)


def timed(step, steps: int, warmup: int, sync) -> list:
    """Seconds of each of ``steps`` calls after ``warmup`` untimed ones (device synced)."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times


# ----- tinytf ------------------------------------------------------------------------------

class Device:
    """The array module, tinytf device name, synchronisation and torch device in use."""

    def __init__(self, gpu: bool):
        self.gpu = gpu
        if gpu:
            import cupy
            self.xp, self.name, self.torch = cupy, "gpu", "cuda"
            self.sync = cupy.cuda.Device().synchronize
        else:  # --cpu-smoke: the same code path on NumPy, to check this script without a GPU
            self.xp, self.name, self.torch = np, "cpu", "cpu"
            self.sync = lambda: None

    def free(self):
        if self.gpu:
            self.xp.get_default_memory_pool().free_all_blocks()

    def pool_gib(self) -> float:
        return self.xp.get_default_memory_pool().total_bytes() / 2 ** 30 if self.gpu else 0.0


def _tinytf_model(dev: Device, cfg):
    """(model, Adam): a fresh model from seed 0 on the device, in training mode."""
    import tinytf
    from tinytf.fast import adam
    from tinytf.models import transformer

    dev.free()  # what the previous run left in CuPy's pool
    tinytf.manual_seed(0)
    model = transformer.Transformer(cfg).to(dev.name).train()
    return model, adam(model.named_parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)


def _summed_loss(model, cfg, batch):
    """The batch's summed label-smoothed loss (the count of tokens stays on the device)."""
    from tinytf import functional as F
    src, tgt_in, tgt_out = batch
    logits = model(src, tgt_in)
    return F.cross_entropy(logits.reshape(-1, cfg.vocab_size), tgt_out.reshape(-1),
                           label_smoothing=cfg.label_smoothing, ignore_index=0, reduction="sum")


def _tinytf_step_fn(dev: Device, cfg, mode: str, batch):
    """(step, model): one training step of a fresh model under precision ``mode``."""
    from tinytf.fast.loss_scaler import DynamicLossScaler
    from tinytf.nn import amp

    model, opt = _tinytf_model(dev, cfg)
    scaler = DynamicLossScaler(enabled=amp.Policy(mode).loss_scaling)
    ntok = int(batch[2].size)

    def step():
        # Backward inside the block too: TF32 is a switch, not a dtype carried by the graph.
        with amp.autocast(mode):
            loss = _summed_loss(model, cfg, batch)
            scaler.scale_loss(loss).backward()
            found_inf = scaler.unscale_(opt.params, extra_factor=1.0 / ntok)  # also / tokens
            if not found_inf:
                opt.step()
            scaler.update(found_inf)
            opt.zero_grad()
        step.loss = loss
    return step, model


def tinytf_train(dev: Device, cfg, mode: str, batch, steps: int, warmup: int,
                 profile_dir=None) -> dict:
    from tinytf.fast.cuda import kernels

    step, _ = _tinytf_step_fn(dev, cfg, mode, batch)
    ntok = int(batch[2].size)
    kernels.calls.clear()
    times = timed(step, steps, warmup, dev.sync)
    loss = float(step.loss.item()) / ntok
    calls = {k: n // (steps + warmup) for k, n in sorted(kernels.calls.items())}
    # Host time: how long the Python side takes to issue one step when the GPU never
    # makes it wait (the step returns before the GPU finishes). Close to the step time
    # means the step is bound by launch overhead, not by the GPU.
    dev.sync()
    t0 = time.perf_counter()
    step()
    host = time.perf_counter() - t0
    dev.sync()
    out = {"times": times, "loss": loss, "fused_calls_per_step": calls,
           "pool_gib": dev.pool_gib(), "host_s": host}
    if profile_dir and mode == "bf16":
        import cProfile
        import pstats
        prof = cProfile.Profile()
        prof.enable()
        step()
        dev.sync()
        prof.disable()
        path = os.path.join(profile_dir, f"profile_{mode}.txt")
        with open(path, "w") as f:
            pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
            pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(40)
        out["profile"] = path
    return out


def op_profile(dev: Device, cfg, mode: str, batch, path: str) -> dict:
    """Time every op's forward and backward, summed per op class, over one step.

    Two passes: with a device sync around every call (host + GPU time of the op, run one
    after another) and without (host time alone: the Python and launch cost). Where the
    first is much larger than the second the op is GPU-bound; where they are close it is
    bound by the host. Written as a table to ``path``.
    """
    from tinytf.engine.tensor import Function

    classes, todo = [], list(Function.__subclasses__())
    while todo:
        c = todo.pop()
        classes.append(c)
        todo.extend(c.__subclasses__())
    step, _ = _tinytf_step_fn(dev, cfg, mode, batch)
    step()
    dev.sync()
    result = {}
    for synced in (True, False):
        totals: dict = {}
        originals = {}

        def wrap(cls, name, fn):
            def timed_call(self, *a, **k):
                if synced:
                    dev.sync()
                t0 = time.perf_counter()
                out = fn(self, *a, **k)
                if synced:
                    dev.sync()
                key = f"{cls.__name__}.{name}"
                totals[key] = totals.get(key, 0.0) + time.perf_counter() - t0
                return out
            return timed_call
        for cls in classes:
            for name in ("forward", "backward"):
                if name in vars(cls):
                    originals[(cls, name)] = vars(cls)[name]
                    setattr(cls, name, wrap(cls, name, vars(cls)[name]))
        try:
            dev.sync()
            t0 = time.perf_counter()
            step()
            dev.sync()
            total = time.perf_counter() - t0
        finally:
            for (cls, name), fn in originals.items():
                setattr(cls, name, fn)
        result["synced" if synced else "host"] = {"total_s": total, "ops": totals}
    with open(path, "w") as f:
        f.write(f"# one {mode} step of base, per op class: seconds with a device sync around "
                f"each call / host seconds without syncs\n")
        f.write(f"# step total: {result['synced']['total_s']:.4f} s synced, "
                f"{result['host']['total_s']:.4f} s unsynced\n")
        ops = result["synced"]["ops"]
        for key in sorted(ops, key=ops.get, reverse=True):
            host = result['host']['ops'].get(key, 0)
            f.write(f"{key:40s} {ops[key] * 1e3:9.2f} ms {host * 1e3:9.2f} ms\n")
    return result


def tinytf_graph_train(dev: Device, cfg, mode: str, batch, steps: int, warmup: int) -> dict:
    """The tinytf step with its forward and backward replayed as a CUDA graph.

    ``tinytf.fast.cuda.graph.CapturedStep`` records one step's launches and replays them; the
    Adam step (one launch on the flat buffers) stays outside. First a check with dropout
    off: the replayed gradients must equal those of the ordinary step on the same
    weights (``grad_rel_diff``). Then the timed run with dropout on, as the eager row.
    """
    import dataclasses

    from tinytf.fast.cuda.graph import CapturedStep
    from tinytf.fast.loss_scaler import DynamicLossScaler
    from tinytf.nn import amp

    ntok = int(batch[2].size)

    def build(config):
        model, opt = _tinytf_model(dev, config)

        def forward_backward():
            with amp.autocast(mode):
                loss = _summed_loss(model, config, batch)
                loss.backward()
            return loss
        forward_backward()          # one ordinary step: Adam builds its flat buffers
        opt.step()
        opt.zero_grad()
        return opt, forward_backward

    out = {}
    opt, fb = build(dataclasses.replace(cfg, dropout=0.0))
    fb()
    eager = opt.flat_buffers.grad.copy()
    opt.zero_grad()
    graph = CapturedStep(fb, [p for _, p in opt.params])
    graph()
    dev.sync()
    diff = dev.xp.linalg.norm(opt.flat_buffers.grad - eager) / dev.xp.linalg.norm(eager)
    out["grad_rel_diff"] = float(diff)
    del graph, opt, fb, eager

    opt, fb = build(cfg)
    graph = CapturedStep(fb, [p for _, p in opt.params])
    unscale = DynamicLossScaler(enabled=False)

    def step():
        loss = graph()
        unscale.unscale_(opt.params, extra_factor=1.0 / ntok)   # the gradient per token
        opt.step()
        opt.zero_grad()
        step.loss = loss
    out["times"] = timed(step, steps, warmup, dev.sync)
    out["loss"] = float(step.loss.item()) / ntok
    dev.sync()
    t0 = time.perf_counter()
    step()
    out["host_s"] = time.perf_counter() - t0
    dev.sync()
    pools = graph.pool.total_bytes() + dev.xp.get_default_memory_pool().total_bytes()
    out["pool_gib"] = pools / 2 ** 30
    return out


def attention_probe(dev: Device, cfg, mode: str, batch: int, length: int,
                    reps: int = 20) -> dict:
    """GPU time of one attention call, forward and backward, at the benchmark's shape.

    q, k and v (batch, h, length, d_k) in the compute dtype with a padding mask, as in the
    encoder's self-attention; the call is replayed as a CUDA graph, so the time is the
    GPU's alone (no launch cost). ``per_step_ms`` multiplies by the step's attention calls
    (6 encoder, 12 decoder): the share of the step a fused attention kernel could save.
    """
    from tinytf import functional as F
    from tinytf.engine.tensor import Tensor
    from tinytf.fast.cuda.graph import CapturedStep
    from tinytf.nn import amp

    xp = dev.xp
    dtype = amp.Policy(mode).compute_dtype(xp) or np.float32
    g = np.random.default_rng(0)
    shape = (batch, cfg.n_heads, length, cfg.d_model // cfg.n_heads)
    q, k, v = (Tensor(xp.asarray(g.standard_normal(shape, dtype=np.float32)).astype(dtype),
                      requires_grad=True) for _ in range(3))
    mask = xp.asarray(g.random((batch, 1, 1, length)) > 0.1)
    grad = xp.asarray(g.standard_normal(shape, dtype=np.float32)).astype(dtype)

    def fn():
        out = F.attention(q, k, v, mask=mask)
        out.backward(grad)
        return out
    fn()
    graph = CapturedStep(fn, [q, k, v])
    graph()
    dev.sync()
    times = timed(graph, reps, 2, dev.sync)
    ms = 1e3 * float(np.median(times))
    return {"shape": list(shape), "dtype": str(np.dtype(dtype)), "ms": ms,
            "per_step_ms": ms * (cfg.n_encoder_layers + 2 * cfg.n_decoder_layers)}


def autocast_wired(dev: Device) -> bool:
    """Whether F.linear computes in bf16 under autocast (it passes the compute dtype)."""
    from tinytf import functional as F
    from tinytf import nn
    from tinytf.engine.tensor import Tensor
    from tinytf.nn import amp
    lin = nn.Linear(4, 4).to(dev.name)
    with amp.autocast("bf16"):
        y = F.linear(Tensor(dev.xp.ones((2, 4), dtype=np.float32)), lin.weight, lin.bias)
    return getattr(y._ctx, "compute_dtype", None) is not None


def tinytf_decode(dev: Device, cfg, n_sent: int, src_len: int, max_new: int, beam: int,
                  mode: str) -> dict:
    import tinytf
    from tinytf.decoding import search
    from tinytf.models import transformer
    from tinytf.nn import amp

    tinytf.manual_seed(0)
    model = transformer.Transformer(cfg).to(dev.name).eval()
    src = dev.xp.asarray(np.random.default_rng(1).integers(4, cfg.vocab_size, (n_sent, src_len)))

    def run():
        with tinytf.no_grad(), amp.autocast(mode):
            memory = model.encode(src)
            state = model.start_decoding(memory, src)
            max_lens = np.full(n_sent, max_new)
            if beam == 1:
                return search.greedy_search(model.decode_step, state, n_sent, max_lens)
            return search.beam_search(model.decode_step, state, n_sent, max_lens,
                                      beam_size=beam)

    run()  # warm-up (kernel compilation, memory pool)
    dev.sync()
    t0 = time.perf_counter()
    hyps = run()
    dev.sync()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "sentences_per_s": n_sent / dt, "sentences": len(hyps)}


# ----- PyTorch -----------------------------------------------------------------------------

def _torch_sync(dev: Device):
    import torch
    return torch.cuda.synchronize if dev.gpu else (lambda: None)


def torch_train(dev: Device, cfg, mode: str, batch_np, steps: int, warmup: int) -> dict:
    import torch
    from torch_transformer import TorchTransformer, label_smoothed_loss

    if dev.gpu:
        torch.cuda.empty_cache()  # what the previous run left in torch's cache
    torch.manual_seed(0)
    torch.backends.cuda.matmul.allow_tf32 = mode == "tf32"
    torch.backends.cudnn.allow_tf32 = mode == "tf32"
    model = TorchTransformer(cfg).to(dev.torch).train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    src, tgt_in, tgt_out = (torch.as_tensor(a).to(dev.torch) for a in batch_np)
    ntok = tgt_out.numel()

    def step():
        with torch.autocast(dev.torch, dtype=torch.bfloat16, enabled=mode == "bf16"):
            logits = model(src, tgt_in)
        loss = label_smoothed_loss(logits.float(), tgt_out, cfg.label_smoothing) / ntok
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        step.loss = loss

    times = timed(step, steps, warmup, _torch_sync(dev))
    out = {"times": times, "loss": float(step.loss.detach())}
    torch.backends.cuda.matmul.allow_tf32 = False
    return out


def torch_greedy(dev: Device, cfg, n_sent: int, src_len: int, max_new: int) -> dict:
    """Greedy decoding by re-running the decoder on the whole prefix (no KV cache)."""
    import torch
    from torch_transformer import TorchTransformer

    torch.manual_seed(0)
    model = TorchTransformer(cfg).to(dev.torch).eval()
    src = torch.as_tensor(np.random.default_rng(1).integers(4, cfg.vocab_size,
                                                            (n_sent, src_len))).to(dev.torch)

    @torch.no_grad()
    def run():
        ys = torch.ones((n_sent, 1), dtype=torch.long, device=dev.torch)
        for _ in range(max_new):
            logits = model(src, ys)[:, -1]
            ys = torch.cat([ys, logits.argmax(-1, keepdim=True)], dim=1)
        return ys

    sync = _torch_sync(dev)
    run()
    sync()
    t0 = time.perf_counter()
    run()
    sync()
    dt = time.perf_counter() - t0
    return {"seconds": dt, "sentences_per_s": n_sent / dt}


# ----- driver ------------------------------------------------------------------------------

def summarise(times, flops, ntok, peak_tflops) -> dict:
    t = float(np.median(times))
    return {"step_s": t, "tokens_per_s": ntok / t, "tflops": flops / t / 1e12,
            "mfu": flops / t / (peak_tflops * 1e12)}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", default="float32,tf32,bf16")
    ap.add_argument("--tokens", type=int, default=25000, help="target tokens per batch")
    ap.add_argument("--length", type=int, default=32, help="tokens per sentence (src and tgt)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--preset", default="base")
    ap.add_argument("--peak", type=float, default=None, help="peak TFLOP/s for every mode")
    ap.add_argument("--decode-sentences", type=int, default=512)
    ap.add_argument("--decode-new", type=int, default=32, help="tokens generated per sentence")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--profile-dir", default=None,
                    help="write a cProfile of one tinytf bf16 step here")
    ap.add_argument("--op-profile", default=None, metavar="FILE",
                    help="write per-op forward/backward times of one bf16 step to FILE")
    ap.add_argument("--graph", default="bf16", metavar="MODES",
                    help="modes also timed with the step replayed as a CUDA graph "
                         "(comma-separated; empty for none)")
    ap.add_argument("--skip-decode", action="store_true")
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every code path on NumPy/CPU torch with tiny sizes (no figures)")
    args = ap.parse_args(argv)

    from tinytf.models.transformer import TransformerConfig

    dev = Device(gpu=not args.cpu_smoke)
    cfg = TransformerConfig.preset(args.preset)
    b = max(1, args.tokens // args.length)
    flops = 3 * forward_flops(cfg, b, args.length, args.length)
    ntok = b * args.length
    if dev.gpu:
        props = dev.xp.cuda.runtime.getDeviceProperties(0)
        gpu_name = props["name"].decode() if isinstance(props["name"], bytes) else props["name"]
        xp_version = f"cupy {dev.xp.__version__}"
    else:
        gpu_name, xp_version = "CPU (smoke run, figures meaningless)", f"numpy {np.__version__}"
    report = {"device": gpu_name, "array_module": xp_version, "preset": args.preset,
              "batch": b, "length": args.length, "tokens": ntok,
              "train_tflop_per_step": flops / 1e12, "train": {}, "decode": {}}
    try:
        import torch
        ok = torch.cuda.is_available() or not dev.gpu
        report["torch"] = torch.__version__ if ok else None
    except ImportError:
        report["torch"] = None
    use_torch = report["torch"] is not None and not args.no_torch
    print(f"# {gpu_name}; {xp_version}; torch {report['torch']}; {args.preset}: "
          f"{b} x {args.length} tokens, {flops / 1e12:.3f} TFLOP per training step", flush=True)

    try:
        report["autocast_wired"] = autocast_wired(dev)
    except Exception as e:
        report["autocast_wired"] = f"error: {type(e).__name__}: {e}"
    if report["autocast_wired"] is not True:
        print(f"# NOTE: autocast is not wired into tinytf.nn.functional ({report['autocast_wired']}):"
              " the tinytf bf16 row below then runs in float32", flush=True)
    batch = synthetic_batch(dev.xp, b, args.length, cfg.vocab_size)
    batch_np = tuple(np.asarray(a.get() if dev.gpu else a) for a in batch)
    for mode in args.modes.split(","):
        peak = args.peak or PEAK_TFLOPS[mode]
        row = {}
        for name, fn in (("tinytf", lambda: tinytf_train(dev, cfg, mode, batch, args.steps,
                                                         args.warmup, args.profile_dir)),
                         ("torch", lambda: torch_train(dev, cfg, mode, batch_np, args.steps,
                                                       args.warmup))):
            if name == "torch" and not use_torch:
                continue
            try:
                r = fn()
                r.update(summarise(r["times"], flops, ntok, peak))
                print(f"train {mode:7s} {name:6s}: {r['step_s'] * 1e3:8.1f} ms/step  "
                      f"{r['tokens_per_s']:10.0f} tok/s  {r['tflops']:6.1f} TFLOP/s  "
                      f"MFU {100 * r['mfu']:5.1f}%  loss {r['loss']:.3f}", flush=True)
                if name == "tinytf":
                    print(f"    fused calls/step: {r['fused_calls_per_step']}; host time "
                          f"{r['host_s'] * 1e3:.1f} ms/step; pool {r['pool_gib']:.1f} GiB",
                          flush=True)
            except Exception as e:  # report and go on: the other figures are still worth it
                r = {"error": f"{type(e).__name__}: {e}"}
                print(f"train {mode:7s} {name:6s}: FAILED {r['error']}", flush=True)
            row[name] = r
        if "step_s" in row.get("tinytf", {}) and "step_s" in row.get("torch", {}):
            row["tinytf_vs_torch"] = row["torch"]["step_s"] / row["tinytf"]["step_s"]
            print(f"    tinytf speed / torch speed = {row['tinytf_vs_torch']:.2f}", flush=True)
        report["train"][mode] = row

    if args.op_profile:
        try:
            r = op_profile(dev, cfg, "bf16", batch, args.op_profile)
            report["op_profile"] = {k: v["total_s"] for k, v in r.items()}
            print(f"op profile (bf16): {r['synced']['total_s'] * 1e3:.1f} ms synced, "
                  f"{r['host']['total_s'] * 1e3:.1f} ms host -> {args.op_profile}", flush=True)
        except Exception as e:
            print(f"op profile: FAILED {type(e).__name__}: {e}", flush=True)
    n, new = args.decode_sentences, args.decode_new
    for label, fn in () if args.skip_decode else (
            ("tinytf beam4 float32", lambda: tinytf_decode(dev, cfg, n, args.length, new, 4,
                                                           "float32")),
            ("tinytf greedy float32", lambda: tinytf_decode(dev, cfg, n, args.length, new, 1,
                                                            "float32")),
            ("tinytf greedy tf32", lambda: tinytf_decode(dev, cfg, n, args.length, new, 1,
                                                         "tf32")),
            ("torch greedy float32 (no KV cache)",
             lambda: torch_greedy(dev, cfg, n, args.length, new) if use_torch else None)):
        try:
            r = fn()
            if r is None:
                continue
            print(f"decode {label:36s}: {r['sentences_per_s']:8.1f} sentences/s "
                  f"({n} sentences, {new} new tokens each, {r['seconds']:.2f} s)", flush=True)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"}
            print(f"decode {label:36s}: FAILED {r['error']}", flush=True)
        report["decode"][label] = r

    # The graph rows come last, after the figures so far are saved: a capture that hangs
    # must not cost the rest of the report.
    write_report(report, args.json)
    for mode in [m for m in args.graph.split(",") if m] if dev.gpu else []:
        peak = args.peak or PEAK_TFLOPS[mode]
        row = report["train"].setdefault(mode, {})
        try:
            r = tinytf_graph_train(dev, cfg, mode, batch, args.steps, args.warmup)
            r.update(summarise(r["times"], flops, ntok, peak))
            print(f"train {mode:7s} graph : {r['step_s'] * 1e3:8.1f} ms/step  "
                  f"{r['tokens_per_s']:10.0f} tok/s  {r['tflops']:6.1f} TFLOP/s  "
                  f"MFU {100 * r['mfu']:5.1f}%  loss {r['loss']:.3f}", flush=True)
            print(f"    replayed gradients vs the ordinary step's (dropout off): relative "
                  f"difference {r['grad_rel_diff']:.2e}; host time {r['host_s'] * 1e3:.1f} "
                  f"ms/step; pools {r['pool_gib']:.1f} GiB", flush=True)
            if "step_s" in row.get("torch", {}):
                r["vs_torch"] = row["torch"]["step_s"] / r["step_s"]
                print(f"    tinytf graph speed / torch speed = {r['vs_torch']:.2f}", flush=True)
        except Exception as e:
            import traceback
            r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()[-3000:]}
            print(f"train {mode:7s} graph : FAILED {r['error']}\n{r['traceback']}", flush=True)
        row["tinytf_graph"] = r
        write_report(report, args.json)
        try:
            r = attention_probe(dev, cfg, mode, b, args.length)
            print(f"attention {mode}, forward + backward, GPU time (graph-replayed): "
                  f"{r['ms']:.3f} ms per call at {r['shape']}, {r['per_step_ms']:.1f} ms "
                  f"per training step", flush=True)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}"}
            print(f"attention {mode} probe: FAILED {r['error']}", flush=True)
        row["attention_probe"] = r

    write_report(report, args.json)
    return 0


def write_report(report: dict, path) -> None:
    """The report as JSON at ``path`` (if given), written whole each time."""
    if path:
        with open(path, "w") as f:
            json.dump(report, f, indent=1, default=float)


if __name__ == "__main__":
    sys.exit(main())
