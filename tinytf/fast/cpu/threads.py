"""Row-parallel NumPy: an op's rows split over threads, since NumPy's loops use one core.

NumPy runs every ufunc and reduction on one core; only its BLAS products use the others. On
a 2-core machine that leaves one core idle for about 40 % of a training step (layer norm,
the loss's softmax, dropout masks, bias and ReLU passes, Adam). NumPy releases the GIL
inside those loops, so plain threads run them in parallel:

    parallel_rows(fn, n_rows, row_size)

calls ``fn(lo, hi)`` once for each of ``threads()`` contiguous ranges of rows that together
cover ``0 .. n_rows`` (the calling thread takes the last range) and returns when every call
has. ``fn`` writes its rows of preallocated outputs. Each row's arithmetic is the one NumPy
does for it in a single call over all rows, so the results are **bitwise identical for any
number of threads** (tests/fast/test_fast.py); sums *across* rows (bias and layer-norm parameter
gradients, gradient norms) stay in the caller, over all rows, as in the reference ops.

Work below ``MIN_ELEMENTS`` (rows x row_size) runs in the caller alone: handing a range to
another thread costs ~20-50 us. The thread count is the process's
:func:`tinytf.utils.workers.thread_budget` (``TINYTF_THREADS``, else ``OMP_NUM_THREADS``, else
``OPENBLAS_NUM_THREADS``, else the CPUs it may run on), at most ``MAX_THREADS``. A call made
from one of the pool's threads runs inline (no nesting), and a forked child starts with a
fresh pool.
"""
from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor

from tinytf.utils.workers import thread_budget

MIN_ELEMENTS = 1 << 18   # rows x row_size below which splitting does not pay
MAX_THREADS = 8          # row passes are memory-bound: more threads than this gain nothing


class RowThreads:
    """The threads that the row-parallel ops share: how many, and the pool, started at its
    first use (one per process: :data:`rows`)."""

    def __init__(self):
        self.count: int | None = None           # None: read the environment at first use
        self.pool: ThreadPoolExecutor | None = None
        self.pool_size = 0                      # the pool's threads
        self.local = threading.local()          # ``in_pool`` on the pool's own threads
        os.register_at_fork(after_in_child=self.forget_pool)

    def threads(self) -> int:
        """The number of threads that row-parallel ops use (see the module's docstring)."""
        if self.count is None:
            self.count = min(thread_budget(), MAX_THREADS)
        return self.count

    def set_threads(self, n: int | None) -> None:
        """Use ``n`` threads from now on (None: read the environment again)."""
        if n is not None and n < 1:
            raise ValueError(f"set_threads: need at least 1 thread, got {n}")
        self.count = None if n is None else min(int(n), MAX_THREADS)
        self.close()

    def close(self) -> None:
        """Stop the pool's threads (the next parallel call starts a pool again)."""
        if self.pool is not None:
            self.pool.shutdown(wait=True)
            self.pool = None

    def forget_pool(self) -> None:
        """In a forked child, which has none of the parent's threads: no pool yet."""
        self.pool = None

    def _pool_of(self, n: int) -> ThreadPoolExecutor:
        if self.pool is not None and self.pool_size != n:
            self.close()
        if self.pool is None:
            self.pool = ThreadPoolExecutor(n, thread_name_prefix="tinytf-rows",
                                           initializer=self._mark_pool_thread)
            self.pool_size = n
        return self.pool

    def _mark_pool_thread(self) -> None:
        self.local.in_pool = True

    def parallel_rows(self, fn, n_rows: int, row_size: int = 1) -> None:
        """Call ``fn(lo, hi)`` over contiguous ranges covering rows 0..n_rows, in
        parallel."""
        n = self.threads()
        if n == 1 or n_rows < 2 or n_rows * row_size < MIN_ELEMENTS or \
                getattr(self.local, "in_pool", False):
            fn(0, n_rows)
            return
        parts = min(n, n_rows)
        bounds = [n_rows * i // parts for i in range(parts + 1)]
        pool = self._pool_of(n - 1)   # one pool of the full size, however many parts
        futures = [pool.submit(fn, bounds[i], bounds[i + 1]) for i in range(parts - 1)]
        try:
            fn(bounds[-2], bounds[-1])
        finally:
            for future in futures:
                future.result()   # waits; re-raises the first error of another range


rows = RowThreads()
"""The process's row threads."""

threads = rows.threads
set_threads = rows.set_threads
parallel_rows = rows.parallel_rows
