"""Decoding length-sorted batches in worker processes: N single-threaded decoders on N cores.

A search step of a small model is a few hundred products of a few hundred rows each, too
small for a BLAS to spread over cores: two BLAS threads decode about as fast as one
(docs/decoding.md, "Cores"). Batches are independent, and a sentence's translation does not
depend on which sentences share its batch, so :func:`translate_batches` forks ``workers``
processes of the loaded model (they share its weights copy-on-write), each with
``thread_budget() // workers`` BLAS and row threads (:func:`tinytf.utils.workers.thread_budget`:
``OMP_NUM_THREADS=1`` keeps it to one core), hands them the batches in order, at most two
per worker in flight (:func:`tinytf.utils.workers.ordered_map`), and yields the n-best lists in
batch order: the output of one process with a worker's thread count (a BLAS may sum in
another order with more threads: docs/decoding.md, "Cores"), on every core it may use. The
workers live for one call (``translate.py``: one input block of ``--buffer-size`` lines); a
fork costs tens of milliseconds against the seconds a block of 1,000 lines takes.
"""
from __future__ import annotations

from tinytf.fast.cpu import threads as row_threads
from tinytf.utils.workers import can_fork, ordered_map, set_blas_threads, thread_budget

_translator = None   # the parent's Translator, which forked workers inherit


def _init_worker(threads: int) -> None:
    set_blas_threads(threads)
    row_threads.set_threads(threads)


def _translate_job(job):
    sources, options = job
    return _translator.translate_batch(sources, options)


def translate_batches(translator, batches, options, workers: int = 1):
    """Yield ``translator.translate_batch(batch, options)`` for each batch (lists of token-id
    lists), in order: in this process for one worker, one batch, a GPU or a platform that
    cannot fork (the workers must inherit the model), else in ``min(workers, len(batches))``
    forked processes."""
    global _translator
    batches = list(batches)
    workers = min(workers, len(batches))
    if workers <= 1 or translator.device != "cpu" or not can_fork():
        for batch in batches:
            yield translator.translate_batch(batch, options)
        return
    previous, _translator = _translator, translator
    try:
        yield from ordered_map(_translate_job, [(b, options) for b in batches], workers,
                               _init_worker, (max(1, thread_budget() // workers),))
    finally:
        _translator = previous
