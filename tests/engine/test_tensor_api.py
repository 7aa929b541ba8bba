"""What a PyTorch user reaches for on a Tensor (issue 62): transpose swaps two dimensions,
permute reorders all, squeeze/unsqueeze/flatten, reductions with ``dim`` and the (values,
indices) of max/min, var/std, clamp, float(t), comparisons as masks, ``scalar ** t``, and
the creation helpers. Gradients are checked in float64 against central differences."""
import math

import numpy as np
import pytest

import tinytf
from tinytf import Tensor
from tinytf.engine.gradcheck import gradcheck

A = np.random.default_rng(0).normal(size=(2, 3, 4))


def leaf(a=A):
    return Tensor(a.copy(), requires_grad=True, dtype=np.float64)


def test_transpose_swaps_two_dimensions_and_permute_reorders_all():
    x = leaf()
    assert x.transpose(0, 2).shape == (4, 3, 2)
    np.testing.assert_array_equal(x.transpose(0, -1).numpy(), np.swapaxes(A, 0, 2))
    np.testing.assert_array_equal(x.transpose(1, 1).numpy(), A)
    np.testing.assert_array_equal(x.permute(2, 0, 1).numpy(), A.transpose(2, 0, 1))
    np.testing.assert_array_equal(x.permute((1, 2, 0)).numpy(), A.transpose(1, 2, 0))
    m = leaf(A[0])
    np.testing.assert_array_equal(m.transpose(0, 1).numpy(), A[0].T)   # not the identity
    np.testing.assert_array_equal(m.T.numpy(), A[0].T)
    with pytest.raises(ValueError, match="not an order"):
        x.permute(0, 0, 1)
    gradcheck(lambda t: t.transpose(0, 2) * t.permute(2, 1, 0), [leaf()])


def test_squeeze_unsqueeze_flatten():
    x = leaf(A[:1])
    assert x.squeeze().shape == (3, 4) and x.squeeze(0).shape == (3, 4)
    assert x.squeeze(1).shape == (1, 3, 4)                 # not of size 1: unchanged
    assert x.unsqueeze(0).shape == (1, 1, 3, 4) and x.unsqueeze(-1).shape == (1, 3, 4, 1)
    assert leaf().flatten().shape == (24,) and leaf().flatten(1).shape == (2, 12)
    assert leaf().view(6, 4).shape == (6, 4)
    gradcheck(lambda t: t.unsqueeze(1).squeeze(1).flatten(1), [leaf()])


def test_reductions_take_dim_or_axis():
    x = leaf()
    np.testing.assert_allclose(x.sum(1).numpy(), A.sum(1))
    np.testing.assert_allclose(x.sum(dim=(0, 2), keepdim=True).numpy(),
                               A.sum((0, 2), keepdims=True))
    np.testing.assert_allclose(x.mean(axis=-1, keepdims=True).numpy(), A.mean(-1, keepdims=True))
    np.testing.assert_allclose(x.var(1).numpy(), A.var(1, ddof=1))
    np.testing.assert_allclose(x.var(correction=0).numpy(), A.var())
    np.testing.assert_allclose(x.std(2, keepdim=True).numpy(), A.std(2, ddof=1, keepdims=True))
    with pytest.raises(TypeError, match="dim or axis"):
        x.sum(0, axis=1)
    gradcheck(lambda t: t.var(1) + t.std(2).sum(), [leaf()])


def test_max_and_min_as_pytorch():
    x = leaf()
    assert x.max().shape == () and float(x.max()) == A.max()
    values, indices = x.max(1)
    np.testing.assert_array_equal(values.numpy(), A.max(1))
    np.testing.assert_array_equal(indices.numpy(), A.argmax(1))
    assert indices.dtype == np.int64 and not indices.requires_grad
    low = x.min(2, keepdim=True)
    np.testing.assert_array_equal(low.values.numpy(), A.min(2, keepdims=True))
    np.testing.assert_array_equal(low.indices.numpy(), A.argmin(2)[..., None])
    np.testing.assert_array_equal(x.max(axis=(0, 1)).numpy(), A.max((0, 1)))   # NumPy's axis
    np.testing.assert_array_equal(x.amin(0).numpy(), A.min(0))
    assert int(x.argmax()) == A.argmax() and x.argmax(keepdim=True).shape == (1, 1, 1)
    gradcheck(lambda t: t.max(1).values + t.min(1)[0], [leaf()])


def test_clamp_abs_sigmoid_methods():
    x = leaf()
    np.testing.assert_allclose(x.clamp(max=0.1).numpy(), np.minimum(A, 0.1))
    np.testing.assert_allclose(abs(x).numpy(), np.abs(A))
    np.testing.assert_allclose(x.sigmoid().numpy(), 1 / (1 + np.exp(-A)))
    with pytest.raises(ValueError, match="min, max or both"):
        x.clamp()


def test_scalars_comparisons_and_power_of_a_scalar():
    x = leaf()
    assert float(x.sum()) == pytest.approx(A.sum()) and int(Tensor(3.7)) == 3
    mask = x > 0
    assert mask.dtype == bool and not mask.requires_grad
    np.testing.assert_array_equal(mask.numpy(), A > 0)
    np.testing.assert_array_equal((x <= 0.5).numpy(), A <= 0.5)
    np.testing.assert_array_equal(x.eq(x).numpy(), np.ones(A.shape, bool))
    np.testing.assert_array_equal(x.ne(0.0).numpy(), A != 0)
    assert (x == x) is True and len({x: 1, leaf(): 2}) == 2    # identity: dict keys work
    np.testing.assert_array_equal(x[x > 0].numpy(), A[A > 0])  # a mask selects
    np.testing.assert_allclose((2.0 ** x).numpy(), 2.0 ** A)
    gradcheck(lambda t: 3.0 ** t, [leaf()])
    assert (2 ** Tensor(np.float32(1.5))).dtype == np.float32


def test_creation_helpers():
    z = tinytf.zeros(2, 3)
    assert z.dtype == np.float32 and z.shape == (2, 3) and not z.requires_grad
    assert tinytf.ones((4,), requires_grad=True).requires_grad
    assert tinytf.full((2, 2), 7.0).numpy().tolist() == [[7, 7], [7, 7]]
    assert tinytf.zeros(3, dtype=np.float64).dtype == np.float64
    assert tinytf.arange(4).numpy().tolist() == [0, 1, 2, 3] and tinytf.arange(4).dtype == np.int64
    assert tinytf.arange(1, 2, 0.5).numpy().tolist() == [1.0, 1.5]
    assert tinytf.arange(1, 2, 0.5).dtype == np.float32
    tinytf.manual_seed(5)
    a = tinytf.randn(3, 4)
    tinytf.manual_seed(5)
    b = tinytf.randn((3, 4))
    np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert a.dtype == np.float32
    u = tinytf.rand(1000)
    assert 0 <= float(u.min()) and float(u.max()) < 1 and abs(float(u.mean()) - 0.5) < 0.05
    like = Tensor(np.zeros((2, 5), np.float64))
    for make in (tinytf.zeros_like, tinytf.ones_like, tinytf.rand_like, tinytf.randn_like):
        t = make(like)
        assert t.shape == (2, 5) and t.dtype == np.float64
    assert tinytf.full_like(like, 2.0).numpy().sum() == 20
    assert math.isclose(float(tinytf.ones(3).sum()), 3.0)
