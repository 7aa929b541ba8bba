"""PyTorch as an optional oracle for the everyday pieces (issue 62): every new function of
``F``, every new module with PyTorch's parameters loaded through ``state_dict``, and SGD,
Adam, AdamW and the schedulers step by step, all in float64 (1e-10). Skipped when torch is
not installed; tinytf itself never imports torch."""
import math

import numpy as np
import pytest

import tinytf
from tinytf import Tensor, nn, optim
from tinytf import functional as F
from tinytf.optim import lr_scheduler

torch = pytest.importorskip("torch")
TF = torch.nn.functional
TOL = dict(rtol=1e-10, atol=1e-12)


def pair(a, grad=True):
    """The same float64 values as a tinytf leaf and a torch leaf."""
    return Tensor(np.array(a, dtype=np.float64), requires_grad=grad, dtype=np.float64), \
        torch.tensor(a, dtype=torch.float64, requires_grad=grad)


def check(ours, theirs):
    got = ours.numpy() if isinstance(ours, Tensor) else np.asarray(ours)
    np.testing.assert_allclose(got, theirs.detach().numpy(), **TOL)


def compare(fn_ours, fn_theirs, *arrays, seed=0):
    """Forward and the gradient of every input under one random cotangent."""
    rng = np.random.default_rng(seed)
    pairs = [pair(a) for a in arrays]
    out = fn_ours(*[p[0] for p in pairs])
    ref = fn_theirs(*[p[1] for p in pairs])
    check(out, ref)
    g = rng.normal(size=out.shape)
    out.backward(g)
    ref.backward(torch.tensor(g))
    for ours, theirs in pairs:
        check(ours.grad, theirs.grad)


R = np.random.default_rng(42)
X = R.normal(size=(3, 5)) * 3

FUNCTIONS = {
    "sigmoid": (F.sigmoid, torch.sigmoid),
    "tanh": (F.tanh, torch.tanh),
    "softplus": (F.softplus, TF.softplus),
    "softplus_beta": (lambda x: F.softplus(x, beta=2.0, threshold=5.0),
                      lambda x: TF.softplus(x, beta=2.0, threshold=5.0)),
    "silu": (F.silu, TF.silu),
    "gelu_tanh": (F.gelu, lambda x: TF.gelu(x, approximate="tanh")),
    "logsumexp": (lambda x: F.logsumexp(x, 1), lambda x: torch.logsumexp(x, 1)),
    "logsumexp_keep": (lambda x: F.logsumexp(x, 0, keepdim=True),
                       lambda x: torch.logsumexp(x, 0, keepdim=True)),
    "abs": (lambda x: x.abs(), torch.abs),
    "clamp": (lambda x: x.clamp(-1.0, 2.0), lambda x: x.clamp(-1.0, 2.0)),
    "clamp_min": (lambda x: x.clamp(min=0.5), lambda x: x.clamp(min=0.5)),
    "var": (lambda x: x.var(1), lambda x: x.var(1)),
    "var_biased": (lambda x: x.var(0, correction=0), lambda x: x.var(0, correction=0)),
    "std": (lambda x: x.std(), lambda x: x.std()),
    "amin": (lambda x: x.amin(1), lambda x: x.amin(1)),
    "max_dim": (lambda x: x.max(1).values, lambda x: x.max(1).values),
    "min_dim": (lambda x: x.min(0, keepdim=True)[0], lambda x: x.min(0, keepdim=True)[0]),
    "transpose": (lambda x: x.reshape(3, 5, 1).transpose(0, 2),
                  lambda x: x.reshape(3, 5, 1).transpose(0, 2)),
    "permute": (lambda x: x.reshape(3, 1, 5).permute(2, 0, 1),
                lambda x: x.reshape(3, 1, 5).permute(2, 0, 1)),
    "squeeze_unsqueeze": (lambda x: x.unsqueeze(1).unsqueeze(-1).squeeze(1),
                          lambda x: x.unsqueeze(1).unsqueeze(-1).squeeze(1)),
    "rpow": (lambda x: 2.5 ** x, lambda x: 2.5 ** x),
    "mse": (lambda x: F.mse_loss(x, Tensor(X.T.copy()).T * 0.5),
            lambda x: TF.mse_loss(x, torch.tensor(X) * 0.5)),
}


@pytest.mark.parametrize("name", sorted(FUNCTIONS))
def test_function(name):
    ours, theirs = FUNCTIONS[name]
    compare(ours, theirs, X)


def test_argmax_argmin_and_comparisons():
    x, xt = pair(X, grad=False)
    np.testing.assert_array_equal(x.argmax(1).numpy(), xt.argmax(1).numpy())
    np.testing.assert_array_equal(x.argmin().numpy(), xt.argmin().numpy())
    np.testing.assert_array_equal(x.max(0).indices.numpy(), xt.max(0).indices.numpy())
    np.testing.assert_array_equal((x > 0).numpy(), (xt > 0).numpy())
    np.testing.assert_array_equal(x.eq(x).numpy(), (xt == xt).numpy())
    assert float(x.sum()) == pytest.approx(float(xt.sum()), rel=1e-12)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_losses(reduction):
    rng = np.random.default_rng(1)
    logits, target = rng.normal(size=(2, 3, 5)), rng.integers(0, 5, size=(2, 3))
    target[0, 1] = 2
    # cross_entropy: classes last here, second in PyTorch
    compare(lambda z: F.cross_entropy(z, target, ignore_index=2, label_smoothing=0.1,
                                      reduction=reduction),
            lambda z: TF.cross_entropy(z.permute(0, 2, 1), torch.tensor(target), ignore_index=2,
                                       label_smoothing=0.1, reduction=reduction), logits)
    compare(lambda z: F.nll_loss(F.log_softmax(z), target, ignore_index=2, reduction=reduction),
            lambda z: TF.nll_loss(TF.log_softmax(z, -1).permute(0, 2, 1), torch.tensor(target),
                                  ignore_index=2, reduction=reduction), logits)
    y = rng.uniform(size=(4, 3))
    compare(lambda z, t: F.binary_cross_entropy_with_logits(z, t, reduction=reduction),
            lambda z, t: TF.binary_cross_entropy_with_logits(z, t, reduction=reduction),
            rng.normal(size=(4, 3)) * 4, y)
    compare(lambda a, b: F.mse_loss(a, b, reduction=reduction),
            lambda a, b: TF.mse_loss(a, b, reduction=reduction), y, rng.normal(size=(4, 3)))


CONVS = [  # (d, input shape, weight shape, stride, padding, dilation, groups)
    (1, (2, 4, 9), (6, 2, 3), 2, 1, 1, 2),
    (1, (1, 3, 7), (2, 3, 1), 1, 0, 1, 1),
    (1, (2, 2, 10), (3, 2, 3), 1, 2, 3, 1),
    (2, (2, 3, 6, 7), (4, 3, 3, 2), (2, 1), (1, 0), 1, 1),
    (2, (1, 4, 5, 5), (4, 1, 3, 3), 1, 1, (1, 2), 4),
]


@pytest.mark.parametrize("case", CONVS)
@pytest.mark.parametrize("bias", [True, False])
def test_conv(case, bias):
    d, xs, ws, stride, padding, dilation, groups = case
    rng = np.random.default_rng(3)
    ours = F.conv1d if d == 1 else F.conv2d
    theirs = TF.conv1d if d == 1 else TF.conv2d
    arrays = [rng.normal(size=xs), rng.normal(size=ws)] + ([rng.normal(size=ws[0])] if bias else [])
    compare(lambda *a: ours(*a, stride=stride, padding=padding, dilation=dilation, groups=groups),
            lambda *a: theirs(*a, stride=stride, padding=padding, dilation=dilation,
                              groups=groups), *arrays)


POOLS = [  # (d, shape, kernel, stride, padding)
    (1, (2, 3, 9), 3, None, 1), (1, (1, 2, 8), 2, 1, 0),
    (2, (2, 2, 7, 6), (3, 2), (2, 1), (1, 1)), (2, (1, 1, 4, 4), 2, None, 0),
]


@pytest.mark.parametrize("case", POOLS)
@pytest.mark.parametrize("kind", ["max", "avg"])
def test_pool(case, kind):
    d, shape, kernel, stride, padding = case
    x = np.random.default_rng(4).permutation(math.prod(shape)).reshape(shape) * 0.1  # no ties
    ours = getattr(F, f"{kind}_pool{d}d")
    theirs = getattr(TF, f"{kind}_pool{d}d")
    compare(lambda a: ours(a, kernel, stride, padding),
            lambda a: theirs(a, kernel, stride, padding), x)


def _module_pair(ours, theirs):
    """Our module and torch's, in float64, with torch's parameters loaded into ours
    through the state_dict (names and shapes must agree)."""
    theirs = theirs.double()
    ours.astype(np.float64).load_state_dict(
        {k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    assert sorted(n for n, _ in ours.named_parameters()) == \
        sorted(n for n, _ in theirs.named_parameters())
    return ours, theirs


MODULES = {
    "Conv1d": (lambda: nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2),
               lambda: torch.nn.Conv1d(4, 6, 3, stride=2, padding=1, groups=2), (2, 4, 9)),
    "Conv2d": (lambda: nn.Conv2d(3, 4, (3, 2), padding="same" if False else 1),
               lambda: torch.nn.Conv2d(3, 4, (3, 2), padding=1), (2, 3, 5, 6)),
    "MaxPool2d": (lambda: nn.MaxPool2d(2), lambda: torch.nn.MaxPool2d(2), (1, 2, 4, 6)),
    "AvgPool1d": (lambda: nn.AvgPool1d(3, 2, 1), lambda: torch.nn.AvgPool1d(3, 2, 1), (2, 3, 8)),
    "GRUCell": (lambda: nn.GRUCell(3, 4), lambda: torch.nn.GRUCell(3, 4), (5, 3)),
    "LSTMCell": (lambda: nn.LSTMCell(3, 4), lambda: torch.nn.LSTMCell(3, 4), (5, 3)),
    "GRU": (lambda: nn.GRU(3, 4, num_layers=2, batch_first=True),
            lambda: torch.nn.GRU(3, 4, num_layers=2, batch_first=True), (2, 6, 3)),
    "GRU_time_first": (lambda: nn.GRU(3, 4), lambda: torch.nn.GRU(3, 4), (6, 2, 3)),
    "LSTM": (lambda: nn.LSTM(3, 5, num_layers=2, batch_first=True),
             lambda: torch.nn.LSTM(3, 5, num_layers=2, batch_first=True), (2, 4, 3)),
    "LSTM_no_bias": (lambda: nn.LSTM(2, 3, bias=False), lambda: torch.nn.LSTM(2, 3, bias=False),
                     (4, 2, 2)),
}


def _flat_outputs(out):
    """A module's outputs as a list of tensors (GRU: output and h_n; LSTM: and c_n)."""
    if not isinstance(out, tuple):
        return [out]
    flat = []
    for o in out:
        flat += _flat_outputs(o)
    return flat


@pytest.mark.parametrize("name", sorted(MODULES))
def test_module(name):
    make_ours, make_theirs, shape = MODULES[name]
    torch.manual_seed(0)
    ours, theirs = _module_pair(make_ours(), make_theirs())
    rng = np.random.default_rng(5)
    x, xt = pair(rng.normal(size=shape))
    outs, refs = _flat_outputs(ours(x)), _flat_outputs(theirs(xt))
    assert len(outs) == len(refs)
    loss, ref_loss = 0, 0
    for o, r in zip(outs, refs):
        check(o, r)
        g = rng.normal(size=o.shape)
        loss, ref_loss = loss + (o * Tensor(g)).sum(), ref_loss + (r * torch.tensor(g)).sum()
    loss.backward()
    ref_loss.backward()
    check(x.grad, xt.grad)
    mine = dict(ours.named_parameters())
    for n, p in theirs.named_parameters():
        check(mine[n].grad, p.grad)


def test_initialisation_matches_torchs_distributions():
    """Same names, shapes and bounds: every weight of ours lies in torch's init range."""
    for ours, theirs in [(nn.Conv2d(3, 8, 3), torch.nn.Conv2d(3, 8, 3)),
                         (nn.GRU(5, 7, 2), torch.nn.GRU(5, 7, 2)),
                         (nn.LSTMCell(4, 6), torch.nn.LSTMCell(4, 6))]:
        mine = dict(ours.named_parameters())
        for n, p in theirs.named_parameters():
            bound = float(p.detach().abs().max())
            assert mine[n].shape == tuple(p.shape)
            assert float(mine[n].abs().max()) <= bound * 1.2 + 1e-6, n


# ----- optimizers and schedulers, step by step ---------------------------------------------

OPTIMIZERS = {
    "sgd": (lambda p: optim.SGD(p, lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    "sgd_momentum": (lambda p: optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                         weight_decay=0.01),
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, dampening=0.1,
                                               weight_decay=0.01)),
    "sgd_nesterov": (lambda p: optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True),
                     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.8, nesterov=True)),
    "adam_l2": (lambda p: optim.Adam(p, lr=0.01, betas=(0.9, 0.999), eps=1e-8,
                                     weight_decay=0.1),
                lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.1)),
    "adamw": (lambda p: optim.AdamW(p, lr=0.01), lambda p: torch.optim.AdamW(p, lr=0.01)),
    "adamw_flat_off": (lambda p: optim.AdamW(p, lr=0.02, weight_decay=0.3, flat=False),
                       lambda p: torch.optim.AdamW(p, lr=0.02, weight_decay=0.3)),
}


def _params(rng):
    shapes = [(3, 4), (4,), (2, 2, 3)]
    values = [rng.normal(size=s) for s in shapes]
    return ([Tensor(v.copy(), requires_grad=True, dtype=np.float64) for v in values],
            [torch.tensor(v, requires_grad=True) for v in values])


def _grads(ours, theirs, rng):
    for p, q in zip(ours, theirs):
        g = rng.normal(size=p.shape)
        p.grad, q.grad = g.copy(), torch.tensor(g)


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
@pytest.mark.parametrize("groups", [False, True])
def test_optimizer_step_by_step(name, groups):
    make_ours, make_theirs = OPTIMIZERS[name]
    rng = np.random.default_rng(7)
    ours, theirs = _params(rng)
    if groups:   # the second group with its own learning rate (and no decay)
        spec_o = [{"params": ours[:2]}, {"params": ours[2:], "lr": 0.003, "weight_decay": 0.0}]
        spec_t = [{"params": theirs[:2]}, {"params": theirs[2:], "lr": 0.003,
                                            "weight_decay": 0.0}]
    else:
        spec_o, spec_t = ours, theirs
    opt_o, opt_t = make_ours(spec_o), make_theirs(spec_t)
    for _ in range(6):
        _grads(ours, theirs, rng)
        opt_o.step()
        opt_t.step()
        for p, q in zip(ours, theirs):
            check(p, q)


SCHEDULERS = {
    "step": (lambda o: lr_scheduler.StepLR(o, 3, gamma=0.5),
             lambda o: torch.optim.lr_scheduler.StepLR(o, 3, gamma=0.5)),
    "cosine": (lambda o: lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=1e-3),
               lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=10, eta_min=1e-3)),
    "linear_warmup": (lambda o: lr_scheduler.LinearLR(o, 0.1, 1.0, 4),
                      lambda o: torch.optim.lr_scheduler.LinearLR(o, 0.1, 1.0, 4)),
    "lambda": (lambda o: lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + t)),
               lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda t: 1 / (1 + t))),
}


@pytest.mark.parametrize("name", sorted(SCHEDULERS))
def test_scheduler_drives_every_group_as_torch(name):
    make_ours, make_theirs = SCHEDULERS[name]
    rng = np.random.default_rng(8)
    ours, theirs = _params(rng)
    opt_o = optim.SGD([{"params": ours[:1]}, {"params": ours[1:], "lr": 0.02}], lr=0.1,
                      momentum=0.9)
    opt_t = torch.optim.SGD([{"params": theirs[:1]}, {"params": theirs[1:], "lr": 0.02}],
                            lr=0.1, momentum=0.9)
    sched_o, sched_t = make_ours(opt_o), make_theirs(opt_t)
    for _ in range(12):
        np.testing.assert_allclose(sched_o.get_last_lr(), sched_t.get_last_lr(), rtol=1e-12)
        _grads(ours, theirs, rng)
        opt_o.step()
        opt_t.step()
        sched_o.step()
        sched_t.step()
        for p, q in zip(ours, theirs):
            check(p, q)


def test_clip_grad_value_and_norm_as_torch():
    rng = np.random.default_rng(9)
    ours, theirs = _params(rng)
    _grads(ours, theirs, rng)
    optim.clip_grad_value_(ours, 0.5)
    torch.nn.utils.clip_grad_value_(theirs, 0.5)
    for p, q in zip(ours, theirs):
        check(p.grad, q.grad)
    norm = optim.clip_grad_norm_(ours, 0.7)
    ref = torch.nn.utils.clip_grad_norm_(theirs, 0.7)
    assert norm == pytest.approx(float(ref), rel=1e-12)
    for p, q in zip(ours, theirs):
        check(p.grad, q.grad)


def test_creation_helpers_as_torch():
    assert tinytf.zeros(2, 3).dtype == np.float32 and tuple(tinytf.ones((4,)).shape) == (4,)
    np.testing.assert_array_equal(tinytf.arange(5).numpy(), torch.arange(5).numpy())
    np.testing.assert_allclose(tinytf.arange(0.0, 1.0, 0.25).numpy(),
                               torch.arange(0.0, 1.0, 0.25).numpy())
    assert str(torch.arange(5).dtype) == "torch.int64" and tinytf.arange(5).dtype == np.int64
    assert tinytf.full((2,), 7.0).numpy().tolist() == torch.full((2,), 7.0).tolist()
