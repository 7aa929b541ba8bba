"""The autograd engine (tinytf/engine/tensor.py): accumulation, deep graphs, freeing, dtypes,
no_grad and which gradients get computed at all."""
import gc
import sys
import tracemalloc
import weakref

import numpy as np
import pytest

import tinytf
from tinytf import Function, Tensor, nn, optim
from tinytf import functional as F


def f32(*shape, seed=0, low=0.5, high=2.0):
    """A float32 leaf requiring grad, values in [low, high) (positive: fine for log/sqrt)."""
    a = np.random.default_rng(seed).uniform(low, high, size=shape).astype(np.float32)
    return Tensor(a, requires_grad=True)


# ----- accumulation ------------------------------------------------------------------------
def test_fan_out_accumulates():
    """x feeds four uses; d/dx (x*x + 3x + exp(x) + x) = 2x + 4 + exp(x)."""
    x = Tensor(np.array([0.5, -1.0, 2.0]), requires_grad=True, dtype=np.float64)
    (x * x + x * 3.0 + x.exp() + x).sum().backward()
    np.testing.assert_allclose(x.grad, 2 * x.data + 4 + np.exp(x.data), rtol=1e-12)


def test_same_tensor_twice_in_one_op():
    x = Tensor(np.array([1.0, 2.0]), requires_grad=True, dtype=np.float64)
    (x * x).sum().backward()
    np.testing.assert_array_equal(x.grad, [2.0, 4.0])
    x.zero_grad()
    (x + x).sum().backward()
    np.testing.assert_array_equal(x.grad, [2.0, 2.0])


def test_diamond_graph():
    """a -> (b, c) -> d: both paths' contributions reach a exactly once."""
    a = Tensor(np.array(3.0), requires_grad=True, dtype=np.float64)
    b, c = a * 2.0, a ** 2
    (b * c).backward()                       # d = 2a^3, dd/da = 6a^2
    np.testing.assert_allclose(a.grad, 54.0)


def test_accumulates_across_backward_calls_until_zeroed():
    w = Tensor(np.array([1.0, 2.0], dtype=np.float32), requires_grad=True)
    (w * 3.0).sum().backward()
    (w * w).sum().backward()
    np.testing.assert_allclose(w.grad, [3 + 2, 3 + 4])
    w.zero_grad()
    assert w.grad is None
    (w * 3.0).sum().backward()
    np.testing.assert_allclose(w.grad, [3, 3])


def test_backward_with_explicit_gradient_and_scalar_seed():
    x = Tensor(np.arange(6.0).reshape(2, 3), requires_grad=True, dtype=np.float64)
    (x * 2.0).backward(np.ones((2, 3)) * 0.5)
    np.testing.assert_array_equal(x.grad, np.ones((2, 3)))
    with pytest.raises(RuntimeError):
        (x * 2.0).backward()  # non-scalar output needs an explicit gradient
    with pytest.raises(ValueError):
        (x * 2.0).backward(np.ones(3))  # wrong shape


def test_second_backward_through_a_freed_graph_is_an_error():
    """No retain_graph: the graph is freed, so a second backward must fail loudly rather than
    silently leave the leaves' gradients unchanged."""
    x = f32(3)
    y = (x * 2.0).sum()
    y.backward()
    with pytest.raises(RuntimeError):
        y.backward()
    np.testing.assert_array_equal(x.grad, [2.0, 2.0, 2.0])
    h = x * 3.0                      # shared by two outputs
    y1, y2 = h.sum(), (h * h).sum()
    y1.backward()                    # frees h's node
    with pytest.raises(RuntimeError):
        y2.backward()                # would otherwise stop at h and never reach x
    np.testing.assert_array_equal(x.grad, [5.0, 5.0, 5.0])


def test_leaf_grads_are_not_aliased():
    """Two leaves fed by one gradient array must not share memory (in-place updates)."""
    a, b = f32(3), f32(3, seed=1)
    (a + b).sum().backward()
    assert not np.shares_memory(a.grad, b.grad)
    a.grad *= 0
    assert np.all(b.grad == 1)


# ----- deep graphs and freeing -------------------------------------------------------------
def test_deep_chain_has_no_recursion_limit():
    x = Tensor(np.array([1.0, 2.0], dtype=np.float32), requires_grad=True)
    y = x
    for _ in range(10_000):
        y = y * 1.0001 + 0.0
    assert 10_000 * 2 > sys.getrecursionlimit()
    y.sum().backward()
    np.testing.assert_allclose(x.grad, 1.0001 ** 10_000, rtol=1e-3)


def test_graph_and_saved_arrays_are_freed_after_backward():
    """Only refcounting (gc disabled): no reference cycles keep the graph alive."""
    x = Tensor(np.ones((4, 4), dtype=np.float32), requires_grad=True)
    gc.collect()
    gc.disable()
    try:
        h = (x * 2.0).exp()                  # Exp saves its output array
        h_ref, h_data_ref = weakref.ref(h), weakref.ref(h.data)
        y = (h * h).sum()                    # Mul saves h.data twice
        del h
        assert h_ref() is not None           # the graph holds the intermediate
        y.backward()
        assert h_ref() is None               # ... and lets go of it after backward
        assert h_data_ref() is None          # the saved array is gone too
        assert y.is_leaf                     # the output no longer points into a graph
    finally:
        gc.enable()
    assert x.grad is not None


def test_no_memory_growth_over_100_training_steps():
    """A small MLP's training loop: memory after 100 steps ~= memory after 10 steps."""
    tinytf.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))
    opt = optim.Adam(model.named_parameters(), lr=1e-3)
    rng = np.random.default_rng(0)
    x = Tensor(rng.normal(size=(16, 8)).astype(np.float32))
    target = rng.integers(0, 4, size=16)

    def step():
        loss = F.cross_entropy(model(x), target, label_smoothing=0.1)
        opt.zero_grad()
        loss.backward()
        optim.clip_grad_norm(model.parameters(), 1.0)
        opt.step()
        return loss.item()

    tracemalloc.start()
    try:
        first = [step() for _ in range(10)]
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]
        last = [step() for _ in range(100)]
        gc.collect()
        growth = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    # One leaked step's graph holds ~10 KB of activations; 100 leaked steps would be ~1 MB.
    assert growth < 100_000, f"memory grew by {growth} bytes over 100 steps"
    assert last[-1] < first[0]  # and it did train


# ----- which gradients exist -----------------------------------------------------------------
def test_integer_tensors_get_no_gradient():
    with pytest.raises(TypeError):
        Tensor(np.arange(3), requires_grad=True)
    ids = Tensor(np.array([0, 2, 2]))
    w = f32(3, 2)
    F.embedding(ids, w).sum().backward()
    assert ids.grad is None and not ids.requires_grad
    np.testing.assert_array_equal(w.grad, [[1, 1], [0, 0], [2, 2]])


def test_inputs_without_requires_grad_get_no_grad():
    x, c = f32(2, 3), Tensor(np.ones((2, 3), dtype=np.float32))
    w = Tensor(np.ones((4, 3), dtype=np.float32))
    (F.linear(x * c + c, w).sum() + (c @ x.T).sum()).backward()
    assert x.grad is not None
    assert c.grad is None and w.grad is None


BINARY_NODES = {  # op -> builds out from (a, b); checks ops skip gradients nobody needs
    "add": lambda a, b: a + b,
    "mul": lambda a, b: a * b,
    "matmul": lambda a, b: a @ b.T,
    "linear": lambda a, b: F.linear(a, b),
    "where": lambda a, b: tinytf.where(np.array([True, False, True]), a, b),
    "layer_norm": lambda a, b: F.layer_norm(a, b[0], b[1]),
    "attention": lambda a, b: F.attention(a.reshape(1, 1, 2, 3), b.reshape(1, 1, 2, 3),
                                          b.reshape(1, 1, 2, 3)),
}


@pytest.mark.parametrize("name", sorted(BINARY_NODES))
def test_ops_do_not_compute_unneeded_gradients(name):
    """With one input frozen, the node's backward returns None for it (no wasted work)."""
    a, b = f32(2, 3), Tensor(np.ones((2, 3), dtype=np.float32))
    out = BINARY_NODES[name](a, b)
    ctx = out._ctx
    grads = ctx.backward(np.ones(out.shape, dtype=np.float32))
    grads = grads if isinstance(grads, tuple) else (grads,)
    for inp, g, needed in zip(ctx.inputs, grads, ctx.needs_input_grad):
        assert needed == inp.requires_grad
        assert (g is None) == (not needed), f"{type(ctx).__name__}: needed={needed}, got {g}"


def test_no_grad_builds_no_graph():
    x = f32(3)
    with tinytf.no_grad():
        assert not tinytf.is_grad_enabled()
        y = (x * 2.0).exp().sum()
    assert tinytf.is_grad_enabled()
    assert not y.requires_grad and y.is_leaf
    with pytest.raises(RuntimeError):
        y.backward()
    x_ref = weakref.ref(x)
    del x
    assert x_ref() is None  # y does not hold x through a graph

    @tinytf.no_grad()
    def infer(t):
        return t * 2.0

    z = infer(f32(3))
    assert not z.requires_grad and z.is_leaf
    assert tinytf.is_grad_enabled()


def test_several_outputs_share_one_node_and_free_it():
    """Split's pieces: plain tensors under no_grad; with a graph, one node that backward
    releases (no reference cycle between the pieces and their node)."""
    x = f32(6)
    with tinytf.no_grad():
        pieces = F.split(x, 3)
    assert all(p.is_leaf and not p.requires_grad for p in pieces)
    gc.collect()
    gc.disable()
    try:
        a, b = F.split(x * 2.0, 3)
        node_ref = weakref.ref(a._ctx)
        assert b._ctx is a._ctx
        y = (a * b).sum()
        del a, b
        y.backward()
        assert node_ref() is None
    finally:
        gc.enable()
    np.testing.assert_allclose(x.grad, 2.0 * np.concatenate([2.0 * x.data[3:], 2.0 * x.data[:3]]))
    a, b = F.split(x * 1.0, 3)
    y1, y2 = a.sum(), (a + b).sum()
    y1.backward()                  # frees a's node, which b shares
    with pytest.raises(RuntimeError):
        y2.backward()


def test_detach_cuts_the_graph():
    x = f32(3)
    y = (x * 2.0).detach()
    assert not y.requires_grad
    z = (y * x).sum()
    z.backward()
    np.testing.assert_allclose(x.grad, y.data)  # y treated as a constant


# ----- dtypes --------------------------------------------------------------------------------
IDS = np.array([[0, 2], [1, 2]])
MASK = np.array([[True, False, True], [False, False, True]])
OPS = {  # name -> (fn of float32 leaves, shapes of the leaves)
    "add": (lambda a, b: a + b, [(2, 3), (3,)]),
    "sub": (lambda a, b: a - b, [(2, 3), (1, 3)]),
    "mul": (lambda a, b: a * b, [(2, 3), (2, 1)]),
    "div": (lambda a, b: a / b, [(2, 3), (3,)]),
    "scalar ops": (lambda a: 2.0 - a * 3 + 1 / a - a / 4.0, [(2, 3)]),
    "neg": (lambda a: -a, [(2, 3)]),
    "pow": (lambda a: a ** 1.5 + a ** 2, [(2, 3)]),
    "exp": (lambda a: a.exp(), [(2, 3)]),
    "log": (lambda a: a.log(), [(2, 3)]),
    "sqrt": (lambda a: a.sqrt(), [(2, 3)]),
    "tanh": (lambda a: a.tanh(), [(2, 3)]),
    "relu": (lambda a: (a - 1.0).relu(), [(2, 3)]),
    "gelu": (lambda a: F.gelu(a - 1.0), [(2, 3)]),
    "matmul": (lambda a, b: a @ b, [(2, 2, 3), (3, 4)]),
    "sum": (lambda a: a.sum(axis=1, keepdims=True), [(2, 3)]),
    "mean": (lambda a: a.mean(axis=(0, 1)), [(2, 3)]),
    "max": (lambda a: a.max(axis=0), [(2, 3)]),
    "reshape": (lambda a: a.reshape(3, 2), [(2, 3)]),
    "transpose": (lambda a: a.transpose(1, 0), [(2, 3)]),
    "getitem": (lambda a: a[:, 1:].sum(axis=1) + a[np.array([1, 1]), 2], [(2, 3)]),
    "cat": (lambda a, b: tinytf.cat([a, b], axis=0), [(2, 3), (1, 3)]),
    "split": (lambda a: tinytf.cat(F.split(a, [2, 1], axis=1)[::-1], axis=1), [(2, 3)]),
    "stack": (lambda a, b: tinytf.stack([a, b], axis=1), [(2, 3), (2, 3)]),
    "where": (lambda a, b: tinytf.where(MASK, a, b), [(2, 3), (2, 3)]),
    "masked_fill": (lambda a: a.masked_fill(MASK, float(np.finfo(np.float32).min)), [(2, 3)]),
    "softmax": (lambda a: a.softmax(axis=0), [(2, 3)]),
    "log_softmax": (lambda a: a.log_softmax(), [(2, 3)]),
    "layer_norm": (lambda a, w, b: F.layer_norm(a, w, b), [(2, 3), (3,), (3,)]),
    "dropout": (lambda a: F.dropout(a, 0.5), [(2, 3)]),
    "embedding": (lambda w: F.embedding(IDS, w), [(3, 4)]),
    "cross_entropy": (lambda a: F.cross_entropy(a, np.array([0, 2]), label_smoothing=0.1,
                                                ignore_index=2), [(2, 3)]),
    "linear": (lambda x, w, b: F.linear(x, w, b), [(2, 2, 3), (4, 3), (4,)]),
    "attention": (lambda q, k, v: F.attention(q, k, v, mask=MASK[None, None, :, :],
                                              dropout=0.1, training=True),
                  [(1, 2, 2, 4), (1, 2, 3, 4), (1, 2, 3, 4)]),
    "abs": (lambda a: a.abs(), [(2, 3)]),
    "clamp": (lambda a: a.clamp(0.2, 0.6), [(2, 3)]),
    "sigmoid": (lambda a: F.sigmoid(a), [(2, 3)]),
    "softplus": (lambda a: F.softplus(a), [(2, 3)]),
    "silu": (lambda a: F.silu(a), [(2, 3)]),
    "logsumexp": (lambda a: F.logsumexp(a, 1), [(2, 3)]),
    "var": (lambda a: a.var(0), [(2, 3)]),
    "rpow": (lambda a: 2.0 ** a, [(2, 3)]),
    "conv1d": (lambda x, w, b: F.conv1d(x, w, b, padding=1), [(2, 2, 5), (3, 2, 3), (3,)]),
    "conv2d": (lambda x, w: F.conv2d(x, w, stride=2, groups=2), [(1, 2, 5, 4), (2, 1, 2, 2)]),
    "max_pool": (lambda a: F.max_pool2d(a, 2), [(1, 2, 4, 4)]),
    "avg_pool": (lambda a: F.avg_pool1d(a, 3, 1, 1), [(1, 2, 5)]),
    "bce_with_logits": (lambda a, b: F.binary_cross_entropy_with_logits(a, b), [(2, 3), (2, 3)]),
    "nll_loss": (lambda a: F.nll_loss(a, np.array([[0, 2]])), [(1, 2, 3)]),
    "mse_loss": (lambda a, b: F.mse_loss(a, b), [(2, 3), (2, 3)]),
}


@pytest.mark.parametrize("name", sorted(OPS))
def test_float32_in_float32_out_for_every_op(name):
    fn, shapes = OPS[name]
    leaves = [f32(*s, seed=i) for i, s in enumerate(shapes)]
    out = fn(*leaves)
    assert out.dtype == np.float32, f"{name}: output {out.dtype}"
    out.backward(np.ones(out.shape, dtype=np.float32))
    for i, t in enumerate(leaves):
        assert t.grad is not None, f"{name}: input {i} got no gradient"
        assert t.grad.dtype == np.float32, f"{name}: input {i} gradient {t.grad.dtype}"
        assert t.grad.shape == t.shape


@pytest.mark.parametrize("name", sorted(OPS))
def test_float64_stays_float64_for_every_op(name):
    fn, shapes = OPS[name]
    leaves = [Tensor(f32(*s, seed=i).data, requires_grad=True, dtype=np.float64)
              for i, s in enumerate(shapes)]
    out = fn(*leaves)
    assert out.dtype == np.float64, f"{name}: output {out.dtype}"
    out.backward(np.ones(out.shape))
    assert all(t.grad.dtype == np.float64 for t in leaves)


def test_python_scalars_take_the_tensor_dtype():
    x = f32(3)
    for y in (x + 1, 1 - x, x * 2.5, 2.5 / x, x ** 2, x ** 0.5, x * np.float64(2.0)):
        assert y.dtype == np.float32
    assert Tensor([1.0, 2.0]).dtype == np.float32   # Python floats default to float32
    assert Tensor([1, 2]).dtype.kind == "i"          # ints stay ints


def test_op_outputs_are_arrays_even_from_full_reductions():
    # NumPy's full reductions return scalars (np.float32), not arrays; an op's output
    # tensor must hold a 0-d array all the same (in-place gradient code relies on it).
    x = tinytf.Tensor(np.arange(4, dtype=np.float32), requires_grad=True)
    s = x.sum()
    assert isinstance(s.data, np.ndarray) and s.data.shape == () and s.dtype == np.float32
    with tinytf.no_grad():
        assert isinstance(x.sum().data, np.ndarray)


# ---- Function.apply's guard rails -----------------------------------------------------------

class _Scale(Function):
    """x * 2 (+ b): b is optional (None), as a layer's bias is."""

    def forward(self, x, b=None):
        return x * 2 if b is None else x * 2 + b

    def backward(self, grad):
        return grad * 2, (None if self.inputs[1] is None else grad)


class _ShortBackward(Function):
    """x * y whose backward forgets y's gradient."""

    def forward(self, x, y):
        self.save_for_backward(x, y)
        return x * y

    def backward(self, grad):
        return (grad * self.saved[1],)


class _ReturnsTensor(Function):
    def forward(self, x):
        return Tensor(x * 2)

    def backward(self, grad):
        return grad * 2


class _Upcasts(Function):
    def forward(self, x):
        return x * np.float64(2.0)     # a float64 constant promotes float32 to float64

    def backward(self, grad):
        return grad * 2


def test_a_backward_with_too_few_gradients_is_an_error_naming_the_op():
    x = Tensor(np.ones(3, np.float32), requires_grad=True)
    y = Tensor(np.ones(3, np.float32), requires_grad=True)
    with pytest.raises(TypeError, match=r"_ShortBackward.backward returned 1 gradients for 2"):
        _ShortBackward.apply(x, y).sum().backward()


def test_a_tensor_as_a_keyword_argument_is_refused():
    x = Tensor(np.ones(3, np.float32), requires_grad=True)
    with pytest.raises(TypeError, match=r"_Scale.apply: keyword argument 'b' is a Tensor"):
        _Scale.apply(x, b=Tensor(np.ones(3, np.float32)))


def test_a_forward_that_returns_a_tensor_is_refused():
    with pytest.raises(TypeError, match=r"_ReturnsTensor.forward returned a Tensor"):
        _ReturnsTensor.apply(Tensor(np.ones(3, np.float32), requires_grad=True))


def test_a_forward_that_upcasts_float32_to_float64_is_refused():
    with pytest.raises(TypeError, match=r"_Upcasts.forward returned float64 from float32"):
        _Upcasts.apply(Tensor(np.ones(3, np.float32), requires_grad=True))
    out = _Upcasts.apply(Tensor(np.ones(3, np.float64), requires_grad=True))  # float64 in
    assert out.dtype == np.float64


def test_none_and_constants_are_positional_inputs_without_a_gradient():
    x = Tensor(np.arange(3, dtype=np.float32), requires_grad=True)
    y = _Scale.apply(x, None)                  # an optional bias left out
    y.sum().backward()
    np.testing.assert_array_equal(x.grad, [2, 2, 2])
    x.grad = None
    _Scale.apply(x, np.ones(3, np.float32)).sum().backward()   # a constant array
    np.testing.assert_array_equal(x.grad, [2, 2, 2])
