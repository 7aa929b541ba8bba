"""Compiling and launching the kernels of :mod:`.sources`.

Two executors run the same launch: CuPy (``cupy.RawModule``, compiled by NVRTC the first
time a kernel is needed and cached on disk by CuPy) for CuPy arrays, and, in tests only,
a g++ build of the same source on NumPy arrays (:mod:`.host`). The wrappers in
``tinytf/fast/cuda/kernels/__init__.py`` do not know which one runs.

Scalar arguments are converted from the kernel's own C signature, read from the source:
passing a Python float where the kernel expects ``long long`` would silently hand the GPU
the wrong bytes, so no wrapper converts by hand.
"""
from __future__ import annotations

import functools
import re

import numpy as np

from tinytf.engine import backend
from tinytf.fast.cuda.kernels.sources import INSTANTIATIONS, NVRTC_OPTIONS, SOURCE

# dtype name -> C++ storage type in the source. ml_dtypes' bfloat16 is named "bfloat16".
STORAGE = {"float32": "float", "float16": "f16_t", "bfloat16": "bf16_t"}
_extra_storage: dict = {}   # dtype -> C++ name, for the host tests (uint16 bits as bf16)

_SCALARS = {"long long": np.int64, "int": np.int32, "float": np.float32,
            "unsigned long long": np.uint64}

_host_executor = None        # set by tinytf.fast.cuda.kernels.host.install() in tests

calls: dict = {}
"""How many times each fused function ran (benchmarks print it to show the hooks are wired)."""


def count(name: str) -> None:
    """Count one call of the fused function ``name``."""
    calls[name] = calls.get(name, 0) + 1


def storage(dtype) -> str | None:
    """The kernel storage type ("float", "bf16_t", "f16_t") of ``dtype``, or None."""
    if _extra_storage:
        found = _extra_storage.get(np.dtype(dtype))
        if found:
            return found
    return _storage(dtype)


@functools.lru_cache(maxsize=None)
def _storage(dtype) -> str | None:
    # Cached: numpy's dtype.name is computed in Python, and every launch asks.
    return STORAGE.get(np.dtype(dtype).name)


@functools.cache
def signatures() -> dict:
    """{kernel name: (template parameter names, [(C type, parameter name), ...])}."""
    found = {}
    pattern = re.compile(r"template\s*<([^>]*)>\s*__global__\s+void\s+(\w+)\s*\(([^)]*)\)")
    for tparams, name, params in pattern.findall(SOURCE):
        tnames = [t.split()[-1] for t in tparams.split(",")]
        plist = []
        for p in params.split(","):
            p = " ".join(p.replace("__restrict__", "").split())
            ctype, pname = p.rsplit(" ", 1)
            if pname.startswith("*"):
                ctype, pname = ctype + "*", pname.lstrip("*")
            plist.append((ctype, pname))
        found[name] = (tnames, plist)
    return found


_C_OF_DTYPE = {"int64": "long long", "int32": "int", "uint8": "unsigned char",
               "bool": "unsigned char", "uint64": "unsigned long long"}


def _c_name(dtype) -> str | None:
    """The C type an array of ``dtype`` holds (storage types for the floats)."""
    return storage(dtype) or _integer_c_name(dtype)


@functools.lru_cache(maxsize=None)
def _integer_c_name(dtype) -> str | None:
    return _C_OF_DTYPE.get(np.dtype(dtype).name)


@functools.lru_cache(maxsize=None)
def _parameters(name: str, types: tuple) -> tuple:
    """((pointer?, C type wanted or scalar converter, parameter name), ...) of name<types>."""
    tnames, params = signatures()[name]
    bound = dict(zip(tnames, types))
    spec = []
    for ctype, pname in params:
        base = ctype.replace("const ", "").rstrip("*").strip()
        if ctype.endswith("*"):
            spec.append((True, bound.get(base, base), pname))
        else:
            spec.append((False, _SCALARS[base], pname))
    return tuple(spec)


def convert_args(name: str, types, args) -> tuple:
    """Check ``args`` against kernel ``name<types>``'s C signature; cast the scalars.

    Every array must be C-contiguous and hold the parameter's C type: a wrong dtype or a
    strided view would be read as garbage by the GPU, without an error.
    """
    params = _parameters(name, tuple(types))
    if len(args) != len(params):
        raise TypeError(f"kernels/_runtime.py: {name} takes {len(params)} arguments, "
                        f"got {len(args)}")
    out = []
    for (pointer, want, pname), a in zip(params, args):
        if pointer:
            if not hasattr(a, "shape"):
                raise TypeError(f"kernels/_runtime.py: {name}({pname}) needs an array")
            if _c_name(a.dtype) != want:
                raise TypeError(f"kernels/_runtime.py: {name}({pname}) needs {want}, "
                                f"got an array of {a.dtype}")
            if not a.flags.c_contiguous:
                raise ValueError(f"kernels/_runtime.py: {name}({pname}) needs a "
                                 f"C-contiguous array")
            out.append(a)
        else:
            out.append(want(a))
    return tuple(out)


def address(array) -> int:
    """The device (or host) address of ``array``'s first element; 0 for None."""
    if array is None:
        return 0
    if backend.get_array_module(array) is np:
        return array.ctypes.data
    return array.data.ptr


@functools.cache
def _cupy_module():
    cupy = backend.array_module("gpu")
    return cupy.RawModule(code=SOURCE, options=NVRTC_OPTIONS, name_expressions=INSTANTIATIONS)


def launch(name: str, types, grid, block, args) -> None:
    """Run kernel ``name<types>`` on a grid of ``grid`` blocks of ``block`` threads."""
    full = f"{name}<{', '.join(types)}>"
    if full not in INSTANTIATIONS:
        raise ValueError(f"kernels/_runtime.py: {full} is not instantiated in sources.py")
    args = convert_args(name, types, args)
    # The first array argument says where the kernel runs. Not the first argument with
    # a shape: the scalars are NumPy scalars (shape ()), an address among them.
    first = next(a for (pointer, _, _), a in zip(_parameters(name, tuple(types)), args)
                 if pointer)
    if backend.get_array_module(first) is np:
        if _host_executor is None:
            raise RuntimeError("kernels/_runtime.py: fused kernels need CuPy arrays "
                               "(or tinytf.fast.cuda.kernels.host.install() in tests)")
        _host_executor(full, tuple(grid), tuple(block), args)
    else:
        _cupy_module().get_function(full)(tuple(grid), tuple(block), args)
