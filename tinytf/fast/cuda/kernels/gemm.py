"""Matrix products through cuBLAS with an explicit compute type (tensor cores on request).

Why not ``cupy.matmul``: for arrays of more than two dimensions it computes in plain
float32 and ignores ``CUPY_TF32`` (see shared/NOTES.md), and whether it takes bfloat16
depends on the CuPy version. Attention's (B, h, T, T) products are exactly such batched
products. Here every product, 2-D or batched, is one ``cublasGemmEx`` or
``cublasGemmStridedBatchedEx`` call with compute type float32, float32-via-TF32
(:func:`set_tf32`) or float32 accumulation of float16/bfloat16 inputs.

cuBLAS is column-major and tinytf's arrays are row-major. A row-major (r, c) matrix is,
read column-major, its (c, r) transpose, so C = A B is computed as C^T = B^T A^T: cuBLAS's
first operand is ``b`` and its second is ``a``. A transposed view (``w.T``,
``k.swapaxes(-1, -2)``) is read in place with the transpose flag; only layouts that no
leading dimension describes (a slice of heads, say) are copied first.

:func:`plan` does all of that on shapes and strides alone, so tests check it on the CPU
against NumPy (tests/fast/test_kernels.py) without a GPU.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import math
import os
from dataclasses import dataclass

import numpy as np

from tinytf.engine import backend
from tinytf.fast.cuda.kernels import _runtime
from tinytf.nn import amp

OP_N, OP_T = 0, 1
_tf32 = os.environ.get("TINYTF_TF32", "0") == "1"


def set_tf32(flag: bool) -> None:
    """Let float32 products use TF32 tensor cores (10-bit mantissa inputs, float32 sums)
    outside :func:`tinytf.nn.amp.autocast` blocks (a block's precision decides inside)."""
    global _tf32
    _tf32 = bool(flag)


def tf32_enabled() -> bool:
    """Whether float32 products run on TF32 tensor cores here: the innermost autocast
    block's choice ("tf32" or not), else :func:`set_tf32`'s (``TINYTF_TF32=1``)."""
    override = amp.tf32_override()
    return _tf32 if override is None else override


@dataclass(frozen=True)
class Operand:
    """How cuBLAS reads one row-major operand: transpose flag, leading dim, batch stride.

    All in elements; ``batch_stride`` 0 means one matrix shared by the whole batch.
    """

    op: int
    ld: int
    batch_stride: int


@dataclass(frozen=True)
class Plan:
    """One cuBLAS call computing ``a @ b`` into a C-contiguous (batch..., m, n) output.

    cuBLAS's A is ``b`` and its B is ``a`` (C^T = B^T A^T); ``m, n, k`` are cuBLAS's
    (rows of C^T = n of the row-major result, and so on).
    """

    first: Operand   # b, as cuBLAS's A
    second: Operand  # a, as cuBLAS's B
    m: int
    n: int
    k: int
    batch: int
    out_shape: tuple


def matrix_layout(rows: int, cols: int, s_row: int, s_col: int):
    """(op, ld) for reading a row-major (rows, cols) matrix with element strides
    (s_row, s_col) as cuBLAS's transposed operand; None if no leading dimension fits.

    Row-major storage (s_col == 1) read column-major is the transpose: op N, ld = s_row.
    Column-major storage (s_row == 1, a transposed view) is the matrix itself: op T,
    ld = s_col. A dimension of size 1 has no meaningful stride and fits either way.
    """
    if s_row < 0 or s_col < 0:
        return None
    if cols == 1 or s_col == 1:
        ld = s_row if rows > 1 else cols
        if ld >= max(cols, 1):
            return OP_N, ld
    if rows == 1 or s_row == 1:
        ld = s_col if cols > 1 else rows
        if ld >= max(rows, 1):
            return OP_T, ld
    return None


def batch_stride(shape, strides):
    """One stride s such that batch element i (row-major over ``shape``) starts at i * s.

    0 when every non-trivial axis is broadcast (stride 0); None when the batch axes are
    not evenly spaced (then the operand must be copied).
    """
    dims = [(n, s) for n, s in zip(shape, strides) if n != 1]
    if not dims or all(s == 0 for _, s in dims):
        return 0
    expected = dims[-1][1]
    for n, s in reversed(dims):
        if s != expected:
            return None
        expected = s * n
    return dims[-1][1]


def operand(shape, strides, itemsize: int, batch_shape) -> Operand | None:
    """The :class:`Operand` for an array of ``shape``/byte ``strides`` broadcast to
    ``batch_shape`` in front of its last two axes, or None if it must be copied."""
    if any(s % itemsize for s in strides):
        return None
    el = [s // itemsize for s in strides]
    rows, cols = shape[-2], shape[-1]
    layout = matrix_layout(rows, cols, el[-2], el[-1])
    if layout is None:
        return None
    lead = len(batch_shape) - (len(shape) - 2)
    bstrides = [0] * lead + [s if n != 1 else 0 for n, s in zip(shape[:-2], el[:-2])]
    bstride = batch_stride(batch_shape, bstrides)
    if bstride is None:
        return None
    return Operand(layout[0], layout[1], bstride)


def _contiguous_strides(shape, itemsize: int) -> tuple:
    """Byte strides of a C-contiguous array of ``shape``."""
    strides, step = [], itemsize
    for n in reversed(shape):
        strides.append(step)
        step *= max(n, 1)
    return tuple(reversed(strides))


@functools.lru_cache(maxsize=4096)
def plan(a_shape, a_strides, b_shape, b_strides, itemsize: int):
    """The :class:`Plan` for a @ b (both at least 2-D, broadcast batch axes), or
    ("copy", which) naming the operand ("a" or "b") to make C-contiguous first, or None
    when one cuBLAS call cannot do it (1-D or empty operands, huge sizes, a batch
    broadcast that no single stride describes): then ``cupy.matmul`` does.

    Cached: a training step asks for the same few dozen layouts every time, and working
    one out costs more CPU time than launching the product."""
    if len(a_shape) < 2 or len(b_shape) < 2 or a_shape[-1] != b_shape[-2]:
        return None
    m, k, n = a_shape[-2], a_shape[-1], b_shape[-1]
    if 0 in (m, n, k) or max(m, n, k) >= 2 ** 31:
        return None
    batch_shape = tuple(np.broadcast_shapes(tuple(a_shape[:-2]), tuple(b_shape[:-2])))
    ops = []
    for name, shape, strides in (("a", a_shape, a_strides), ("b", b_shape, b_strides)):
        op = operand(shape, strides, itemsize, batch_shape)
        if op is None:
            # Copying helps unless the batch broadcast itself has no single stride.
            dense = operand(shape, _contiguous_strides(shape, itemsize), itemsize, batch_shape)
            return ("copy", name) if dense is not None else None
        ops.append(op)
    op_a, op_b = ops
    return Plan(first=op_b, second=op_a, m=n, n=m, k=k, batch=math.prod(batch_shape),
                out_shape=batch_shape + (m, n))


# ----- the GPU call ----------------------------------------------------------------------

@functools.lru_cache(maxsize=None)
def _cuda_type(dtype):
    """cuBLAS's data type constant for ``dtype`` (None if cuBLAS has none)."""
    runtime = _cuda_runtime()
    name = np.dtype(dtype).name
    return {"float32": getattr(runtime, "CUDA_R_32F", 0),
            "float16": getattr(runtime, "CUDA_R_16F", 2),
            "bfloat16": getattr(runtime, "CUDA_R_16BF", 14)}.get(name)


_ALPHA = np.ones(1, dtype=np.float32)   # host scalars for cuBLAS (pointer mode host)
_BETA = np.zeros(1, dtype=np.float32)


def matmul(a, b, out_dtype=None, alpha: float = 1.0):
    """a @ b (NumPy semantics for arrays of two or more dimensions).

    NumPy arrays: exactly ``a @ b``. CuPy float32/float16/bfloat16 arrays of one dtype:
    one cuBLAS call (tensor cores for 16-bit inputs, and for float32 when
    :func:`set_tf32` is on), with float32 accumulation; anything else: ``cupy.matmul``.

    ``out_dtype=numpy.float32`` with 16-bit inputs writes the float32 accumulators
    themselves (cuBLAS's C type float32), not their 16-bit rounding: how a float32
    weight's gradient is formed from bf16 activations without a cast afterwards. On
    NumPy the product is then taken in float32.

    ``alpha`` scales the product: on the GPU inside the same cuBLAS call (its alpha), so
    attention's 1/sqrt(d_k) costs no pass of its own; on NumPy, in place afterwards.
    """
    xp = backend.get_array_module(a, b)
    if out_dtype is not None:
        out_dtype = np.dtype(out_dtype)
    if xp is np:
        if out_dtype is None or out_dtype == np.result_type(a.dtype, b.dtype):
            return _scaled(a @ b, alpha)
        return _scaled(a.astype(out_dtype, copy=False) @ b.astype(out_dtype, copy=False), alpha)
    if a.dtype != b.dtype:
        # NumPy's promotion (bfloat16 with float32 gives float32), then one cuBLAS call:
        # cupy.matmul itself takes no bfloat16.
        common = np.result_type(a.dtype, b.dtype)
        a, b = a.astype(common, copy=False), b.astype(common, copy=False)
    ctype = _cuda_type(a.dtype)
    out_ctype = ctype
    if out_dtype is not None and out_dtype != a.dtype:
        # Only a float32 result of float16/bfloat16 inputs is one cuBLAS call; any other
        # request is the product in a's dtype, cast.
        if out_dtype != np.float32 or ctype is None or a.dtype == np.float32:
            return matmul(a, b, alpha=alpha).astype(out_dtype)
        out_ctype = _cuda_type(out_dtype)
    if ctype is None:   # float64 (gradient checks on the GPU): CuPy's own product
        return _scaled(a @ b, alpha)
    p = plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
    for _ in range(2):  # an operand laid out in no way cuBLAS reads is copied, at most both
        if not isinstance(p, tuple):
            break
        if p[1] == "a":
            a = xp.ascontiguousarray(a)
        else:
            b = xp.ascontiguousarray(b)
        p = plan(a.shape, a.strides, b.shape, b.strides, a.itemsize)
    result_dtype = a.dtype if out_dtype is None else out_dtype
    if not isinstance(p, Plan):
        if a.dtype.name == "bfloat16":  # cupy.matmul takes no bfloat16: float32, rounded back
            out = _scaled(xp.matmul(a.astype(np.float32), b.astype(np.float32)), alpha)
            return out.astype(result_dtype)
        return _scaled(xp.matmul(a, b).astype(result_dtype, copy=False), alpha)
    _runtime.count("matmul")
    out = xp.empty(p.out_shape, dtype=result_dtype)
    _gemm(p, b, a, out, ctype, out_ctype, alpha)
    return out


def _scaled(out, alpha: float):
    """``out`` times ``alpha``, in place (the products cuBLAS does not scale itself)."""
    if alpha != 1.0:
        out *= alpha
    return out


def _cuda_runtime():
    return backend.array_module("gpu").cuda.runtime


# ----- cuBLAS's C API, for CUDA-graph capture --------------------------------------------

_CUBLAS_COMPUTE_32F, _CUBLAS_COMPUTE_32F_FAST_TF32, _CUBLAS_GEMM_DEFAULT = 68, 77, -1
_capture = None   # (_CublasC, handle) while a CUDA graph is captured (see :func:`capturing`)


def loaded_library_path(stem: str) -> str | None:
    """The path of the shared library ``stem`` (e.g. "libcublas.so") this process has loaded,
    read from /proc/self/maps (Linux); None if it is not loaded."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith(stem + ".") or path.endswith("/" + stem):
                    return path
    except OSError:
        return None
    return None


class _CublasC:  # pragma: no cover - GPU only
    """cuBLAS's C functions called through ctypes, on the library CuPy loaded.

    CuPy's own cuBLAS wrappers refuse every call while a stream captures
    (``cupy_backends.cuda.libs.cublas.setStream`` raises NotImplementedError), although
    cuBLAS itself supports capture when it has a workspace of its own. These are the four
    calls a captured step needs.
    """

    def __init__(self):
        path = loaded_library_path("libcublas.so")
        if path is None:
            raise RuntimeError("kernels/gemm.py: libcublas is not loaded in this process")
        lib = ctypes.CDLL(path)
        vp, i, ll = ctypes.c_void_p, ctypes.c_int, ctypes.c_longlong
        self.gemm = lib.cublasGemmEx
        self.gemm.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, vp, i, i, vp, vp, i, i, i, i]
        self.gemm_batched = lib.cublasGemmStridedBatchedEx
        self.gemm_batched.argtypes = [vp, i, i, i, i, i, vp, vp, i, i, ll, vp, i, i, ll, vp, vp,
                                      i, i, ll, i, i, i]
        self.set_stream = lib.cublasSetStream_v2
        self.set_stream.argtypes = [vp, vp]
        self.set_workspace = lib.cublasSetWorkspace_v2
        self.set_workspace.argtypes = [vp, vp, ctypes.c_size_t]
        for fn in (self.gemm, self.gemm_batched, self.set_stream, self.set_workspace):
            fn.restype = ctypes.c_int

    @staticmethod
    def check(status: int, what: str) -> None:
        if status != 0:
            raise RuntimeError(f"kernels/gemm.py: {what} failed during graph capture "
                               f"(cublasStatus {status})")


@functools.cache
def _cublas_c() -> _CublasC:  # pragma: no cover - GPU only
    return _CublasC()


@contextlib.contextmanager
def capturing(stream, workspace_bytes: int = 32 << 20,
              workspace=None):  # pragma: no cover - GPU only
    """Inside the block, products go through cuBLAS's C API on ``stream`` (to be captured).

    Sets the handle's stream and a workspace of its own (cuBLAS must not allocate while
    a graph is captured); yields the workspace, which must live as long as the graph.
    ``workspace``: a uint8 device array to use instead of a new one (graphs that are never
    replayed at the same time can share one). On exit the handle is back on cuBLAS's
    default workspace.
    """
    global _capture
    cupy = backend.array_module("gpu")
    from cupy_backends.cuda.libs import cublas  # noqa: PLC0415 (optional dependency)
    handle = cupy.cuda.device.get_cublas_handle()   # (loads libcublas if nothing has yet)
    c = _cublas_c()
    cublas.setPointerMode(handle, getattr(cublas, "CUBLAS_POINTER_MODE_HOST", 0))
    if workspace is None:
        workspace = cupy.empty(workspace_bytes, dtype=np.uint8)
    c.check(c.set_stream(handle, stream.ptr), "cublasSetStream")
    c.check(c.set_workspace(handle, workspace.data.ptr, workspace.nbytes), "cublasSetWorkspace")
    _capture = (c, handle)
    try:
        yield workspace
    finally:
        _capture = None
        # cublasSetStream also puts the handle back on cuBLAS's own workspace: later calls
        # must not use this one, which is freed with the graph (CuPy sets the stream
        # before each of its calls as well).
        c.check(c.set_stream(handle, cupy.cuda.get_current_stream().ptr), "cublasSetStream")


def _gemm(p: Plan, first, second, out, ctype, out_ctype=None,
          alpha: float = 1.0) -> None:  # pragma: no cover - GPU only
    """One cuBLAS call: ``out`` (C type ``out_ctype``, default ``ctype``) = alpha * the
    product of ``second`` and ``first`` as :class:`Plan` ``p`` reads them."""
    out_ctype = ctype if out_ctype is None else out_ctype
    # Host pointer mode: cuBLAS reads alpha during the call, so a local array will do.
    alpha_host = _ALPHA if alpha == 1.0 else np.array([alpha], dtype=np.float32)
    f, s = p.first, p.second
    if _capture is not None:
        c, handle = _capture
        compute = _CUBLAS_COMPUTE_32F_FAST_TF32 if (
            ctype == _cuda_type(np.dtype(np.float32)) and tf32_enabled()) else _CUBLAS_COMPUTE_32F
        if p.batch == 1:
            status = c.gemm(handle, f.op, s.op, p.m, p.n, p.k, alpha_host.ctypes.data,
                            first.data.ptr, ctype, f.ld, second.data.ptr, ctype, s.ld,
                            _BETA.ctypes.data, out.data.ptr, out_ctype, p.m, compute,
                            _CUBLAS_GEMM_DEFAULT)
        else:
            status = c.gemm_batched(
                handle, f.op, s.op, p.m, p.n, p.k, alpha_host.ctypes.data,
                first.data.ptr, ctype, f.ld, f.batch_stride,
                second.data.ptr, ctype, s.ld, s.batch_stride,
                _BETA.ctypes.data, out.data.ptr, out_ctype, p.m, p.m * p.n, p.batch, compute,
                _CUBLAS_GEMM_DEFAULT)
        c.check(status, "cublasGemmEx")
        return
    cupy = backend.array_module("gpu")
    from cupy_backends.cuda.libs import cublas  # noqa: PLC0415 (optional dependency)
    handle = cupy.cuda.device.get_cublas_handle()
    cublas.setStream(handle, cupy.cuda.get_current_stream().ptr)
    cublas.setPointerMode(handle, getattr(cublas, "CUBLAS_POINTER_MODE_HOST", 0))
    compute = getattr(cublas, "CUBLAS_COMPUTE_32F", 68)
    if ctype == _cuda_type(np.dtype(np.float32)) and tf32_enabled():
        compute = getattr(cublas, "CUBLAS_COMPUTE_32F_FAST_TF32", 77)
    algo = getattr(cublas, "CUBLAS_GEMM_DEFAULT", -1)
    if p.batch == 1:
        cublas.gemmEx(handle, f.op, s.op, p.m, p.n, p.k, alpha_host.ctypes.data,
                      first.data.ptr, ctype, f.ld, second.data.ptr, ctype, s.ld,
                      _BETA.ctypes.data, out.data.ptr, out_ctype, p.m, compute, algo)
    else:
        cublas.gemmStridedBatchedEx(
            handle, f.op, s.op, p.m, p.n, p.k, alpha_host.ctypes.data,
            first.data.ptr, ctype, f.ld, f.batch_stride,
            second.data.ptr, ctype, s.ld, s.batch_stride,
            _BETA.ctypes.data, out.data.ptr, out_ctype, p.m, p.m * p.n, p.batch, compute, algo)
