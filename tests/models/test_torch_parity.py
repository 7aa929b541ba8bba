"""PyTorch as an optional oracle: forward and backward of the layers and a few Adam steps
agree with torch to 1e-6 in float64. Skipped when torch is not installed; tinytf itself
never imports torch."""
import numpy as np
import pytest

import tinytf
from tinytf import Tensor, nn, optim
from tinytf import functional as F

torch = pytest.importorskip("torch")
TF = torch.nn.functional
TOL = dict(rtol=1e-6, atol=1e-6)


def pair(a):
    """The same float64 values as a tinytf leaf and a torch leaf, both requiring grad."""
    return Tensor(a.copy(), requires_grad=True, dtype=np.float64), \
        torch.tensor(a, dtype=torch.float64, requires_grad=True)


def check(ours, theirs):
    """Equal values; ``ours`` a Tensor or ndarray, ``theirs`` a torch tensor."""
    got = ours.numpy() if isinstance(ours, Tensor) else ours
    np.testing.assert_allclose(got, theirs.detach().numpy(), **TOL)


def backward_both(out, ref, rng):
    """Backpropagate the same random cotangent through both graphs."""
    g = rng.normal(size=out.shape)
    out.backward(g)
    ref.backward(torch.tensor(g))


@pytest.mark.parametrize("lead", [(5,), (2, 3)])
@pytest.mark.parametrize("bias", [True, False])
def test_linear(lead, bias):
    rng = np.random.default_rng(0)
    x, xt = pair(rng.normal(size=lead + (4,)))
    w, wt = pair(rng.normal(size=(3, 4)))
    b, bt = pair(rng.normal(size=3))
    out = F.linear(x, w, b if bias else None)
    ref = TF.linear(xt, wt, bt if bias else None)
    check(out, ref)
    backward_both(out, ref, rng)
    for ours, theirs in [(x, xt), (w, wt)] + ([(b, bt)] if bias else []):
        check(ours.grad, theirs.grad)


def test_linear_module_matches_torch_module():
    tinytf.manual_seed(0)
    ours = nn.Linear(4, 3).astype(np.float64)
    theirs = torch.nn.Linear(4, 3).double()
    with torch.no_grad():
        theirs.weight.copy_(torch.tensor(ours.weight.numpy()))
        theirs.bias.copy_(torch.tensor(ours.bias.numpy()))
    rng = np.random.default_rng(1)
    x, xt = pair(rng.normal(size=(6, 4)))
    out, ref = ours(x), theirs(xt)
    check(out, ref)
    backward_both(out, ref, rng)
    check(ours.weight.grad, theirs.weight.grad)
    check(ours.bias.grad, theirs.bias.grad)
    check(x.grad, xt.grad)


def test_gelu_matches_torch_tanh_gelu():
    rng = np.random.default_rng(2)
    x, xt = pair(rng.normal(scale=3.0, size=(4, 5)))
    out, ref = F.gelu(x), TF.gelu(xt, approximate="tanh")
    check(out, ref)
    backward_both(out, ref, rng)
    check(x.grad, xt.grad)


@pytest.mark.parametrize("eps", [1e-5, 1e-2])
def test_layer_norm(eps):
    rng = np.random.default_rng(0)
    x, xt = pair(rng.normal(size=(2, 3, 8)) * 3 + 1)
    w, wt = pair(rng.normal(size=8))
    b, bt = pair(rng.normal(size=8))
    out = F.layer_norm(x, w, b, eps=eps)
    ref = TF.layer_norm(xt, (8,), wt, bt, eps=eps)
    check(out, ref)
    backward_both(out, ref, rng)
    for ours, theirs in [(x, xt), (w, wt), (b, bt)]:
        check(ours.grad, theirs.grad)


@pytest.mark.parametrize("name", ["softmax", "log_softmax"])
@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_softmax_family(name, axis):
    rng = np.random.default_rng(0)
    x, xt = pair(rng.normal(size=(3, 4, 5)) * 3)
    out = getattr(F, name)(x, axis=axis)
    ref = getattr(TF, name)(xt, dim=axis)
    check(out, ref)
    backward_both(out, ref, rng)
    check(x.grad, xt.grad)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
@pytest.mark.parametrize("ignore", [None, 0])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_cross_entropy(smoothing, ignore, reduction):
    rng = np.random.default_rng(0)
    x, xt = pair(rng.normal(size=(7, 11)) * 2)
    target = rng.integers(0, 11, size=7)
    target[[1, 4]] = 0  # a padding id, ignored when ignore == 0
    out = F.cross_entropy(x, target, label_smoothing=smoothing, ignore_index=ignore,
                          reduction=reduction)
    ref = TF.cross_entropy(xt, torch.tensor(target), label_smoothing=smoothing,
                           ignore_index=-100 if ignore is None else ignore, reduction=reduction)
    check(out, ref)
    backward_both(out, ref, rng)
    check(x.grad, xt.grad)


@pytest.mark.parametrize("mask_kind", ["none", "causal", "padding"])
def test_attention_matches_scaled_dot_product_attention(mask_kind):
    rng = np.random.default_rng(0)
    q, qt = pair(rng.normal(size=(2, 3, 4, 8)))
    k, kt = pair(rng.normal(size=(2, 3, 6, 8)))
    v, vt = pair(rng.normal(size=(2, 3, 6, 8)))
    mask = {"none": None,
            "causal": np.tril(np.ones((4, 6), bool)),
            "padding": (np.arange(6) < np.array([[4], [6]]))[:, None, None, :]}[mask_kind]
    out = F.attention(q, k, v, mask=mask)
    ref = TF.scaled_dot_product_attention(
        qt, kt, vt, attn_mask=None if mask is None else torch.tensor(mask))
    check(out, ref)
    backward_both(out, ref, rng)
    for ours, theirs in [(q, qt), (k, kt), (v, vt)]:
        check(ours.grad, theirs.grad)


@pytest.mark.parametrize("lr,betas,eps", [(1e-2, (0.9, 0.98), 1e-9), (3e-3, (0.8, 0.999), 1e-6)])
def test_adam_steps_match_torch(lr, betas, eps):
    rng = np.random.default_rng(0)
    w0, b0 = rng.normal(size=(3, 4)), rng.normal(size=4)
    ours = [Tensor(w0.copy(), requires_grad=True, dtype=np.float64),
            Tensor(b0.copy(), requires_grad=True, dtype=np.float64)]
    theirs = [torch.tensor(w0, requires_grad=True), torch.tensor(b0, requires_grad=True)]
    opt = optim.Adam([("b", ours[1]), ("w", ours[0])], lr=lr, betas=betas, eps=eps)
    topt = torch.optim.Adam(theirs, lr=lr, betas=betas, eps=eps)
    for _ in range(5):
        grads = [rng.normal(size=(3, 4)), rng.normal(size=4) * 1e-3]
        for p, pt, g in zip(ours, theirs, grads):
            p.grad = g.copy()
            pt.grad = torch.tensor(g)
        opt.step()
        topt.step()
        for p, pt in zip(ours, theirs):
            np.testing.assert_allclose(p.numpy(), pt.detach().numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("betas", [(0.9, 0.98), (0.8, 0.999)])
def test_radam_steps_match_torch(betas):
    """Adam(rectify=True) against torch.optim.RAdam. While rho_t <= 5 PyTorch takes a
    momentum-SGD step and tinytf none, so both run those updates at lr 0 (as a warm-up
    from 0 nearly does), then the rectified ones at lr 1e-2."""
    rng = np.random.default_rng(1)
    w0 = rng.normal(size=(3, 4))
    ours = Tensor(w0.copy(), requires_grad=True, dtype=np.float64)
    theirs = torch.tensor(w0, requires_grad=True)
    opt = optim.Adam([ours], lr=0.0, betas=betas, eps=1e-9, rectify=True)
    topt = torch.optim.RAdam([theirs], lr=0.0, betas=betas, eps=1e-9)
    early = [t for t in range(1, 30) if optim.radam_rectifier(t, betas[1]) == 0]
    for t in range(1, 20):
        lr = 0.0 if t in early else 1e-2
        opt.lr = topt.param_groups[0]["lr"] = lr
        g = rng.normal(size=(3, 4))
        ours.grad, theirs.grad = g.copy(), torch.tensor(g)
        opt.step()
        topt.step()
        np.testing.assert_allclose(ours.numpy(), theirs.detach().numpy(), rtol=1e-10,
                                   atol=1e-12)
    assert not np.allclose(ours.numpy(), w0)


def test_adam_on_a_training_loop_matches_torch():
    """Loss and parameters stay equal over several steps of a small float64 regression."""
    tinytf.manual_seed(0)
    ours = nn.Sequential(nn.Linear(3, 5), nn.ReLU(), nn.Linear(5, 2)).astype(np.float64)
    theirs = torch.nn.Sequential(torch.nn.Linear(3, 5), torch.nn.ReLU(),
                                 torch.nn.Linear(5, 2)).double()
    with torch.no_grad():
        for name, p in theirs.named_parameters():
            p.copy_(torch.tensor(ours.state_dict()[name]))
    opt = optim.Adam(ours.named_parameters(), lr=1e-2)
    topt = torch.optim.Adam(theirs.parameters(), lr=1e-2, betas=(0.9, 0.98), eps=1e-9)
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(8, 3)), rng.normal(size=(8, 2))
    for _ in range(4):
        diff = ours(Tensor(x, dtype=np.float64)) - Tensor(y, dtype=np.float64)
        loss = (diff * diff).mean()
        tloss = ((theirs(torch.tensor(x)) - torch.tensor(y)) ** 2).mean()
        assert loss.item() == pytest.approx(tloss.item(), rel=1e-10)
        opt.zero_grad()
        topt.zero_grad()
        loss.backward()
        tloss.backward()
        opt.step()
        topt.step()
    for name, p in theirs.named_parameters():
        np.testing.assert_allclose(ours.state_dict()[name], p.detach().numpy(), **TOL)
