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
import functools
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


def _gpu_masks(dev: Device) -> None:
    """transformer.causal_mask builds a NumPy mask by default; on the GPU it must be CuPy."""
    from tinytf import transformer
    if dev.gpu and not getattr(transformer, "_gpu_causal_mask", False):
        transformer.causal_mask = functools.partial(transformer.causal_mask, xp=dev.xp)
        transformer._gpu_causal_mask = True


def tinytf_train(dev: Device, cfg, mode: str, batch, steps: int, warmup: int) -> dict:
    import tinytf
    from tinytf import amp, kernels, transformer
    from tinytf import functional as F
    from tinytf.optim import Adam

    _gpu_masks(dev)
    dev.free()  # what the previous run left in CuPy's pool
    tinytf.manual_seed(0)
    model = transformer.Transformer(cfg).to(dev.name).train()
    opt = Adam(model.named_parameters(), lr=1e-4, betas=(0.9, 0.98), eps=1e-9)
    scaler = amp.DynamicLossScaler(enabled=amp.Policy(mode).loss_scaling)
    src, tgt_in, tgt_out = batch
    ntok = int(tgt_out.size)
    v = cfg.vocab_size

    def step():
        with amp.autocast(mode):
            logits = model(src, tgt_in)
            loss = F.cross_entropy(logits.reshape(-1, v), tgt_out.reshape(-1),
                                   label_smoothing=cfg.label_smoothing, ignore_index=0,
                                   reduction="sum")
        scaler.scale_loss(loss).backward()
        found_inf = scaler.unscale_(opt.params, extra_factor=1.0 / ntok)  # also / tokens
        if not found_inf:
            opt.step()
        scaler.update(found_inf)
        opt.zero_grad()
        step.loss = loss

    kernels.calls.clear()
    times = timed(step, steps, warmup, dev.sync)
    loss = float(step.loss.item()) / ntok
    calls = {k: n // (steps + warmup) for k, n in sorted(kernels.calls.items())}
    mem = dev.pool_gib()
    return {"times": times, "loss": loss, "fused_calls_per_step": calls, "pool_gib": mem}


def autocast_wired(dev: Device) -> bool:
    """Whether F.linear casts its weight under autocast (the hook in tinytf.functional)."""
    from tinytf import amp, nn
    from tinytf import functional as F
    from tinytf.tensor import Tensor
    lin = nn.Linear(4, 4).to(dev.name)
    with amp.autocast("bf16"):
        y = F.linear(Tensor(dev.xp.ones((2, 4), dtype=np.float32)), lin.weight, lin.bias)
    return isinstance(y._ctx.inputs[1]._ctx, amp.CastTo)


def tinytf_decode(dev: Device, cfg, n_sent: int, src_len: int, max_new: int, beam: int,
                  mode: str) -> dict:
    import tinytf
    from tinytf import amp, search, transformer

    _gpu_masks(dev)
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
    ap.add_argument("--cpu-smoke", action="store_true",
                    help="run every code path on NumPy/CPU torch with tiny sizes (no figures)")
    args = ap.parse_args(argv)

    from tinytf.transformer import TransformerConfig

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
        print(f"# NOTE: autocast is not wired into tinytf.functional ({report['autocast_wired']}):"
              " the tinytf bf16 row below then runs in float32", flush=True)
    batch = synthetic_batch(dev.xp, b, args.length, cfg.vocab_size)
    batch_np = tuple(np.asarray(a.get() if dev.gpu else a) for a in batch)
    for mode in args.modes.split(","):
        peak = args.peak or PEAK_TFLOPS[mode]
        row = {}
        for name, fn in (("tinytf", lambda: tinytf_train(dev, cfg, mode, batch, args.steps,
                                                          args.warmup)),
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
                    print(f"    fused calls/step: {r['fused_calls_per_step']}", flush=True)
            except Exception as e:  # report and go on: the other figures are still worth it
                r = {"error": f"{type(e).__name__}: {e}"}
                print(f"train {mode:7s} {name:6s}: FAILED {r['error']}", flush=True)
            row[name] = r
        if "step_s" in row.get("tinytf", {}) and "step_s" in row.get("torch", {}):
            row["tinytf_vs_torch"] = row["torch"]["step_s"] / row["tinytf"]["step_s"]
            print(f"    tinytf speed / torch speed = {row['tinytf_vs_torch']:.2f}", flush=True)
        report["train"][mode] = row

    n, new = args.decode_sentences, args.decode_new
    for label, fn in (
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

    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=float)
    return 0


if __name__ == "__main__":
    sys.exit(main())
