"""Run the CUDA source of :mod:`.sources` on the CPU, for tests on machines without a GPU.

The very same source is built with g++ under a small shim that provides what CUDA gives a
kernel: ``blockIdx``/``threadIdx``, warp shuffles and ``__syncthreads``. Each thread of a
block is a fiber (``ucontext``) on the calling thread, resumed in turn by a scheduler; a
shuffle is a write to a per-warp slot, a barrier, a read of the partner's slot and a
second barrier, which is what the hardware's lock-step warp guarantees, and a barrier
yields until its last thread arrives (threads that wait at different barriers abort with a
message, where a GPU would hang). Blocks run one after another, so ``__shared__`` arrays
can be plain statics.

This checks the kernels' logic (indexing, reductions, rounding to bf16/fp16, masks,
the Python wrappers' launch arguments) against the NumPy ops; it says nothing about
speed, memory coalescing or races between blocks, which only a GPU run shows.

Use::

    with host.install():            # fused kernels now accept NumPy arrays
        y = kernels.softmax_forward(x)

``install`` needs ``g++`` and ``ucontext.h`` (glibc); the build is cached in the
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

from tinytf.engine.dispatch import impl
from tinytf.fast.cuda.kernels import _runtime
from tinytf.fast.cuda.kernels.sources import INSTANTIATIONS, SOURCE

SHIM = r"""
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>
#include <ucontext.h>
#define TINYTF_HOST_EMULATION 1
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static   /* blocks run one at a time */
struct dim3_t { unsigned x, y, z; };
static dim3_t blockIdx, blockDim, gridDim;
// A barrier among fibers: the last to arrive opens it, the others yield until it opens.
struct Barrier { unsigned expected = 0, arrived = 0; unsigned long generation = 0; };
struct Warp { float slot[32]; Barrier bar; };
struct Fiber { ucontext_t ctx; dim3_t tid; Warp* warp; bool done; };
static Fiber* current_fiber;
static ucontext_t scheduler;
static Barrier* this_block;
static unsigned long progress;       // arrivals and finished threads: no change = deadlock
#define threadIdx (current_fiber->tid)
inline void fiber_yield() { swapcontext(&current_fiber->ctx, &scheduler); }
inline void barrier_wait(Barrier& b) {
    unsigned long generation = b.generation;
    ++progress;
    if (++b.arrived == b.expected) { b.arrived = 0; ++b.generation; return; }
    while (b.generation == generation) fiber_yield();
}
inline float __uint_as_float(unsigned int u) { float f; memcpy(&f, &u, 4); return f; }
inline float __int_as_float(int u) { float f; memcpy(&f, &u, 4); return f; }
inline unsigned int __float_as_uint(float f) { unsigned int u; memcpy(&u, &f, 4); return u; }
inline float __shfl_xor_sync(unsigned, float v, int offset) {
    int lane = (threadIdx.y * blockDim.x + threadIdx.x) & 31;
    Warp* w = current_fiber->warp;
    w->slot[lane] = v;
    barrier_wait(w->bar);
    float r = w->slot[lane ^ offset];
    barrier_wait(w->bar);
    return r;
}
inline void __syncthreads() { barrier_wait(*this_block); }
#include <math.h>  /* expf, logf, sqrtf, fmaxf as in CUDA */
"""

LAUNCHER = r"""
// Every thread of a block is a fiber (ucontext) on the calling OS thread; a scheduler
// resumes them in turn until all have returned. A barrier yields until its last thread
// arrives, so __syncthreads and the warp shuffles behave as on the GPU, at the cost of a
// context switch instead of an OS thread's wake-up (blocks of 256 threads on 2 cores
// made that the whole run time). Blocks run one after another.
static const size_t STACK_BYTES = 256 * 1024;
static std::vector<std::unique_ptr<char[]>> stacks;
static std::function<void()>* current_job;

static void fiber_entry() {
    (*current_job)();
    ++progress;
    current_fiber->done = true;    // returning resumes the scheduler (uc_link)
}

static std::mutex launch_mutex;      // ctypes drops the GIL: one launch at a time

template <typename... P, typename... A>
static void launch(void (*kernel)(P...), unsigned gx, unsigned gy, unsigned bx, unsigned by,
                   A... args) {
    std::lock_guard<std::mutex> lock(launch_mutex);
    gridDim = {gx, gy, 1};
    blockDim = {bx, by, 1};
    const unsigned threads = bx * by;
    while (stacks.size() < threads) stacks.emplace_back(new char[STACK_BYTES]);
    std::vector<Fiber> fibers(threads);
    std::vector<Warp> warps((threads + 31) / 32);
    for (unsigned w = 0; w < warps.size(); ++w)
        warps[w].bar.expected = threads - 32 * w < 32 ? threads - 32 * w : 32;
    Barrier block;
    block.expected = threads;
    this_block = &block;
    std::function<void()> job = [&] { kernel(args...); };
    current_job = &job;
    for (unsigned y = 0; y < gy; ++y) {
        for (unsigned x = 0; x < gx; ++x) {
            blockIdx = {x, y, 0};
            for (unsigned t = 0; t < threads; ++t) {
                Fiber& f = fibers[t];
                f.tid = {t % bx, t / bx, 0};
                f.warp = &warps[t / 32];
                f.done = false;
                getcontext(&f.ctx);
                f.ctx.uc_stack.ss_sp = stacks[t].get();
                f.ctx.uc_stack.ss_size = STACK_BYTES;
                f.ctx.uc_link = &scheduler;
                makecontext(&f.ctx, fiber_entry, 0);
            }
            for (unsigned remaining = threads; remaining;) {
                unsigned long before = progress;
                for (Fiber& f : fibers) {
                    if (f.done) continue;
                    current_fiber = &f;
                    swapcontext(&scheduler, &f.ctx);
                    if (f.done) --remaining;
                }
                if (remaining && progress == before) {
                    fprintf(stderr, "kernels/host.py: deadlock, threads of a block wait at "
                                    "different barriers\n");
                    abort();
                }
            }
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
        result = subprocess.run([cxx, "-std=c++20", "-O0", "-shared", "-fPIC",
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
    """Within the block, fused kernels run on NumPy arrays through the CPU build, and the
    op table runs the GPU's classes on NumPy arrays (what the GPU would run).

    ``bf16_dtype``: the NumPy dtype that holds bfloat16 *bits* in tests (NumPy has no
    bfloat16; uint16 arrays of bits stand in for it).
    """
    build()
    prev_exec, prev_extra = _runtime._host_executor, dict(_runtime._extra_storage)
    _runtime._host_executor = _execute
    if bf16_dtype is not None:
        _runtime._extra_storage[np.dtype(bf16_dtype)] = "bf16_t"
    cpu_ops = impl.installed("cpu")
    impl.uninstall("cpu")
    impl.install("cpu", impl.installed("gpu"))
    try:
        yield
    finally:
        impl.uninstall("cpu")
        impl.install("cpu", cpu_ops)
        _runtime._host_executor = prev_exec
        _runtime._extra_storage.clear()
        _runtime._extra_storage.update(prev_extra)
