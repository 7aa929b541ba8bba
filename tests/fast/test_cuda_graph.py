"""CUDA-graph training steps, the parts that run without a GPU: bucketing and padding batch
shapes, and StepGraphs (fixed inputs, gradient slots, accumulation, invalidation) with the
graph replaced by an eager call (fast.cuda.graph.EagerReplay). The capture itself is tested on a
GPU (tests/fast/test_gpu.py, bench/gpu_train.py)."""
import os

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from train_support import _config

from tinytf.data.batches import Batch
from tinytf.engine import backend
from tinytf.fast import adam
from tinytf.fast.cuda.graph import EagerReplay, StepGraphs, bucket_shape, pad_batch
from tinytf.models.transformer import Transformer, TransformerConfig, label_smoothed_loss
from tinytf.text import BOS_ID, EOS_ID, PAD_ID
from tinytf.training import pipelined
from tinytf.training.config import TrainConfig, TrainError, apply_overrides


@given(b=st.integers(1, 5000), s=st.integers(1, 300), t=st.integers(1, 300),
       multiple=st.sampled_from([1, 8, 16]))
def test_bucket_shapes_cover_the_batch_with_little_padding(b, s, t, multiple):
    rows, src_len, tgt_len = bucket_shape(b, s, t, multiple)
    assert rows >= b and src_len >= s and tgt_len >= t
    assert src_len % multiple == 0 and tgt_len % multiple == 0
    assert src_len - s < multiple and tgt_len - t < multiple
    assert rows - b <= b / 8                        # at most 12.5 % padding rows
    if b < 16:
        assert rows == b


def test_bucket_shapes_are_few():
    # Every batch of a 25k-token length-grouped epoch: a few dozen shapes, not hundreds.
    shapes = {bucket_shape(25000 // L, L, t, 8) for L in range(4, 129)
              for t in range(max(2, L - 6), min(129, L + 7))}
    assert len(shapes) < 200
    rows = {r for r, _, _ in shapes}
    assert len(rows) < 60


def _batch(rng, b, s, t):
    src = rng.integers(4, 50, size=(b, s))
    tgt = rng.integers(4, 50, size=(b, t + 1))
    tgt[:, 0] = BOS_ID
    for i in range(b):
        n = rng.integers(1, s + 1)
        src[i, n:] = PAD_ID
        src[i, n - 1] = EOS_ID
        m = rng.integers(2, t + 2)
        tgt[i, m:] = PAD_ID
    tgt_in, tgt_out = tgt[:, :-1], tgt[:, 1:].copy()
    return Batch(src, tgt_in, tgt_out, n_src_tokens=int((src != PAD_ID).sum()),
                 n_tgt_tokens=int((tgt_out != PAD_ID).sum()), indices=np.arange(b))


def test_pad_batch_pads_with_pad_and_checks_the_fit():
    batch = _batch(np.random.default_rng(0), 3, 5, 4)
    src, tgt_in, tgt_out = pad_batch(batch, (4, 8, 8))
    assert src.shape == (4, 8) and tgt_in.shape == tgt_out.shape == (4, 8)
    assert src.dtype == batch.src.dtype
    np.testing.assert_array_equal(src[:3, :5], batch.src)
    np.testing.assert_array_equal(tgt_out[:3, :4], batch.tgt_out)
    assert (src[3] == PAD_ID).all() and (src[:, 5:] == PAD_ID).all()
    assert (tgt_in[:, 4:] == PAD_ID).all() and (tgt_out[3] == PAD_ID).all()
    with pytest.raises(ValueError, match="does not fit"):
        pad_batch(batch, (2, 8, 8))


def _model(max_len: int = 61):
    backend.manual_seed(0)
    cfg = TransformerConfig.preset("tiny", d_model=16, n_heads=2, d_ff=32, n_encoder_layers=1,
                                   n_decoder_layers=1, vocab_size=50, dropout=0.0,
                                   max_len=max_len)
    return Transformer(cfg).train()


def _loss_fn(model):
    def loss(src, tgt_in, tgt_out):
        return label_smoothed_loss(model(src, tgt_in), tgt_out, count=0)[0]
    return loss


def _eager_grads(model, batch):
    for _, p in model.named_parameters():
        p.grad = None
    loss = _loss_fn(model)(batch.src, batch.tgt_in, batch.tgt_out)
    loss.backward()
    return float(loss.data), {n: p.grad.copy() for n, p in model.named_parameters()}


def test_step_graphs_equal_the_unpadded_step():
    """A batch run through StepGraphs (padded to its bucket shape, copied into that shape's
    fixed inputs) gives the unpadded batch's loss and gradients, in the flat buffer's slots;
    one graph per shape, reused; least recently used dropped beyond max_graphs."""
    rng = np.random.default_rng(1)
    model = _model()
    opt = adam(model.named_parameters(), lr=1e-3)
    _eager_grads(model, _batch(rng, 3, 5, 4))
    opt.step()                                   # builds the flat buffers
    opt.zero_grad()
    graphs = StepGraphs(_loss_fn(model), opt, "cpu", capture=EagerReplay, max_graphs=2)
    assert graphs.ready()
    for b, s, t in [(3, 5, 4), (19, 7, 9), (3, 6, 3), (18, 11, 2)]:
        batch = _batch(rng, b, s, t)
        loss_ref, grads_ref = _eager_grads(model, batch)
        opt.zero_grad()
        loss = graphs.run(batch, seed=7)
        assert float(loss.data) == pytest.approx(loss_ref, rel=1e-5)
        for name, p in model.named_parameters():
            assert p.grad is p.grad_buffer, name          # the flat buffer's slot
            np.testing.assert_allclose(p.grad, grads_ref[name], rtol=2e-4, atol=1e-6,
                                       err_msg=name)
    # (3, 5, 4) and (3, 6, 3) share the shape (3, 8, 8); (19, 7, 9) pads to 20 rows.
    assert graphs.captures == 3
    assert [shape for shape, _ in graphs.graphs] == [(3, 8, 8), (18, 16, 8)]  # max 2, LRU
    assert bucket_shape(19, 7, 9) == (20, 8, 16)


def test_step_graphs_never_pad_beyond_the_models_length():
    rng = np.random.default_rng(3)
    model = _model(max_len=61)                   # positions 0..60
    opt = adam(model.named_parameters(), lr=1e-3)
    _eager_grads(model, _batch(rng, 2, 4, 4))
    opt.step()
    graphs = StepGraphs(_loss_fn(model), opt, "cpu", capture=EagerReplay, max_len=61)
    graphs.run(_batch(rng, 2, 58, 60))           # 64 and 64 would not fit: 61 and 61
    graphs.run(_batch(rng, 2, 30, 20))
    assert [shape for shape, _ in graphs.graphs] == [(2, 61, 61), (2, 32, 24)]
    with pytest.raises(ValueError, match="exceeds max_len"):   # without the cap
        StepGraphs(_loss_fn(model), opt, "cpu", capture=EagerReplay).run(_batch(rng, 2, 58, 60))


def test_step_graphs_recapture_when_the_flat_buffer_is_rebuilt():
    rng = np.random.default_rng(2)
    model = _model()
    opt = adam(model.named_parameters(), lr=1e-3)
    assert not StepGraphs(_loss_fn(model), opt, "cpu", capture=EagerReplay).ready()
    _eager_grads(model, _batch(rng, 2, 4, 4))
    opt.step()
    graphs = StepGraphs(_loss_fn(model), opt, "cpu", capture=EagerReplay)
    graphs.run(_batch(rng, 2, 4, 4))
    assert graphs.captures == 1
    model.load_state_dict(model.state_dict())    # new arrays: the graphs' addresses are stale
    assert not graphs.ready()
    _eager_grads(model, _batch(rng, 2, 4, 4))
    opt.step()                                   # Adam rebuilds its flat buffers
    assert graphs.ready()
    graphs.run(_batch(rng, 2, 4, 4))
    assert graphs.captures == 2                  # recaptured on the new buffer


def _graph_trainer(data_dir, out, capture=EagerReplay, **kw):
    cfg = apply_overrides(_config(data_dir, out, **kw), ["dropout=0.0"])
    t = pipelined.PipelinedTrainer(cfg, log_stream=open(os.devnull, "w"))
    t.graphs = t.make_step_graphs(capture=capture)
    return t


def test_trainer_with_step_graphs_follows_the_eager_run(data_dir, tmp_path):
    """The trainer's --cuda-graph path (graphs emulated eagerly: padding, fixed inputs,
    gradient accumulation over update_freq batches in a second buffer) trains like the
    ordinary path: at every step the same loss, token count and gradient up to rounding.

    Parameters are not compared entry by entry: gradients that are zero in exact
    arithmetic (the key biases: softmax ignores a shift that is the same for every key)
    or nearly so get rounding noise, which differs with padding, and Adam turns noise of
    any size into steps of size lr.
    """
    runs = {}
    for name in ("eager", "graphs"):
        cfg = apply_overrides(_config(data_dir, tmp_path / name, max_steps=4, update_freq=2),
                              ["dropout=0.0"])
        t = pipelined.PipelinedTrainer(cfg, log_stream=open(os.devnull, "w"))
        if name == "graphs":
            t.graphs = t.make_step_graphs(capture=EagerReplay)
        results, grads, settle, adam = [], [], t.settle, t.optimizer.step

        def settle_step(update, settle=settle, results=results):
            results.append(settle(update))
            return results[-1]

        def adam_step(skip=None, t=t, grads=grads, adam=adam):
            grads.append(np.concatenate([p.grad.ravel() for _, p in t.params]))
            adam(skip=skip)
        t.settle, t.optimizer.step = settle_step, adam_step
        runs[name] = (t.train(), t, results, grads)
    (s_e, _, r_e, g_e), (s_g, t_g, r_g, g_g) = runs["eager"], runs["graphs"]
    assert s_g["steps"] == s_e["steps"] == 4 and len(g_g) == len(g_e) == 4
    assert t_g.graphs.captures >= 2         # the first step is eager: it builds Adam's buffers
    for a, b, ga, gb in zip(r_e, r_g, g_e, g_g):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5)
        assert b["tokens"] == a["tokens"]
        assert np.linalg.norm(gb - ga) <= 1e-3 * np.linalg.norm(ga)
    assert s_g["dev_loss"] == pytest.approx(s_e["dev_loss"], rel=1e-4)


def test_a_failed_capture_falls_back_to_eager_steps(data_dir, tmp_path):
    class Broken(EagerReplay):
        def __init__(self, *a, **k):
            raise RuntimeError("capture refused")
    t = _graph_trainer(data_dir, tmp_path / "broken", capture=Broken, max_steps=3)
    messages = []
    t.log.info = messages.append
    summary = t.train()
    assert summary["steps"] == 3 and t.graphs is None
    assert any("the step failed (RuntimeError: capture refused)" in m
               for m in messages)


def test_cuda_graph_needs_a_gpu():
    with pytest.raises(TrainError, match="needs --device gpu"):
        TrainConfig(cuda_graph=True).resolved()
    for precision in ("bf16", "fp16"):
        assert TrainConfig(cuda_graph=True, device="gpu", precision=precision).resolved()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # float16 overflow is the point
def test_fp16_through_step_graphs_follows_the_eager_run(data_dir, tmp_path):
    """fp16 with --cuda-graph: backward starts from the loss times the scaler's device
    scalar, which a replay reads afresh, so the overflow-skip-halve pattern and the losses
    are the eager run's (a graph that kept its capture's scale would overflow for ever)."""
    runs = {}
    for name in ("eager", "graphs"):
        cfg = apply_overrides(_config(data_dir, tmp_path / name, max_steps=4,
                                      precision="fp16"), ["dropout=0.0"])
        t = pipelined.PipelinedTrainer(cfg, log_stream=open(os.devnull, "w"))
        if name == "graphs":
            t.graphs = t.make_step_graphs(capture=EagerReplay)
        results, settle = [], t.settle

        def settle_step(update, settle=settle, results=results):
            results.append(settle(update))
            return results[-1]
        t.settle = settle_step
        runs[name] = (t.train(), t, results)
    (s_e, t_e, r_e), (s_g, t_g, r_g) = runs["eager"], runs["graphs"]
    assert t_g.graphs.captures >= 1 and s_g["steps"] == s_e["steps"] == 4
    assert [r["overflow"] for r in r_g] == [r["overflow"] for r in r_e]
    assert any(r["overflow"] for r in r_e) and t_g.scaler.scale == t_e.scaler.scale
    for a, b in zip(r_e, r_g):
        if not a["overflow"]:
            assert b["loss"] == pytest.approx(a["loss"], rel=1e-3)


def test_the_device_loss_scale_follows_the_scale():
    from tinytf.engine.tensor import Tensor
    from tinytf.fast.loss_scaler import DynamicLossScaler
    scaler = DynamicLossScaler(init_scale=8.0)
    loss = Tensor(np.float32(2.0), requires_grad=True)
    assert float(scaler.scale_loss(loss, on_device=True).data) == 16.0
    device_scale = scaler._device_scale
    scaler.update(found_inf=True)                       # halves S: the scalar follows
    assert float(device_scale) == 4.0 and scaler._device_scale is device_scale
    scaler.load_state_dict(dict(scaler.state_dict(), scale=32.0))
    assert float(device_scale) == 32.0
    assert DynamicLossScaler(enabled=False).scale_loss(loss, on_device=True) is loss


def test_step_graphs_keep_one_graph_per_variant():
    """A step captured without dropout is never replayed with it (late dropout switches the
    model's training mode during a run): each (shape, variant) gets its own graph."""
    rng = np.random.default_rng(4)
    model = _model()
    opt = adam(model.named_parameters(), lr=1e-3)
    _eager_grads(model, _batch(rng, 2, 4, 4))
    opt.step()
    graphs = StepGraphs(_loss_fn(model), opt, "cpu", capture=EagerReplay)
    for variant in (False, False, True, True):
        graphs.run(_batch(rng, 2, 4, 4), variant=variant)
    assert graphs.captures == 2
    assert list(graphs.graphs) == [((2, 8, 8), False), ((2, 8, 8), True)]
