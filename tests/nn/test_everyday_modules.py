"""The layers added for other models (issue 62): convolution and pooling modules, GRU and
LSTM cells and layers (against NumPy written from their equations), ModuleDict, buffers, the
readable repr, and ``gradcheck_module`` (which must also catch a wrong gradient). PyTorch
parity of the same modules is in tests/nn/test_torch_parity_everyday.py."""
import numpy as np
import pytest

import tinytf
from tinytf import Tensor, nn
from tinytf.engine.gradcheck import gradcheck_module
from tinytf.engine.tensor import Function


def sig(x):
    return 1 / (1 + np.exp(-x))


def gru_ref(x, h, wi, wh, bi, bh):
    """PyTorch's GRU equations in NumPy, gates r, z, n."""
    gi, gh = x @ wi.T + bi, h @ wh.T + bh
    H = h.shape[-1]
    r = sig(gi[:, :H] + gh[:, :H])
    z = sig(gi[:, H:2 * H] + gh[:, H:2 * H])
    n = np.tanh(gi[:, 2 * H:] + r * gh[:, 2 * H:])
    return (1 - z) * n + z * h


def lstm_ref(x, h, c, wi, wh, bi, bh):
    """PyTorch's LSTM equations in NumPy, gates i, f, g, o."""
    g = x @ wi.T + bi + h @ wh.T + bh
    H = h.shape[-1]
    i, f, gg, o = sig(g[:, :H]), sig(g[:, H:2 * H]), np.tanh(g[:, 2 * H:3 * H]), sig(g[:, 3 * H:])
    c = f * c + i * gg
    return o * np.tanh(c), c


def arrays(module, *names):
    return [getattr(module, n).numpy() for n in names]


def test_recurrent_parameters_are_pytorchs():
    gru = nn.GRU(3, 5, num_layers=2)
    assert {n: p.shape for n, p in gru.named_parameters()} == {
        "weight_ih_l0": (15, 3), "weight_hh_l0": (15, 5), "bias_ih_l0": (15,),
        "bias_hh_l0": (15,), "weight_ih_l1": (15, 5), "weight_hh_l1": (15, 5),
        "bias_ih_l1": (15,), "bias_hh_l1": (15,)}
    cell = nn.LSTMCell(3, 4, bias=False)
    assert sorted(n for n, _ in cell.named_parameters()) == ["weight_hh", "weight_ih"]
    bound = 1 / np.sqrt(5)
    assert all(float(p.abs().max()) <= bound for p in gru.parameters())
    assert all(p.dtype == np.float32 for p in gru.parameters())


def test_gru_and_lstm_cells_follow_the_equations():
    rng = np.random.default_rng(0)
    x, h, c = rng.normal(size=(4, 3)), rng.normal(size=(4, 5)), rng.normal(size=(4, 5))
    gru = nn.GRUCell(3, 5).astype(np.float64)
    out = gru(Tensor(x), Tensor(h))
    np.testing.assert_allclose(out.numpy(), gru_ref(x, h, *arrays(
        gru, "weight_ih", "weight_hh", "bias_ih", "bias_hh")), rtol=1e-12)
    lstm = nn.LSTMCell(3, 5).astype(np.float64)
    h2, c2 = lstm(Tensor(x), (Tensor(h), Tensor(c)))
    ref_h, ref_c = lstm_ref(x, h, c, *arrays(lstm, "weight_ih", "weight_hh", "bias_ih", "bias_hh"))
    np.testing.assert_allclose(h2.numpy(), ref_h, rtol=1e-12)
    np.testing.assert_allclose(c2.numpy(), ref_c, rtol=1e-12)
    zero = gru(Tensor(x))                     # no state: zeros
    np.testing.assert_allclose(zero.numpy(), gru(Tensor(x), Tensor(np.zeros((4, 5)))).numpy())


@pytest.mark.parametrize("batch_first", [True, False])
def test_gru_and_lstm_layers_unroll_the_cells(batch_first):
    rng = np.random.default_rng(1)
    seq = rng.normal(size=(2, 6, 3))                     # (B, T, I)
    x = Tensor(seq if batch_first else seq.transpose(1, 0, 2).copy())
    gru = nn.GRU(3, 4, num_layers=2, batch_first=batch_first).astype(np.float64)
    out, h_n = gru(x)
    inp = seq
    for layer in range(2):
        h, hs = np.zeros((2, 4)), []
        for t in range(6):
            h = gru_ref(inp[:, t], h, *arrays(gru, *(f"{k}_l{layer}" for k in (
                "weight_ih", "weight_hh", "bias_ih", "bias_hh"))))
            hs.append(h)
        np.testing.assert_allclose(h_n.numpy()[layer], h, rtol=1e-12)
        inp = np.stack(hs, axis=1)
    got = out.numpy() if batch_first else out.numpy().transpose(1, 0, 2)
    np.testing.assert_allclose(got, inp, rtol=1e-12)
    lstm = nn.LSTM(3, 4, batch_first=batch_first).astype(np.float64)
    out, (h_n, c_n) = lstm(x)
    h, c = np.zeros((2, 4)), np.zeros((2, 4))
    for t in range(6):
        h, c = lstm_ref(seq[:, t], h, c, *arrays(lstm, "weight_ih_l0", "weight_hh_l0",
                                                  "bias_ih_l0", "bias_hh_l0"))
    np.testing.assert_allclose(h_n.numpy()[0], h, rtol=1e-12)
    np.testing.assert_allclose(c_n.numpy()[0], c, rtol=1e-12)
    assert out.shape == ((2, 6, 4) if batch_first else (6, 2, 4))


MODELS = {
    "conv1d": (lambda: nn.Sequential(nn.Conv1d(2, 4, 3, padding=1), nn.ReLU(), nn.MaxPool1d(2),
                                     nn.Conv1d(4, 2, 2, groups=2), nn.AvgPool1d(2)), (2, 2, 9)),
    "conv2d": (lambda: nn.Sequential(nn.Conv2d(1, 3, 3, stride=2, padding=1), nn.Tanh(),
                                     nn.MaxPool2d(2), nn.Flatten(), nn.Linear(12, 2)),
               (2, 1, 7, 8)),
    "gru": (lambda: nn.GRU(3, 4, num_layers=2, batch_first=True), (2, 5, 3)),
    "lstm": (lambda: nn.LSTM(3, 4, batch_first=True), (2, 5, 3)),
    "cells": (lambda: nn.ModuleDict({"g": nn.GRUCell(3, 4), "l": nn.LSTMCell(3, 4)}), (3, 3)),
}


def _loss(out):
    if isinstance(out, tuple):
        return sum((_loss(o) for o in out), Tensor(0.0, dtype=np.float64))
    return (out * out).sum()


@pytest.mark.parametrize("name", sorted(MODELS))
def test_gradcheck_module_passes_every_layer(name):
    tinytf.manual_seed(0)
    make, shape = MODELS[name]
    model = make().astype(np.float64)
    x = Tensor(np.random.default_rng(2).normal(size=shape))
    if name == "cells":
        cells = model
        model = nn.Module()
        model.cells = cells
        model.forward = lambda t: (cells["g"](t), cells["l"](t))
    assert gradcheck_module(model, _loss, x)


class _WrongSigmoid(Function):
    """A sigmoid whose backward is 1 % off: gradcheck_module must catch it."""

    def forward(self, x):
        self.y = 1 / (1 + np.exp(-x))
        return self.y

    def backward(self, grad):
        return grad * self.y * (1 - self.y) * 1.01


class _Planted(nn.Module):
    def __init__(self):
        self.first, self.second = nn.Linear(3, 4), nn.Linear(4, 1)

    def forward(self, x):
        return self.second(_WrongSigmoid.apply(self.first(x)))


def test_gradcheck_module_catches_a_wrong_backward_and_names_the_parameter():
    model = _Planted().astype(np.float64)
    x = Tensor(np.random.default_rng(3).normal(size=(5, 3)))
    with pytest.raises(AssertionError, match="parameter 'first"):
        gradcheck_module(model, lambda y: (y * y).sum(), x)
    with pytest.raises(ValueError, match="not float64"):
        gradcheck_module(nn.Linear(2, 2), lambda y: y.sum(), x)


def test_module_dict_registers_its_modules():
    d = nn.ModuleDict({"enc": nn.Linear(2, 3), "dec": nn.Linear(3, 2)})
    d["extra"] = nn.LayerNorm(2)
    names = [n for n, _ in d.named_parameters()]
    assert names == sorted(["enc.weight", "enc.bias", "dec.weight", "dec.bias",
                            "extra.weight", "extra.bias"])
    assert list(d.keys()) == ["enc", "dec", "extra"] and "enc" in d and len(d) == 3
    with pytest.raises(TypeError, match="not a Module"):
        d["x"] = 3


def test_a_plain_dict_or_list_of_modules_is_refused_with_the_container_to_use():
    m = nn.Module()
    with pytest.raises(TypeError, match="use nn.ModuleDict"):
        m.heads = {"a": nn.Linear(2, 2)}
    with pytest.raises(TypeError, match="use nn.ModuleList"):
        m.blocks = [nn.Linear(2, 2), nn.Linear(2, 2)]
    m.sizes = [1, 2, 3]                       # plain data is fine
    m.heads = nn.ModuleDict({"a": nn.Linear(2, 2)})
    assert [n for n, _ in m.named_parameters()] == ["heads.a.bias", "heads.a.weight"]


class _WithBuffer(nn.Module):
    def __init__(self):
        self.lin = nn.Linear(2, 2)
        self.register_buffer("running_mean", np.zeros(2, np.float32))
        self.register_buffer("steps", np.zeros((), np.int64))

    def forward(self, x):
        return self.lin(x) - self.running_mean


def test_buffers_are_saved_and_moved_but_never_trained():
    m = _WithBuffer()
    assert [n for n, _ in m.named_parameters()] == ["lin.bias", "lin.weight"]
    assert [n for n, _ in m.named_buffers()] == ["running_mean", "steps"]
    assert not m.running_mean.requires_grad
    state = m.state_dict()
    assert set(state) == {"lin.bias", "lin.weight", "running_mean", "steps"}
    state["running_mean"] = np.array([1.0, 2.0], np.float32)
    other = _WithBuffer()
    other.load_state_dict(state)
    np.testing.assert_array_equal(other.running_mean.numpy(), [1.0, 2.0])
    other.astype(np.float64)
    assert other.running_mean.dtype == np.float64 and other.steps.dtype == np.int64
    other(Tensor(np.ones((1, 2)))).sum().backward()
    assert other.running_mean.grad is None
    with pytest.raises(KeyError, match="missing"):
        _WithBuffer().load_state_dict({k: v for k, v in state.items() if k != "steps"})


def test_repr_reads_like_pytorchs():
    model = nn.Sequential(nn.Conv1d(1, 2, 3), nn.ReLU(), nn.ModuleDict({"head": nn.Linear(4, 1)}))
    assert repr(model) == (
        "Sequential(\n"
        "  (0): Conv1d(1, 2, kernel_size=(3,), stride=(1,), padding=(0,), dilation=(1,), "
        "groups=1, bias=True)\n"
        "  (1): ReLU()\n"
        "  (2): ModuleDict(\n"
        "    (head): Linear(in_features=4, out_features=1, bias=True)\n"
        "  )\n"
        ")")
    assert repr(nn.GRU(2, 3, batch_first=True)) == \
        "GRU(2, 3, num_layers=1, bias=True, batch_first=True, dropout=0)"
