"""The fast paths against the reference ops they replace (tinytf.fast, tinytf.engine.dispatch).

Each CPU fast variant is run by the same test body as its reference; a whole Transformer
training step is the same with the fast paths on and off. The GPU variants are tested
against the reference through the kernel source compiled for the CPU (test_kernels.py).
"""
import subprocess
import sys

import numpy as np
import pytest

import tinytf
from tinytf import fast, ops
from tinytf import functional as F
from tinytf.engine import backend
from tinytf.engine.dispatch import impl
from tinytf.engine.gradcheck import gradcheck
from tinytf.engine.tensor import Tensor
from tinytf.models.transformer import Transformer, TransformerConfig, label_smoothed_loss

rng = np.random.default_rng(0)


@pytest.fixture(params=["reference", "fast"])
def mode(request):
    """Run the test once with the reference ops and once with the fast variants."""
    fast.set_enabled(request.param == "fast")
    try:
        yield request.param
    finally:
        fast.set_enabled(True)


def leaf(a):
    return Tensor(np.asarray(a), requires_grad=True)


def test_every_fast_op_subclasses_the_reference_it_replaces_directly():
    """Each device's class names its reference as its parent: a GPU class never inherits
    a CPU one, so what runs on one device is read in two classes."""
    for device, table in (("cpu", fast.CPU_OPS), ("gpu", fast.GPU_OPS)):
        for name, cls in table.items():
            ref = impl.reference(name)
            assert cls.__bases__ == (ref,), (device, name)
            assert ref.__module__.startswith("tinytf.ops."), name
            assert cls.__module__ == ("tinytf.fast.cpu.ops" if device == "cpu" else
                                      "tinytf.fast.cuda.ops"), name
        assert impl.installed(device) == table


def test_switching_off_restores_every_reference():
    fast.set_enabled(False)
    try:
        assert impl.installed("cpu") == impl.installed("gpu") == {} and not fast.enabled()
        assert impl.CrossEntropy.cpu is impl.CrossEntropy.gpu is ops.CrossEntropy
    finally:
        fast.set_enabled(True)
    assert impl.CrossEntropy.cpu is fast.CPU_OPS["CrossEntropy"]
    assert impl.CrossEntropy.gpu is fast.GPU_OPS["CrossEntropy"]


def test_an_op_runs_the_class_of_its_inputs_device():
    x = Tensor(rng.standard_normal((4, 8)).astype(np.float32), requires_grad=True)
    assert impl.LayerNorm.for_inputs((x,)) is fast.CPU_OPS["LayerNorm"]
    assert impl.LayerNorm.for_inputs((None, x.data)) is fast.CPU_OPS["LayerNorm"]
    assert type(F.layer_norm(x)._ctx) is fast.CPU_OPS["LayerNorm"]
    assert impl.Softmax.for_inputs((x,)) is ops.Softmax      # no CPU variant


def test_the_table_takes_only_subclasses_of_the_reference():
    with pytest.raises(TypeError, match="must subclass CrossEntropy"):
        impl.install("cpu", {"CrossEntropy": ops.Softmax})
    with pytest.raises(KeyError):
        impl.install("gpu", {"NoSuchOp": ops.Softmax})
    with pytest.raises(ValueError, match="device"):
        impl.install("tpu", {})
    assert impl.installed("cpu") == fast.CPU_OPS      # a refused table changes nothing


def test_tinytf_fast_0_starts_with_the_reference_ops():
    code = ("import tinytf; from tinytf.engine.dispatch import impl; from tinytf import fast; "
            "assert impl.installed('cpu') == impl.installed('gpu') == {} "
            "and not fast.enabled()")
    env = {"TINYTF_FAST": "0", "PATH": ""}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@pytest.mark.parametrize("eps", [0.0, 0.1])
@pytest.mark.parametrize("ignore_index", [None, 0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(mode, eps, ignore_index, reduction):
    # 150 rows: three of BlockedCrossEntropy's 64-row blocks, the last one partial.
    logits = rng.standard_normal((150, 11)).astype(np.float32) * 3
    target = rng.integers(0, 11, 150)
    target[:7] = 0
    x = leaf(logits)
    loss = F.cross_entropy(x, target, eps, ignore_index, reduction)
    assert type(loss._ctx) is impl.CrossEntropy.cpu
    (loss.sum() if reduction == "none" else loss).backward()
    # The formula of the docstring, in float64.
    z = logits.astype(np.float64)
    logp = z - z.max(1, keepdims=True)
    logp -= np.log(np.exp(logp).sum(1, keepdims=True))
    rows = -(1 - eps) * logp[np.arange(150), target] - eps * logp.mean(1)
    weights = np.ones(150) if ignore_index is None else (target != ignore_index) * 1.0
    rows *= weights
    expected = {"none": rows, "sum": rows.sum(), "mean": rows.sum() / weights.sum()}[reduction]
    np.testing.assert_allclose(loss.numpy(), expected, rtol=2e-5, atol=1e-6)
    q = np.full((150, 11), eps / 11)
    q[np.arange(150), target] += 1 - eps
    grad = (np.exp(logp) - q) * weights[:, None]
    if reduction == "mean":
        grad /= weights.sum()
    np.testing.assert_allclose(x.grad, grad, rtol=2e-5, atol=1e-6)


def test_cross_entropy_gradcheck(mode):
    target = rng.integers(0, 7, 70)
    gradcheck(lambda x: F.cross_entropy(x, target, 0.1, ignore_index=0),
              [leaf(rng.standard_normal((70, 7)))])


def test_embedding(mode):
    ids = rng.integers(0, 9, (4, 6))
    ids[0, :3] = 5                                # repeated ids accumulate
    w = leaf(rng.standard_normal((9, 5)).astype(np.float32))
    out = F.embedding(ids, w)
    assert type(out._ctx) is impl.Embedding.cpu
    g = rng.standard_normal(out.shape).astype(np.float32)
    out.backward(g)
    expected = np.zeros((9, 5), np.float32)
    np.add.at(expected, ids.reshape(-1), g.reshape(-1, 5))
    np.testing.assert_array_equal(out.numpy(), w.data[ids])
    np.testing.assert_allclose(w.grad, expected, rtol=1e-6)
    gradcheck(lambda t: F.embedding(ids, t), [leaf(rng.standard_normal((9, 5)))])


def _training_step(fast_on: bool):
    """Loss and every gradient of one dropout-on training step of a small Transformer."""
    fast.set_enabled(fast_on)
    try:
        backend.manual_seed(3)
        cfg = TransformerConfig(vocab_size=50, d_model=32, n_heads=4, d_ff=64,
                                n_encoder_layers=2, n_decoder_layers=2, dropout=0.1,
                                max_len=64)
        model = Transformer(cfg).train()
        data = np.random.default_rng(1)
        src = data.integers(3, 50, (6, 9))
        tgt = data.integers(3, 50, (6, 8))
        src[0, 6:] = 0
        tgt[1, 5:] = 0
        loss, n = label_smoothed_loss(model(src, tgt[:, :-1]), tgt[:, 1:])
        (loss / n).backward()
        grads = {name: p.grad.copy() for name, p in model.named_parameters()}
        return float(loss.item()), grads
    finally:
        fast.set_enabled(True)


def test_a_whole_transformer_step_is_the_same_with_and_without_the_fast_paths():
    loss_ref, grads_ref = _training_step(False)
    loss_fast, grads_fast = _training_step(True)
    assert loss_fast == pytest.approx(loss_ref, rel=1e-6)
    assert grads_ref.keys() == grads_fast.keys()
    for name in grads_ref:
        scale = np.abs(grads_ref[name]).max() + 1e-12
        np.testing.assert_allclose(grads_fast[name], grads_ref[name], rtol=1e-4,
                                   atol=1e-5 * scale, err_msg=name)


def test_fused_adam_is_adam_where_no_kernel_runs():
    params = [tinytf.nn.Parameter(rng.standard_normal(s).astype(np.float32))
              for s in ((4, 3), (5,))]
    twins = [tinytf.nn.Parameter(p.data.copy()) for p in params]
    a, b = fast.FusedAdam(params, lr=1e-2), tinytf.optim.Adam(twins, lr=1e-2)
    for _ in range(3):
        for p, q in zip(params, twins):
            p.grad = rng.standard_normal(p.shape).astype(np.float32)
            q.grad = p.grad.copy()
        a.step(skip=np.zeros(1, np.int32))
        b.step(skip=np.zeros(1, np.int32))
    for p, q in zip(params, twins):
        np.testing.assert_array_equal(p.data, q.data)
    assert type(fast.adam(params)) is fast.FusedAdam


def test_fused_radam_is_radam_where_no_kernel_runs():
    """With ``rectify`` the threaded flat update takes RAdam's scalars: bitwise Adam(rectify)
    over the updates that take no step (1-5) and those that do."""
    params = [tinytf.nn.Parameter(rng.standard_normal(s).astype(np.float32))
              for s in ((4, 3), (5,))]
    twins = [tinytf.nn.Parameter(p.data.copy()) for p in params]
    a = fast.FusedAdam(params, lr=1e-2, rectify=True)
    b = tinytf.optim.Adam(twins, lr=1e-2, rectify=True)
    start = [p.data.copy() for p in params]
    for t in range(1, 9):
        for p, q in zip(params, twins):
            p.grad = rng.standard_normal(p.shape).astype(np.float32)
            q.grad = p.grad.copy()
        a.step()
        b.step()
        for p, q, p0 in zip(params, twins, start):
            np.testing.assert_array_equal(p.data, q.data)
            assert np.array_equal(p.data, p0) == (t <= 5)
