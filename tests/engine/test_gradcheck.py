"""tinytf.engine.gradcheck: it passes correct gradients, catches wrong ones with a useful message,
and the worked example in docs/autograd.md (a GELU op with its gradient check) runs."""
import re
from pathlib import Path

import numpy as np
import pytest

from tinytf import Function, Tensor
from tinytf.engine.gradcheck import gradcheck, gradcheck_random

DOC = Path(__file__).resolve().parent.parent.parent / "docs" / "autograd.md"


def leaf(a):
    return Tensor(np.asarray(a, dtype=np.float64), requires_grad=True, dtype=np.float64)


class Cube(Function):
    """x ** 3 with a backward that is wrong by ``error`` at element ``at`` (for the tests)."""

    error, at = 0.0, None

    def forward(self, x):
        self.save_for_backward(x)
        return x ** 3

    def backward(self, grad):
        (x,) = self.saved
        g = grad * 3 * x ** 2
        if self.error:
            g = g.copy()
            g[self.at] += self.error
        return g


class WrongSecondInput(Function):
    """a * b whose gradient for b forgets a factor."""

    def forward(self, a, b):
        self.save_for_backward(a, b)
        return a * b

    def backward(self, grad):
        a, b = self.saved
        return grad * b, grad


class Off(Cube):
    error, at = 1e-3, (1, 2)


def test_passes_on_correct_gradients():
    rng = np.random.default_rng(0)
    assert gradcheck(Cube.apply, [leaf(rng.normal(size=(2, 3)))])
    big = leaf(rng.normal(size=(40, 50)))
    assert gradcheck_random(lambda x: Cube.apply(x).sum(axis=0), [big], n_dirs=3)


def test_reports_input_index_errors_and_worst_element():
    x = leaf(np.random.default_rng(0).normal(size=(2, 3)))
    with pytest.raises(AssertionError) as info:
        gradcheck(Off.apply, [x])
    msg = str(info.value)
    assert "input 0" in msg and "shape (2, 3)" in msg
    assert "max abs error 1.000e-03" in msg
    assert "worst element (1, 2)" in msg
    assert "analytic" in msg and "numeric" in msg


def test_names_the_failing_input():
    rng = np.random.default_rng(1)
    a, b = leaf(rng.normal(size=3)), leaf(rng.normal(size=3))
    with pytest.raises(AssertionError, match="input 1"):
        gradcheck(WrongSecondInput.apply, [a, b])


def test_tolerance_is_atol_plus_rtol_times_numeric():
    """A gradient 5e-4 too large (relative) fails rtol=1e-4 and passes rtol=1e-3."""

    class SlightlyOff(Cube):
        def backward(self, grad):
            return super().backward(grad) * (1 + 5e-4)

    x = leaf([1.0, -2.0])
    with pytest.raises(AssertionError, match="max rel error 5.000e-04"):
        gradcheck(SlightlyOff.apply, [x])
    assert gradcheck(SlightlyOff.apply, [x], rtol=1e-3)


def test_random_directions_catch_a_wrong_gradient():
    x = leaf(np.random.default_rng(0).normal(size=(30, 40)))

    class Wrong(Cube):
        error, at = 0.1, (7, 9)

    with pytest.raises(AssertionError, match=r"gradcheck_random failed for input 0.*direction 0"):
        gradcheck_random(Wrong.apply, [x])


def test_large_outputs_use_random_cotangents():
    """Output bigger than the full-Jacobian threshold: still catches a single wrong element."""
    x = leaf(np.random.default_rng(0).normal(size=(5, 7)))
    with pytest.raises(AssertionError, match="random cotangent"):
        gradcheck(Off.apply, [x])


def test_inputs_are_restored_exactly_even_when_non_contiguous():
    base = np.random.default_rng(0).normal(size=(4, 3))
    view = base.T
    x = Tensor(view, requires_grad=True, dtype=np.float64)
    before = base.copy()
    gradcheck(lambda x: (x * x).sum(axis=0), [x])
    assert x.data is view and not x.data.flags.c_contiguous
    np.testing.assert_array_equal(base, before)
    assert x.grad is None


def test_non_differentiable_inputs_are_passed_through():
    ids = Tensor(np.array([2, 0, 2]))
    w = leaf(np.random.default_rng(0).normal(size=(3, 2)))
    const = Tensor(np.ones(2), dtype=np.float64)  # requires_grad=False: not checked
    assert gradcheck(lambda ids, w, c: w[ids.data] * c, [ids, w, const])


def test_rejects_float32_inputs_and_nothing_to_check():
    with pytest.raises(ValueError, match="float64"):
        gradcheck(lambda x: x * 2.0, [Tensor(np.ones(2, dtype=np.float32), requires_grad=True)])
    with pytest.raises(ValueError, match="requires_grad"):
        gradcheck(lambda x: x * 2.0, [Tensor(np.ones(2), dtype=np.float64)])


def test_flags_an_op_that_changes_dtype():
    x = leaf([1.0, 2.0])
    with pytest.raises(AssertionError, match="float32"):
        gradcheck(lambda x: x.astype(np.float32), [x])


# ----- the worked example in docs/autograd.md ------------------------------------------------
def doc_code_blocks():
    """The ```python blocks of docs/autograd.md, in order."""
    return re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)


def test_autograd_doc_gelu_example_runs():
    """Execute the doc's code blocks, then its GELU op and its gradient-check test."""
    namespace = {"__name__": "autograd_doc"}
    blocks = doc_code_blocks()
    assert len(blocks) >= 2
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), namespace)
    gelu = namespace["gelu"]
    x = np.array([-3.0, -1.0, 0.0, 0.5, 2.0])
    c = np.sqrt(2 / np.pi)
    expected = 0.5 * x * (1 + np.tanh(c * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(gelu(leaf(x)).numpy(), expected, rtol=1e-12)
    assert gelu(Tensor(x.astype(np.float32))).dtype == np.float32
    namespace["test_gelu"]()  # the doc's hypothesis property test
    # and gradcheck would notice a wrong GELU derivative:
    namespace["GELU"].backward = lambda self, grad: grad
    with pytest.raises(AssertionError, match="gradcheck failed for input 0"):
        gradcheck(gelu, [leaf(x)])
