"""cuBLAS's GEMM entry points as the stand-in computes them: from raw pointers, column-major
leading dimensions and transpose flags, in float32 arithmetic (what tinytf asks cuBLAS for:
compute type 32F, storage float32, float16 or bfloat16)."""
import ctypes

import numpy as np

CUBLAS_OP_N, CUBLAS_OP_T = 0, 1
CUBLAS_POINTER_MODE_HOST = 0
CUBLAS_COMPUTE_32F, CUBLAS_COMPUTE_32F_FAST_TF32 = 68, 77
CUBLAS_GEMM_DEFAULT = -1


def _dtype(cuda_type):
    if cuda_type == 14:
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    return {0: np.dtype(np.float32), 2: np.dtype(np.float16)}[cuda_type]


def _matrix(ptr, dtype, rows, cols, ld, batch=1, stride=0):
    """The (batch, rows, cols) column-major matrices at ``ptr`` as a NumPy view."""
    if rows == 0 or cols == 0 or batch == 0:
        return np.zeros((batch, rows, cols), dtype)
    count = (batch - 1) * stride + (cols - 1) * ld + rows
    raw = (ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)
    flat = np.ctypeslib.as_array(raw).view(dtype)
    size = dtype.itemsize
    return np.lib.stride_tricks.as_strided(
        flat, shape=(batch, rows, cols), strides=(stride * size, size, ld * size))


def _operand(ptr, dtype, op, rows, cols, ld, batch=1, stride=0):
    """op(A) of shape (batch, rows, cols) in float32."""
    if op == CUBLAS_OP_N:
        a = _matrix(ptr, dtype, rows, cols, ld, batch, stride)
    else:
        a = _matrix(ptr, dtype, cols, rows, ld, batch, stride).transpose(0, 2, 1)
    return a.astype(np.float32)


def gemmStridedBatchedEx(handle, transa, transb, m, n, k,  # noqa: N802
                         alpha, A, atype, lda, stride_a,
                         B, btype, ldb, stride_b, beta, C, ctype, ldc, stride_c, batch,
                         compute_type, algo):
    """C[i] = alpha * op(A[i]) @ op(B[i]) (beta must be 0, as tinytf passes it)."""
    alpha_value = ctypes.c_float.from_address(alpha).value
    assert ctypes.c_float.from_address(beta).value == 0.0
    a = _operand(A, _dtype(atype), transa, m, k, lda, batch, stride_a)
    b = _operand(B, _dtype(btype), transb, k, n, ldb, batch, stride_b)
    out = _matrix(C, _dtype(ctype), m, n, ldc, batch, stride_c)
    out[...] = (np.float32(alpha_value) * np.matmul(a, b)).astype(out.dtype)


def gemmEx(handle, transa, transb, m, n, k, alpha, A, atype, lda, B, btype, ldb,  # noqa: N802
           beta, C, ctype, ldc, compute_type, algo):
    """C = alpha * op(A) @ op(B): one matrix of the batched form."""
    gemmStridedBatchedEx(handle, transa, transb, m, n, k, alpha, A, atype, lda, 0, B, btype,
                         ldb, 0, beta, C, ctype, ldc, 0, 1, compute_type, algo)


def setStream(handle, stream):  # noqa: N802
    pass


def setPointerMode(handle, mode):  # noqa: N802
    pass


def setMathMode(handle, mode):  # noqa: N802
    pass
