"""The whole model on the GPU: the same numbers as on the CPU, mixed precision that tracks
float32, and incremental decoding. Skipped without CuPy and a GPU (bench/gpu_check.sh runs
these on one); the op-by-op and kernel-by-kernel checks are in tests/fast/test_kernels.py.
"""
from __future__ import annotations

import numpy as np
import pytest

import tinytf
from tinytf.decoding import search
from tinytf.engine import backend
from tinytf.fast import adam
from tinytf.fast.cuda import kernels
from tinytf.fast.loss_scaler import DynamicLossScaler
from tinytf.models.transformer import Transformer, TransformerConfig, label_smoothed_loss
from tinytf.nn import amp


def _cupy_or_reason():
    try:
        import cupy
        if cupy.cuda.runtime.getDeviceCount() < 1:
            return None, "no GPU visible to CuPy"
        return cupy, ""
    except Exception as e:  # ImportError, or CUDA errors without a driver
        return None, f"CuPy is not usable ({type(e).__name__})"


cp, _why = _cupy_or_reason()
pytestmark = pytest.mark.skipif(cp is None, reason=f"needs a GPU: {_why}")

V = 101


def small_config(**kw) -> TransformerConfig:
    base = dict(vocab_size=V, d_model=64, n_heads=4, d_ff=128, n_encoder_layers=2,
                n_decoder_layers=2, dropout=0.0, max_len=64)
    base.update(kw)
    return TransformerConfig.preset("tiny", **base)


def batch(seed=0, b=6, s=11, t=9):
    """A padded batch: ids in [4, V), rows of different lengths (pads 0 at the end)."""
    g = np.random.default_rng(seed)
    src = g.integers(4, V, (b, s))
    tgt = g.integers(4, V, (b, t))
    for i in range(b):
        src[i, s - i:] = 0
        tgt[i, t - i // 2:] = 0
    tgt_in = np.concatenate([np.ones((b, 1), np.int64), tgt[:, :-1]], axis=1)
    return src, tgt_in, tgt


def loss_and_grads(model, src, tgt_in, tgt, precision="float32"):
    model.zero_grad()
    with amp.autocast(precision):
        logits = model(src, tgt_in)
        loss, n = label_smoothed_loss(logits, tgt, eps=0.1)
        loss.backward()
    grads = {name: backend.to_numpy(p.grad).astype(np.float64)
             for name, p in model.named_parameters()}
    return float(loss.item()) / n, grads


def test_transformer_loss_and_every_gradient_equal_the_cpu():
    tinytf.manual_seed(0)
    model = Transformer(small_config()).train()
    data = batch()
    loss_cpu, g_cpu = loss_and_grads(model, *data)
    model.to("gpu")
    assert model.embed.weight.device == "gpu"
    kernels.calls.clear()
    loss_gpu, g_gpu = loss_and_grads(model, *(cp.asarray(a) for a in data))
    # The fused kernels and cuBLAS ran (not a silent fallback to NumPy-style code).
    for name in ("layer_norm_forward", "softmax_forward", "cross_entropy_forward", "matmul",
                 "bias_grad"):
        assert kernels.calls.get(name, 0) > 0, name
    assert loss_gpu == pytest.approx(loss_cpu, rel=1e-5)
    for name in g_cpu:
        np.testing.assert_allclose(g_gpu[name], g_cpu[name], rtol=2e-3, atol=2e-6,
                                   err_msg=name)


@pytest.mark.parametrize("precision", ["tf32", "bf16", "fp16"])
def test_mixed_precision_gradients_track_float32(precision):
    tinytf.manual_seed(0)
    model = Transformer(small_config()).to("gpu").train()
    data = [cp.asarray(a) for a in batch()]
    loss32, g32 = loss_and_grads(model, *data)
    loss, g = loss_and_grads(model, *data, precision=precision)
    assert loss == pytest.approx(loss32, rel=2e-2)
    flat32 = np.concatenate([g32[k].ravel() for k in sorted(g32)])
    flat = np.concatenate([g[k].ravel() for k in sorted(g)])
    cosine = flat @ flat32 / (np.linalg.norm(flat) * np.linalg.norm(flat32))
    assert cosine > 0.99, cosine
    # Master weights and their gradients stay float32 whatever the compute dtype.
    assert all(p.grad.dtype == np.float32 for _, p in model.named_parameters())


def _train_on_gpu(precision, scaler, steps=30):
    """(model, Adam, per-token losses) of ``steps`` updates on one batch under ``precision``;
    ``scaler`` scales the loss and divides the gradients by the token count."""
    tinytf.manual_seed(0)
    model = Transformer(small_config()).to("gpu").train()
    opt = adam(model.named_parameters(), lr=3e-3)
    src, tgt_in, tgt = (cp.asarray(a) for a in batch())
    losses = []
    for _ in range(steps):
        with amp.autocast(precision):
            logits = model(src, tgt_in)
            loss, n = label_smoothed_loss(logits, tgt, eps=0.1)
            scaler.scale_loss(loss).backward()
            scaler.step(opt, extra_factor=1.0 / n)
            opt.zero_grad()
        losses.append(float(loss.item()) / n)
    return model, opt, losses


def test_bf16_training_steps_lower_the_loss_with_float32_adam_state():
    model, opt, losses = _train_on_gpu("bf16", DynamicLossScaler(enabled=False))
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(m.dtype == np.float32 for m in opt.exp_avg.values())
    assert all(p.dtype == np.float32 for _, p in model.named_parameters())


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # float16 overflow is the point
def test_fp16_loss_scaling_skips_overflow_and_trains():
    scaler = DynamicLossScaler(init_scale=2.0 ** 24)   # overflows at first, on purpose
    _, _, losses = _train_on_gpu("fp16", scaler)
    assert scaler.skipped_steps >= 1 and scaler.scale < 2.0 ** 24
    assert losses[-1] < 0.6 * losses[0], losses


def decode_on_each_device(model, src, search_fn) -> dict:
    """{device: search_fn(model, state)} with the model and ``src`` moved to each device."""
    results = {}
    for device in ("cpu", "gpu"):
        model.to(device)
        s = backend.to_device(src, device)
        with tinytf.no_grad():
            state = model.start_decoding(model.encode(s), s)
            results[device] = search_fn(model, state)
    return results


def test_incremental_decoding_matches_the_cpu():
    tinytf.manual_seed(1)
    model = Transformer(small_config()).eval()
    src = batch(seed=3)[0]

    def five_forced_steps(model, state):
        tokens, out = np.ones(len(src), np.int64), []
        for t in range(5):
            out.append(backend.to_numpy(model.decode_step(tokens, state)))
            tokens = np.full(len(src), 4 + t, np.int64)   # the same forced prefix
        return out
    steps = decode_on_each_device(model, src, five_forced_steps)
    for a, b in zip(steps["gpu"], steps["cpu"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_beam_search_runs_on_the_gpu_like_on_the_cpu():
    tinytf.manual_seed(2)
    model = Transformer(small_config()).eval()
    src = batch(seed=4)[0]

    def beam(model, state):
        hyps = search.beam_search(model.decode_step, state, len(src), np.full(len(src), 12),
                                  beam_size=4)
        return [(nbest[0].tokens, nbest[0].score) for nbest in hyps]
    results = decode_on_each_device(model, src, beam)
    for (tok_g, score_g), (tok_c, score_c) in zip(results["gpu"], results["cpu"]):
        assert score_g == pytest.approx(score_c, abs=1e-3)
        assert tok_g == tok_c


def test_unequal_beams_decode_on_the_gpu_like_on_the_cpu():
    """Sentences with runs of unequal length (beams that lost hypotheses): the padded
    encoder-decoder attention, its index arrays on the device, gives the CPU's scores."""
    tinytf.manual_seed(1)
    model = Transformer(small_config()).eval()
    src = batch(seed=3)[0]
    n, k = len(src), 4
    keep = np.concatenate([k * i + np.arange(i % k + 1) for i in range(n)])   # 1..4 rows

    def ragged_steps(model, state):
        state.select(np.repeat(np.arange(n), k))
        out = [backend.to_numpy(model.decode_step(np.ones(n * k, np.int64), state))]
        state.select(keep)
        assert state.padding is not None and state.group == k
        out.append(backend.to_numpy(model.decode_step(4 + keep % 7, state)))
        return out
    steps = decode_on_each_device(model, src, ragged_steps)
    for a, b in zip(steps["gpu"], steps["cpu"]):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


def test_a_gpu_model_saves_and_loads_through_numpy():
    tinytf.manual_seed(0)
    gpu_model = Transformer(small_config()).to("gpu")
    state = gpu_model.state_dict()
    assert all(isinstance(v, np.ndarray) for v in state.values())
    cpu_model = Transformer(small_config())
    cpu_model.load_state_dict(state)
    for (name, a), (_, b) in zip(gpu_model.named_parameters(), cpu_model.named_parameters()):
        np.testing.assert_array_equal(backend.to_numpy(a.data), b.data, err_msg=name)


def _graph_setup(dropout, precision="bf16"):
    """A model, its Adam (flat buffers built by one ordinary step) and a forward+backward
    on fixed device inputs, as tinytf.fast.cuda.graph wants them."""
    from tinytf import functional as F
    tinytf.manual_seed(0)
    model = Transformer(small_config(dropout=dropout)).to("gpu").train()
    opt = adam(model.named_parameters(), lr=3e-3)
    src, tgt_in, tgt = (cp.asarray(a) for a in batch())

    def forward_backward():
        with amp.autocast(precision):
            logits = model(src, tgt_in)
            loss = F.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), label_smoothing=0.1,
                                   ignore_index=0, reduction="sum")
            loss.backward()
        return loss
    forward_backward()
    opt.step()
    opt.zero_grad()
    return opt, forward_backward


@pytest.mark.parametrize("precision", ["float32", "bf16"])
def test_a_captured_step_replays_the_ordinary_steps_gradients(precision):
    from tinytf.fast.cuda.graph import CapturedStep
    opt, fb = _graph_setup(dropout=0.0, precision=precision)
    loss = fb()
    eager, eager_loss = opt.flat_buffers.grad.copy(), float(loss.item())
    opt.zero_grad()
    step = CapturedStep(fb, [p for _, p in opt.params])
    # cuBLAS may pick other algorithms with the capture's workspace: equal to rounding.
    tol = 1e-4 if precision == "float32" else 1e-2
    for _ in range(2):                                  # replays are repeatable
        opt.zero_grad()
        replayed = step()
        cp.cuda.Device().synchronize()
        assert all(p.grad is not None for _, p in opt.params)
        np.testing.assert_allclose(float(replayed.item()), eager_loss, rtol=tol)
        diff = float(cp.linalg.norm(opt.flat_buffers.grad - eager) / cp.linalg.norm(eager))
        assert diff < tol, diff


def test_captured_steps_draw_new_dropout_masks_and_train():
    from tinytf.fast.cuda.graph import CapturedStep
    opt, fb = _graph_setup(dropout=0.3)
    step = CapturedStep(fb, [p for _, p in opt.params])
    losses = []
    for _ in range(40):
        losses.append(float(step().item()))
        opt.step()
        opt.zero_grad()
    assert len(set(losses[:3])) == 3           # new masks (and new weights) every replay
    assert np.mean(losses[-5:]) < 0.8 * np.mean(losses[:5])


def test_captured_step_graphs_of_several_shapes_share_a_pool_and_match_eager():
    """StepGraphs (train.py --cuda-graph): batches of three shapes, each padded and replayed
    from its own graph in one shared memory pool, in an interleaved order, give the
    unpadded eager batch's loss and gradients."""
    from tinytf.data.batches import Batch
    from tinytf.fast.cuda.graph import StepGraphs
    from tinytf.models.transformer import label_smoothed_loss
    tinytf.manual_seed(0)
    model = Transformer(small_config(dropout=0.0)).to("gpu").train()
    opt = adam(model.named_parameters(), lr=1e-3)
    g = np.random.default_rng(5)

    def make(b, s, t):
        src = g.integers(4, V, (b, s))
        tgt = g.integers(4, V, (b, t + 1))
        src[:, -1] = 0
        tgt[:, -1] = 0
        return Batch(src, tgt[:, :-1], tgt[:, 1:].copy(), int((src != 0).sum()),
                     int((tgt[:, 1:] != 0).sum()), np.arange(b))

    def loss_fn(src, tgt_in, tgt_out):
        with amp.autocast("float32"):
            return label_smoothed_loss(model(src, tgt_in), tgt_out, count=0)[0]

    def eager(batch):
        opt.zero_grad()
        loss = loss_fn(*(cp.asarray(a) for a in (batch.src, batch.tgt_in, batch.tgt_out)))
        loss.backward()
        return float(loss.item()), opt.flat_buffers.grad.copy()
    batches = [make(5, 7, 6), make(12, 3, 4), make(5, 6, 5), make(30, 9, 9)]
    eager(batches[0])
    opt.step()
    graphs = StepGraphs(loss_fn, opt, "gpu")
    for batch in batches + batches[::-1]:
        ref_loss, ref_grad = eager(batch)
        opt.zero_grad()
        loss = float(graphs.run(batch, seed=11).item())
        assert loss == pytest.approx(ref_loss, rel=1e-4)
        diff = float(cp.linalg.norm(opt.flat_buffers.grad - ref_grad) / cp.linalg.norm(ref_grad))
        assert diff < 1e-4, diff
    assert graphs.captures == 3 and len({id(e[0].pool) for e in graphs.graphs.values()}) == 1


def test_pinned_staging_copies_batches_exactly():
    # Two pinned buffers for twelve arrays: every reuse waits for the copy before it.
    staging = backend.PinnedStaging(slots=2)
    g = np.random.default_rng(3)
    arrays = [g.integers(0, 8000, (int(g.integers(1, 300)), int(g.integers(1, 60))))
              for _ in range(12)] + [np.zeros((0, 5), np.int64), np.arange(7, dtype=np.float32)]
    outs = [staging.to_gpu(a) for a in arrays]
    for a, out in zip(arrays, outs):
        assert out.dtype == a.dtype and out.shape == a.shape
        np.testing.assert_array_equal(cp.asnumpy(out), a)
    assert isinstance(backend.to_device_pinned(arrays[0], "cpu"), np.ndarray)
