"""Mixed precision: matrix products in bfloat16 or float16, float32 master weights and Adam.

The design is PyTorch's autocast, with its casts written out where they happen:

- **Parameters stay float32.** They are the master weights, and Adam's moments, built
  with the parameter's dtype, are float32 too. Nothing about the optimizer changes.
- **Under** ``autocast("bf16")`` **the matrix products run in 16 bits.**
  :func:`autocast` only sets the block's :class:`Policy`; the functions of
  :mod:`tinytf.nn.functional` ask it. ``F.linear`` passes the op the compute dtype
  (:func:`compute_dtype`): ``Linear`` casts its float32 input and weight itself, adds the
  float32 bias to its 16-bit output, and forms every gradient in its input's dtype
  straight from the 16-bit operands: no cast nodes in the graph, every ``param.grad``
  float32. ``F.attention`` casts its inputs with :func:`cast_inputs` (a :class:`Cast`
  node each, whose backward turns the 16-bit gradient back into float32). On the GPU the
  products run on tensor cores with float32 accumulation (``kernels.matmul``).
- **Range-sensitive ops run in float32**: ``softmax``, ``log_softmax``, ``layer_norm`` and
  ``cross_entropy`` (they exponentiate or sum thousands of terms). :func:`cast_inputs`
  casts their 16-bit inputs up, except where the op that will run reads 16 bits and
  computes in float32 anyway (the fused GPU kernels: ``reads_16_bit``).
- **float16 needs loss scaling**: :class:`tinytf.fast.loss_scaler.DynamicLossScaler`.
- ``"tf32"`` is not autocast: float32 everywhere, but float32 products on the GPU use
  TF32 tensor cores (:func:`tf32_override`, read by ``kernels.matmul``).

On the CPU bf16 is emulated: float32 arrays whose values are rounded to bf16
(:mod:`tinytf.ops.cast`). That reproduces bf16's rounding at every cast boundary, not its
speed, and is what the CPU tests use.
"""
from __future__ import annotations

import contextlib
import functools
import warnings

import numpy as np

from tinytf.engine import backend
from tinytf.engine.dispatch import impl
from tinytf.engine.tensor import Tensor
from tinytf.ops.cast import EMULATED_BF16

PRECISIONS = ("float32", "tf32", "bf16", "fp16")

LOW_PRECISION_OPS = frozenset({"linear", "matmul", "attention"})
"""Ops whose float32 inputs are cast to the compute dtype under autocast."""

FLOAT32_OPS = {"softmax": "Softmax", "log_softmax": "LogSoftmax", "layer_norm": "LayerNorm",
               "cross_entropy": "CrossEntropy"}
"""Ops whose 16-bit inputs are cast up to float32 under autocast (unless the op that runs
reads 16 bits itself), and the op-table entry of each."""


@functools.cache
def bfloat16_dtype():
    """The ``ml_dtypes.bfloat16`` NumPy dtype (CuPy >= 14 uses it too), or None."""
    try:
        import ml_dtypes  # noqa: PLC0415 (optional)
    except ImportError:
        return None
    return np.dtype(ml_dtypes.bfloat16)


class Policy:
    """A precision mode: "float32", "tf32", "bf16" or "fp16" (see the module docstring)."""

    def __init__(self, precision: str = "float32"):
        if isinstance(precision, Policy):
            precision = precision.name
        if precision not in PRECISIONS:
            raise ValueError(f"amp: precision must be one of {PRECISIONS}, got {precision!r}")
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

    def compute_dtype(self, xp=None):
        """The dtype matrix products run in, for array module ``xp`` (None: NumPy).

        float32 for "float32"/"tf32"; float16 for "fp16"; for "bf16" on NumPy the marker
        :data:`EMULATED_BF16`, on CuPy ``ml_dtypes.bfloat16`` (an error if missing).
        """
        if self.name == "fp16":
            return np.dtype(np.float16)
        if self.name != "bf16":
            return np.dtype(np.float32)
        if xp is None or xp is np:
            return EMULATED_BF16
        dtype = bfloat16_dtype()
        if dtype is None:
            raise RuntimeError("amp: bf16 on the GPU needs CuPy >= 14 and ml_dtypes "
                               "(pip install ml_dtypes)")
        return dtype


class _Block:
    """The innermost :func:`autocast` block's settings (None outside every block)."""

    policy: Policy | None = None    # a 16-bit or tf32 policy; None for float32
    tf32: bool | None = None        # the block's TF32 setting; None: no block set one


_block = _Block()


def active() -> Policy | None:
    """The policy of the innermost :func:`autocast` block, or None outside one (and
    under "float32")."""
    return _block.policy


def tf32_override() -> bool | None:
    """Whether the innermost :func:`autocast` block asks for TF32 products (True under
    "tf32", False under any other precision), or None outside every block."""
    return _block.tf32


@contextlib.contextmanager
def autocast(precision="bf16", enabled: bool = True):
    """Run the block's forward pass under ``precision`` (a name or a :class:`Policy`).

    The functions of :mod:`tinytf.nn.functional` read the policy and cast as it says
    (:func:`compute_dtype`, :func:`cast_inputs`); the model code does not change.
    Backward may run outside the block: the casts were recorded in the graph.
    ``enabled=False`` turns autocast off for the block, as in PyTorch (an enclosing
    block's TF32 setting holds).
    """
    policy = Policy(precision) if enabled else None
    prev = (_block.policy, _block.tf32)
    _block.policy = policy if policy is not None and policy.name != "float32" else None
    if policy is not None:
        _block.tf32 = policy.tf32
    try:
        yield policy
    finally:
        _block.policy, _block.tf32 = prev


def compute_dtype(op: str, *tensors):
    """The dtype op ``op`` computes in under the active policy, or None for "as given".

    Non-None only under "bf16"/"fp16" for :data:`LOW_PRECISION_OPS`: the policy's
    compute dtype for the tensors' array module (:data:`EMULATED_BF16` on NumPy).
    """
    policy = _block.policy
    if policy is None or not policy.low_precision or op not in LOW_PRECISION_OPS:
        return None
    first = next((t for t in tensors if isinstance(t, Tensor)), None)
    xp = backend.get_array_module(first.data) if first is not None else np
    return policy.compute_dtype(xp)


def _cast(t, dtype):
    if t is None or not isinstance(t, Tensor) or not backend.is_float(t.dtype):
        return t
    if dtype == EMULATED_BF16:
        return impl.Cast.apply(t, dtype=EMULATED_BF16) if t.dtype == np.float32 else t
    return t if t.dtype == dtype else impl.Cast.apply(t, dtype=dtype)


def cast_inputs(op: str, *tensors):
    """``tensors`` as op ``op`` should see them under the active autocast policy.

    Outside :func:`autocast` (or under "float32"/"tf32") they come back unchanged. Under
    "bf16"/"fp16": for :data:`LOW_PRECISION_OPS` float32 tensors are cast to the compute
    dtype; for :data:`FLOAT32_OPS` 16-bit tensors are cast to float32, unless the class
    that will run the op reads them as they are (``reads_16_bit``: the fused GPU kernels).
    Other ops and non-float tensors are left alone.
    """
    policy = _block.policy
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
        runs = getattr(impl, FLOAT32_OPS[op]).for_inputs(tensors)
        reads_16_bit = getattr(runs, "reads_16_bit", None)
        if reads_16_bit is not None and reads_16_bit(*(t.data for t in floats)):
            return tensors
        return tuple(_cast(t, np.dtype(np.float32)) for t in tensors)
    return tensors


def speed_warning(precision, device: str) -> str | None:
    """A warning for a precision that makes ``device`` far slower than float32, else None.

    On the CPU fp16 computes in NumPy's float16, which has no BLAS behind its products: a
    training update of the ``tiny`` model takes about 80x as long as in float32, beam
    search about 40x (docs/gpu.md, "Mixed precision"). It reproduces
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
