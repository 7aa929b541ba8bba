"""SGD, Adam's weight decay, AdamW, parameter groups and the schedulers for any optimizer
(issue 62), against their formulas in NumPy, step by step in float64. PyTorch parity of the
same is in tests/nn/test_torch_parity_everyday.py (skipped without torch)."""
import math

import numpy as np
import pytest

from tinytf import Tensor, optim
from tinytf.optim import lr_scheduler
from tinytf.optim.schedule import Schedule


def params(rng, n=2):
    return [Tensor(rng.normal(size=(3, 2)), requires_grad=True, dtype=np.float64)
            for _ in range(n)]


def sgd_ref(p, grads, lr, momentum=0.0, dampening=0.0, wd=0.0, nesterov=False):
    b = None
    for g in grads:
        g = g + wd * p
        if momentum:
            b = g.copy() if b is None else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        p = p - lr * g
    return p


def adam_ref(p, grads, lr, b1, b2, eps, wd=0.0, decoupled=False):
    m = v = np.zeros_like(p)
    for t, g in enumerate(grads, 1):
        if decoupled:
            p = p * (1 - lr * wd)
        else:
            g = g + wd * p
        m = b1 * m + (1 - b1) * g
        v = b2 * v + (1 - b2) * g * g
        p = p - lr * (m / (1 - b1 ** t)) / (np.sqrt(v / (1 - b2 ** t)) + eps)
    return p


def run(opt, ps, grads):
    for step in grads:
        for p, g in zip(ps, step):
            p.grad = g.copy()
        opt.step()


@pytest.mark.parametrize("kw", [dict(), dict(momentum=0.9), dict(momentum=0.9, dampening=0.5),
                                dict(momentum=0.8, nesterov=True, wd=0.1), dict(wd=0.05)])
def test_sgd_follows_its_formula(kw):
    rng = np.random.default_rng(0)
    ps = params(rng)
    start = [p.numpy().copy() for p in ps]
    grads = [[rng.normal(size=(3, 2)) for _ in ps] for _ in range(5)]
    wd = kw.pop("wd", 0.0)
    run(optim.SGD(ps, lr=0.1, weight_decay=wd, **kw), ps, grads)
    for i, p in enumerate(ps):
        np.testing.assert_allclose(p.numpy(), sgd_ref(start[i], [g[i] for g in grads], 0.1,
                                                      wd=wd, **kw), rtol=1e-13)


@pytest.mark.parametrize("flat", [True, False])
@pytest.mark.parametrize("cls", ["Adam", "AdamW"])
def test_adam_weight_decay_and_adamw(cls, flat):
    rng = np.random.default_rng(1)
    ps = [Tensor(rng.normal(size=(3, 2)).astype(np.float32), requires_grad=True)
          for _ in range(2)] if flat else params(rng)
    start = [p.numpy().astype(np.float64) for p in ps]
    grads = [[rng.normal(size=(3, 2)).astype(ps[0].dtype) for _ in ps] for _ in range(5)]
    opt = getattr(optim, cls)(ps, lr=0.01, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.2,
                              flat=flat)
    run(opt, ps, grads)
    assert (opt.flat_buffers is not None) == flat
    for i, p in enumerate(ps):
        ref = adam_ref(start[i], [g[i].astype(np.float64) for g in grads], 0.01, 0.9, 0.99,
                       1e-8, 0.2, decoupled=cls == "AdamW")
        np.testing.assert_allclose(p.numpy(), ref, rtol=1e-5 if flat else 1e-12)


def test_adamw_defaults_are_pytorchs():
    opt = optim.AdamW(params(np.random.default_rng(0)))
    g = opt.param_groups[0]
    assert (g["lr"], g["betas"], g["eps"], g["weight_decay"]) == (1e-3, (0.9, 0.999), 1e-8, 1e-2)
    assert opt.describe() == "AdamW(0.9, 0.999, 1e-8) with weight decay 0.01"


def test_param_groups_have_their_own_settings():
    rng = np.random.default_rng(2)
    a, b = params(rng)
    start_a, start_b = a.numpy().copy(), b.numpy().copy()
    opt = optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5, "momentum": 0.9}], lr=0.1)
    grads = [[rng.normal(size=(3, 2)) for _ in range(2)] for _ in range(3)]
    run(opt, [a, b], grads)
    np.testing.assert_allclose(a.numpy(), sgd_ref(start_a, [g[0] for g in grads], 0.1))
    np.testing.assert_allclose(b.numpy(), sgd_ref(start_b, [g[1] for g in grads], 0.5, 0.9))
    opt.lr = 0.01                                   # sets every group
    assert [g["lr"] for g in opt.param_groups] == [0.01, 0.01]
    with pytest.raises(ValueError, match="unknown setting"):
        optim.SGD([{"params": [a], "betas": (0.9, 0.9)}])
    with pytest.raises(ValueError, match="more than one place"):
        optim.Adam([{"params": [a]}, {"params": [a, b]}])
    with pytest.raises(ValueError, match="empty"):
        optim.SGD([])
    with pytest.raises(TypeError, match="must be a Tensor"):
        optim.SGD([np.zeros(3)])


def test_adam_with_groups_equals_one_optimizer_per_group():
    rng = np.random.default_rng(3)
    a, b = params(rng)
    a2, b2 = (Tensor(p.numpy().copy(), requires_grad=True, dtype=np.float64) for p in (a, b))
    grouped = optim.Adam([{"params": [a]}, {"params": [b], "lr": 0.05, "weight_decay": 0.1}],
                         lr=0.01)
    alone = [optim.Adam([a2], lr=0.01), optim.Adam([b2], lr=0.05, weight_decay=0.1)]
    for _ in range(4):
        ga, gb = rng.normal(size=(3, 2)), rng.normal(size=(3, 2))
        a.grad, b.grad, a2.grad, b2.grad = ga, gb, ga.copy(), gb.copy()
        grouped.step()
        for o in alone:
            o.step()
    np.testing.assert_array_equal(a.numpy(), a2.numpy())
    np.testing.assert_array_equal(b.numpy(), b2.numpy())


@pytest.mark.parametrize("make", [
    lambda ps: optim.SGD([{"params": ps[:1]}, {"params": ps[1:], "lr": 0.3}], lr=0.1,
                         momentum=0.9),
    lambda ps: optim.AdamW([{"params": ps[:1]}, {"params": ps[1:], "weight_decay": 0.0}]),
])
def test_state_dict_resumes_exactly(make):
    rng = np.random.default_rng(4)
    grads = [[rng.normal(size=(3, 2)) for _ in range(2)] for _ in range(6)]
    ps = params(np.random.default_rng(5))
    opt = make(ps)
    run(opt, ps, grads)
    ps2 = params(np.random.default_rng(5))
    opt2 = make(ps2)
    run(opt2, ps2, grads[:3])
    saved = opt2.state_dict()
    ps3 = [Tensor(p.numpy().copy(), requires_grad=True, dtype=np.float64) for p in ps2]
    opt3 = make(ps3)
    opt3.load_state_dict(saved)
    run(opt3, ps3, grads[3:])
    for p, q in zip(ps, ps3):
        np.testing.assert_array_equal(p.numpy(), q.numpy())


def test_clip_grad_value_():
    p = Tensor(np.zeros(4), requires_grad=True, dtype=np.float64)
    p.grad = np.array([-3.0, -0.2, 0.4, 9.0])
    optim.clip_grad_value_([p], 0.5)
    np.testing.assert_array_equal(p.grad, [-0.5, -0.2, 0.4, 0.5])


def _lrs(make, steps=8, lr=0.1):
    opt = optim.SGD(params(np.random.default_rng(0), 1), lr=lr)
    sched = make(opt)
    out = []
    for _ in range(steps):
        out.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    return out


def test_schedulers_follow_their_formulas():
    np.testing.assert_allclose(_lrs(lambda o: lr_scheduler.StepLR(o, 3, 0.5)),
                               [0.1] * 3 + [0.05] * 3 + [0.025] * 2)
    np.testing.assert_allclose(
        _lrs(lambda o: lr_scheduler.CosineAnnealingLR(o, 4, eta_min=0.02)),
        [0.02 + 0.08 * (1 + math.cos(math.pi * t / 4)) / 2 for t in range(8)])
    np.testing.assert_allclose(_lrs(lambda o: lr_scheduler.LinearLR(o, 0.25, 1.0, 3)),
                               [0.025, 0.05, 0.075] + [0.1] * 5)
    np.testing.assert_allclose(_lrs(lambda o: lr_scheduler.LambdaLR(o, lambda t: 0.5 ** t)),
                               [0.1 * 0.5 ** t for t in range(8)])
    noam = Schedule("noam", warmup=4, factor=2.0, d_model=16)
    np.testing.assert_allclose(_lrs(lambda o: lr_scheduler.ScheduleLR(o, noam), lr=1.0),
                               [noam(t) / noam.peak_lr for t in range(1, 9)])
    linear = Schedule("linear", warmup=2, peak=0.1)
    np.testing.assert_allclose(
        _lrs(lambda o: lr_scheduler.ScheduleLR(o, linear, total_steps=8)),
        [linear(t, t / 8) for t in range(1, 9)], rtol=1e-12)


def test_scheduler_state_dict_continues():
    opt = optim.SGD(params(np.random.default_rng(0), 1), lr=0.1)
    sched = lr_scheduler.StepLR(opt, 2, 0.1)
    for _ in range(3):
        sched.step()
    again = lr_scheduler.StepLR(optim.SGD(params(np.random.default_rng(0), 1), lr=0.1), 2, 0.1)
    again.load_state_dict(sched.state_dict())
    assert again.get_last_lr() == pytest.approx(sched.get_last_lr())
