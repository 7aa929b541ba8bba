"""tinytf.nn.functional: property tests for the fused neural-network ops (forward equals a NumPy
reference, backward equals float64 central differences), plus their numerical edge cases:
logits around +-1e4, masked positions, fully masked rows, repeated embedding ids.
"""
import numpy as np
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tinytf
from tinytf import Tensor
from tinytf import functional as F
from tinytf.engine.gradcheck import gradcheck, gradcheck_random
from tinytf.fast import BlockedCrossEntropy

SEEDS = st.integers(0, 2**32 - 1)


def leaf(a):
    """A float64 leaf Tensor that requires a gradient, wrapping ``a`` without copying."""
    return Tensor(a, requires_grad=True, dtype=np.float64)


def close(out, expected, rtol=1e-10, atol=1e-12):
    assert isinstance(out, Tensor)
    assert out.shape == np.shape(expected)
    np.testing.assert_allclose(out.numpy(), expected, rtol=rtol, atol=atol)


def np_log_softmax(a, axis=-1):
    m = a.max(axis=axis, keepdims=True)
    return a - m - np.log(np.exp(a - m).sum(axis=axis, keepdims=True))


# ----- linear ------------------------------------------------------------------------------
@given(lead=hnp.array_shapes(min_dims=0, max_dims=2, max_side=3), n_in=st.integers(1, 4),
       n_out=st.integers(1, 4), bias=st.booleans(), transposed_x=st.booleans(), seed=SEEDS)
def test_linear(lead, n_in, n_out, bias, transposed_x, seed):
    rng = np.random.default_rng(seed)
    shape = lead + (n_in,)
    a = rng.normal(size=shape[::-1]).T if transposed_x else rng.normal(size=shape)
    w, b = rng.normal(size=(n_out, n_in)), rng.normal(size=(n_out,))
    inputs = [leaf(a), leaf(w)] + ([leaf(b)] if bias else [])
    close(F.linear(*inputs), a @ w.T + (b if bias else 0.0))
    gradcheck(F.linear, inputs)


@given(lead=hnp.array_shapes(min_dims=0, max_dims=2, max_side=3), n_in=st.integers(1, 4),
       n_out=st.integers(1, 4), bias=st.booleans(), seed=SEEDS)
def test_linear_with_relu(lead, n_in, n_out, bias, seed):
    # One node equal to relu(linear(...)), value and gradients; float64 gradient check.
    rng = np.random.default_rng(seed)
    a = rng.normal(size=lead + (n_in,))
    w, b = rng.normal(size=(n_out, n_in)), rng.normal(size=n_out)
    inputs = [leaf(a), leaf(w)] + ([leaf(b)] if bias else [])
    close(F.linear(*inputs, activation="relu"), np.maximum(a @ w.T + (b if bias else 0.0), 0))
    gradcheck(lambda *t: F.linear(*t, activation="relu"), inputs)
    twins = [leaf(t.data) for t in inputs]
    g = rng.normal(size=lead + (n_out,))
    F.linear(*inputs, activation="relu").backward(g)
    F.relu(F.linear(*twins)).backward(g)
    for t, twin in zip(inputs, twins):
        np.testing.assert_array_equal(t.grad, twin.grad)


def test_linear_activation_is_checked_and_nan_passes_relu():
    x, w = Tensor(np.ones((2, 3), dtype=np.float32)), Tensor(np.ones((4, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="activation must be"):
        F.linear(x, w, activation="gelu")
    x.data[0, 0] = np.nan          # as np.maximum: an overflow must stay visible (fp16 scaler)
    y = F.linear(x, w, Tensor(-np.ones(4, dtype=np.float32) * 5), activation="relu").data
    assert np.isnan(y[0]).all() and (y[1] == 0).all()


# ----- layer norm --------------------------------------------------------------------------
def np_layer_norm(a, w, b, eps):
    mean = a.mean(-1, keepdims=True)
    var = ((a - mean) ** 2).mean(-1, keepdims=True)  # biased, as in PyTorch
    return (a - mean) / np.sqrt(var + eps) * w + b


@given(lead=hnp.array_shapes(min_dims=0, max_dims=2, max_side=3), d=st.integers(1, 6),
       affine=st.sampled_from(["both", "weight", "none"]), eps=st.sampled_from([1e-5, 1e-2]),
       seed=SEEDS)
def test_layer_norm(lead, d, affine, eps, seed):
    rng = np.random.default_rng(seed)
    a = rng.normal(size=lead + (d,)) * rng.uniform(0.5, 3) + rng.normal()
    w, b = rng.normal(size=d), rng.normal(size=d)
    args = {"both": [leaf(w), leaf(b)], "weight": [leaf(w)], "none": []}[affine]
    fn = lambda x, *p: F.layer_norm(x, *p, eps=eps)  # noqa: E731
    expected = np_layer_norm(a, w if args else 1.0, b if len(args) == 2 else 0.0, eps)
    close(fn(leaf(a), *args), expected, rtol=1e-9, atol=1e-10)
    gradcheck(fn, [leaf(a)] + args)


# ----- dropout -----------------------------------------------------------------------------
@given(shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
       p=st.sampled_from([0.1, 0.5, 0.9]), seed=SEEDS)
def test_dropout(shape, p, seed):
    """Gradcheck with a fixed mask: fn reseeds, so every call draws the same mask."""
    a = np.random.default_rng(seed).uniform(0.5, 2.0, size=shape)

    def fn(x):
        tinytf.manual_seed(seed)
        return F.dropout(x, p, training=True)

    out = fn(leaf(a)).numpy()
    kept = out != 0
    np.testing.assert_allclose(out[kept], a[kept] / (1 - p), rtol=1e-12)
    gradcheck(fn, [leaf(a)])


@given(shape=hnp.array_shapes(min_dims=0, max_dims=3, max_side=4),
       p=st.sampled_from([0.1, 0.5, 0.9]), seed=SEEDS)
def test_dropout_add(shape, p, seed):
    """residual + dropout(x) as one node: the same mask as F.dropout from the same seed,
    and the gradients of both inputs (gradcheck with a fixed mask)."""
    g = np.random.default_rng(seed)
    a, r = g.uniform(0.5, 2.0, size=shape), g.normal(size=shape)

    def fn(x, res):
        tinytf.manual_seed(seed)
        return F.dropout_add(x, res, p, training=True)

    tinytf.manual_seed(seed)
    expected = leaf(r) + F.dropout(leaf(a), p, training=True)
    out = fn(leaf(a), leaf(r))
    np.testing.assert_array_equal(out.numpy(), expected.numpy())
    if out._ctx is not None:
        assert isinstance(out._ctx, tinytf.ops.DropoutAdd)
    gradcheck(fn, [leaf(a), leaf(r)])


def test_dropout_add_identity_and_errors():
    x, r = Tensor(np.ones((3, 4), np.float32)), Tensor(np.full((3, 4), 2.0, np.float32))
    np.testing.assert_array_equal(F.dropout_add(x, r, 0.3, training=False).numpy(), 3.0)
    np.testing.assert_array_equal(F.dropout_add(x, r, 0.0).numpy(), 3.0)
    np.testing.assert_array_equal(F.dropout_add(x, r, 1.0).numpy(), 2.0)
    with pytest.raises(ValueError, match="one shape"):
        F.dropout_add(x, Tensor(np.ones(4, np.float32)), 0.3)
    with pytest.raises(ValueError, match="dropout probability"):
        F.dropout_add(x, r, 1.5)


def test_dropout_statistics_and_identity():
    x = Tensor(np.ones((200, 500), dtype=np.float32))
    tinytf.manual_seed(0)
    out = F.dropout(x, 0.3, training=True).numpy()
    assert out.dtype == np.float32
    assert abs((out == 0).mean() - 0.3) < 0.01           # 100k Bernoulli draws: sd ~0.0015
    assert set(np.unique(out)) == {np.float32(0), np.float32(1 / 0.7)}
    assert abs(out.mean() - 1.0) < 0.02                   # inverted dropout keeps the mean
    np.testing.assert_array_equal(F.dropout(x, 0.3, training=False).numpy(), x.numpy())
    np.testing.assert_array_equal(F.dropout(x, 0.0, training=True).numpy(), x.numpy())


def test_dropout_is_reproducible_from_the_seed():
    x = Tensor(np.ones((8, 8), dtype=np.float32))
    tinytf.manual_seed(3)
    first = F.dropout(x, 0.5).numpy()
    tinytf.manual_seed(3)
    np.testing.assert_array_equal(F.dropout(x, 0.5).numpy(), first)
    assert not np.array_equal(F.dropout(x, 0.5).numpy(), first)  # the generator advanced


# ----- embedding ---------------------------------------------------------------------------
@given(ids_shape=hnp.array_shapes(min_dims=1, max_dims=2, max_side=4), vocab=st.integers(1, 5),
       dim=st.integers(1, 3), ids_as_tensor=st.booleans(), seed=SEEDS)
def test_embedding(ids_shape, vocab, dim, ids_as_tensor, seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, size=ids_shape)  # small vocab: repeats are the norm
    w = rng.normal(size=(vocab, dim))
    arg = Tensor(ids) if ids_as_tensor else ids
    fn = lambda w: F.embedding(arg, w)  # noqa: E731
    close(fn(leaf(w)), w[ids])
    gradcheck(fn, [leaf(w)])


def test_embedding_repeated_ids_accumulate():
    w = Tensor(np.zeros((4, 2), dtype=np.float32), requires_grad=True)
    ids = np.array([[1, 1, 3], [1, 0, 3]])
    F.embedding(ids, w).sum().backward()
    np.testing.assert_array_equal(w.grad, [[1, 1], [3, 3], [0, 0], [2, 2]])
    assert w.grad.dtype == np.float32


# ----- cross-entropy -----------------------------------------------------------------------
def np_cross_entropy(logits, target, eps, ignore_index, reduction):
    """PyTorch's definition: (1-eps) NLL + eps * mean_j(-logp_j); ignored rows excluded."""
    logp = np_log_softmax(logits)
    n, v = logits.shape
    valid = np.ones(n, bool) if ignore_index is None else target != ignore_index
    safe = np.where(valid, target, 0)
    loss = -(1 - eps) * logp[np.arange(n), safe] - eps * logp.mean(axis=1)
    loss = np.where(valid, loss, 0.0)
    if reduction == "none":
        return loss
    return loss.sum() if reduction == "sum" else loss.sum() / valid.sum()


@given(n=st.integers(1, 5), v=st.integers(1, 5), eps=st.sampled_from([0.0, 0.1, 0.3]),
       ignore=st.sampled_from([None, 0, -100]),
       reduction=st.sampled_from(["mean", "sum", "none"]), target_as_tensor=st.booleans(),
       seed=SEEDS)
def test_cross_entropy(n, v, eps, ignore, reduction, target_as_tensor, seed):
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=(n, v)) * 2
    target = rng.integers(0, v, size=n)
    if ignore is not None:
        target[rng.random(n) < 0.3] = ignore
        if reduction == "mean" and np.all(target == ignore):
            target[0] = v - 1  # keep one row counted (the mean over no rows is undefined)
    assume(not (reduction == "mean" and np.all(target == ignore)))  # v == 1, ignore == 0
    arg = Tensor(target) if target_as_tensor else target

    def fn(x):
        return F.cross_entropy(x, arg, label_smoothing=eps, ignore_index=ignore,
                               reduction=reduction)

    close(fn(leaf(logits)), np_cross_entropy(logits, target, eps, ignore, reduction))
    gradcheck(fn, [leaf(logits)])


def test_cross_entropy_large_vocabulary_random_directions():
    """gradcheck_random on a (16, 300) problem, too big for a full Jacobian."""
    rng = np.random.default_rng(0)
    target = rng.integers(0, 300, size=16)
    target[:3] = 0
    fn = lambda x: F.cross_entropy(x, target, label_smoothing=0.1, ignore_index=0)  # noqa: E731
    assert gradcheck_random(fn, [leaf(rng.normal(size=(16, 300)))], n_dirs=3)


def test_cross_entropy_keeps_float32():
    x = Tensor(np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32),
               requires_grad=True)
    loss = F.cross_entropy(x, np.array([0, 1, 2, 5]), label_smoothing=0.1)
    loss.backward()
    assert loss.dtype == np.float32 and x.grad.dtype == np.float32


def test_cross_entropy_reuses_its_buffer_only_when_nothing_holds_it():
    """The (N, V) gradient buffer of one backward serves the next forward, unless someone
    still refers to it; either way every gradient is right."""
    rng = np.random.default_rng(0)
    target = np.array([0, 3, 6, 2, 1])
    xs = [rng.normal(size=(5, 7)).astype(np.float32) for _ in range(3)]

    def grad_of(x):
        t = Tensor(x, requires_grad=True)
        (F.cross_entropy(t, target, label_smoothing=0.1) * 2.0).backward()
        return t.grad

    def expected(x):
        p = np.exp(x - x.max(axis=1, keepdims=True))
        p /= p.sum(axis=1, keepdims=True)
        p -= 0.1 / 7
        p[np.arange(5), target] -= 0.9
        return p * (2.0 / 5)

    def address(a):
        return a.__array_interface__["data"][0]

    np.testing.assert_allclose(grad_of(xs[0]), expected(xs[0]), rtol=1e-5, atol=1e-7)
    first = address(BlockedCrossEntropy._spare)
    held = BlockedCrossEntropy._spare[:2]          # a view keeps the buffer referenced
    kept = held.copy()
    np.testing.assert_allclose(grad_of(xs[1]), expected(xs[1]), rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(held, kept)   # not overwritten: a new buffer was used
    assert address(BlockedCrossEntropy._spare) != first
    second = address(BlockedCrossEntropy._spare)
    del held
    np.testing.assert_allclose(grad_of(xs[2]), expected(xs[2]), rtol=1e-5, atol=1e-7)
    assert address(BlockedCrossEntropy._spare) == second   # free again: reused


# ----- attention ---------------------------------------------------------------------------
def np_attention(q, k, v, mask):
    s = q @ k.swapaxes(-1, -2) / np.sqrt(q.shape[-1])
    if mask is not None:
        s = np.where(mask, s, -np.inf)
    s = s - s.max(-1, keepdims=True)
    p = np.exp(s)
    p /= p.sum(-1, keepdims=True)
    return p @ v, p


@st.composite
def attention_case(draw):
    """Sizes and a mask kind: none, padding (B,1,1,Tk), causal (Tq,Tk) or random (B,h,Tq,Tk)."""
    b, h, tq, tk, d = (draw(st.integers(1, n)) for n in (2, 2, 3, 3, 3))
    kind = draw(st.sampled_from(["none", "padding", "causal", "random"]))
    return b, h, tq, tk, d, kind


def make_mask(rng, kind, b, h, tq, tk):
    """A boolean mask (True = attend) with at least one allowed key in every row."""
    if kind == "none":
        return None
    if kind == "padding":
        lengths = rng.integers(1, tk + 1, size=b)
        return (np.arange(tk)[None, :] < lengths[:, None])[:, None, None, :]
    if kind == "causal":
        return np.tril(np.ones((tq, tk), bool))  # query i sees keys 0..i
    m = rng.random((b, h, tq, tk)) < 0.6
    m[..., 0] = True
    return m


@given(case=attention_case(), seed=SEEDS)
def test_attention(case, seed):
    b, h, tq, tk, d, kind = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=s) for s in [(b, h, tq, d), (b, h, tk, d), (b, h, tk, d)])
    mask = make_mask(rng, kind, b, h, tq, tk)
    fn = lambda q, k, v: F.attention(q, k, v, mask=mask)  # noqa: E731
    expected, weights = np_attention(q, k, v, mask)
    close(fn(leaf(q), leaf(k), leaf(v)), expected, rtol=1e-9, atol=1e-11)
    _, got_weights = F.attention(leaf(q), leaf(k), leaf(v), mask=mask, return_weights=True)
    np.testing.assert_allclose(got_weights, weights, rtol=1e-9, atol=1e-12)
    if mask is not None:
        assert np.all(got_weights[~np.broadcast_to(mask, got_weights.shape)] == 0.0)
    gradcheck(fn, [leaf(q), leaf(k), leaf(v)])


@given(case=attention_case(), p=st.sampled_from([0.2, 0.5]), seed=SEEDS)
def test_attention_with_dropout(case, p, seed):
    """Dropout on the attention weights, mask fixed by reseeding inside fn."""
    b, h, tq, tk, d, kind = case
    rng = np.random.default_rng(seed)
    q, k, v = (rng.normal(size=s) for s in [(b, h, tq, d), (b, h, tk, d), (b, h, tk, d)])
    mask = make_mask(rng, kind, b, h, tq, tk)

    def fn(q, k, v):
        tinytf.manual_seed(seed)
        return F.attention(q, k, v, mask=mask, dropout=p, training=True)

    gradcheck(fn, [leaf(q), leaf(k), leaf(v)])
    eval_out = F.attention(leaf(q), leaf(k), leaf(v), mask=mask, dropout=p, training=False)
    close(eval_out, np_attention(q, k, v, mask)[0], rtol=1e-9, atol=1e-11)


def test_attention_fully_masked_row_is_finite_with_zero_grad_for_q_and_k():
    """A query that may attend nowhere: no NaN; its output does not depend on q or k."""
    rng = np.random.default_rng(0)
    q, k, v = rng.normal(size=(1, 1, 2, 3)), rng.normal(size=(1, 1, 3, 3)), rng.normal(
        size=(1, 1, 3, 3))
    mask = np.array([[True, False, True], [False, False, False]])
    qt, kt, vt = leaf(q), leaf(k), leaf(v)
    out = F.attention(qt, kt, vt, mask=mask)
    out.sum().backward()
    assert np.all(np.isfinite(out.numpy()))
    for t in (qt, kt, vt):
        assert np.all(np.isfinite(t.grad))
    # Row 1's output is a constant mix of v; q[..., 1, :] gets no gradient at all.
    np.testing.assert_array_equal(qt.grad[0, 0, 1], 0.0)
    gradcheck(lambda q, k, v: F.attention(q, k, v, mask=mask), [leaf(q), leaf(k), leaf(v)])


# ----- numerical edge cases ----------------------------------------------------------------
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_softmax_family_is_stable_around_1e4(dtype):
    a = np.array([[1e4, -1e4, 0.0, 1e4 - 1.0], [-1e4, -1e4 + 2.0, -1e4, -1e4]])
    x = Tensor(a.astype(dtype), requires_grad=True)
    p, logp = F.softmax(x).numpy(), F.log_softmax(x).numpy()
    assert p.dtype == dtype and logp.dtype == dtype
    np.testing.assert_allclose(p, np.exp(np_log_softmax(a)), rtol=1e-6, atol=1e-30)
    np.testing.assert_allclose(logp, np_log_softmax(a), rtol=1e-6)  # -2e4 is finite, not -inf
    assert np.all(np.isfinite(logp))
    (F.softmax(x)[:, 0].sum() + F.log_softmax(x).sum()).backward()
    assert np.all(np.isfinite(x.grad))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_cross_entropy_is_stable_around_1e4(dtype):
    a = np.array([[1e4, -1e4, 0.0], [-1e4, 1e4, 1e4], [-1e4, -1e4, -1e4 + 1]])
    target = np.array([1, 2, 0])
    x = Tensor(a.astype(dtype), requires_grad=True)
    loss = F.cross_entropy(x, target, label_smoothing=0.1, reduction="none")
    np.testing.assert_allclose(loss.numpy(), np_cross_entropy(a, target, 0.1, None, "none"),
                               rtol=1e-6)
    loss.sum().backward()
    assert np.all(np.isfinite(x.grad))
    np.testing.assert_allclose(x.grad.sum(axis=1), 0.0, atol=1e-6)  # softmax - target sums to 0


@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_masked_softmax_gives_exactly_zero_probability(dtype):
    """Filling with the dtype's most negative finite value: exact zeros, no overflow."""
    rng = np.random.default_rng(0)
    x = Tensor((rng.normal(size=(3, 5)) * 10).astype(dtype))
    mask = rng.random((3, 5)) < 0.5
    mask[:, 0] = False  # every row keeps one position
    p = F.softmax(F.masked_fill(x, mask, float(np.finfo(dtype).min))).numpy()
    assert p.dtype == dtype
    assert np.all(p[mask] == 0.0)
    np.testing.assert_allclose(p.sum(-1), 1.0, rtol=1e-3)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_attention_masked_weights_exactly_zero(dtype):
    rng = np.random.default_rng(1)
    q, k, v = (Tensor((rng.normal(size=(2, 2, 4, 8)) * 30).astype(dtype)) for _ in range(3))
    mask = np.tril(np.ones((4, 4), bool))
    out, w = F.attention(q, k, v, mask=mask, return_weights=True)
    assert out.dtype == dtype and w.dtype == dtype
    assert np.all(w[..., ~mask] == 0.0)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-5)
