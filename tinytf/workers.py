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
import multiprocessing
import os


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. under mpirun's binding)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def ordered_map(fn, items, workers: int, initializer=None, initargs=()):
    """Yield ``fn(item)`` for each item, in order: in this process for one worker (after
    ``initializer(*initargs)``), else in ``workers`` processes, each initialised once."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, items)
        return
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
    with concurrent.futures.ProcessPoolExecutor(workers, mp_context=context,
                                                initializer=initializer,
                                                initargs=initargs) as pool:
        pending = collections.deque()
        try:
            for item in items:
                pending.append(pool.submit(fn, item))
                if len(pending) >= 2 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()
