"""tinytf.optim: Adam against the formula by hand, the paper's schedule, gradient clipping."""
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
