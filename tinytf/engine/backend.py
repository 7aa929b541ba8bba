"""The one place that chooses the array library: NumPy on the CPU, CuPy on the GPU.

Every op in tinytf is written once against ``xp``, the module returned by
:func:`get_array_module` for the arrays at hand (the same idea as
``cupy.get_array_module`` and ``chainer.backend``). Importing tinytf never imports CuPy;
CuPy is loaded only when a GPU array or ``TINYTF_DEVICE=gpu`` asks for it.

The global random generators (dropout masks, initialisation) also live here, one per
array module, so that a run is reproducible from ``manual_seed`` and its state can be
saved in a checkpoint and restored exactly.
"""
from __future__ import annotations

import os
import sys

import numpy as np

_cupy = None
_rngs: dict = {}
_seed = 0


def _import_cupy():
    """Import CuPy on first use, with a clear error when it is missing."""
    global _cupy
    if _cupy is None:
        try:
            import cupy  # noqa: PLC0415 (optional dependency)
        except ImportError as e:  # pragma: no cover - depends on the machine
            raise RuntimeError(
                "the GPU device needs CuPy: pip install 'tinytf[gpu]' (cupy-cuda12x)") from e
        _cupy = cupy
    return _cupy


def gpu_unusable() -> str | None:
    """Why ``--device gpu`` cannot run here, as words that follow "--device gpu", or None.

    CuPy missing or failing to import; or CUDA failing to count the GPUs (no driver, a
    driver older than the CUDA runtime of the installed CuPy wheel) or counting none.
    Asking for the count makes no CUDA context: no rank takes memory on a GPU by asking.
    """
    try:
        cupy = _import_cupy()
    except RuntimeError:
        return ("needs CuPy: pip install 'tinytf[gpu]' (cupy-cuda12x; or the CuPy wheel of "
                "your CUDA)")
    except Exception as e:  # noqa: BLE001 - installed, but failing to load its libraries
        return f"cannot import CuPy ({type(e).__name__}: {e})"
    try:
        count = cupy.cuda.runtime.getDeviceCount()
    except Exception as e:  # noqa: BLE001 - CUDARuntimeError, or CUDA libraries not loading
        return f"finds no usable GPU ({e})"
    return None if count > 0 else "finds no GPU (CUDA counts none)"


def default_device() -> str:
    """The device named by ``TINYTF_DEVICE`` ("cpu" or "gpu"); "cpu" when unset."""
    device = os.environ.get("TINYTF_DEVICE", "cpu").lower()
    if device not in ("cpu", "gpu"):
        raise ValueError(f"TINYTF_DEVICE must be 'cpu' or 'gpu', got {device!r}")
    return device


def array_module(device: str):
    """numpy for ``"cpu"``, cupy for ``"gpu"``."""
    if device == "cpu":
        return np
    if device == "gpu":
        return _import_cupy()
    raise ValueError(f"device must be 'cpu' or 'gpu', got {device!r}")


def get_array_module(*arrays):
    """The module (numpy or cupy) that owns ``arrays``; numpy for anything else.

    CuPy arrays made by code that imported CuPy itself (not through tinytf) count too.
    """
    global _cupy
    if _cupy is None and "cupy" in sys.modules:
        _cupy = sys.modules["cupy"]
    if _cupy is not None:
        for a in arrays:
            if isinstance(a, _cupy.ndarray):
                return _cupy
    return np


def device_of(array) -> str:
    """"gpu" for a CuPy array, "cpu" otherwise."""
    return "gpu" if get_array_module(array) is not np else "cpu"


def is_float(dtype) -> bool:
    """Whether ``dtype`` is a floating-point type, bfloat16 included.

    ``ml_dtypes.bfloat16`` (the bfloat16 of NumPy and CuPy >= 14) is a NumPy extension
    type whose ``kind`` is "V", not "f", so ``dtype.kind == "f"`` alone would miss it.
    """
    dtype = np.dtype(dtype)
    return dtype.kind == "f" or dtype.name == "bfloat16"


def finfo(dtype):
    """``numpy.finfo`` of ``dtype``, bfloat16 included (through ``ml_dtypes.finfo``)."""
    dtype = np.dtype(dtype)
    if dtype.name == "bfloat16":
        import ml_dtypes  # noqa: PLC0415 (present wherever a bfloat16 array exists)
        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def to_device(array, device: str):
    """Copy ``array`` to ``device`` (a no-op when it is already there)."""
    if device == device_of(array):
        return array
    if device == "gpu":
        return _import_cupy().asarray(array)
    return array.get()


class PinnedStaging:
    """Host-to-GPU copies of small arrays (batches of token ids) through pinned memory.

    ``cupy.asarray`` on a NumPy array copies from pageable memory, which the driver may
    stage synchronously, waiting for the GPU's queue; from page-locked (pinned) memory the
    copy is a true asynchronous transfer on the current stream. A ring of ``slots`` pinned
    buffers, each reused only after the event recorded behind its last copy has passed
    (normally long since), so a buffer is never overwritten while the GPU still reads it.
    """

    def __init__(self, slots: int = 8):
        self.buffers, self.events, self.next = [None] * slots, [None] * slots, 0

    def to_gpu(self, array):  # pragma: no cover - GPU only
        """A CuPy copy of NumPy ``array``, enqueued on the current stream."""
        cupy = _import_cupy()
        import cupyx  # noqa: PLC0415
        a = np.ascontiguousarray(array)
        if a.size == 0:
            return cupy.empty(a.shape, dtype=a.dtype)
        k, self.next = self.next, (self.next + 1) % len(self.buffers)
        if self.events[k] is not None:
            self.events[k].synchronize()
        if self.buffers[k] is None or self.buffers[k].nbytes < a.nbytes:
            self.buffers[k] = cupyx.empty_pinned(max(a.nbytes, 1 << 16), dtype=np.uint8)
        host = self.buffers[k][:a.nbytes].view(a.dtype).reshape(a.shape)
        host[...] = a
        out = cupy.empty(a.shape, dtype=a.dtype)
        stream = cupy.cuda.get_current_stream()
        out.set(host, stream=stream)
        self.events[k] = stream.record()
        return out


_staging = PinnedStaging()


def to_device_pinned(array, device: str):
    """:func:`to_device`, through :class:`PinnedStaging` for NumPy arrays going to the GPU
    (batches; not parameters: the staging buffers grow to the largest array copied)."""
    if device == "gpu" and get_array_module(array) is np and isinstance(array, np.ndarray):
        return _staging.to_gpu(array)
    return to_device(array, device)


def to_numpy(array) -> np.ndarray:
    """A NumPy array with the values of ``array`` (copied from the GPU if needed)."""
    if get_array_module(array) is not np:
        return array.get()
    return array if isinstance(array, np.ndarray) else np.asarray(array)


def scatter_add(target, indices, values) -> None:
    """``target[indices] += values`` where repeated indices accumulate.

    Plain ``target[idx] += v`` keeps only one write per repeated index; NumPy's
    ``add.at`` and CuPy's ``scatter_add`` sum all of them.
    """
    xp = get_array_module(target)
    if xp is np:
        np.add.at(target, indices, values)
    else:  # pragma: no cover - GPU only
        import cupyx  # noqa: PLC0415
        cupyx.scatter_add(target, indices, values)


def manual_seed(seed: int) -> None:
    """Seed every random generator tinytf uses (initialisation and dropout)."""
    global _seed
    _seed = int(seed)
    _rngs.clear()


def rng(xp=np):
    """The global random generator for array module ``xp`` (created from the seed)."""
    key = xp.__name__
    if key not in _rngs:
        _rngs[key] = xp.random.default_rng(_seed)
    return _rngs[key]


class CounterStream:
    """Random numbers for the fused GPU kernels: ``uniform(seed, offset + i)`` by a hash.

    ``seed`` is a one-element uint64 array on the device (from :func:`manual_seed`'s seed);
    :meth:`take` hands out consecutive, never reused offsets. The kernel hashes (seed,
    offset + i) itself, so drawing costs no launch and no array of random numbers, and a
    replayed CUDA graph (whose offsets are fixed) draws new numbers after :meth:`advance`.
    """

    def __init__(self, xp, seed: int):
        self.seed = xp.full(1, seed % 2 ** 64, dtype=np.uint64)
        self.offset = 0

    def take(self, n: int) -> int:
        """The first of ``n`` fresh offsets."""
        first = self.offset
        self.offset += int(n)
        return first

    def advance(self) -> None:
        """A new seed on the device (one small launch, no host round trip)."""
        self.seed += np.uint64(1)


def counter_stream(xp) -> CounterStream:
    """The :class:`CounterStream` of array module ``xp`` (reset by :func:`manual_seed`)."""
    key = "counter:" + xp.__name__
    if key not in _rngs:
        _rngs[key] = CounterStream(xp, _seed)
    return _rngs[key]


def get_rng_state() -> dict:
    """The CPU generator's state as a JSON-serialisable dict (for checkpoints)."""
    return {"seed": _seed, "numpy": rng(np).bit_generator.state}


def set_rng_state(state: dict) -> None:
    """Restore the state returned by :func:`get_rng_state`."""
    manual_seed(state["seed"])
    rng(np).bit_generator.state = state["numpy"]
