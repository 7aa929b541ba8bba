"""Worker processes for work in independent pieces: word counts, encoding a corpus.

:func:`ordered_map` is ``map(fn, items)`` over ``workers`` processes with the results in input
order and at most two pieces per worker in flight, so reading, computing and writing overlap
and memory stays bounded by the pieces, whatever the input's size. Workers are forked where the
platform can (as fairseq-preprocess's are): a spawned worker would import the user's main
script again. They must touch no MPI or GPU state.
"""
from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import ctypes
import multiprocessing
import os
import select
import signal
import threading
import time

# What OpenBLAS's thread-count setter is called in the builds that NumPy ships (scipy-openblas,
# 64-bit integers) and in a distribution's own library.
_OPENBLAS_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads", "openblas_set_num_threads")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. under mpirun's binding)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def thread_budget() -> int:
    """The cores this process is meant to use: ``TINYTF_THREADS``, else ``OMP_NUM_THREADS``,
    else ``OPENBLAS_NUM_THREADS`` (the knobs that already size the BLAS), else the CPUs it
    may run on. Row threads and decode workers share it."""
    for var in ("TINYTF_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return available_cpus()


def _openblas_functions(names):
    """The first of ``names`` found in each OpenBLAS library loaded in this process (Linux)."""
    try:
        with open("/proc/self/maps", encoding="utf-8") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        function = next((getattr(lib, n) for n in names if hasattr(lib, n)), None)
        if function is not None:
            found.append(function)
    return found


def set_blas_threads(n: int) -> bool:
    """Size the thread pool of every OpenBLAS library loaded in this process to ``n`` threads,
    at run time (``OPENBLAS_NUM_THREADS`` is read only when NumPy loads OpenBLAS; this is what
    threadpoolctl does). Returns False where it cannot (no OpenBLAS, not Linux)."""
    setters = _openblas_functions(_OPENBLAS_SETTERS)
    for setter in setters:
        setter(ctypes.c_int(int(n)))
    return bool(setters)


def blas_threads() -> int | None:
    """The thread count of the first OpenBLAS library loaded in this process (None: unknown)."""
    getters = _openblas_functions([n.replace("_set_", "_get_") for n in _OPENBLAS_SETTERS])
    if not getters:
        return None
    getters[0].restype = ctypes.c_int
    return int(getters[0]())


def can_fork() -> bool:
    """Whether this platform starts worker processes by forking (they inherit the parent's
    memory, such as a loaded model)."""
    return "fork" in multiprocessing.get_all_start_methods()


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1")
                     if hasattr(signal, name))
"""The signals that stop a command or a training run (the run's handling of them:
:mod:`tinytf.stop_signals`). SIGUSR1 is the one Open MPI's ``mpirun`` forwards to its ranks
(it handles SIGTERM itself)."""


@contextlib.contextmanager
def stop_signals_held():
    """The stop signals held back (pending, not lost) while the block runs, and delivered
    when it ends: work that a stop must not cut in two (a block of output written and
    counted). :func:`ordered_map` holds them while it forks workers: in the parent, a
    handler that ran inside fork's at-fork hooks would have its exception ignored, and a
    worker must not run the parent's handler before :func:`_start_worker` replaces it."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


PARENT_CHECK_SECONDS = 1.0


def _end_with(parent: int, stop_fd) -> None:
    """End this worker, by a thread that looks every :data:`PARENT_CHECK_SECONDS`, once
    process ``parent`` is gone (killed by a signal, SIGKILL included, or by the OOM killer)
    or once the pipe ``stop_fd`` (its read end; None: no such pipe) has a byte to read: the
    parent stopped early and drops the pieces in progress. Nothing is read, so every worker
    sees it; and nothing waits for the workers to answer (a multiprocessing Event's ``set``
    waits for every waiter, for ever for a worker that a signal killed). An orphaned worker
    would otherwise live on: blocked for ever writing its result into a pipe whose other end
    the other orphans hold, with its memory (hundreds of MB of word counts at WMT size) and
    the files it inherited (a run directory's lock)."""
    def watch():
        while os.getppid() == parent:
            if stop_fd is None:
                time.sleep(PARENT_CHECK_SECONDS)
            elif select.select([stop_fd], [], [], PARENT_CHECK_SECONDS)[0]:
                break
        os.kill(os.getpid(), signal.SIGKILL)        # no clean-up: the parent's state

    threading.Thread(target=watch, name="tinytf-parent-watch", daemon=True).start()


def _start_worker(initializer, initargs, parent: int, stop_fd) -> None:
    """A worker's first act: SIGINT ignored (a terminal's Ctrl-C reaches the whole process
    group; the parent stops and ends its workers), SIGTERM and SIGUSR1 back to their default
    actions (a fork inherits the parent's handlers, such as a training run's stop handler,
    which must not run in a worker), the signals held back by the fork let through, and
    an end with process ``parent`` or at its word on ``stop_fd`` (:func:`_end_with`); then
    ``initializer(*initargs)``."""
    _end_with(parent, stop_fd)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    for sig in STOP_SIGNALS:
        if sig != signal.SIGINT:
            signal.signal(sig, signal.SIG_DFL)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    if initializer is not None:
        initializer(*initargs)


def ordered_map(fn, items, workers: int, initializer=None, initargs=()):
    """Yield ``fn(item)`` for each item, in order: in this process for one worker (after
    ``initializer(*initargs)``), else in ``workers`` processes, each initialised once."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, items)
        return
    fork = can_fork()
    context = multiprocessing.get_context("fork" if fork else "spawn")
    stop_read, stop_write = os.pipe() if fork else (None, None)   # (forked workers inherit it)
    pool = concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=context, initializer=_start_worker,
        initargs=(initializer, initargs, os.getpid(), stop_read))
    pending = collections.deque()
    try:
        for item in items:
            with stop_signals_held():       # the first submit forks the workers
                pending.append(pool.submit(fn, item))
            if len(pending) >= 2 * workers:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    except BaseException:
        # Stopped early (an error, Ctrl-C, a consumer that stopped reading): the pieces not
        # started are dropped, and the workers end at once rather than after their pieces
        # in progress (seconds each at WMT size, which the interpreter's exit would wait for).
        if stop_write is not None:
            os.write(stop_write, b"x")      # (a byte that no one reads: every worker sees it)
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    else:
        pool.shutdown(wait=True)
    finally:
        for fd in (stop_read, stop_write):
            if fd is not None:
                os.close(fd)
