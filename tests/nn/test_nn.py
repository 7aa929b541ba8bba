"""tinytf.nn.modules: parameter registration and order, state dicts, train/eval, seeded init."""
import numpy as np
import pytest

import tinytf
from tinytf import Tensor, nn
from tinytf.engine.gradcheck import gradcheck


class Block(nn.Module):
    """A module with parameters, a sub-module, a list of sub-modules and a shared parameter."""

    def __init__(self):
        self.zeta = nn.Linear(3, 4)
        self.alpha = nn.LayerNorm(4)
        self.layers = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 2, bias=False)])
        self.drop = nn.Dropout(0.5)
        self.scale = nn.Parameter(np.ones(1))
        self.table = np.arange(3.0, dtype=np.float32)  # a plain array: not a parameter

    def forward(self, x):
        h = self.drop(self.alpha(self.zeta(x)))
        for layer in self.layers:
            h = layer(h)
        return h * self.scale


EXPECTED_NAMES = ["alpha.bias", "alpha.weight", "layers.0.bias", "layers.0.weight",
                  "layers.1.weight", "scale", "zeta.bias", "zeta.weight"]


def test_named_parameters_sorted_and_deterministic():
    tinytf.manual_seed(0)
    m = Block()
    names = [n for n, _ in m.named_parameters()]
    assert names == EXPECTED_NAMES
    assert names == [n for n, _ in Block().named_parameters()]
    assert [id(p) for p in m.parameters()] == [id(p) for _, p in m.named_parameters()]
    assert m.num_parameters() == 4 + 4 + 4 + 16 + 8 + 1 + 4 + 12
    assert all(p.requires_grad and p.dtype == np.float32 for p in m.parameters())


def test_shared_parameter_listed_once():
    m = Block()
    m.tied = m.zeta  # the same module under two names (weight tying)
    params = m.parameters()
    assert len(params) == len({id(p) for p in params}) == len(EXPECTED_NAMES)


def test_sequential_and_module_list():
    tinytf.manual_seed(0)
    seq = nn.Sequential(nn.Linear(2, 3), nn.ReLU(), nn.Linear(3, 1))
    assert [n for n, _ in seq.named_parameters()] == ["0.bias", "0.weight", "2.bias",
                                                      "2.weight"]
    assert len(seq) == 3 and isinstance(seq[1], nn.ReLU)
    x = Tensor(np.ones((5, 2), dtype=np.float32))
    ref = np.maximum(x.numpy() @ seq[0].weight.numpy().T + seq[0].bias.numpy(), 0)
    ref = ref @ seq[2].weight.numpy().T + seq[2].bias.numpy()
    np.testing.assert_allclose(seq(x).numpy(), ref, rtol=1e-6)


def test_state_dict_round_trip():
    tinytf.manual_seed(1)
    a = Block()
    state = a.state_dict()
    assert list(state) == EXPECTED_NAMES
    assert all(isinstance(v, np.ndarray) for v in state.values())
    state["zeta.weight"][...] = 7.0  # a copy: changing it leaves the model alone
    assert not np.any(a.zeta.weight.numpy() == 7.0)
    tinytf.manual_seed(2)
    b = Block()
    b.load_state_dict(a.state_dict())
    for (na, pa), (nb, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert na == nb
        np.testing.assert_array_equal(pa.numpy(), pb.numpy())
        assert pb.dtype == np.float32
    a.eval()
    b.eval()
    x = Tensor(np.ones((2, 3), dtype=np.float32))
    np.testing.assert_array_equal(a(x).numpy(), b(x).numpy())
    b.zeta.weight.data[...] = 0.0  # and the loaded arrays are not shared with a
    assert np.any(a.zeta.weight.numpy() != 0.0)


def test_load_state_dict_errors_name_the_keys():
    m = Block()
    state = m.state_dict()
    missing = dict(state)
    del missing["layers.1.weight"]
    with pytest.raises(KeyError, match=r"layers\.1\.weight"):
        m.load_state_dict(missing)
    unexpected = dict(state, **{"layers.2.weight": np.zeros((2, 2))})
    with pytest.raises(KeyError, match=r"layers\.2\.weight"):
        m.load_state_dict(unexpected)
    bad = dict(state, **{"zeta.weight": np.zeros((3, 4), dtype=np.float32)})
    with pytest.raises(ValueError, match=r"zeta\.weight.*\(3, 4\).*\(4, 3\)"):
        m.load_state_dict(bad)
    before = m.state_dict()
    m.load_state_dict(missing, strict=False)  # non-strict: load what is there
    for name, value in m.state_dict().items():
        np.testing.assert_array_equal(value, before[name])


def test_train_eval_toggles_dropout_everywhere():
    tinytf.manual_seed(0)
    m = Block()
    assert m.training and m.drop.training and m.layers[0].training
    x = Tensor(np.random.default_rng(0).normal(size=(64, 3)).astype(np.float32))
    assert m.eval() is m
    assert not m.training and not m.drop.training and not m.layers[1].training
    np.testing.assert_array_equal(m(x).numpy(), m(x).numpy())  # deterministic
    m.train()
    assert m.drop.training
    assert not np.array_equal(m(x).numpy(), m(x).numpy())     # dropout active
    drop = nn.Dropout(0.5)
    h = Tensor(np.ones((100, 100), dtype=np.float32))
    assert 0.4 < (drop(h).numpy() == 0).mean() < 0.6
    np.testing.assert_array_equal(drop.eval()(h).numpy(), h.numpy())


def test_seeded_init_is_reproducible():
    tinytf.manual_seed(42)
    a = Block().state_dict()
    tinytf.manual_seed(42)
    b = Block().state_dict()
    tinytf.manual_seed(43)
    c = Block().state_dict()
    for name in a:
        np.testing.assert_array_equal(a[name], b[name])
    assert not np.array_equal(a["zeta.weight"], c["zeta.weight"])


def test_documented_initialisation():
    tinytf.manual_seed(0)
    lin = nn.Linear(400, 300)
    bound = 1 / np.sqrt(400)  # PyTorch's default: U(-1/sqrt(in), 1/sqrt(in))
    w, b = lin.weight.numpy(), lin.bias.numpy()
    assert w.shape == (300, 400) and b.shape == (300,)
    assert np.abs(w).max() <= bound and np.abs(w).max() > 0.99 * bound
    assert abs(w.std() - bound / np.sqrt(3)) < 0.01 * bound  # std of U(-a, a) is a/sqrt(3)
    assert np.abs(b).max() <= bound
    emb = nn.Embedding(1000, 64)
    assert emb.weight.shape == (1000, 64)
    assert abs(emb.weight.numpy().std() - 64 ** -0.5) < 0.01 * 64 ** -0.5
    assert abs(nn.Embedding(500, 16, std=0.02).weight.numpy().std() - 0.02) < 0.001
    ln = nn.LayerNorm(5)
    np.testing.assert_array_equal(ln.weight.numpy(), np.ones(5))
    np.testing.assert_array_equal(ln.bias.numpy(), np.zeros(5))
    t = nn.Parameter(np.empty((30, 50), dtype=np.float32))
    nn.init.xavier_uniform_(t)
    limit = np.sqrt(6 / (30 + 50))
    assert np.abs(t.numpy()).max() <= limit and t.dtype == np.float32
    assert np.all(nn.init.zeros_(t).numpy() == 0) and np.all(nn.init.ones_(t).numpy() == 1)
    assert abs(nn.init.normal_(t, 0.5).numpy().std() - 0.5) < 0.05


def test_zero_grad_and_module_gradcheck():
    """A whole module (cast to float64) passes gradcheck with respect to its parameters."""
    tinytf.manual_seed(0)
    m = Block().astype(np.float64).eval()
    x = Tensor(np.random.default_rng(0).normal(size=(2, 3)), dtype=np.float64)
    params = m.parameters()

    def fn(*ps):
        return m(x)

    gradcheck(fn, params)
    m(x).sum().backward()
    assert all(p.grad is not None for p in params)
    m.zero_grad()
    assert all(p.grad is None for p in params)
