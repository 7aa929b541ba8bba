"""Mixed precision: matrix products in bfloat16 or float16, float32 master weights and Adam.

The design is PyTorch's autocast + GradScaler, in tinytf's terms:

- **Parameters stay float32.** They are the master weights, and Adam's moments, built
  with the parameter's dtype, are float32 too. Nothing about the optimizer changes.
- **Under** ``autocast("bf16")`` **the matrix products run in 16 bits.** :func:`autocast`
  wraps the op table's entries for the block (:data:`AUTOCAST_OPS`). The ``Linear`` op of
  the fast paths (``fast.FusedLinear``) is passed the compute dtype (:func:`compute_dtype`)
  and casts its float32 input and weight itself (:func:`to_compute`), adds the float32 bias to its
  16-bit output, and forms the weight's and bias's gradients as float32 sums straight
  from the 16-bit operands: no cast nodes in the graph, every ``param.grad`` float32, and
  Adam updates float32 weights. ``attention`` (and the reference ``Linear``, with the
  fast paths off) get their inputs through :func:`cast_inputs`, which casts float32 inputs
  through :class:`CastTo`,
  a differentiable cast whose backward turns the 16-bit gradient back into float32. On
  the GPU the products run on tensor cores with float32 accumulation (``kernels.matmul``).
- **Range-sensitive ops run in float32**: ``softmax``, ``log_softmax``, ``layer_norm`` and
  ``cross_entropy`` (they exponentiate or sum thousands of terms). :func:`cast_inputs`
  casts their 16-bit inputs up, except where the fused GPU kernels take them, since
  those read 16 bits and compute in float32 anyway.
- **float16 needs loss scaling**: its 5 exponent bits flush small gradients to zero.
  :class:`DynamicLossScaler` multiplies the loss by a large factor S before backward,
  divides the gradients by S after, skips a step whose gradients hold inf/NaN (and halves
  S), and doubles S after ``growth_interval`` clean steps. bfloat16 has float32's
  exponent range and needs none.
- ``"tf32"`` is not autocast: float32 everywhere, but float32 products on the GPU use
  TF32 tensor cores (``kernels.set_tf32``).

NumPy has no bfloat16 type, and a bfloat16 matmul in NumPy would have no BLAS behind
it. On the CPU, bf16 is therefore *emulated*: float32 arrays whose values are rounded to
bf16 (:func:`round_to_bf16`, round-to-nearest-even, the same bit arithmetic as the GPU
kernels' ``from_f32<bf16_t>``). That reproduces bf16's rounding at every cast boundary,
not its speed, and is what the CPU tests use.
"""
from __future__ import annotations

import contextlib
import functools
import math
import warnings

import numpy as np

from tinytf.engine import backend
from tinytf.engine.dispatch import impl
from tinytf.engine.tensor import Function, Tensor
from tinytf.fast import kernels
from tinytf.optim.adam import gradient_arrays

PRECISIONS = ("float32", "tf32", "bf16", "fp16")

LOW_PRECISION_OPS = frozenset({"linear", "matmul", "attention"})
"""Ops whose float32 inputs are cast to the compute dtype under autocast."""

FLOAT32_OPS = frozenset({"softmax", "log_softmax", "layer_norm", "cross_entropy"})
"""Ops whose 16-bit inputs are cast up to float32 under autocast (unless fused kernels run)."""


# ----- bfloat16 on NumPy -----------------------------------------------------------------

def bf16_bits(x):
    """The bfloat16 bit patterns (uint16) of float32 ``x``, rounded to nearest, ties to even.

    bfloat16 is the top half of a float32 (sign, 8 exponent bits, 7 mantissa bits). To
    round, add 0x7FFF plus the lowest kept bit, then drop the low 16 bits: exactly half an
    ulp rounds to the even neighbour. NaN stays NaN (quiet bit set); overflow gives inf.
    """
    xp = backend.get_array_module(x)
    u = xp.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    rounded = (u + (0x7FFF + ((u >> 16) & 1))) >> 16
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return xp.where(is_nan, (u >> 16) | 0x40, rounded).astype(np.uint16)


def bf16_from_bits(bits):
    """float32 values of bfloat16 bit patterns (exact: bf16 is a float32 prefix)."""
    xp = backend.get_array_module(bits)
    return (xp.asarray(bits, dtype=np.uint16).astype(np.uint32) << 16).view(np.float32)


def round_to_bf16(x):
    """float32 ``x`` rounded to the nearest bfloat16 value, kept as float32 (emulated bf16)."""
    return bf16_from_bits(bf16_bits(x)).reshape(np.shape(x))


@functools.cache
def bfloat16_dtype():
    """The ``ml_dtypes.bfloat16`` NumPy dtype (CuPy >= 14 uses it too), or None."""
    try:
        import ml_dtypes  # noqa: PLC0415 (optional)
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


# ----- the policy ------------------------------------------------------------------------

EMULATED_BF16 = "emulated-bf16"
"""``Policy.compute_dtype`` on NumPy for bf16: float32 storage rounded to bf16 values."""


class Policy:
    """A precision mode: "float32", "tf32", "bf16" or "fp16" (see the module docstring)."""

    def __init__(self, precision: str = "float32"):
        if isinstance(precision, Policy):
            precision = precision.name
        if precision not in PRECISIONS:
            raise ValueError(f"amp.py: precision must be one of {PRECISIONS}, got {precision!r}")
        self.name = precision

    def __repr__(self) -> str:
        return f"Policy({self.name!r})"

    @property
    def low_precision(self) -> bool:
        """Whether matrix products run in 16 bits."""
        return self.name in ("bf16", "fp16")

    @property
    def loss_scaling(self) -> bool:
        """Whether a :class:`DynamicLossScaler` is needed (float16 only)."""
        return self.name == "fp16"

    @property
    def tf32(self) -> bool:
        """Whether float32 products use TF32 tensor cores."""
        return self.name == "tf32"

    def compute_dtype(self, xp=np):
        """The dtype matrix products run in, for array module ``xp``.

        float32 for "float32"/"tf32"; float16 for "fp16"; for "bf16" on NumPy the marker
        :data:`EMULATED_BF16`, on CuPy ``ml_dtypes.bfloat16`` (an error if missing).
        """
        if self.name == "fp16":
            return np.dtype(np.float16)
        if self.name != "bf16":
            return np.dtype(np.float32)
        if xp is np:
            return EMULATED_BF16
        dtype = bfloat16_dtype()
        if dtype is None:
            raise RuntimeError("amp.py: bf16 on the GPU needs CuPy >= 14 and ml_dtypes "
                               "(pip install ml_dtypes)")
        return dtype


_policy: Policy | None = None


def active() -> Policy | None:
    """The policy of the innermost :func:`autocast` block, or None outside one."""
    return _policy


AUTOCAST_OPS = {"Linear": "linear", "Attention": "attention", "Softmax": "softmax",
                "LogSoftmax": "log_softmax", "LayerNorm": "layer_norm",
                "CrossEntropy": "cross_entropy"}
"""The op-table entries that :func:`autocast` wraps, and the name :func:`cast_inputs` knows
each by."""


@contextlib.contextmanager
def autocast(precision="bf16", enabled: bool = True):
    """Run the block's forward pass under ``precision`` (a name or a :class:`Policy`).

    Under "bf16"/"fp16" the op table's entries of :data:`AUTOCAST_OPS` are replaced, for
    the block, by subclasses whose ``apply`` first casts the inputs as the policy says
    (:func:`cast_inputs`), or, for an op that casts inside itself (``takes_compute_dtype``:
    ``fast.FusedLinear``), passes it the compute dtype. The model code does not change.
    Backward may run outside the block: the casts were recorded in the graph.
    """
    global _policy
    policy = Policy(precision) if enabled else None
    prev, prev_tf32 = _policy, kernels.tf32_enabled()
    _policy = policy if policy is not None and policy.name != "float32" else None
    if policy is not None:
        kernels.set_tf32(policy.tf32)
    saved = {}          # the entries this block changes (none for float32 outside autocast)
    for name, op in AUTOCAST_OPS.items():
        current = getattr(impl, name)
        base = getattr(current, "autocast_base", current)
        wanted = _autocasting(base, op) if _policy and _policy.low_precision else base
        if wanted is not current:
            saved[name] = current
            impl.replace(name, wanted)
    try:
        yield policy
    finally:
        _policy = prev
        kernels.set_tf32(prev_tf32)
        for name, cls in saved.items():
            impl.replace(name, cls)


@functools.cache
def _autocasting(cls, op: str):
    """``cls`` whose ``apply`` casts its inputs for op ``op`` under the active policy."""
    if getattr(cls, "takes_compute_dtype", False):
        def apply(_, *inputs, **kwargs):
            return cls.apply(*inputs, compute_dtype=compute_dtype(op, *inputs), **kwargs)
    else:
        def apply(_, *inputs, **kwargs):
            return cls.apply(*cast_inputs(op, *inputs), **kwargs)
    return type(f"Autocast{cls.__name__}", (cls,), {
        "apply": classmethod(apply), "autocast_base": cls, "__module__": __name__,
        "__doc__": f"{cls.__name__} with its inputs cast by amp.autocast ({op!r})."})


class CastTo(Function):
    """x converted to ``dtype`` (None: emulated bf16); the gradient is converted back.

    Emulated bf16 rounds the incoming gradient to bf16 as well: on a GPU that gradient
    would have been computed, and stored, in bf16.
    """

    def forward(self, x, dtype=None):
        self.in_dtype = x.dtype
        self.emulated = dtype is None
        return round_to_bf16(x) if self.emulated else x.astype(dtype)

    def backward(self, grad):
        if self.emulated:
            grad = round_to_bf16(grad)
        return grad.astype(self.in_dtype, copy=False)


def to_compute(a, dtype):
    """Array ``a`` as an op computing in ``dtype`` reads it: float32 arrays are cast
    (:data:`EMULATED_BF16`: rounded to bf16 values, still float32); others, and None,
    are returned as they are. Ops that take a ``compute_dtype`` (``Linear``) cast their
    inputs with this inside the op, which saves the graph a :class:`CastTo` node per input.
    """
    if a is None or a.dtype != np.float32 or dtype is None:
        return a
    return round_to_bf16(a) if dtype == EMULATED_BF16 else a.astype(dtype)


def compute_dtype(op: str, *tensors):
    """The dtype op ``op`` computes in under the active policy, or None for "as given".

    Non-None only under "bf16"/"fp16" for :data:`LOW_PRECISION_OPS`: the policy's
    compute dtype for the tensors' array module (:data:`EMULATED_BF16` on NumPy).
    """
    policy = _policy
    if policy is None or not policy.low_precision or op not in LOW_PRECISION_OPS:
        return None
    first = next((t for t in tensors if isinstance(t, Tensor)), None)
    xp = backend.get_array_module(first.data) if first is not None else np
    return policy.compute_dtype(xp)


def _cast(t, dtype):
    if t is None or not isinstance(t, Tensor) or not backend.is_float(t.dtype):
        return t
    if dtype == EMULATED_BF16:
        return CastTo.apply(t, dtype=None) if t.dtype == np.float32 else t
    return t if t.dtype == dtype else CastTo.apply(t, dtype=dtype)


def cast_inputs(op: str, *tensors):
    """``tensors`` as op ``op`` should see them under the active autocast policy.

    Outside :func:`autocast` (or under "float32"/"tf32") they come back unchanged. Under
    "bf16"/"fp16": for :data:`LOW_PRECISION_OPS` float32 tensors are cast to the compute
    dtype; for :data:`FLOAT32_OPS` 16-bit tensors are cast to float32, unless the fused GPU
    kernels will run on them. Other ops and non-float tensors are left alone.
    """
    policy = _policy
    if policy is None or not policy.low_precision:
        return tensors
    floats = [t for t in tensors if isinstance(t, Tensor) and backend.is_float(t.dtype)]
    if not floats:
        return tensors
    if op in LOW_PRECISION_OPS:
        dtype = policy.compute_dtype(backend.get_array_module(floats[0].data))
        return tuple(_cast(t, dtype) if t is None or t.dtype == np.float32 else t
                     for t in tensors)
    if op in FLOAT32_OPS:
        if kernels.fused(*(t.data for t in floats)):
            return tensors
        return tuple(_cast(t, np.dtype(np.float32)) for t in tensors)
    return tensors


def speed_warning(precision, device: str) -> str | None:
    """A warning for a precision that makes ``device`` far slower than float32, else None.

    On the CPU fp16 computes in NumPy's float16, which has no BLAS behind its products: a
    training update of the ``tiny`` model takes about 80x as long as in float32, beam
    search about 40x (docs/gpu.md, "Mixed precision (`tinytf/fast/amp.py`)"). It reproduces
    fp16's numerics and loss scaling, for checking them on a small model, not its speed.
    """
    if device != "cpu" or Policy(precision).name != "fp16":
        return None
    return ("warning: --precision fp16 on the CPU computes in NumPy's float16, which has no "
            "BLAS: training about 80x and decoding about 40x slower than in float32 (fp16's "
            "numerics, for checking them on a small model; not its speed). The CPU is "
            "fastest in float32; bf16 is emulated there at about two thirds of its speed")


@contextlib.contextmanager
def overflows_expected(precision):
    """NumPy's warnings of overflows and invalid values held back for the block under fp16.

    There an overflow of the scaled gradients is expected: :class:`DynamicLossScaler`
    finds it, the update is skipped and the log says so. A filter of the warnings
    module, not ``numpy.errstate``, whose setting the row-parallel ops' threads would
    not see. Under any other precision the block runs as it is.
    """
    if Policy(precision).name != "fp16":
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", r"(overflow|invalid value|divide by zero) "
                                "encountered", RuntimeWarning)
        yield


@contextlib.contextmanager
def training_autocast(precision):
    """:func:`autocast` for a training step's forward, backward and update: under fp16
    with :func:`overflows_expected` too, since the loss scaler handles the step's overflows
    (validation and decoding use :func:`autocast` alone, and still warn)."""
    with autocast(precision), overflows_expected(precision):
        yield


# ----- dynamic loss scaling --------------------------------------------------------------

class DynamicLossScaler:
    """Dynamic loss scaling for float16 training (Micikevicius et al. 2018; as torch's GradScaler).

    Per step: backward on ``scale_loss(loss)`` = loss * S; ``found_inf = unscale_(params)``
    multiplies every gradient by 1/S and reports whether any was inf/NaN; the optimizer
    steps only if not; ``update(found_inf)`` then halves S after an overflow (the step is
    skipped) or doubles it after ``growth_interval`` overflow-free steps in a row.
    S below ``min_scale`` means the gradients are inf/NaN at any scale (the run has
    diverged): FloatingPointError. ``enabled=False`` (bf16, float32) makes every method a
    pass-through, so one training loop serves all precisions.
    """

    def __init__(self, init_scale: float = 2.0 ** 16, growth_factor: float = 2.0,
                 backoff_factor: float = 0.5, growth_interval: int = 2000,
                 min_scale: float = 2.0 ** -16, enabled: bool = True):
        if not (growth_factor > 1.0 and 0.0 < backoff_factor < 1.0 and growth_interval >= 1
                and init_scale > 0):
            raise ValueError("amp.py: DynamicLossScaler needs growth_factor > 1, "
                             "0 < backoff_factor < 1, growth_interval >= 1, init_scale > 0")
        self._device_scale = None   # S as a device scalar, for captured graphs (scale_loss)
        self.scale = float(init_scale)
        self.growth_factor, self.backoff_factor = float(growth_factor), float(backoff_factor)
        self.growth_interval, self.min_scale = int(growth_interval), float(min_scale)
        self.enabled = bool(enabled)
        self.growth_tracker = 0     # overflow-free steps since the last change of scale
        self.skipped_steps = 0

    @property
    def scale(self) -> float:
        """The current loss scale S."""
        return self._scale

    @scale.setter
    def scale(self, value: float) -> None:
        self._scale = float(value)
        if self._device_scale is not None:      # one fill launch; a graph reads it next
            self._device_scale.fill(self._scale)

    def scale_loss(self, loss: Tensor, on_device: bool = False) -> Tensor:
        """loss * S (the loss itself when disabled).

        ``on_device``: S is read from a device scalar that the scaler keeps equal to
        :attr:`scale`, instead of being a constant of the product. A CUDA graph that
        captures this product then multiplies by each step's S when replayed
        (``train.py --cuda-graph --precision fp16``).
        """
        if not self.enabled:
            return loss
        if not on_device:
            return loss * self.scale
        xp = backend.get_array_module(loss.data)
        if self._device_scale is None or backend.get_array_module(self._device_scale) is not xp:
            self._device_scale = xp.full((), self._scale, dtype=np.float32)
        return loss * Tensor(self._device_scale)

    def unscale_(self, params, extra_factor: float = 1.0) -> bool:
        """Multiply every gradient by extra_factor / S in place; True if any was inf/NaN.

        ``extra_factor`` folds another scaling into the same pass (1 / global token count
        in train.py). Disabled: multiplies by ``extra_factor`` and returns False unchecked.
        On CuPy the check costs one host sync per step (one flag for all gradients).
        """
        grads = gradient_arrays(params)   # the flat buffer if any: one pass, one launch
        factor = extra_factor / self.scale if self.enabled else extra_factor
        if not self.enabled:
            if factor != 1.0:
                for g in grads:
                    g *= factor
            return False
        if not grads:
            return False
        if kernels.fused(*grads):
            return bool(kernels.unscale_(grads, factor)[0])
        xp = backend.get_array_module(grads[0])
        finite = xp.stack([xp.isfinite(g).all() for g in grads]).all()  # before scaling
        for g in grads:
            g *= factor
        return not bool(finite)

    def update(self, found_inf: bool) -> None:
        """Back off after an overflow, grow after ``growth_interval`` clean steps."""
        if not self.enabled:
            return
        if found_inf:
            self.scale *= self.backoff_factor
            self.growth_tracker = 0
            self.skipped_steps += 1
            if self.scale < self.min_scale:
                raise FloatingPointError(
                    f"amp.py: loss scale fell to {self.scale:g} < min_scale "
                    f"{self.min_scale:g}: the gradients are inf/NaN at every scale")
            return
        self.growth_tracker += 1
        if self.growth_tracker >= self.growth_interval:
            self.scale *= self.growth_factor
            self.growth_tracker = 0

    def update_on_device(self, found_inf) -> None:
        """Move the device scale (:meth:`scale_loss` with ``on_device``) to where
        :meth:`update` will move :attr:`scale`, without reading ``found_inf``, a flag on
        the device: S * backoff_factor if it is set, else S, or S * growth_factor when this
        step completes a growth interval. The next backward can then be launched before the
        host knows whether this step overflowed; the host's own state follows when the
        caller learns the outcome and calls :meth:`update` (one step in flight,
        docs/training.md).
        """
        if not self.enabled or self._device_scale is None:
            return
        xp = backend.get_array_module(self._device_scale)
        grown = self.growth_tracker + 1 >= self.growth_interval
        clean = self._scale * self.growth_factor if grown else self._scale
        self._device_scale[...] = xp.where(found_inf.reshape(()) != 0,
                                           np.float32(self._scale * self.backoff_factor),
                                           np.float32(clean))

    def step(self, optimizer, params=None, extra_factor: float = 1.0) -> bool:
        """unscale_, then ``optimizer.step()`` unless inf/NaN, then update; True if stepped.

        ``params`` defaults to ``optimizer.params``. Gradients are not cleared.
        """
        params = optimizer.params if params is None else params
        found_inf = self.unscale_(params, extra_factor)
        if not found_inf:
            optimizer.step()
        self.update(found_inf)
        return not found_inf

    def state_dict(self) -> dict:
        """JSON-serialisable state (scale, counters and settings)."""
        return {"scale": self.scale, "growth_tracker": self.growth_tracker,
                "skipped_steps": self.skipped_steps, "growth_factor": self.growth_factor,
                "backoff_factor": self.backoff_factor, "growth_interval": self.growth_interval,
                "min_scale": self.min_scale, "enabled": self.enabled}

    def load_state_dict(self, state: dict) -> None:
        """Restore :meth:`state_dict`'s output (KeyError naming a missing key)."""
        missing = sorted(set(self.state_dict()) - set(state))
        if missing:
            raise KeyError(f"amp.py: loss-scaler state is missing {missing}")
        self.scale = float(state["scale"])
        if not math.isfinite(self.scale) or self.scale <= 0:
            raise ValueError(f"amp.py: loss-scaler state has scale {self.scale}")
        self.growth_tracker, self.skipped_steps = int(state["growth_tracker"]), \
            int(state["skipped_steps"])
        self.growth_factor, self.backoff_factor = float(state["growth_factor"]), \
            float(state["backoff_factor"])
        self.growth_interval, self.min_scale = int(state["growth_interval"]), \
            float(state["min_scale"])
        self.enabled = bool(state["enabled"])
