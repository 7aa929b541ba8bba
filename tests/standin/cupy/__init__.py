"""A NumPy-backed stand-in for CuPy's module interface (tests only; see README.md)."""
import collections as _collections

import numpy as _np

from . import cuda  # noqa: F401  (cupy.cuda.*, as in CuPy)

__version__ = "0.0-standin"

transfers = _collections.Counter()   # device-to-host reads, by kind
transferred_bytes = _collections.Counter()   # and their bytes


def _count(kind, array=None):
    transfers[kind] += 1
    transferred_bytes[kind] += 0 if array is None else array.nbytes


class ndarray(_np.ndarray):
    """A "device" array: NumPy memory, CuPy's host-transfer methods (counted)."""

    def __array_wrap__(self, array, context=None, return_scalar=False):
        # CuPy returns 0-d arrays where NumPy returns scalars (x.sum(), a @ b of vectors).
        return _np.asarray(array).view(ndarray)

    def get(self, stream=None, out=None):
        _count("get", self)
        if out is not None:
            out[...] = self.view(_np.ndarray)
            return out
        return _np.array(self.view(_np.ndarray), copy=True)

    def set(self, arr, stream=None):
        self.view(_np.ndarray)[...] = arr

    def item(self, *args):
        _count("item")
        return self.view(_np.ndarray).item(*args)

    def tolist(self):
        _count("tolist", self)
        return self.view(_np.ndarray).tolist()

    def __float__(self):
        _count("float")
        return float(self.view(_np.ndarray))

    def __int__(self):
        _count("int")
        return int(self.view(_np.ndarray))

    def __bool__(self):
        _count("bool")
        return bool(self.view(_np.ndarray))

    @property
    def data(self):
        return _Memory(self.ctypes.data)


class _Memory:
    def __init__(self, ptr):
        self.ptr = ptr


def _wrap(x):
    if isinstance(x, _np.ndarray) and not isinstance(x, ndarray):
        return x.view(ndarray)
    if isinstance(x, _np.generic):
        return _np.asarray(x).view(ndarray)
    if isinstance(x, (tuple, list)):
        return type(x)(_wrap(v) for v in x)
    return x


def _host(x):
    if isinstance(x, ndarray):
        return x.view(_np.ndarray)
    if isinstance(x, (tuple, list)):
        return type(x)(_host(v) for v in x)
    return x


def asarray(a, dtype=None, order=None):
    """A device copy of host data (or ``a`` itself when it already is one of that dtype)."""
    if isinstance(a, ndarray) and (dtype is None or _np.dtype(dtype) == a.dtype):
        return a
    return _np.array(_host(a), dtype=dtype, order=order or "K").view(ndarray)


def array(a, dtype=None, copy=True, order="K"):
    return _np.array(_host(a), dtype=dtype, copy=copy, order=order).view(ndarray)


def ascontiguousarray(a, dtype=None):
    return _wrap(_np.ascontiguousarray(a, dtype=dtype))


def asnumpy(a, stream=None):
    host = _np.array(_host(a), copy=True)
    _count("asnumpy", host)
    return host


def get_array_module(*args):
    return __import__(__name__) if any(isinstance(a, ndarray) for a in args) else _np


def __getattr__(name):
    attr = getattr(_np, name)
    if callable(attr) and not isinstance(attr, type):
        def call(*args, **kwargs):
            return _wrap(attr(*args, **kwargs))
        call.__name__ = name
        return call
    return attr


class _Generator:
    def __init__(self, seed=None):
        self._g = _np.random.default_rng(seed)

    def __getattr__(self, name):
        method = getattr(self._g, name)
        return lambda *a, **k: _wrap(method(*a, **k))


class random:  # noqa: N801  (cupy.random)
    default_rng = _Generator


_pool = cuda.MemoryPool()   # nothing to free: NumPy owns the memory


def get_default_memory_pool():
    return _pool


def get_default_pinned_memory_pool():
    return _pool


class RawModule:
    """Kernels from tinytf's CUDA source, run by the g++ host build."""

    def __init__(self, code=None, options=(), name_expressions=()):
        from tinytf.fast.cuda.kernels import host
        host.build()
        self._execute = host._execute

    def get_function(self, name):
        def launch(grid, block, args):
            self._execute(name, grid, block, args)
        return launch
