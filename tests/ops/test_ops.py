"""Property tests for every primitive op on Tensor: forward equals NumPy, backward equals
float64 central differences (tinytf.engine.gradcheck, rtol 1e-4, atol 1e-6).

Hypothesis draws the shapes (0-d, size-1 broadcast dimensions), the memory layout of each
input (contiguous, transposed view, strided view) and a seed for the values; values are kept
away from kinks (relu at 0, ties in max, log/sqrt/pow of non-positive numbers).
The functional ops (layer_norm, dropout, embedding, cross_entropy, linear, attention) are
tested the same way in tests/nn/test_functional.py.
"""
import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

import tinytf
from tinytf import Tensor
from tinytf import functional as F
from tinytf.engine.gradcheck import gradcheck

LAYOUTS = st.sampled_from(["contiguous", "transposed", "strided"])
SEEDS = st.integers(0, 2**32 - 1)
SHAPES = hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4)
PAIRS = hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=3, max_side=3)


def make(rng, shape, layout, low=-2.0, high=2.0):
    """A float64 array of ``shape`` with uniform values in [low, high), laid out as asked.

    "transposed" is a transposed view of a C-contiguous array (non-contiguous for ndim >= 2),
    "strided" takes every second element of the last axis (non-contiguous for ndim >= 1).
    """
    shape = tuple(shape)
    if layout == "transposed" and len(shape) >= 2:
        return rng.uniform(low, high, size=shape[::-1]).T
    if layout == "strided" and len(shape) >= 1:
        return rng.uniform(low, high, size=shape[:-1] + (2 * shape[-1],))[..., ::2]
    return rng.uniform(low, high, size=shape)


def away_from_zero(a, margin=0.1):
    """Push values at least ``margin`` away from 0, in place (keeps the array's layout)."""
    a[...] = np.where(a >= 0, a + margin, a - margin)
    return a


def distinct(rng, a, gap=0.1):
    """Refill ``a`` in place with values at least ``gap`` apart (no ties for max)."""
    a[...] = (rng.permutation(a.size) * gap + rng.uniform(0, gap / 10, a.size)).reshape(a.shape)
    return a


def leaf(a):
    """A float64 leaf Tensor that requires a gradient, wrapping ``a`` without copying."""
    return Tensor(a, requires_grad=True, dtype=np.float64)


def close(out, expected):
    """Forward check: same shape, float64 kept, values equal to NumPy's to round-off."""
    assert isinstance(out, Tensor)
    assert out.dtype == np.float64
    assert out.shape == np.shape(expected)
    np.testing.assert_allclose(out.numpy(), expected, rtol=1e-10, atol=1e-12)


# ----- elementwise binary ------------------------------------------------------------------
BINARY = {
    "add": (lambda a, b: a + b, np.add),
    "sub": (lambda a, b: a - b, np.subtract),
    "mul": (lambda a, b: a * b, np.multiply),
    "div": (lambda a, b: a / b, np.divide),
}


@pytest.mark.parametrize("name", sorted(BINARY))
@given(shapes=PAIRS, layouts=st.tuples(LAYOUTS, LAYOUTS), seed=SEEDS)
def test_binary(name, shapes, layouts, seed):
    rng = np.random.default_rng(seed)
    a = make(rng, shapes.input_shapes[0], layouts[0])
    b = make(rng, shapes.input_shapes[1], layouts[1], 0.5, 2.0)  # divisor away from 0
    if name != "div":
        b *= rng.choice([-1.0, 1.0], size=b.shape)
    op, ref = BINARY[name]
    x, y = leaf(a), leaf(b)
    close(op(x, y), ref(a, b))
    gradcheck(op, [x, y])


@pytest.mark.parametrize("name", sorted(BINARY))
@given(shape=SHAPES, layout=LAYOUTS, seed=SEEDS, c=st.floats(0.5, 3.0), left=st.booleans())
def test_binary_with_python_scalar(name, shape, layout, seed, c, left):
    """``x op c`` and ``c op x``: the scalar takes the tensor's dtype and gets no gradient."""
    rng = np.random.default_rng(seed)
    a = make(rng, shape, layout, 0.5, 2.0)
    op, ref = BINARY[name]
    fn = (lambda x: op(c, x)) if left else (lambda x: op(x, c))
    x = leaf(a)
    close(fn(x), ref(c, a) if left else ref(a, c))
    gradcheck(fn, [x])


# ----- elementwise unary -------------------------------------------------------------------
@given(shape=SHAPES, layout=LAYOUTS, seed=SEEDS)
def test_neg(shape, layout, seed):
    a = make(np.random.default_rng(seed), shape, layout)
    x = leaf(a)
    close(-x, -a)
    gradcheck(lambda x: -x, [x])


UNARY = {  # name: (tinytf op, numpy reference, value range that avoids kinks/poles)
    "exp": (lambda x: x.exp(), np.exp, (-2.0, 2.0)),
    "log": (lambda x: x.log(), np.log, (0.2, 3.0)),
    "sqrt": (lambda x: x.sqrt(), np.sqrt, (0.2, 3.0)),
    "tanh": (lambda x: x.tanh(), np.tanh, (-2.0, 2.0)),
    "relu": (lambda x: x.relu(), lambda a: np.maximum(a, 0), (-2.0, 2.0)),
    "F.relu": (lambda x: F.relu(x), lambda a: np.maximum(a, 0), (-2.0, 2.0)),
    "F.gelu": (lambda x: F.gelu(x), lambda a: 0.5 * a * (1 + np.tanh(
        np.sqrt(2 / np.pi) * (a + 0.044715 * a ** 3))), (-4.0, 4.0)),
}


@pytest.mark.parametrize("name", sorted(UNARY))
@given(shape=SHAPES, layout=LAYOUTS, seed=SEEDS)
def test_unary(name, shape, layout, seed):
    op, ref, (low, high) = UNARY[name]
    a = make(np.random.default_rng(seed), shape, layout, low, high)
    if "relu" in name:
        away_from_zero(a)  # the kink at 0 has no derivative
    x = leaf(a)
    close(op(x), ref(a))
    gradcheck(op, [x])


@given(shape=SHAPES, layout=LAYOUTS, seed=SEEDS,
       exponent=st.sampled_from([-2.0, -1.5, -1.0, -0.5, 0.0, 0.5, 1.0, 1.5, 2.0, 3.0]))
def test_pow_positive_base(shape, layout, seed, exponent):
    a = make(np.random.default_rng(seed), shape, layout, 0.3, 2.0)
    x = leaf(a)
    close(x ** exponent, a ** exponent)
    gradcheck(lambda x: x ** exponent, [x])


@given(shape=SHAPES, layout=LAYOUTS, seed=SEEDS, exponent=st.sampled_from([-1, 2, 3, 2.0, 3.0]))
def test_pow_integer_exponent_negative_base(shape, layout, seed, exponent):
    a = away_from_zero(make(np.random.default_rng(seed), shape, layout, -2.0, 2.0), 0.3)
    x = leaf(a)
    close(x ** exponent, a ** float(exponent))
    gradcheck(lambda x: x ** exponent, [x])


# ----- matmul ------------------------------------------------------------------------------
@given(batch=hnp.mutually_broadcastable_shapes(num_shapes=2, min_dims=0, max_dims=2, max_side=3),
       n=st.integers(1, 3), k=st.integers(1, 3), m=st.integers(1, 3),
       layouts=st.tuples(LAYOUTS, LAYOUTS), seed=SEEDS)
def test_matmul_batched_broadcast(batch, n, k, m, layouts, seed):
    rng = np.random.default_rng(seed)
    a = make(rng, batch.input_shapes[0] + (n, k), layouts[0])
    b = make(rng, batch.input_shapes[1] + (k, m), layouts[1])
    x, y = leaf(a), leaf(b)
    close(x @ y, a @ b)
    gradcheck(lambda x, y: x @ y, [x, y])


@given(batch=hnp.array_shapes(min_dims=0, max_dims=2, max_side=3), n=st.integers(1, 3),
       k=st.integers(1, 3), vector_on_left=st.booleans(), seed=SEEDS)
def test_matmul_with_vector(batch, n, k, vector_on_left, seed):
    """1-D operands follow NumPy: the vector gains and then loses a unit dimension."""
    rng = np.random.default_rng(seed)
    v = rng.normal(size=(k,))
    m = rng.normal(size=batch + ((k, n) if vector_on_left else (n, k)))
    args = (v, m) if vector_on_left else (m, v)
    x, y = leaf(args[0]), leaf(args[1])
    close(x @ y, args[0] @ args[1])
    gradcheck(lambda x, y: x @ y, [x, y])


@given(k=st.integers(1, 4), seed=SEEDS)
def test_matmul_vector_vector(k, seed):
    """1-D @ 1-D is the inner product: a 0-d output whose gradient is 0-d too."""
    rng = np.random.default_rng(seed)
    a, b = rng.normal(size=k), rng.normal(size=k)
    x, y = leaf(a), leaf(b)
    close(x @ y, a @ b)
    gradcheck(lambda x, y: x @ y, [x, y])


# ----- reductions --------------------------------------------------------------------------
@st.composite
def shape_and_axis(draw, min_dims=0):
    """A shape and an axis argument for it: None, an int (maybe negative) or a tuple."""
    shape = draw(hnp.array_shapes(min_dims=min_dims, max_dims=3, min_side=1, max_side=4))
    nd = len(shape)
    options = [st.none()]
    if nd:
        options += [st.integers(-nd, nd - 1), hnp.valid_tuple_axes(nd, min_size=1)]
    return shape, draw(st.one_of(*options))


@pytest.mark.parametrize("name", ["sum", "mean", "max"])
@given(sa=shape_and_axis(), keepdims=st.booleans(), layout=LAYOUTS, seed=SEEDS)
def test_reduction(name, sa, keepdims, layout, seed):
    shape, axis = sa
    rng = np.random.default_rng(seed)
    a = make(rng, shape, layout)
    if name == "max":
        distinct(rng, a)  # a tie has no unique derivative
    x = leaf(a)
    op = lambda x: getattr(x, name)(axis=axis, keepdims=keepdims)  # noqa: E731
    close(op(x), getattr(np, name)(a, axis=axis, keepdims=keepdims))
    gradcheck(op, [x])


def test_max_ties_split_the_gradient():
    """Documented tie rule: equal maxima share the gradient equally (so it still sums to 1)."""
    x = leaf(np.array([[1.0, 3.0, 3.0], [2.0, 2.0, 2.0]]))
    x.max(axis=1).sum().backward()
    np.testing.assert_allclose(x.grad, [[0, 0.5, 0.5], [1 / 3, 1 / 3, 1 / 3]])


# ----- shape ops ---------------------------------------------------------------------------
@st.composite
def reshape_case(draw):
    """A shape and a different shape with the same size (maybe with one -1 and extra 1s)."""
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4))
    factors = [f for d in shape for f in {1: [], 2: [2], 3: [3], 4: [2, 2]}[d]]
    factors = draw(st.permutations(factors))
    new, i = [], 0
    while i < len(factors):  # group neighbouring factors into new dimensions
        j = draw(st.integers(i + 1, len(factors)))
        new.append(int(np.prod(factors[i:j])))
        i = j
    for _ in range(draw(st.integers(0, 2))):
        new.insert(draw(st.integers(0, len(new))), 1)
    if new and draw(st.booleans()):
        new[draw(st.integers(0, len(new) - 1))] = -1
    return shape, tuple(new)


@given(case=reshape_case(), layout=LAYOUTS, seed=SEEDS, as_tuple=st.booleans())
def test_reshape(case, layout, seed, as_tuple):
    shape, new = case
    a = make(np.random.default_rng(seed), shape, layout)
    op = (lambda x: x.reshape(new)) if as_tuple else (lambda x: x.reshape(*new))
    x = leaf(a)
    close(op(x), a.reshape(new))
    gradcheck(op, [x])


@st.composite
def transpose_case(draw):
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=4, min_side=1, max_side=3))
    perm = tuple(draw(st.permutations(range(len(shape)))))
    how = draw(st.sampled_from(["transpose", "permute", "T"]))
    pair = tuple(draw(st.permutations(range(len(shape)))))[:2] if len(shape) >= 2 else (0, 0)
    return shape, perm if how != "transpose" else pair, how


@given(case=transpose_case(), layout=LAYOUTS, seed=SEEDS)
def test_transpose_permute(case, layout, seed):
    shape, perm, how = case
    a = make(np.random.default_rng(seed), shape, layout)
    if how == "transpose" and not shape:
        return
    op = {"transpose": lambda x: x.transpose(*perm), "permute": lambda x: x.permute(*perm),
          "T": lambda x: x.T}[how]
    expected = {"transpose": lambda: np.swapaxes(a, *perm), "permute": lambda: a.transpose(perm),
                "T": lambda: a.T}[how]()
    x = leaf(a)
    close(op(x), expected)
    gradcheck(op, [x])


@st.composite
def basic_index_case(draw):
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    index = draw(hnp.basic_indices(shape, allow_newaxis=True, allow_ellipsis=True))
    return shape, index


@given(case=basic_index_case(), layout=LAYOUTS, seed=SEEDS)
def test_getitem_basic(case, layout, seed):
    """Ints, slices (any step, negative too), None and Ellipsis."""
    shape, index = case
    a = make(np.random.default_rng(seed), shape, layout)
    x = leaf(a)
    close(x[index], a[index])
    gradcheck(lambda x: x[index], [x])


@st.composite
def array_index_case(draw):
    """Integer-array indices (repeats and negatives included), alone or after a slice."""
    shape = draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=4))
    after_slice = len(shape) >= 2 and draw(st.booleans())
    tail = shape[1:] if after_slice else shape
    arrays = draw(hnp.integer_array_indices(
        tail, result_shape=hnp.array_shapes(min_dims=1, max_dims=2, max_side=4)))
    return shape, ((slice(None),) + arrays) if after_slice else arrays


@given(case=array_index_case(), layout=LAYOUTS, seed=SEEDS)
def test_getitem_integer_arrays(case, layout, seed):
    shape, index = case
    a = make(np.random.default_rng(seed), shape, layout)
    x = leaf(a)
    close(x[index], a[index])
    gradcheck(lambda x: x[index], [x])


def test_getitem_repeated_indices_accumulate():
    x = leaf(np.arange(4.0))
    x[np.array([0, 2, 2, 2, -1])].sum().backward()
    np.testing.assert_array_equal(x.grad, [1.0, 0.0, 3.0, 1.0])


@st.composite
def cat_case(draw):
    shape = list(draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    sizes = draw(st.lists(st.integers(1, 3), min_size=1, max_size=3))
    shapes = []
    for s in sizes:
        shape[axis] = s
        shapes.append(tuple(shape))
    return shapes, axis


@given(case=cat_case(), layouts=st.lists(LAYOUTS, min_size=3, max_size=3), seed=SEEDS)
def test_cat(case, layouts, seed):
    shapes, axis = case
    rng = np.random.default_rng(seed)
    arrays = [make(rng, s, lay) for s, lay in zip(shapes, layouts)]
    xs = [leaf(a) for a in arrays]
    op = lambda *xs: tinytf.cat(list(xs), axis=axis)  # noqa: E731
    close(op(*xs), np.concatenate(arrays, axis=axis))
    gradcheck(op, xs)


@st.composite
def split_case(draw):
    shape = list(draw(hnp.array_shapes(min_dims=1, max_dims=3, min_side=1, max_side=3)))
    axis = draw(st.integers(-len(shape), len(shape) - 1))
    # empty pieces too
    sizes = draw(st.lists(st.integers(0, 3), min_size=1, max_size=3).filter(sum))
    shape[axis] = sum(sizes)
    used = draw(st.lists(st.booleans(), min_size=len(sizes), max_size=len(sizes)))
    return tuple(shape), sizes, axis, used


@given(case=split_case(), layout=LAYOUTS, seed=SEEDS)
def test_split(case, layout, seed):
    """Each piece equals NumPy's; the gradient is checked with some pieces left unused
    (their part of the gradient is zero) and the used ones weighted differently."""
    shape, sizes, axis, used = case
    rng = np.random.default_rng(seed)
    a = make(rng, shape, layout)
    x = leaf(a)
    pieces = F.split(x, sizes, axis=axis)
    bounds = np.cumsum(sizes)[:-1]
    assert len(pieces) == len(sizes)
    for p, expected in zip(pieces, np.split(a, bounds, axis=axis)):
        close(p, expected)

    def op(x):
        parts = [p * float(i + 1) for i, (p, u) in enumerate(zip(F.split(x, sizes, axis=axis),
                                                                 used)) if u]
        return tinytf.cat(parts, axis=axis) if parts else (x * 0.0).sum()
    gradcheck(op, [x])


@given(b=st.integers(1, 2), t=st.integers(1, 3), heads=st.integers(1, 3),
       dk=st.integers(1, 3), used=st.lists(st.booleans(), min_size=1, max_size=3),
       layout=LAYOUTS, seed=SEEDS)
def test_split_heads(b, t, heads, dk, used, layout, seed):
    """Each part equals NumPy's reshape/slice/transpose; gradient checked with some parts
    unused and the others weighted differently. merge_heads undoes split_heads."""
    parts = len(used)
    rng = np.random.default_rng(seed)
    a = make(rng, (b, t, parts * heads * dk), layout)
    x = leaf(a)
    out = F.split_heads(x, heads, parts=parts)
    out = out if parts > 1 else (out,)
    ref = a.reshape(b, t, parts, heads, dk)
    for i, p in enumerate(out):
        close(p, ref[:, :, i].transpose(0, 2, 1, 3))
        close(F.merge_heads(p), ref[:, :, i].reshape(b, t, heads * dk))

    def op(x):
        pieces = F.split_heads(x, heads, parts=parts)
        pieces = pieces if parts > 1 else (pieces,)
        kept = [F.merge_heads(p) * float(i + 1) for i, (p, u) in enumerate(zip(pieces, used)) if u]
        return tinytf.cat(kept, axis=-1) if kept else (x * 0.0).sum()
    gradcheck(op, [x])


def test_split_heads_is_one_node_and_rejects_a_bad_width():
    x = leaf(np.ones((2, 3, 12)))
    q, k, v = F.split_heads(x, 2, parts=3)
    assert q._ctx is k._ctx is v._ctx and type(q._ctx).__name__ == "SplitHeads"
    assert q.shape == (2, 2, 3, 2)
    with pytest.raises(ValueError, match="split_heads"):
        F.split_heads(x, 5, parts=1)


def test_split_int_sizes_and_errors():
    x = leaf(np.arange(14.0).reshape(7, 2))
    assert [p.shape for p in F.split(x, 3)] == [(3, 2), (3, 2), (1, 2)]   # as torch.split
    assert [p.shape for p in tinytf.split(x, [2, 5])] == [(2, 2), (5, 2)]
    with pytest.raises(ValueError):
        F.split(x, [2, 2])
    with pytest.raises(ValueError):
        F.split(x, 0)


def test_split_backward_runs_once_with_every_piece():
    """The pieces share one node: its backward runs once, after all their gradients are in,
    and writes them into one array; a piece nobody used contributes zeros."""
    x = leaf(np.arange(6.0))
    calls = []
    real_backward = tinytf.ops.Split.backward

    def spy(self, grads):
        calls.append([None if g is None else g.copy() for g in grads])
        return real_backward(self, grads)

    tinytf.ops.Split.backward = spy
    try:
        a, b, c = F.split(x, 2)
        y = (a * 2.0).sum() + (c * (b * 3.0).sum()).sum()    # c's gradient needs b first
        y.backward()
    finally:
        tinytf.ops.Split.backward = real_backward
    assert len(calls) == 1
    np.testing.assert_array_equal(x.grad, [2.0, 2.0, 27.0, 27.0, 15.0, 15.0])
    a, b, c = F.split(leaf(np.arange(6.0)), 2)
    z = leaf(np.ones(2))
    (b * z).sum().backward()                  # only the middle piece is reached
    np.testing.assert_array_equal(z.grad, [2.0, 3.0])
    assert b.is_leaf and not a.is_leaf        # the unreached pieces keep their node


@given(shape=hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=3),
       n=st.integers(1, 3), data=st.data(), layouts=st.lists(LAYOUTS, min_size=3, max_size=3),
       seed=SEEDS)
def test_stack(shape, n, data, layouts, seed):
    axis = data.draw(st.integers(-len(shape) - 1, len(shape)), label="axis")
    rng = np.random.default_rng(seed)
    arrays = [make(rng, shape, lay) for lay in layouts[:n]]
    xs = [leaf(a) for a in arrays]
    op = lambda *xs: tinytf.stack(list(xs), axis=axis)  # noqa: E731
    close(op(*xs), np.stack(arrays, axis=axis))
    gradcheck(op, xs)


# ----- selection ---------------------------------------------------------------------------
@given(shapes=hnp.mutually_broadcastable_shapes(num_shapes=3, min_dims=0, max_dims=3,
                                                max_side=3),
       layouts=st.tuples(LAYOUTS, LAYOUTS), seed=SEEDS, cond_as_tensor=st.booleans())
def test_where(shapes, layouts, seed, cond_as_tensor):
    rng = np.random.default_rng(seed)
    cond = rng.random(shapes.input_shapes[0]) < 0.5
    a = make(rng, shapes.input_shapes[1], layouts[0])
    b = make(rng, shapes.input_shapes[2], layouts[1])
    c = Tensor(cond) if cond_as_tensor else cond
    op = lambda x, y: tinytf.where(c, x, y)  # noqa: E731
    x, y = leaf(a), leaf(b)
    close(op(x, y), np.where(cond, a, b))
    gradcheck(op, [x, y])


@st.composite
def masked_fill_case(draw):
    """A shape and a mask shape that broadcasts to it (dims set to 1, leading dims dropped)."""
    shape = draw(hnp.array_shapes(min_dims=0, max_dims=3, min_side=1, max_side=4))
    mask = [1 if draw(st.booleans()) else d for d in shape]
    mask = mask[draw(st.integers(0, len(mask))):]
    return shape, tuple(mask)


@given(case=masked_fill_case(), layout=LAYOUTS, seed=SEEDS,
       value=st.sampled_from([0.0, -1.5, 7.0, float(np.finfo(np.float64).min)]),
       functional=st.booleans())
def test_masked_fill(case, layout, seed, value, functional):
    shape, mask_shape = case
    rng = np.random.default_rng(seed)
    a = make(rng, shape, layout)
    mask = rng.random(mask_shape) < 0.5
    op = (lambda x: F.masked_fill(x, mask, value)) if functional else \
        (lambda x: x.masked_fill(mask, value))
    x = leaf(a)
    close(op(x), np.where(mask, value, a))
    gradcheck(op, [x])


# ----- softmax family ----------------------------------------------------------------------
def np_log_softmax(a, axis):
    m = a.max(axis=axis, keepdims=True)
    return a - m - np.log(np.exp(a - m).sum(axis=axis, keepdims=True))


@pytest.mark.parametrize("name", ["softmax", "log_softmax", "F.softmax", "F.log_softmax"])
@given(sa=shape_and_axis(min_dims=1), layout=LAYOUTS, seed=SEEDS)
def test_softmax_family(name, sa, layout, seed):
    shape, _ = sa
    rng = np.random.default_rng(seed)
    axis = int(rng.integers(-len(shape), len(shape)))
    a = make(rng, shape, layout, -3.0, 3.0)
    fname = name.split(".")[-1]
    op = (lambda x: getattr(F, fname)(x, axis=axis)) if name.startswith("F.") else \
        (lambda x: getattr(x, fname)(axis=axis))
    expected = np_log_softmax(a, axis)
    if fname == "softmax":
        expected = np.exp(expected)
    x = leaf(a)
    close(op(x), expected)
    gradcheck(op, [x])


def test_softmax_default_axis_is_last():
    a = np.random.default_rng(0).normal(size=(2, 3, 4))
    np.testing.assert_allclose(leaf(a).softmax().numpy(), np.exp(np_log_softmax(a, -1)),
                               rtol=1e-12)
    np.testing.assert_allclose(F.log_softmax(leaf(a)).numpy(), np_log_softmax(a, -1),
                               rtol=1e-12)


# ----- composition -------------------------------------------------------------------------
@given(seed=SEEDS)
def test_composite_expression(seed):
    """A small graph mixing many ops, with fan-out: the chain rule across op boundaries."""
    rng = np.random.default_rng(seed)
    x, w = leaf(rng.normal(size=(3, 4))), leaf(rng.normal(size=(4, 2)))

    def fn(x, w):
        h = (x @ w).tanh()
        return (h * h.exp() - h / 3.0).sum(axis=0).log_softmax() + (x ** 2).mean()

    gradcheck(fn, [x, w])
