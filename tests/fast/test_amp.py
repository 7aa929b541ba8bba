"""Mixed precision on the CPU: bf16 rounding, autocast casts, loss scaling, master weights.

bf16 is emulated on NumPy (float32 values rounded to bf16); float16 is NumPy's own. The
loss scaler is exercised with real float16 overflow, not with planted flags only.
"""
import concurrent.futures
import json
import math
import warnings

import numpy as np
import pytest

import tinytf
from tinytf import functional as F
from tinytf.engine.tensor import Tensor
from tinytf.fast.cuda import kernels
from tinytf.fast.loss_scaler import DynamicLossScaler
from tinytf.nn import amp
from tinytf.ops import cast
from tinytf.optim.adam import Adam

rng = np.random.default_rng(0)


# ----- bf16 emulation --------------------------------------------------------------------

def test_bf16_rounding_hand_cases():
    ulp = 2.0 ** -7  # bf16 keeps 7 mantissa bits: the spacing just above 1.0
    cases = {
        1.0 + ulp / 2: 1.0,                 # halfway, 1.0 has an even mantissa: down
        1.0 + ulp + ulp / 2: 1.0 + 2 * ulp,  # halfway, 1+ulp is odd: up to the even one
        1.0 + ulp / 2 + 2.0 ** -20: 1.0 + ulp,  # just above halfway: up
        -(1.0 + ulp / 2): -1.0,
        3.0e38: 3.0040553e38,               # large but below bf16's max (~3.39e38)
        float(np.finfo(np.float32).max): math.inf,  # rounds past bf16's max
        0.0: 0.0,
        2.0 ** -130: 2.0 ** -130,           # subnormal with few bits: exact
    }
    x = np.array(list(cases), dtype=np.float32)
    np.testing.assert_array_equal(cast.round_to_bf16(x), np.array(list(cases.values()),
                                                                 dtype=np.float32))
    special = cast.round_to_bf16(np.array([np.nan, -np.nan, np.inf, -np.inf], np.float32))
    assert np.isnan(special[:2]).all() and list(special[2:]) == [np.inf, -np.inf]


def test_bf16_bits_round_trip_and_idempotence():
    x = (rng.standard_normal(10_000) * 10.0 ** rng.integers(-30, 30, 10_000)).astype(np.float32)
    r = cast.round_to_bf16(x)
    assert r.dtype == np.float32 and r.shape == x.shape
    np.testing.assert_array_equal(cast.round_to_bf16(r), r)          # bf16 values are fixed
    np.testing.assert_array_equal(cast.bf16_from_bits(cast.bf16_bits(r)), r)
    assert (r.view(np.uint32) & 0xFFFF == 0).all()                   # low half is zero
    # Relative error at most half a bf16 ulp (2^-8) for normal numbers.
    normal = np.abs(x) > 1e-37
    assert (np.abs(r - x)[normal] <= np.abs(x)[normal] * 2.0 ** -8).all()


def test_bf16_matches_torch():
    torch = pytest.importorskip("torch", reason="PyTorch is only an optional oracle")
    x = np.concatenate([rng.standard_normal(5000).astype(np.float32) * 1e3,
                        (1.0 + np.arange(512) * 2.0 ** -9).astype(np.float32)])  # ties
    want = torch.from_numpy(x).to(torch.bfloat16).to(torch.float32).numpy()
    np.testing.assert_array_equal(cast.round_to_bf16(x), want)


# ----- policy and autocast -------------------------------------------------------------

def test_policy_names_and_dtypes():
    assert amp.Policy("bf16").compute_dtype(np) == cast.EMULATED_BF16
    assert amp.Policy("fp16").compute_dtype(np) == np.float16
    assert amp.Policy("tf32").compute_dtype(np) == np.float32
    assert amp.Policy("fp16").loss_scaling and not amp.Policy("bf16").loss_scaling
    with pytest.raises(ValueError, match="amp: precision"):
        amp.Policy("fp8")


def test_cast_inputs_is_identity_outside_autocast():
    x, w = Tensor(rng.standard_normal((3, 4))), Tensor(rng.standard_normal((5, 4)))
    assert amp.active() is None
    assert amp.cast_inputs("linear", x, w) == (x, w)
    with amp.autocast("float32"):
        assert amp.active() is None and amp.cast_inputs("linear", x, w) == (x, w)


def test_nested_autocast_blocks_and_tf32():
    """An inner block's policy holds inside it and the outer's comes back after it;
    ``enabled=False`` turns autocast off (PyTorch's meaning) and keeps the outer TF32;
    "tf32" asks kernels.matmul for TF32 products, any other precision for none."""
    x, w = Tensor(rng.standard_normal((3, 4)).astype(np.float32)), \
        Tensor(rng.standard_normal((5, 4)).astype(np.float32))
    assert amp.tf32_override() is None
    with amp.autocast("tf32"):
        assert amp.tf32_override() is True and kernels.tf32_enabled()
        with amp.autocast("bf16"):
            assert amp.active().name == "bf16" and amp.tf32_override() is False
            assert F.linear(x, w).data.dtype == np.float32        # emulated bf16 ...
            assert amp.compute_dtype("linear", x) == cast.EMULATED_BF16   # ... in bf16
            with amp.autocast(enabled=False):
                assert amp.active() is None and amp.compute_dtype("linear", x) is None
                assert amp.tf32_override() is False
            assert amp.active().name == "bf16"
        assert amp.active().name == "tf32" and amp.tf32_override() is True
    assert amp.active() is None and amp.tf32_override() is None


def test_autocast_fp16_linear_gives_float32_param_grads():
    x = Tensor(rng.standard_normal((6, 4)).astype(np.float32), requires_grad=True)
    w = tinytf.nn.Parameter(rng.standard_normal((3, 4)))
    b = tinytf.nn.Parameter(rng.standard_normal(3))
    with amp.autocast("fp16"):
        xc, wc, bc = amp.cast_inputs("linear", x, w, b)
        y = F.linear(xc, wc, bc)
        assert y.dtype == np.float16
        (logits,) = amp.cast_inputs("cross_entropy", y)
        assert logits.dtype == np.float32            # range-sensitive op back in float32
        loss = F.cross_entropy(logits, np.array([0, 1, 2, 0, 1, 2]))
    loss.backward()
    assert w.grad.dtype == np.float32 and b.grad.dtype == np.float32
    assert x.grad.dtype == np.float32
    # The same maths in float32 on float16-rounded inputs.
    x16, w16, b16 = (Tensor(t.data.astype(np.float16).astype(np.float32), requires_grad=True)
                     for t in (x, w, b))
    F.cross_entropy(F.linear(x16, w16, b16), np.array([0, 1, 2, 0, 1, 2])).backward()
    np.testing.assert_allclose(w.grad, w16.grad, rtol=2e-2, atol=2e-3)


def test_autocast_bf16_emulation_rounds_inputs_and_grads():
    x = Tensor(rng.standard_normal((5, 8)).astype(np.float32), requires_grad=True)
    w = tinytf.nn.Parameter(rng.standard_normal((7, 8)))
    with amp.autocast("bf16") as policy:
        assert policy.compute_dtype(np) == cast.EMULATED_BF16
        xc, wc = amp.cast_inputs("linear", x, w)
        y = F.linear(xc, wc)
    np.testing.assert_array_equal(xc.data, cast.round_to_bf16(x.data))
    np.testing.assert_array_equal(wc.data, cast.round_to_bf16(w.data))
    g = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(g)
    assert w.grad.dtype == np.float32
    # dW = round(g^T round(x)): the gradient crossing the cast back is rounded to bf16.
    np.testing.assert_allclose(w.grad, cast.round_to_bf16(g.T @ xc.data), rtol=1e-6, atol=1e-6)
    assert amp.active() is None                                  # restored on exit


def test_autocast_linear_casts_inside_the_op():
    # Under autocast, F.linear adds one Linear node and no cast nodes: the op rounds x and
    # W itself and adds the float32 bias; dx (x is float32), dW and db are float32 sums of
    # the rounded operands (cuBLAS's float32 result type), not rounded again.
    x = Tensor(rng.standard_normal((5, 8)).astype(np.float32), requires_grad=True)
    w = tinytf.nn.Parameter(rng.standard_normal((7, 8)))
    b = tinytf.nn.Parameter(rng.standard_normal(7))
    with amp.autocast("bf16"):
        y = F.linear(x, w, b)
    assert isinstance(y._ctx, tinytf.ops.Linear) and y._ctx.inputs == (x, w, b)
    xr, wr = (cast.round_to_bf16(t.data) for t in (x, w))
    np.testing.assert_allclose(y.data, xr @ wr.T + b.data, rtol=1e-6, atol=1e-6)  # float32 bias
    g = rng.standard_normal(y.shape).astype(np.float32)
    y.backward(g)
    np.testing.assert_allclose(x.grad, g @ wr, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(w.grad, g.T @ xr, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(b.grad, g.sum(0), rtol=1e-6, atol=1e-6)
    assert x.grad.dtype == w.grad.dtype == b.grad.dtype == np.float32


def test_autocast_fp16_linear_weight_grad_is_a_float32_sum():
    # Real float16 operands: the output is float16, the weight gradient is the float32
    # product of the float16 values (no float16 rounding of the sum).
    x = Tensor((rng.standard_normal((64, 16)) * 4).astype(np.float32), requires_grad=True)
    w = tinytf.nn.Parameter(rng.standard_normal((8, 16)))
    with amp.autocast("fp16"):
        y = F.linear(x, w)
    assert y.dtype == np.float16
    g = rng.standard_normal(y.shape).astype(np.float16)
    y.backward(g)
    want = g.astype(np.float64).T @ x.data.astype(np.float16).astype(np.float64)
    assert w.grad.dtype == np.float32 and x.grad.dtype == np.float32
    np.testing.assert_allclose(w.grad, want, rtol=1e-5, atol=1e-4)
    want_x = g.astype(np.float64) @ w.data.astype(np.float16).astype(np.float64)
    np.testing.assert_allclose(x.grad, want_x, rtol=1e-5, atol=1e-4)   # float32 too
    assert np.abs(want.astype(np.float16) - want).max() > 1e-3   # float16 would have lost it


def test_matmul_out_dtype_on_numpy():
    a = rng.standard_normal((4, 6)).astype(np.float16)
    b = rng.standard_normal((6, 3)).astype(np.float16)
    got = kernels.matmul(a, b, out_dtype=np.float32)
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, a.astype(np.float64) @ b, rtol=1e-6, atol=1e-6)
    assert kernels.matmul(a, b).dtype == np.float16
    a32, b32 = a.astype(np.float32), b.astype(np.float32)
    np.testing.assert_allclose(kernels.matmul(a32, b32, alpha=0.25), (a32 @ b32) * 0.25,
                               rtol=1e-6)


# ----- DynamicLossScaler -----------------------------------------------------------------

def _param(values):
    p = tinytf.nn.Parameter(np.zeros(len(values)))
    p.grad = np.array(values, dtype=np.float32)
    return p


def test_scaler_skips_on_inf_and_nan_and_backs_off():
    scaler = DynamicLossScaler(init_scale=1024.0, growth_interval=3)
    for bad in (np.inf, -np.inf, np.nan):
        p = _param([1.0, bad])
        opt = Adam([p], lr=0.1)
        before = p.data.copy()
        stepped = scaler.step(opt)
        assert not stepped and opt.step_count == 0
        np.testing.assert_array_equal(p.data, before)             # no update on overflow
    assert scaler.scale == 1024.0 * 0.5 ** 3 and scaler.skipped_steps == 3
    assert scaler.growth_tracker == 0


def test_scaler_unscales_and_grows_after_interval():
    scaler = DynamicLossScaler(init_scale=8.0, growth_interval=3)
    for i in range(3):
        p = _param([8.0, -16.0])
        found = scaler.unscale_([("w", p)])
        assert not found
        np.testing.assert_array_equal(p.grad, np.array([1.0, -2.0]) * 8.0 / scaler.scale)
        scaler.update(found)
    assert scaler.scale == 16.0 and scaler.growth_tracker == 0
    # An overflow in the middle of a window restarts the count.
    scaler.update(False)
    scaler.update(True)
    assert scaler.scale == 8.0 and scaler.growth_tracker == 0
    scaler.update(False)
    scaler.update(False)
    assert scaler.scale == 8.0 and scaler.growth_tracker == 2


def test_scaler_extra_factor_and_disabled_passthrough():
    p = _param([4.0, 8.0])
    assert not DynamicLossScaler(init_scale=4.0).unscale_([p], extra_factor=0.5)
    np.testing.assert_array_equal(p.grad, [0.5, 1.0])
    off = DynamicLossScaler(enabled=False)
    loss = Tensor(np.float32(3.0))
    assert off.scale_loss(loss) is loss
    q = _param([np.inf, 2.0])
    assert not off.unscale_([q], extra_factor=0.5)               # disabled: no check
    assert q.grad[1] == 1.0
    off.update(True)
    assert off.scale == 2.0 ** 16 and off.skipped_steps == 0


def test_scaler_state_round_trip_json():
    a = DynamicLossScaler(init_scale=256.0, growth_interval=5)
    for found in (False, False, True, False):
        a.update(found)
    state = json.loads(json.dumps(a.state_dict()))
    b = DynamicLossScaler()
    b.load_state_dict(state)
    assert b.state_dict() == a.state_dict()
    for found in (False,) * 4:          # continues exactly where a would
        a.update(found)
        b.update(found)
    assert a.scale == b.scale == 256.0 and b.growth_tracker == a.growth_tracker == 0
    with pytest.raises(KeyError, match="missing"):
        b.load_state_dict({"scale": 1.0})


def test_scaler_gives_up_below_min_scale():
    scaler = DynamicLossScaler(init_scale=2.0, min_scale=0.5)
    scaler.update(True)
    scaler.update(True)                 # 0.5: still allowed
    with pytest.raises(FloatingPointError, match="every scale"):
        scaler.update(True)


# ----- training with float32 master weights ----------------------------------------------

def _regression(n=64, d=16):
    g = np.random.default_rng(1)
    x = g.standard_normal((n, d)).astype(np.float32)
    w_true = g.standard_normal((1, d)).astype(np.float32)
    return x, x @ w_true.T


def _train(precision, steps=60, init_scale=2.0 ** 16, scale_loss_by=1.0):
    tinytf.manual_seed(0)
    x, y = _regression()
    lin = tinytf.nn.Linear(x.shape[1], 1)
    opt = Adam(lin.named_parameters(), lr=0.05)
    scaler = DynamicLossScaler(init_scale=init_scale,
                                   enabled=amp.Policy(precision).loss_scaling)
    losses = []
    for _ in range(steps):
        with amp.autocast(precision):
            xc, w, b = amp.cast_inputs("linear", Tensor(x), lin.weight, lin.bias)
            pred = F.linear(xc, w, b).astype(np.float32)
            loss = ((pred - Tensor(y)) ** 2).mean() * scale_loss_by
        scaler.scale_loss(loss).backward()
        scaler.step(opt)
        opt.zero_grad()
        losses.append(loss.item())
    return lin, opt, scaler, losses


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # fp16 overflow is the point
@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_mixed_precision_training_tracks_float32(precision):
    lin32, _, _, l32 = _train("float32")
    lin, opt, scaler, losses = _train(precision)
    assert losses[-1] < 0.05 * losses[0]
    # Master weights and Adam state stay float32; the run follows the float32 one.
    assert lin.weight.dtype == np.float32 and lin.weight.grad is None
    assert all(v.dtype == np.float32 for v in opt.exp_avg.values())
    assert all(v.dtype == np.float32 for v in opt.exp_avg_sq.values())
    np.testing.assert_allclose(lin.weight.data, lin32.weight.data, atol=0.05)


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_fp16_overflow_is_skipped_and_scale_recovers():
    # Loss ~1e3 times 2^16 overflows float16's 65504 in backward: the first steps must be
    # skipped (weights untouched) while the scale backs off, then training proceeds.
    lin, opt, scaler, losses = _train("fp16", steps=40, init_scale=2.0 ** 16,
                                      scale_loss_by=1000.0)
    assert scaler.skipped_steps >= 1 and scaler.scale < 2.0 ** 16
    assert opt.step_count == 40 - scaler.skipped_steps
    assert losses[-1] < 0.1 * losses[0]
    assert np.isfinite(lin.weight.data).all()


def test_master_weights_keep_updates_that_bf16_weights_lose():
    # An update of 1e-4 on a weight of 1.0 is below half a bf16 ulp (2^-8 ~ 3.9e-3): a
    # bf16 weight never moves, the float32 master accumulates all of them.
    master = np.ones(4, dtype=np.float32)
    bf16_weight = cast.round_to_bf16(master)
    for _ in range(100):
        master -= np.float32(1e-4)
        bf16_weight = cast.round_to_bf16(bf16_weight - np.float32(1e-4))
    np.testing.assert_array_equal(bf16_weight, 1.0)
    np.testing.assert_allclose(master, 0.99, rtol=1e-5)
    # The weights a bf16 forward pass then sees are the master's, rounded.
    assert (cast.round_to_bf16(master) < 1.0).all()


@pytest.mark.parametrize("found", [True, False])
@pytest.mark.parametrize("tracker", [0, 2])
def test_the_device_scale_moves_before_the_host_learns_the_outcome(found, tracker):
    """update_on_device(flag) sets the device scale to what update(flag) then sets the
    host's: halved after an overflow, doubled when the clean step ends a growth interval."""
    scaler = DynamicLossScaler(init_scale=64.0, growth_interval=3)
    scaler.growth_tracker = tracker
    scaler.scale_loss(Tensor(np.float32(1.0)), on_device=True)   # creates the device scale
    scaler.update_on_device(np.array([int(found)], np.int32))
    device = float(scaler._device_scale)
    assert scaler.scale == 64.0             # the host has not been told yet
    scaler.update(found_inf=found)
    assert device == scaler.scale == {True: 32.0, False: 128.0 if tracker == 2 else 64.0}[found]


def test_fp16_on_the_cpu_is_named_slow_and_its_overflows_are_quiet_only_under_fp16():
    """The warning of train.py and translate.py: fp16 on the CPU only (NumPy's float16 has
    no BLAS); and the overflows that the loss scaler handles raise no NumPy warning under
    fp16, in the calling thread or in the row-parallel ops' threads, while under any other
    precision they still do."""
    assert "no BLAS" in amp.speed_warning("fp16", "cpu")
    assert amp.speed_warning(amp.Policy("fp16"), "cpu") == amp.speed_warning("fp16", "cpu")
    for precision, device in [("fp16", "gpu"), ("bf16", "cpu"), ("float32", "cpu"),
                              ("tf32", "cpu")]:
        assert amp.speed_warning(precision, device) is None
    big = np.array([60000.0], np.float16)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            with amp.overflows_expected("fp16"):
                assert np.isinf(big * big).all()
                assert np.isinf(pool.submit(lambda: big * big).result()).all()
            for precision in ("bf16", "float32"):
                with amp.overflows_expected(precision), pytest.raises(RuntimeWarning):
                    big * big
            with pytest.raises(RuntimeWarning):   # the filter ends with the block
                big * big
