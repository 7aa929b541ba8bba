"""tinytf.optim.adam: Adam against the formula by hand, the paper's schedule, gradient clipping."""
import json
import math

import numpy as np
import pytest

from tinytf import Tensor, optim


def param(values, dtype=np.float64):
    return Tensor(np.array(values, dtype=dtype), requires_grad=True)


def test_adam_three_steps_by_hand():
    """m = b1 m + (1-b1) g; v = b2 v + (1-b2) g^2; p -= lr m_hat / (sqrt(v_hat) + eps)."""
    lr, b1, b2, eps = 0.1, 0.9, 0.98, 1e-9
    p = param([1.0, -2.0, 0.5])
    grads = [np.array([0.1, -0.2, 0.0]), np.array([0.3, 0.1, -0.05]), np.array([-0.4, 0.2, 1.0])]
    opt = optim.Adam([p], lr=lr, betas=(b1, b2), eps=eps)
    expected, m, v = p.numpy().copy(), np.zeros(3), np.zeros(3)
    for t, g in enumerate(grads, start=1):
        p.grad = g.copy()
        opt.step()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        m_hat, v_hat = m / (1 - b1 ** t), v / (1 - b2 ** t)
        expected = expected - lr * m_hat / (np.sqrt(v_hat) + eps)
        np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12, atol=1e-15)
    assert opt.step_count == 3


def test_adam_first_step_is_lr_times_sign():
    """At t=1, m_hat / sqrt(v_hat) = sign(g): every coordinate with a gradient moves by lr."""
    p = param([0.0, 0.0, 0.0])
    p.grad = np.array([1e-3, -5.0, 0.0])
    optim.Adam([p], lr=0.01).step()
    np.testing.assert_allclose(p.numpy(), [-0.01, 0.01, 0.0], rtol=1e-6)


def test_adam_defaults_named_params_lr_and_missing_grads():
    a, b = param([1.0], np.float32), param([1.0], np.float32)
    opt = optim.Adam([("a", a), ("b", b)])
    assert (opt.lr, opt.betas, opt.eps) == (1e-3, (0.9, 0.98), 1e-9)  # the paper's betas/eps
    a.grad = np.array([1.0], dtype=np.float32)
    opt.lr = 0.5
    opt.step()
    np.testing.assert_allclose(a.numpy(), [0.5], rtol=1e-6)
    np.testing.assert_array_equal(b.numpy(), [1.0])  # no gradient: untouched
    assert a.dtype == np.float32
    opt.zero_grad()
    assert a.grad is None and b.grad is None


def test_adam_state_dict_resumes_exactly():
    rng = np.random.default_rng(0)
    grads = [rng.normal(size=(2, 3)) for _ in range(6)]

    def run(steps, opt, p):
        for g in steps:
            p.grad = g.copy()
            opt.step()

    p1 = param(np.ones((2, 3)))
    o1 = optim.Adam([("w", p1)], lr=0.01)
    run(grads, o1, p1)

    p2 = param(np.ones((2, 3)))
    o2 = optim.Adam([("w", p2)], lr=0.01)
    run(grads[:3], o2, p2)
    state = o2.state_dict()
    scalars = {k: v for k, v in state.items() if not isinstance(v, np.ndarray)}
    json.dumps(scalars)  # JSON-able scalars (checkpoint metadata)
    p3 = param(p2.numpy())
    o3 = optim.Adam([("w", p3)], lr=123.0)
    o3.load_state_dict(state)
    assert o3.step_count == 3 and o3.lr == 0.01
    run(grads[3:], o3, p3)
    np.testing.assert_array_equal(p3.numpy(), p1.numpy())
    bad = dict(state, **{"exp_avg.w": np.zeros((3, 2))})
    with pytest.raises(ValueError, match="exp_avg.w"):
        o3.load_state_dict(bad)


@pytest.mark.parametrize("beta2", [0.98, 0.999])
def test_radam_rectifier_is_the_papers_formula(beta2):
    """r_t from rho_t (Liu et al. 2020, eq. 7-8): 0 until rho_t passes 5, then rising
    towards 1; at beta2 0.98 (rho_inf 99) the values docs/training.md quotes."""
    rho_inf = 2 / (1 - beta2) - 1
    rs = []
    for t in range(1, 3000):
        rho = rho_inf - 2 * t * beta2 ** t / (1 - beta2 ** t)
        r = optim.radam_rectifier(t, beta2)
        if rho <= 5:
            assert r == 0.0
        else:
            expected = math.sqrt((rho - 4) * (rho - 2) * rho_inf
                                 / ((rho_inf - 4) * (rho_inf - 2) * rho))
            assert r == pytest.approx(expected, rel=1e-12)
        rs.append(r)
    assert np.all(np.diff(rs) >= -1e-15) and 0 < rs[-1] <= 1   # (rounding near 1)
    if beta2 == 0.98:
        assert [t for t in range(1, 10) if rs[t - 1] == 0] == [1, 2, 3, 4, 5]
        assert [round(rs[t - 1], 2) for t in (10, 50, 100, 300)] == [0.22, 0.62, 0.82, 0.99]


@pytest.mark.parametrize("flat", [True, False])
def test_rectified_adam_by_hand(flat):
    """RAdam as PyTorch writes it, once rho_t > 5: p -= lr r_t m_hat sqrt(1 - b2^t) /
    (sqrt(v) + eps); before that the moments grow and the parameter stays put."""
    lr, b1, b2, eps = 0.1, 0.9, 0.98, 1e-6     # an eps large enough to see where it sits
    rng = np.random.default_rng(3)
    p = param(rng.normal(size=5))
    start = p.numpy().copy()
    opt = optim.Adam([p], lr=lr, betas=(b1, b2), eps=eps, rectify=True, flat=flat)
    expected, m, v = p.numpy().copy(), np.zeros(5), np.zeros(5)
    for t in range(1, 13):
        g = rng.normal(size=5) * 1e-3
        p.grad = g.copy()
        opt.step()
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        r = optim.radam_rectifier(t, b2)
        if r > 0:
            expected = expected - lr * r * (m / (1 - b1 ** t)) * math.sqrt(1 - b2 ** t) \
                / (np.sqrt(v) + eps)
        np.testing.assert_allclose(p.numpy(), expected, rtol=1e-12, atol=1e-15)
        np.testing.assert_allclose(opt.exp_avg_sq["0"], v, rtol=1e-12)
        assert np.array_equal(p.numpy(), start) == (t <= 5)   # the first 5: no step
    assert opt.lr == lr          # the rectifier scales the step, not the scheduled rate
    assert opt.describe() == "RAdam: Adam(0.9, 0.98, 1e-6) with its rectifier"
    assert optim.Adam([p]).describe() == "Adam(0.9, 0.98, 1e-9)"


def test_rectified_adam_keeps_float32_and_is_adam_in_the_limit():
    """float32 stays float32; far past its warm-up (r_t -> 1, 1 - b2^t -> 1) RAdam takes
    Adam's step."""
    rng = np.random.default_rng(4)
    a, b = param(rng.normal(size=6), np.float32), param(np.zeros(6), np.float32)
    b.data[...] = a.data
    radam = optim.Adam([a], lr=1e-3, rectify=True)
    adam = optim.Adam([b], lr=1e-3)
    radam.step_count = adam.step_count = 5000
    for opt in (radam, adam):
        opt.exp_avg["0"] = np.full(6, 1e-3, np.float32)
        opt.exp_avg_sq["0"] = np.full(6, 1e-6, np.float32)
    a.grad = b.grad = np.full(6, 1e-3, np.float32)
    radam.step()
    adam.step()
    assert a.dtype == np.float32 and radam.exp_avg["0"].dtype == np.float32
    np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-6)


@pytest.mark.parametrize("d_model,warmup,factor", [(512, 4000, 1.0), (256, 100, 2.0)])
def test_noam_lr_is_the_papers_formula(d_model, warmup, factor):
    for step in (1, 2, warmup // 2, warmup - 1, warmup, warmup + 1, 10 * warmup):
        expected = factor * d_model ** -0.5 * min(step ** -0.5, step * warmup ** -1.5)
        assert optim.noam_lr(step, d_model, warmup, factor) == pytest.approx(expected, rel=1e-12)
    steps = np.arange(1, 3 * warmup)
    lrs = [optim.noam_lr(int(s), d_model, warmup, factor) for s in steps]
    assert steps[int(np.argmax(lrs))] == warmup  # peak at the end of warmup
    assert max(lrs) == pytest.approx(factor * (d_model * warmup) ** -0.5, rel=1e-12)
    assert np.all(np.diff(lrs[:warmup]) > 0) and np.all(np.diff(lrs[warmup:]) < 0)


def test_clip_grad_norm():
    a, b, c = param(np.zeros(2)), param(np.zeros((2, 2))), param(np.zeros(3))
    a.grad, b.grad = np.array([3.0, 0.0]), np.array([[0.0, 4.0], [0.0, 12.0]])  # norm 13
    assert optim.grad_norm([a, b, c]) == pytest.approx(13.0)
    total = optim.clip_grad_norm([a, b, c], max_norm=1.3)
    assert total == pytest.approx(13.0)  # the norm before clipping
    assert optim.grad_norm([a, b, c]) == pytest.approx(1.3, rel=1e-5)
    np.testing.assert_allclose(a.grad, [0.3, 0.0], rtol=1e-5)
    assert c.grad is None
    # Below the threshold nothing changes; named pairs are accepted too.
    before = b.grad.copy()
    assert optim.clip_grad_norm([("a", a), ("b", b)], max_norm=10.0) == pytest.approx(1.3,
                                                                                      rel=1e-5)
    np.testing.assert_array_equal(b.grad, before)


def test_clip_grad_norm_keeps_float32():
    p = param(np.zeros(4), np.float32)
    p.grad = np.full(4, 10.0, dtype=np.float32)
    total = optim.clip_grad_norm([p], 1.0)
    assert isinstance(total, float) and math.isclose(total, 20.0, rel_tol=1e-6)
    assert p.grad.dtype == np.float32


# ----- flat parameter buffers -------------------------------------------------------------

def _mlp(seed=0):
    """A small float32 model: two Linear layers (4 parameters)."""
    import tinytf
    tinytf.manual_seed(seed)
    return tinytf.nn.Sequential(tinytf.nn.Linear(6, 5), tinytf.nn.Linear(5, 3))


def _train_steps(model, opt, steps, seed=1, clip=None):
    from tinytf import functional as F
    g = np.random.default_rng(seed)
    for _ in range(steps):
        x = Tensor(g.standard_normal((8, 6)).astype(np.float32))
        loss = (F.relu(model(x)) ** 2).sum()
        loss.backward()
        if clip is not None:
            optim.clip_grad_norm(opt.params, clip)
        opt.step()
        opt.zero_grad()


def _flat_and_not(steps=0):
    """Two equal models, one with the flat Adam and one without, trained ``steps`` alike."""
    a, b = _mlp(), _mlp()
    opt_a = optim.Adam(a.named_parameters(), lr=0.01)
    opt_b = optim.Adam(b.named_parameters(), lr=0.01, flat=False)
    _train_steps(a, opt_a, steps)
    _train_steps(b, opt_b, steps)
    return a, opt_a, b, opt_b


def test_flat_adam_equals_adam_one_parameter_at_a_time():
    a, opt_a, b, opt_b = _flat_and_not()
    for clip in (None, 0.5):      # 0.5 clips: the flat buffer is scaled in one operation
        _train_steps(a, opt_a, 4, clip=clip)
        _train_steps(b, opt_b, 4, clip=clip)
        for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
            np.testing.assert_array_equal(p.data, q.data, err_msg=name)
            np.testing.assert_array_equal(opt_a.exp_avg_sq[name], opt_b.exp_avg_sq[name])
    flat = opt_a.flat_buffers
    assert flat is not None and opt_b.flat_buffers is None
    # Parameters, moments and the gradient slots are views of the four flat buffers.
    for p, (_, q) in zip(flat.params, a.named_parameters()):
        assert p is q and np.shares_memory(p.data, flat.data)
        assert np.shares_memory(p.grad_buffer, flat.grad)
    assert all(np.shares_memory(opt_a.exp_avg[n], flat.moments[0]) for n, _ in opt_a.params)


def test_backward_writes_gradients_into_the_flat_buffer():
    model = _mlp()
    opt = optim.Adam(model.named_parameters(), lr=0.01)
    _train_steps(model, opt, 1)
    flat = opt.flat_buffers
    from tinytf import functional as F
    x = Tensor(np.ones((2, 6), np.float32))
    (F.relu(model(x)) ** 2).sum().backward()
    assert flat.grads_linked()                       # no copy: backward wrote the slots
    assert optim.flat_gradient(opt.params) is flat.grad
    norm = math.sqrt(sum(float((p.grad.astype(np.float64) ** 2).sum()) for p in flat.params))
    assert optim.grad_norm(opt.params) == pytest.approx(norm, rel=1e-6)
    # A second backward before the step accumulates in place (gradient accumulation).
    first = flat.grad.copy()
    (F.relu(model(x)) ** 2).sum().backward()
    np.testing.assert_allclose(flat.grad, 2 * first, rtol=1e-6)
    # The same parameters in another order (the all-reduce sorts them by name) share the
    # buffer; a part of them does not.
    assert optim.flat_gradient(opt.params[::-1]) is flat.grad
    assert optim.flat_gradient(opt.params[1:]) is None


def test_flat_adam_relinks_after_the_arrays_are_replaced():
    # load_state_dict gives the parameters new arrays and the optimizer new moments; a
    # gradient can also be replaced from outside. The flat optimizer must notice each
    # and continue exactly like the one-at-a-time optimizer.
    a, opt_a, b, opt_b = _flat_and_not(steps=3)
    c = _mlp(seed=5)                                 # a fresh model and optimizer, resumed
    opt_c = optim.Adam(c.named_parameters(), lr=0.01)
    _train_steps(c, opt_c, 1)                        # (built its own flat buffers first)
    c.load_state_dict(a.state_dict())
    opt_c.load_state_dict(opt_a.state_dict())
    _train_steps(c, opt_c, 2)
    _train_steps(b, opt_b, 2)
    for (name, p), (_, q) in zip(c.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)
    assert opt_c.flat_buffers.linked([p for _, p in opt_c.params])
    # A gradient replaced by a new array is gathered back into the buffer.
    from tinytf import functional as F
    (F.relu(c(Tensor(np.ones((2, 6), np.float32)))) ** 2).sum().backward()
    first = opt_c.flat_buffers.params[0]
    first.grad = first.grad.copy()
    assert optim.flat_gradient(opt_c.params) is None
    opt_c.step()
    assert opt_c.flat_buffers.grads_linked()


def test_flat_adam_skips_parameters_without_a_gradient():
    # A parameter with no gradient must keep its value and its moments (PyTorch skips
    # it): the flat step, which updates every slot, is not used for such a step.
    a, opt_a, b, opt_b = _flat_and_not(steps=2)
    for model, opt in ((a, opt_a), (b, opt_b)):
        params = [p for _, p in opt.params]
        for p in params:
            p.grad = np.full(p.shape, 0.1, np.float32)
        params[1].grad = None
        opt.step()
    for (name, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        np.testing.assert_array_equal(p.data, q.data, err_msg=name)


def test_flat_adam_refuses_what_it_cannot_pack():
    p64 = param([1.0, 2.0])                          # float64: gradient checks
    assert not optim.Adam([p64]).flat
    p = Tensor(np.ones(3, np.float32), requires_grad=True)
    with pytest.raises(ValueError, match="more than one place"):
        optim.Adam([p, p])                           # the same tensor twice


def test_single_process_allreduce_scales_the_flat_buffer_in_place():
    # The trainer scales the gradients by 1 / tokens through the communicator, which sorts
    # the parameters by name: the flat slots must stay linked (no per-parameter copies).
    from tinytf import functional as F
    from tinytf.distributed.communicator import SingleCommunicator
    model = _mlp()
    opt = optim.Adam(model.named_parameters(), lr=0.01)
    _train_steps(model, opt, 1)
    (F.relu(model(Tensor(np.ones((2, 6), np.float32)))) ** 2).sum().backward()
    before = opt.flat_buffers.grad.copy()
    SingleCommunicator().allreduce_grads(model, scale=0.5)
    assert opt.flat_buffers.grads_linked()
    np.testing.assert_array_equal(opt.flat_buffers.grad, before * np.float32(0.5))


@pytest.mark.parametrize("flat", [True, False])
def test_adam_skips_on_a_device_flag(flat):
    """Adam.step(skip=flag): a set flag changes nothing (the fused GPU kernel reads it on
    the device; NumPy reads it here), a clear one is an ordinary step; both are counted."""
    rng = np.random.default_rng(0)
    params = [Tensor(rng.standard_normal((3, 4)).astype(np.float32), requires_grad=True)
              for _ in range(2)]
    opt = optim.Adam(params, lr=0.1, flat=flat)
    for p in params:
        p.grad = rng.standard_normal(p.shape).astype(np.float32)
    before = [p.data.copy() for p in params]
    opt.step(skip=np.ones(1, np.int32))
    assert opt.step_count == 1
    for p, b in zip(params, before):
        np.testing.assert_array_equal(p.data, b)
    opt.step_count = 0
    opt.step(skip=np.zeros(1, np.int32))
    assert opt.step_count == 1 and not np.array_equal(params[0].data, before[0])


def test_clip_grad_norm_array_stays_on_the_device():
    """The device variant returns the norm as a 0-d float32 array (nothing read back) and
    scales like clip_grad_norm; a non-finite gradient gives a non-finite norm."""
    a = Tensor(np.zeros(2, np.float32), requires_grad=True)
    a.grad = np.array([3.0, 4.0], np.float32)
    norm = optim.clip_grad_norm_array([a], 1.0)
    assert isinstance(norm, np.ndarray) and norm.dtype == np.float32 and float(norm) == 5.0
    np.testing.assert_allclose(a.grad, [0.6, 0.8], rtol=1e-6)
    unchanged = optim.clip_grad_norm_array([a], 10.0)
    np.testing.assert_allclose(a.grad, [0.6, 0.8], rtol=1e-6)
    assert float(unchanged) == pytest.approx(1.0, rel=1e-6)
    a.grad = np.array([np.inf, 1.0], np.float32)
    assert not np.isfinite(optim.grad_norm_array([a]))
    assert optim.grad_norm_array([Tensor(np.zeros(2, np.float32))]) is None
