"""The ops added for other models (issue 62): abs, clamp, sigmoid, softplus, silu,
logsumexp, convolution, max and average pooling, binary cross-entropy on logits.

Forward against NumPy written from the definitions (convolution and pooling as the plain
loops over output positions), backward against float64 central differences
(tinytf.engine.gradcheck) on Hypothesis-drawn shapes and settings, and float32 in, float32
out. PyTorch parity is in tests/nn/test_torch_parity_everyday.py (skipped without torch).
"""
import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from tinytf import Tensor
from tinytf import functional as F
from tinytf.engine.gradcheck import gradcheck

SEEDS = st.integers(0, 2**32 - 1)
SHAPES = hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4)


def leaf(a):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=True, dtype=np.float64)


def sigmoid_ref(x):
    return 1 / (1 + np.exp(-x))


ELEMENTWISE = {   # name: (ours, NumPy's from the definition)
    "abs": (lambda x: x.abs(), np.abs),
    "clamp": (lambda x: x.clamp(-0.5, 0.7), lambda x: np.minimum(np.maximum(x, -0.5), 0.7)),
    "sigmoid": (F.sigmoid, sigmoid_ref),
    "softplus": (F.softplus, lambda x: np.log1p(np.exp(x))),
    "silu": (F.silu, lambda x: x * sigmoid_ref(x)),
}


@pytest.mark.parametrize("name", sorted(ELEMENTWISE))
@given(shape=SHAPES, seed=SEEDS)
def test_elementwise(name, shape, seed):
    ours, ref = ELEMENTWISE[name]
    a = np.random.default_rng(seed).uniform(-3, 3, size=shape)
    a = np.where(np.abs(a) < 0.05, 0.3, a)                        # away from abs's kink
    a = np.where(np.abs(np.abs(a - 0.1) - 0.6) < 0.05, 1.5, a)    # and from clamp's bounds
    np.testing.assert_allclose(ours(leaf(a)).numpy(), ref(a), rtol=1e-12, atol=1e-14)
    gradcheck(ours, [leaf(a)])
    out = ours(Tensor(a.astype(np.float32)))
    assert out.dtype == np.float32


def test_sigmoid_and_softplus_do_not_overflow():
    x = Tensor(np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0], dtype=np.float32),
               requires_grad=True)
    with np.errstate(over="raise", invalid="raise", divide="raise"):
        s, sp = F.sigmoid(x), F.softplus(x)
        (s.sum() + sp.sum()).backward()
    np.testing.assert_allclose(s.numpy(), [0, 1.9287498e-22, 0.5, 1, 1], rtol=1e-6)
    np.testing.assert_allclose(sp.numpy(), [0, 1.9287498e-22, math.log(2), 50, 1000], rtol=1e-6)
    assert np.all(np.isfinite(x.grad))


@given(shape=SHAPES, seed=SEEDS, keep=st.booleans())
def test_logsumexp(shape, seed, keep):
    a = np.random.default_rng(seed).normal(size=shape) * 5
    dim = len(shape) - 1
    ref = np.log(np.exp(a).sum(axis=dim, keepdims=keep))
    np.testing.assert_allclose(F.logsumexp(leaf(a), dim, keep).numpy(), ref, rtol=1e-12)
    gradcheck(lambda x: F.logsumexp(x, dim, keep), [leaf(a)])


def test_logsumexp_of_large_and_infinite_rows():
    a = np.array([[1000.0, 1000.0], [-np.inf, -np.inf], [0.0, -np.inf]])
    np.testing.assert_allclose(F.logsumexp(Tensor(a), 1).numpy(),
                               [1000 + math.log(2), -np.inf, 0.0])


def conv_ref(x, w, b, stride, padding, dilation, groups):
    """Convolution from its definition: a loop over output positions and kernel taps."""
    d = x.ndim - 2
    xp = np.pad(x, ((0, 0), (0, 0)) + tuple((p, p) for p in padding))
    n, c = x.shape[:2]
    o, cg, *kernel = w.shape
    out = [(xp.shape[2 + i] - dilation[i] * (kernel[i] - 1) - 1) // stride[i] + 1
           for i in range(d)]
    y = np.zeros((n, o, *out))
    for oc in range(o):
        g = oc // (o // groups)
        for pos in itertools.product(*(range(m) for m in out)):
            total = np.zeros(n)
            for tap in itertools.product(*(range(k) for k in kernel)):
                at = tuple(pos[i] * stride[i] + tap[i] * dilation[i] for i in range(d))
                window = xp[(slice(None), slice(g * cg, (g + 1) * cg)) + at]
                total += window @ w[(oc, slice(None)) + tap]
            y[(slice(None), oc) + pos] = total + (b[oc] if b is not None else 0)
    return y


@st.composite
def conv_case(draw):
    d = draw(st.sampled_from([1, 2]))
    groups = draw(st.sampled_from([1, 2]))
    c = groups * draw(st.integers(1, 2))
    o = groups * draw(st.integers(1, 2))
    kernel = tuple(draw(st.integers(1, 3)) for _ in range(d))
    stride = tuple(draw(st.integers(1, 2)) for _ in range(d))
    dilation = tuple(draw(st.integers(1, 2)) for _ in range(d))
    padding = tuple(draw(st.integers(0, 2)) for _ in range(d))
    span = [dl * (k - 1) + 1 for k, dl in zip(kernel, dilation)]
    size = tuple(max(1, s - 2 * p) + draw(st.integers(0, 3)) for s, p in zip(span, padding))
    return d, (draw(st.integers(1, 2)), c) + size, (o, c // groups) + kernel, stride, padding, \
        dilation, groups, draw(st.booleans())


@settings(max_examples=40, deadline=None)
@given(case=conv_case(), seed=SEEDS)
def test_conv(case, seed):
    d, xs, ws, stride, padding, dilation, groups, bias = case
    rng = np.random.default_rng(seed)
    x, w = rng.normal(size=xs), rng.normal(size=ws)
    b = rng.normal(size=ws[0]) if bias else None
    conv = F.conv1d if d == 1 else F.conv2d

    def fn(*t):
        return conv(*t, stride=stride, padding=padding, dilation=dilation, groups=groups)

    inputs = [leaf(x), leaf(w)] + ([leaf(b)] if bias else [])
    np.testing.assert_allclose(fn(*inputs).numpy(),
                               conv_ref(x, w, b, stride, padding, dilation, groups),
                               rtol=1e-10, atol=1e-12)
    gradcheck(fn, inputs)
    out = fn(*[Tensor(a.data.astype(np.float32)) for a in inputs])
    assert out.dtype == np.float32


def pool_ref(x, kernel, stride, padding, kind):
    """Pooling from its definition (max pads with -inf, average counts the padding)."""
    d = x.ndim - 2
    fill = -np.inf if kind == "max" else 0.0
    xp = np.pad(x, ((0, 0), (0, 0)) + tuple((p, p) for p in padding), constant_values=fill)
    out = [(xp.shape[2 + i] - kernel[i]) // stride[i] + 1 for i in range(d)]
    y = np.zeros(x.shape[:2] + tuple(out))
    for pos in itertools.product(*(range(m) for m in out)):
        window = xp[(slice(None), slice(None)) + tuple(
            slice(pos[i] * stride[i], pos[i] * stride[i] + kernel[i]) for i in range(d))]
        axes = tuple(range(2, 2 + d))
        y[(slice(None), slice(None)) + pos] = window.max(axis=axes) if kind == "max" \
            else window.mean(axis=axes)
    return y


@settings(max_examples=40, deadline=None)
@given(d=st.sampled_from([1, 2]), kind=st.sampled_from(["max", "avg"]), seed=SEEDS,
       data=st.data())
def test_pool(d, kind, seed, data):
    kernel = tuple(data.draw(st.integers(1, 3)) for _ in range(d))
    stride = tuple(data.draw(st.integers(1, 3)) for _ in range(d))
    padding = tuple(data.draw(st.integers(0, k // 2)) for k in kernel)
    shape = (2, 2) + tuple(k + data.draw(st.integers(0, 3)) for k in kernel)
    rng = np.random.default_rng(seed)
    x = (rng.permutation(math.prod(shape)).reshape(shape) + rng.uniform(0, 0.5)) * 0.1  # no ties
    pool = getattr(F, f"{kind}_pool{d}d")

    def fn(t):
        return pool(t, kernel, stride, padding)

    np.testing.assert_allclose(fn(leaf(x)).numpy(), pool_ref(x, kernel, stride, padding, kind),
                               rtol=1e-12)
    gradcheck(fn, [leaf(x)], eps=1e-7)


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_binary_cross_entropy_with_logits(reduction):
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3, 4)) * 3, rng.uniform(size=(3, 4))
    p = sigmoid_ref(x)
    loss = -(y * np.log(p) + (1 - y) * np.log(1 - p))
    ref = {"mean": loss.mean(), "sum": loss.sum(), "none": loss}[reduction]
    fn = lambda a, b: F.binary_cross_entropy_with_logits(a, b, reduction=reduction)  # noqa: E731
    np.testing.assert_allclose(fn(leaf(x), leaf(y)).numpy(), ref, rtol=1e-12)
    gradcheck(fn, [leaf(x), leaf(y)])
    big = F.binary_cross_entropy_with_logits(Tensor(np.array([800.0, -800.0])),
                                             np.array([0.0, 1.0]), reduction="none")
    np.testing.assert_allclose(big.numpy(), [800.0, 800.0])


def test_conv_and_pool_errors_are_clear():
    x = Tensor(np.zeros((1, 3, 5), np.float32))
    with pytest.raises(ValueError, match="channels"):
        F.conv1d(x, Tensor(np.zeros((4, 2, 3), np.float32)))
    with pytest.raises(ValueError, match="larger than the padded input"):
        F.conv1d(x, Tensor(np.zeros((4, 3, 7), np.float32)))
    with pytest.raises(ValueError, match="conv2d wants"):
        F.conv2d(x, Tensor(np.zeros((4, 3, 3), np.float32)))
    with pytest.raises(ValueError, match="at most half"):
        F.max_pool1d(x, 2, padding=2)
    assert F.conv1d(x, Tensor(np.zeros((2, 3, 3), np.float32)), padding="same").shape == (1, 2, 5)
