"""What incremental decoding keeps between steps, without copying it at every step.

The search (:mod:`tinytf.decoding.search`) holds N rows, the hypotheses, and after every step calls
``state = state.select(rows)`` to keep, repeat or reorder them. Two kinds of arrays follow:

* **Self-attention keys and values**, one pair per decoder layer, of the positions decoded so
  far (:class:`SelfAttentionCache`). They live in buffers of shape (rows, h, capacity, d_k)
  that the step writes in place (the capacity doubles when it is reached: amortised O(1)
  per step, not a concatenation per step). ``select`` gathers only the rows whose content
  changes (row i takes row j != i), and nothing when the selection is the identity (greedy
  decoding while no sentence finishes).
* **Encoder-decoder keys and values**, one pair per layer, the same for every hypothesis of a
  sentence. They are kept once per *memory row* (a source sentence), with ``row_memory[i]``
  the memory row of hypothesis i. While each memory row's hypotheses are one consecutive run
  (a sentence's beam), the decoder attends a sentence's whole run to its keys as one block
  (:meth:`tinytf.models.transformer.MultiHeadAttention.forward`), and these arrays are gathered only
  when sentences leave the batch. Runs may differ in length (a beam whose hypotheses ended
  keeps only its live ones): the attention then lays them out in ``group`` places per memory
  row, the longest run, the empty places showing a copy of a row of the same sentence
  (``padding``). Any other selection (the search never makes one) falls back to one memory
  row per hypothesis.

The old state must not be used after ``select``: the buffers are shared and updated in place.
"""
from __future__ import annotations

import numpy as np

from tinytf.engine import backend


def _is_identity(rows, n: int) -> bool:
    return len(rows) == n and bool((rows == np.arange(n)).all())


class SelfAttentionCache:
    """One decoder layer's self-attention keys and values for ``rows`` hypotheses and
    ``length`` positions: ``k[:rows, :, :length]`` and ``v[:rows, :, :length]``."""

    def __init__(self):
        self.k = self.v = None
        self.rows = 0
        self.length = 0

    def append(self, k, v):
        """Write the keys and values (N, h, T, d_k) of the next T positions; return the
        keys and values of every position so far, views (N, h, length, d_k)."""
        n, _, t, _ = k.shape
        if self.k is None or n > self.k.shape[0] or self.length + t > self.k.shape[2]:
            self._grow(n, max(2 * self.length, self.length + t, 16), k)
        end = self.length + t
        self.k[:n, :, self.length:end] = k
        self.v[:n, :, self.length:end] = v
        self.rows, self.length = n, end
        return self.k[:n, :, :end], self.v[:n, :, :end]

    def _grow(self, rows, capacity, like):
        xp = backend.get_array_module(like)
        shape = (max(rows, self.rows), like.shape[1], capacity, like.shape[3])
        k, v = xp.empty(shape, like.dtype), xp.empty(shape, like.dtype)
        if self.k is not None:
            k[:self.rows, :, :self.length] = self.k[:self.rows, :, :self.length]
            v[:self.rows, :, :self.length] = self.v[:self.rows, :, :self.length]
        self.k, self.v = k, v

    def select(self, rows) -> None:
        """Keep hypotheses ``rows`` (NumPy ints, in that order; repeats allowed), in place."""
        n = len(rows)
        if self.k is None or self.length == 0:
            self.rows = n
            return
        if _is_identity(rows, self.rows):
            return
        t = self.length
        xp = backend.get_array_module(self.k)
        if n > self.k.shape[0]:    # more rows than the buffers hold (the first rows kept)
            self._grow(n, self.k.shape[2], self.k)
        moved = np.flatnonzero(rows != np.arange(n))  # rows whose content changes
        if len(moved):
            src, dst = xp.asarray(rows[moved]), xp.asarray(moved)
            k, v = self.k[src, :, :t], self.v[src, :, :t]   # copies, read before writing
            self.k[dst, :, :t], self.v[dst, :, :t] = k, v
        self.rows = n


class DecoderState:
    """Incremental decoding's state for N hypotheses (see the module docstring).

    ``src_mask`` (M, 1, 1, S) and ``cross_kv`` (per layer: keys and values, each
    (M, h, S, d_k)) hold one row per memory row; ``row_memory`` (N,) maps hypotheses to
    memory rows, in consecutive runs of at most ``group``; ``padding`` is None when every run
    has ``group`` hypotheses, else the pair ``(fill, slots)`` that lays the runs out in
    ``group`` places each: ``slots`` (N,) the place of every hypothesis, ``fill`` (M*group,)
    the hypothesis each place shows (an empty place: the first of its run). ``caches`` holds
    each layer's :class:`SelfAttentionCache`; ``length`` counts the positions decoded.
    """

    def __init__(self, src_mask, cross_kv: list, caches: list, length: int = 0):
        self.src_mask = src_mask
        self.cross_kv = cross_kv
        self.caches = caches
        self.length = length
        self.row_memory = np.arange(len(src_mask))
        self.group = 1
        self.padding = None

    def select(self, indices) -> "DecoderState":
        """Keep hypotheses ``indices`` (in that order; repeats allowed); returns this state,
        updated in place."""
        rows = np.asarray(backend.to_numpy(indices), dtype=np.int64).reshape(-1)
        for cache in self.caches:
            cache.select(rows)
        self._select_memory(self.row_memory[rows])
        return self

    def _select_memory(self, memory_of_row) -> None:
        """Memory rows for hypotheses with memory rows ``memory_of_row``: one per consecutive
        run when no memory row has two runs, else one per hypothesis."""
        n = len(memory_of_row)
        starts = np.flatnonzero(np.r_[True, memory_of_row[1:] != memory_of_row[:-1]])[:n]
        kept = memory_of_row[starts]
        if len(np.unique(kept)) != len(kept):   # not in runs: one memory row per hypothesis
            starts, kept = np.arange(n), memory_of_row
        runs = np.diff(np.r_[starts, n])
        if not _is_identity(kept, len(self.src_mask)):
            idx = backend.to_device(kept, backend.device_of(self.src_mask))
            self.src_mask = self.src_mask[idx]
            self.cross_kv = [(k[idx], v[idx]) for k, v in self.cross_kv]
        self.row_memory = np.repeat(np.arange(len(kept)), runs)
        self.group = int(runs.max(initial=1))
        self.padding = None
        if (runs != self.group).any():
            slots = self.row_memory * self.group + np.arange(n) - np.repeat(starts, runs)
            fill = np.repeat(starts, self.group)
            fill[slots] = np.arange(n)
            device = backend.device_of(self.src_mask)
            self.padding = (backend.to_device(fill, device), backend.to_device(slots, device))
