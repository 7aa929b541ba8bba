"""Finite-difference gradient checks: prove that an op's backward matches its forward.

For a function ``y = f(x_0, ..., x_{n-1})`` the engine computes vector-Jacobian products
(VJPs): given a cotangent ``u`` shaped like ``y`` it returns, for every input,

    g_i = J_i^T u,        J_i[k, j] = d y_k / d x_i[j].

Central differences give the same quantity to O(eps^2) without any backward code:

    J_i[:, j] ~= (f(x_i + eps e_j) - f(x_i - eps e_j)) / (2 eps)

``gradcheck`` builds the full numeric Jacobian of every input (two forward passes per input
element, so keep the inputs small) and compares ``J_i^T u`` with the analytic gradient for a set
of cotangents ``u``: the output's unit vectors when the output is small (that is the full
Jacobian), otherwise a few random ones. ``gradcheck_random`` is the variant for large tensors:
for a random cotangent ``u`` and a random direction ``v`` it compares the two sides of

    <J_i^T u, v> = u . J_i v ~= u . (f(x_i + eps v) - f(x_i - eps v)) / (2 eps),

which costs two forward passes per direction instead of two per element.

Both run in float64: in float32 the truncation and round-off errors of the difference quotient
are ~1e-3 and would hide real bugs. An element passes when

    |analytic - numeric| <= atol + rtol * |numeric|

and a failure raises ``AssertionError`` naming the input, the worst element and both values.

Usage, for someone adding an op::

    from tinytf.engine.gradcheck import gradcheck
    x = tinytf.Tensor(np.random.default_rng(0).normal(size=(3, 4)), requires_grad=True,
                      dtype=np.float64)
    gradcheck(lambda x: my_op(x), [x])

``fn`` must be deterministic: an op that draws random numbers (dropout) must reseed inside
``fn`` (``tinytf.manual_seed(0)``) so that every call sees the same mask.
"""
from __future__ import annotations

import numpy as np

from tinytf.engine import backend
from tinytf.engine.tensor import Tensor, no_grad

__all__ = ["gradcheck", "gradcheck_random", "gradcheck_module"]

# Below this many output elements gradcheck uses the output's unit vectors as cotangents,
# i.e. it compares the complete Jacobian; above it, `n_cotangents` random cotangents.
FULL_JACOBIAN_MAX_OUTPUTS = 16


def _checked_indices(inputs):
    """Indices of the inputs whose gradient is checked: floating Tensors with requires_grad."""
    idx = []
    for i, x in enumerate(inputs):
        if isinstance(x, Tensor) and x.requires_grad:
            if np.dtype(x.dtype) != np.float64:
                raise ValueError(
                    f"tinytf/engine/gradcheck.py: input {i} has dtype {np.dtype(x.dtype)}; finite "
                    "differences need float64 (pass dtype=np.float64 when building the Tensor)")
            idx.append(i)
    if not idx:
        raise ValueError("gradcheck: no input has requires_grad=True; nothing to check")
    return idx


def _call(fn, inputs, what):
    """Run fn and check that it returned a float64 Tensor (an op must not change dtype)."""
    out = fn(*inputs)
    if not isinstance(out, Tensor):
        raise TypeError(f"gradcheck: fn returned {type(out).__name__} during {what}; "
                        "it must return a Tensor")
    if np.dtype(out.dtype) != np.float64:
        raise AssertionError(f"gradcheck: fn turned float64 inputs into a {np.dtype(out.dtype)} "
                             f"output during {what}; ops must preserve dtype")
    return out


def _forward_values(fn, inputs):
    """f(inputs) as a float64 NumPy array, without building a graph."""
    with no_grad():
        return np.array(backend.to_numpy(_call(fn, inputs, "a numeric forward pass").data),
                        dtype=np.float64)


def _vjp(fn, inputs, checked, cotangent):
    """Analytic J_i^T u for every checked input i, via one backward pass."""
    for i in checked:
        inputs[i].grad = None
    out = _call(fn, inputs, "the analytic forward pass")
    if out.shape != cotangent.shape:
        raise AssertionError(f"gradcheck: fn output shape changed between calls: {out.shape} vs "
                             f"{cotangent.shape}")
    out.backward(backend.to_device(cotangent.copy(), out.device))
    grads = {}
    for i in checked:
        g = inputs[i].grad
        if g is None:  # input not reached by the graph: its gradient is zero
            grads[i] = np.zeros(inputs[i].shape)
            continue
        if tuple(g.shape) != tuple(inputs[i].shape):
            raise AssertionError(f"gradcheck: input {i}: gradient shape {tuple(g.shape)} != "
                                 f"input shape {tuple(inputs[i].shape)}")
        if np.dtype(g.dtype) != np.float64:
            raise AssertionError(f"gradcheck: input {i}: gradient dtype {np.dtype(g.dtype)} != "
                                 "float64 (ops must preserve dtype)")
        grads[i] = np.array(backend.to_numpy(g), dtype=np.float64)
        inputs[i].grad = None
    return grads


def _numeric_jacobian(fn, inputs, i, eps):
    """J_i as an (out.size, x_i.size) array, by central differences, one element at a time.

    Perturbs ``inputs[i].data`` in place and restores every element exactly, so views and
    non-contiguous arrays keep their layout.
    """
    x = inputs[i]
    columns = []
    for idx in np.ndindex(*x.shape):
        orig = x.data[idx].copy()
        x.data[idx] = orig + eps
        plus = _forward_values(fn, inputs)
        x.data[idx] = orig - eps
        minus = _forward_values(fn, inputs)
        x.data[idx] = orig
        columns.append(((plus - minus) / (2 * eps)).ravel())
    out_size = columns[0].size if columns else 0
    return np.array(columns).reshape(x.size, out_size).T


def _fail(i, shape, analytic, numeric, atol, rtol, label):
    """Raise an AssertionError describing the worst mismatch of input i.

    The relative error is ``|analytic - numeric| / max(|numeric|, atol)``, so that entries whose
    true value is ~0 do not report astronomically large ratios.
    """
    err = np.abs(analytic - numeric)
    rel = err / np.maximum(np.abs(numeric), atol if atol > 0 else np.finfo(np.float64).tiny)
    excess = err - (atol + rtol * np.abs(numeric))
    worst = int(np.argmax(excess))
    where = tuple(int(k) for k in np.unravel_index(worst, shape)) if shape else ()
    raise AssertionError(
        f"gradcheck failed for input {i} (shape {tuple(shape)}) with {label}: "
        f"max abs error {err.max():.3e}, max rel error {rel.max():.3e}; worst element "
        f"{where}: analytic {float(analytic.flat[worst])!r} vs numeric "
        f"{float(numeric.flat[worst])!r} (atol={atol}, rtol={rtol})")


def gradcheck(fn, inputs, eps=1e-6, atol=1e-6, rtol=1e-4, n_cotangents=2, seed=0):
    """Check every analytic input gradient of ``fn`` against central differences.

    ``fn(*inputs)`` must return a Tensor. Inputs that are float64 Tensors with
    ``requires_grad=True`` are checked; anything else (int Tensors, constants) is passed through.
    For each checked input ``x_i`` the numeric Jacobian is
    ``J_i[:, j] = (f(x_i + eps e_j) - f(x_i - eps e_j)) / (2 eps)``; it is compared with the
    engine's ``J_i^T u`` for every cotangent ``u``: the unit vectors of the output when
    ``out.size <= 16`` (the full Jacobian), otherwise ``n_cotangents`` standard-normal vectors.
    Passes when ``|analytic - numeric| <= atol + rtol * |numeric|`` everywhere; otherwise raises
    AssertionError naming the input index, the max abs/rel errors and the worst element.
    Cost: ``2 * sum(x_i.size)`` forward passes, so keep inputs to a few hundred elements and use
    ``gradcheck_random`` beyond that. Returns True.
    """
    inputs = list(inputs)
    checked = _checked_indices(inputs)
    y0 = _forward_values(fn, inputs)
    rng = np.random.default_rng(seed)
    if y0.size <= FULL_JACOBIAN_MAX_OUTPUTS:
        cotangents = [(f"output element {tuple(int(j) for j in np.unravel_index(k, y0.shape))}"
                       " (full Jacobian row)", np.eye(1, y0.size, k).reshape(y0.shape))
                      for k in range(y0.size)]
    else:
        cotangents = [(f"random cotangent #{c}", rng.standard_normal(y0.shape))
                      for c in range(n_cotangents)]
    analytic = [(label, _vjp(fn, inputs, checked, u)) for label, u in cotangents]
    for i in checked:
        jac = _numeric_jacobian(fn, inputs, i, eps)
        for (label, u), (_, grads) in zip(cotangents, analytic):
            numeric = (jac.T @ u.ravel()).reshape(inputs[i].shape)
            if not np.all(np.abs(grads[i] - numeric) <= atol + rtol * np.abs(numeric)):
                _fail(i, inputs[i].shape, grads[i], numeric, atol, rtol, label)
    return True


def gradcheck_random(fn, inputs, n_dirs=3, eps=1e-6, atol=1e-6, rtol=1e-4, seed=0):
    """Directional-derivative check for inputs too large for a full Jacobian.

    For ``n_dirs`` pairs of a random cotangent ``u`` (shaped like the output) and, per checked
    input, a random direction ``v`` (shaped like that input), compares
    ``analytic = <J_i^T u, v>`` (one backward pass per ``u``) with
    ``numeric = u . (f(x_i + eps v) - f(x_i - eps v)) / (2 eps)`` (two forward passes).
    Passes when ``|analytic - numeric| <= atol * ||v|| ||u|| + rtol * |numeric|`` (the scalar
    sums many elementwise terms, so atol scales with the vector norms); otherwise raises
    AssertionError naming the input, the direction and both values. Returns True.
    """
    inputs = list(inputs)
    checked = _checked_indices(inputs)
    y0 = _forward_values(fn, inputs)
    rng = np.random.default_rng(seed)
    for d in range(n_dirs):
        u = rng.standard_normal(y0.shape)
        grads = _vjp(fn, inputs, checked, u)
        for i in checked:
            x = inputs[i]
            v = rng.standard_normal(x.shape)
            orig = x.data.copy()
            x.data[...] = orig + eps * v
            plus = _forward_values(fn, inputs)
            x.data[...] = orig - eps * v
            minus = _forward_values(fn, inputs)
            x.data[...] = orig
            numeric = float(np.sum(u * (plus - minus)) / (2 * eps))
            analytic = float(np.sum(grads[i] * v))
            tol = atol * np.linalg.norm(v) * np.linalg.norm(u) + rtol * abs(numeric)
            if not abs(analytic - numeric) <= tol:
                rel = abs(analytic - numeric) / max(abs(numeric), np.finfo(np.float64).tiny)
                raise AssertionError(
                    f"gradcheck_random failed for input {i} (shape {tuple(x.shape)}), direction "
                    f"{d}: <grad, v> analytic {analytic!r} vs numeric {numeric!r}; abs error "
                    f"{abs(analytic - numeric):.3e}, rel error {rel:.3e} (tolerance {tol:.3e})")
    return True


def gradcheck_module(model, loss_fn, *inputs, n_dirs=2, eps=1e-6, atol=1e-6, rtol=1e-4, seed=0):
    """Check the gradient of a whole model: ``loss_fn(model(*inputs))`` against central
    differences along random directions, parameter by parameter.

    For each named parameter p and each of ``n_dirs`` standard-normal directions v, compares
    ``<dL/dp, v>`` from one backward pass with ``(L(p + eps v) - L(p - eps v)) / (2 eps)``
    (two forward passes), with :func:`gradcheck_random`'s tolerance. A parameter that the
    backward never reaches has gradient 0 and passes only if the loss does not depend on it.
    The parameters must be float64 (``model.astype(np.float64)``); ``loss_fn`` must return
    a one-element Tensor and be deterministic (``model.eval()`` turns dropout off). Raises
    AssertionError naming the parameter on a mismatch; returns True.
    """
    named = model.named_parameters()
    wrong = [name for name, p in named if np.dtype(p.dtype) != np.float64]
    if wrong:
        raise ValueError(f"gradcheck_module: parameters {wrong[:3]} are not float64; finite "
                         "differences need model.astype(np.float64) first")

    def loss_value() -> float:
        with no_grad():
            return float(backend.to_numpy(loss_fn(model(*inputs)).data))

    rng = np.random.default_rng(seed)
    for d in range(n_dirs):
        model.zero_grad()
        loss = loss_fn(model(*inputs))
        if not isinstance(loss, Tensor) or loss.size != 1:
            raise TypeError("gradcheck_module: loss_fn must return a one-element Tensor")
        loss.backward()
        for name, p in named:
            v = rng.standard_normal(p.shape)
            grad = np.zeros(p.shape) if p.grad is None else backend.to_numpy(p.grad)
            analytic = float(np.sum(grad * v))
            orig = p.data.copy()
            p.data[...] = orig + eps * backend.to_device(v, p.device)
            plus = loss_value()
            p.data[...] = orig - eps * backend.to_device(v, p.device)
            minus = loss_value()
            p.data[...] = orig
            numeric = (plus - minus) / (2 * eps)
            tol = atol * np.linalg.norm(v) + rtol * abs(numeric)
            if not abs(analytic - numeric) <= tol:
                reached = "" if p.grad is not None else " (backward never reached it)"
                raise AssertionError(
                    f"gradcheck_module failed for parameter {name!r} {tuple(p.shape)}"
                    f"{reached}, direction {d}: <grad, v> analytic {analytic!r} vs numeric "
                    f"{numeric!r}; abs error {abs(analytic - numeric):.3e} (tolerance {tol:.3e})")
    model.zero_grad()
    return True
