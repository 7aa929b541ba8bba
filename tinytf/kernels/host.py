"""Run the CUDA source of :mod:`.sources` on the CPU, for tests on machines without a GPU.

The very same source is built with g++ under a small shim that provides what CUDA gives a
kernel: ``blockIdx``/``threadIdx``, warp shuffles and ``__syncthreads``. Each block runs
its threads as real OS threads; a shuffle is a write to a per-warp slot, a barrier, a read
of the partner's slot and a second barrier, which is what the hardware's lock-step warp
guarantees. Blocks run one after another on a pool of worker threads, so ``__shared__``
arrays can be plain statics.

This checks the kernels' logic (indexing, reductions, rounding to bf16/fp16, masks,
the Python wrappers' launch arguments) against the NumPy ops; it says nothing about
speed, memory coalescing or races between blocks, which only a GPU run shows.

Use::

    with host.install():            # fused kernels now accept NumPy arrays
        y = kernels.softmax_forward(x)

``install`` needs ``g++`` (C++20, for ``std::barrier``); the build is cached in the
temporary directory under a hash of the source.
"""
from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

import numpy as np

from . import _runtime
from .sources import INSTANTIATIONS, SOURCE

SHIM = r"""
#include <barrier>
#include <cmath>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
#define TINYTF_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static   /* blocks run one at a time */
struct dim3_t { unsigned x, y, z; };
static thread_local dim3_t threadIdx, blockIdx;
static dim3_t blockDim, gridDim;
struct Warp { float slot[32]; std::barrier<> bar{32}; };
static thread_local Warp* this_warp;
static std::barrier<>* this_block;
inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
    int lane = (threadIdx.y * blockDim.x + threadIdx.x) & 31;
    this_warp->slot[lane] = v;
    this_warp->bar.arrive_and_wait();
    float r = this_warp->slot[lane ^ offset];
    this_warp->bar.arrive_and_wait();
    return r;
}
inline void __syncthreads() { this_block->arrive_and_wait(); }
#include <math.h>  /* expf, logf, sqrtf, fmaxf as in CUDA */
"""

LAUNCHER = r"""
#include <condition_variable>
#include <functional>
#include <mutex>
// A pool of worker threads, one per thread of the largest block so far: creating 256
// OS threads per block would dominate the run time. Never destroyed (no destructor runs
// at exit while workers wait).
struct Pool {
    std::mutex mu;
    std::condition_variable start, done;
    std::vector<std::thread> workers;
    std::function<void(unsigned)> job;
    unsigned long generation = 0;
    unsigned active = 0, remaining = 0;
};
static Pool* pool = new Pool;

static void worker(unsigned id) {
    unsigned long seen = 0;
    for (;;) {
        std::unique_lock<std::mutex> lock(pool->mu);
        pool->start.wait(lock, [&] { return pool->generation != seen; });
        seen = pool->generation;
        if (id >= pool->active) continue;
        auto job = pool->job;
        lock.unlock();
        job(id);
        lock.lock();
        if (--pool->remaining == 0) pool->done.notify_all();
    }
}

// Run job(t) for t in [0, threads) concurrently, and wait for all of them.
static void run_threads(unsigned threads, std::function<void(unsigned)> job) {
    std::unique_lock<std::mutex> lock(pool->mu);
    while (pool->workers.size() < threads) {
        pool->workers.emplace_back(worker, (unsigned)pool->workers.size());
        pool->workers.back().detach();
    }
    pool->job = std::move(job);
    pool->active = pool->remaining = threads;
    ++pool->generation;
    pool->start.notify_all();
    pool->done.wait(lock, [] { return pool->remaining == 0; });
}

template <typename... P, typename... A>
static void launch(void (*kernel)(P...), unsigned gx, unsigned gy, unsigned bx, unsigned by,
                   A... args) {
    gridDim = {gx, gy, 1};
    blockDim = {bx, by, 1};
    unsigned threads = bx * by;
    for (unsigned y = 0; y < gy; ++y) {
        for (unsigned x = 0; x < gx; ++x) {
            std::barrier<> block(threads);
            this_block = &block;
            std::unique_ptr<Warp[]> warps(new Warp[(threads + 31) / 32]);
            Warp* w = warps.get();
            run_threads(threads, [&, w, x, y](unsigned t) {
                threadIdx = {t % bx, t / bx, 0};
                blockIdx = {x, y, 0};
                this_warp = &w[t / 32];
                kernel(args...);
            });
        }
    }
}
"""

_CTYPES = {"long long": ctypes.c_longlong, "int": ctypes.c_int, "float": ctypes.c_float,
           "unsigned long long": ctypes.c_ulonglong}


def _symbol(instantiation: str) -> str:
    """C name of the exported launcher of "name<a, b>": run_name__a__b."""
    name, types = instantiation.rstrip(">").split("<")
    return "run_" + name + "".join("__" + t.strip() for t in types.split(","))


def _exports() -> str:
    """One ``extern "C"`` launcher per instantiation, generated from the signatures."""
    sigs = _runtime.signatures()
    out = []
    for inst in INSTANTIATIONS:
        name, types = inst.rstrip(">").split("<")
        tnames, params = sigs[name]
        bound = dict(zip(tnames, [t.strip() for t in types.split(",")]))
        decl = []
        for ctype, pname in params:
            ctype = re.sub(r"\b(" + "|".join(bound) + r")\b", lambda m: bound[m.group(1)], ctype)
            decl.append(f"{ctype} {pname}")
        names = ", ".join(p for _, p in params)
        out.append(f'extern "C" void {_symbol(inst)}(unsigned gx, unsigned gy, unsigned bx, '
                   f'unsigned by, {", ".join(decl)}) '
                   f'{{ launch({inst}, gx, gy, bx, by, {names}); }}')
    return "\n".join(out)


def compiler() -> str | None:
    """The C++ compiler used (``$CXX`` or g++), or None when there is none."""
    return shutil.which(os.environ.get("CXX", "g++"))


@functools.cache
def build() -> ctypes.CDLL:
    """Compile the kernels for the CPU (once per process); raises RuntimeError on failure."""
    cxx = compiler()
    if cxx is None:
        raise RuntimeError("kernels/host.py: no C++ compiler (g++) to build the kernels with")
    code = SHIM + SOURCE + LAUNCHER + _exports()
    # Cached by content in the temporary directory: rebuilding takes g++ tens of seconds.
    digest = hashlib.sha1((cxx + code).encode()).hexdigest()[:16]
    lib = os.path.join(tempfile.gettempdir(), f"tinytf_kernels_host_{digest}.so")
    if not os.path.exists(lib):
        folder = tempfile.mkdtemp(prefix="tinytf_kernels_")
        src, tmp_lib = os.path.join(folder, "kernels.cc"), os.path.join(folder, "kernels.so")
        with open(src, "w") as f:
            f.write(code)
        result = subprocess.run([cxx, "-std=c++20", "-O0", "-shared", "-fPIC", "-pthread",
                                 src, "-o", tmp_lib], capture_output=True, text=True)
        if result.returncode != 0:
            raise RuntimeError(f"kernels/host.py: {cxx} failed to build the kernels:\n"
                               f"{result.stderr[-4000:]}")
        os.replace(tmp_lib, lib)  # atomic: a concurrent test run sees all of it or none
        shutil.rmtree(folder, ignore_errors=True)
    return ctypes.CDLL(lib)


def _execute(inst: str, grid, block, args) -> None:
    lib = build()
    fn = getattr(lib, _symbol(inst))
    gx, gy = (tuple(grid) + (1,))[:2]
    bx, by = (tuple(block) + (1,))[:2]
    name = inst.split("<")[0]
    cargs = [ctypes.c_uint(gx), ctypes.c_uint(gy), ctypes.c_uint(bx), ctypes.c_uint(by)]
    for (ctype, _), a in zip(_runtime.signatures()[name][1], args):
        if ctype.endswith("*"):
            cargs.append(ctypes.c_void_p(a.ctypes.data))
        else:
            cargs.append(_CTYPES[ctype.replace("const ", "")](a.item()))
    fn(*cargs)


@contextlib.contextmanager
def install(bf16_dtype=np.uint16):
    """Within the block, fused kernels run on NumPy arrays through the CPU build.

    ``bf16_dtype``: the NumPy dtype that holds bfloat16 *bits* in tests (NumPy has no
    bfloat16; uint16 arrays of bits stand in for it).
    """
    build()
    prev_exec, prev_extra = _runtime._host_executor, dict(_runtime._extra_storage)
    _runtime._host_executor = _execute
    if bf16_dtype is not None:
        _runtime._extra_storage[np.dtype(bf16_dtype)] = "bf16_t"
    try:
        yield
    finally:
        _runtime._host_executor = prev_exec
        _runtime._extra_storage.clear()
        _runtime._extra_storage.update(prev_extra)
