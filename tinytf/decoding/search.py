"""Batched beam search over a pluggable next-token scorer.

The search knows nothing about Transformers. It drives a *step function*

    log_probs = step_fn(tokens, state)     # tokens (N,) int64 -> (N, V) float32

that scores the next token of N prefixes and advances ``state`` by one position, and a state with

    state = state.select(rows)             # keep / repeat / reorder the N prefixes

(``Transformer.decode_step`` and ``DecoderState.select`` are such a pair; so is the small Markov
scorer in ``tests/decoding/test_search.py``). Every sentence owns ``beam_size`` consecutive rows of the
state (one at step 0, the empty prefix); all sentences advance together, so one model call per
step serves the whole batch.

The beam (see docs/decoding.md):

* At step t every live hypothesis is extended by every token; the ``beam_size`` best extensions
  of the sentence, by summed log-probability (ties: lower candidate index first), form the next
  beam. Extensions that end in ``</s>`` leave the beam as *finished* hypotheses and the others
  stay *live*; a beam can therefore hold fewer than ``beam_size`` live hypotheses for one step,
  and only the live ones stay in the state (the next step computes no row for the others).
  With ``beam_size=1`` this is exactly greedy decoding.
* Finished hypotheses are ranked by ``log P(Y|X) / lp(Y)`` with the GNMT length penalty
  ``lp(Y) = ((5 + |Y|) / 6) ** alpha`` (Wu et al. 2016), where ``|Y|`` counts the generated
  tokens including ``</s>``.
* A sentence stops when no live hypothesis can still beat its ``nbest``-th best finished one.
  Log-probabilities are <= 0, so a live hypothesis with log-probability ``s`` can only lose
  probability, and its normalised score can be at most ``s / lp(L)`` for the most favourable
  final length ``L`` it can still reach (``max_len + 1`` for ``alpha > 0``): the bound that
  tensor2tensor's beam search (the paper's own code) uses. The bound is exact, so stopping never
  changes the result. The batch stops when every sentence has stopped; at ``max_len`` generated
  tokens ``</s>`` is the only allowed token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from tinytf.engine.backend import get_array_module, to_numpy

NEG_INF = -math.inf


def length_penalty(length, alpha: float):
    """GNMT length penalty ``lp(Y) = ((5 + |Y|) / 6) ** alpha``; ``length`` is a number or array."""
    return ((5.0 + length) / 6.0) ** alpha


@dataclass(frozen=True)
class Hypothesis:
    """A finished translation.

    ``tokens`` excludes ``<s>`` and ``</s>``; ``log_prob`` is ``log P(tokens </s> | source)`` and
    ``score = log_prob / length_penalty(len(tokens) + 1, alpha)`` is what the beam ranks by.
    """

    tokens: tuple[int, ...]
    score: float
    log_prob: float


def top_k(scores, k: int):
    """Indices and values of the ``k`` largest entries of every row of ``scores`` (n, m).

    Rows come back sorted by value, descending; equal values are ordered by index, ascending, and
    a tie at the k-th place is broken the same way, so the result depends on the row alone (not
    on ``argpartition``'s internals). Returns numpy arrays ``(indices (n, k), values (n, k))``.
    """
    xp = get_array_module(scores)
    # Index order first, so that the stable sort below breaks ties by index.
    part = xp.sort(xp.argpartition(scores, scores.shape[1] - k, axis=1)[:, -k:], axis=1)
    vals = xp.take_along_axis(scores, part, axis=1)
    order = xp.argsort(-vals, axis=1, kind="stable")
    idx = to_numpy(xp.take_along_axis(part, order, axis=1))
    vals = to_numpy(xp.take_along_axis(vals, order, axis=1))
    kth = vals[:, -1]
    # argpartition picks an arbitrary subset of the values tied at the k-th place; find the rows
    # where such a tie reaches outside the selection (rare with real models) and redo them.
    kth_dev = xp.asarray(kth)[:, None]
    n_at_least = to_numpy((scores >= kth_dev).sum(axis=1))
    for row in np.flatnonzero((n_at_least > k) & np.isfinite(kth)):
        host = to_numpy(scores[row])
        greater = np.flatnonzero(host > kth[row])
        equal = np.flatnonzero(host == kth[row])[: k - len(greater)]
        chosen = np.concatenate([greater, equal])
        chosen = chosen[np.argsort(-host[chosen], kind="stable")]
        idx[row], vals[row] = chosen, host[chosen]
    return idx, vals


def top_k_by_bound(scores, k: int, samples: int = 256):
    """`top_k` of NumPy ``scores`` (n, m), the same indices and values, ~5x faster on a beam
    step's (64, 16000) by looking at few entries closely.

    A lower bound of each row's k-th largest value is the k-th largest of ``samples`` of its
    entries (any subset's k-th largest is at most the whole row's): the maxima of its
    ``samples`` column classes ``j % samples``, one SIMD pass. Only the entries at or above
    the bound (usually a few per row) are sorted, by value descending, then index ascending,
    and the first k of each row taken (each row has k: its k largest maxima). Falls back to
    `top_k` on other arrays and where the scores hold a NaN (which `top_k` ranks first)."""
    n, m = scores.shape
    if get_array_module(scores) is not np or n == 0 or m < k:
        return top_k(scores, k)
    classes = min(m, max(k, samples))
    width = m // classes
    maxima = scores[:, :classes * width].reshape(n, width, classes).max(axis=1)
    if np.isnan(maxima).any() or np.isnan(scores[:, classes * width:]).any():
        return top_k(scores, k)
    bound = np.partition(maxima, classes - k, axis=1)[:, classes - k]
    at = np.flatnonzero(scores >= bound[:, None])  # faster than 2-d np.nonzero
    rows = at // m
    cols, vals = at - rows * m, scores.reshape(-1)[at]
    order = np.lexsort((cols, -vals, rows))        # row, then value descending, then index
    take = np.searchsorted(rows, np.arange(n))[:, None] + np.arange(k)
    return cols[order[take]], vals[order[take]]


class _NBest:
    """The best ``n`` finished hypotheses of one sentence, best first (earlier first on ties)."""

    def __init__(self, n: int):
        self.n = n
        self.items: list[Hypothesis] = []

    def add(self, hyp: Hypothesis) -> None:
        pos = len(self.items)
        while pos > 0 and self.items[pos - 1].score < hyp.score:
            pos -= 1
        if pos < self.n:
            self.items.insert(pos, hyp)
            del self.items[self.n:]

    def threshold(self) -> float:
        """Score a new hypothesis must beat to enter the list (-inf while it is not full)."""
        return self.items[-1].score if len(self.items) == self.n else NEG_INF


def _ban_and_force(cand, step: int, max_lens, eos_id: int, banned_ids) -> None:
    """In place: never emit ``banned_ids``; only ``</s>`` once a sentence has ``max_len`` tokens."""
    if len(banned_ids):
        cand[:, :, list(banned_ids)] = NEG_INF
    forced = np.flatnonzero(step >= max_lens)
    if len(forced):
        forced = get_array_module(cand).asarray(forced)
        eos_scores = cand[forced, :, eos_id].copy()
        cand[forced] = NEG_INF
        cand[forced, :, eos_id] = eos_scores


def _best_extensions(scores, log_probs, live, shape, step: int, max_lens, eos_id: int,
                     banned_ids, k: int):
    """The ``k`` best extensions of each sentence's ``width`` rows: (flat index into its
    width * V candidates, score), best first, after the banned tokens and the forced
    ``</s>`` (:func:`_ban_and_force`); -inf pads a toy vocabulary of fewer candidates."""
    n, width, vocab = shape
    xp = get_array_module(log_probs)
    cand = _extensions(scores, log_probs, live).reshape(n, width, vocab)
    _ban_and_force(cand, step, max_lens, eos_id, banned_ids)
    cand = cand.reshape(n, width * vocab)
    if width * vocab < k:  # fewer candidates than the beam (a toy vocabulary)
        cand = xp.concatenate([cand, xp.full((n, k - width * vocab), NEG_INF, cand.dtype)], 1)
    return top_k_by_bound(cand, k)  # (n, k), best first


def beam_search(step_fn, state, batch_size: int, max_lens, *, beam_size: int = 4,
                alpha: float = 0.6, nbest: int = 1, bos_id: int = 1, eos_id: int = 2,
                banned_ids=(0, 1), stop_early: bool = True) -> list[list[Hypothesis]]:
    """Beam search for ``batch_size`` sentences at once; returns one n-best list per sentence.

    ``state`` holds one row per sentence; ``max_lens[i]`` (ints, shape (batch_size,)) is the most
    tokens sentence i may generate before ``</s>`` (which is then forced). ``banned_ids`` are never
    generated (``<pad>``, ``<s>``). ``stop_early=False`` runs every sentence until its beam is empty
    (for testing that the stopping rule is exact). Each list holds at most ``nbest`` hypotheses,
    best ``score`` first. The search is described in the module docstring and docs/decoding.md.
    """
    if beam_size < 1 or not 1 <= nbest <= beam_size:
        raise ValueError(f"need 1 <= nbest <= beam_size, got nbest={nbest}, beam_size={beam_size}")
    if batch_size == 0:
        return []
    k = beam_size
    max_lens = np.asarray(max_lens, dtype=np.int64).reshape(batch_size)
    results = [_NBest(nbest) for _ in range(batch_size)]
    active = np.arange(batch_size)  # sentences still searching, in row order
    # Step 0 extends one hypothesis per sentence, the empty prefix, so the state keeps its
    # one row per sentence for it; the top-k of that step then fills the beam's k rows.
    width = 1  # rows per sentence: 1 at step 0, k after it
    # The search's rows: `width` per active sentence, live or not. The state holds only
    # the live ones, the rows where `live` is True (None: all).
    history = np.zeros((batch_size, 0), dtype=np.int64)  # generated tokens of every row
    scores = np.zeros((batch_size, 1), dtype=np.float32)  # log-probability of every row
    tokens = np.full(batch_size, bos_id, dtype=np.int64)  # last token of every live row
    live = None

    for step in range(int(max_lens.max(initial=0)) + 1):
        if len(active) == 0:
            break
        log_probs = step_fn(tokens, state)  # (live rows, V)
        n, vocab = len(active), log_probs.shape[-1]
        flat_idx, vals = _best_extensions(scores, log_probs, live, (n, width, vocab), step,
                                          max_lens[active], eos_id, banned_ids, k)
        # The row each extension comes from (a padded column's, never alive, from the last)
        parent = np.arange(n)[:, None] * width + np.minimum(flat_idx // vocab, width - 1)
        alive = np.isfinite(vals)
        # A dead extension (-inf: the sentence has fewer live candidates than the beam)
        # never becomes a hypothesis; it leaves the state below with the ended ones.
        token = flat_idx % vocab
        ended = alive & (token == eos_id)

        for i, j in zip(*np.nonzero(ended)):
            results[active[i]].add(_hypothesis(history[parent[i, j]], vals[i, j], step, alpha))

        scores = np.where(alive & ~ended, vals, np.float32(NEG_INF)).astype(np.float32)
        keep = ~_done(scores, [results[s] for s in active], max_lens[active], step, alpha,
                      stop_early)
        active = active[keep]
        rows = parent[keep].reshape(-1)
        history = np.concatenate([history[rows], token[keep].reshape(-1, 1)], axis=1)
        scores = scores[keep]
        state, tokens, live = _advance(state, rows, live, token[keep], scores, n * width,
                                       len(active) > 0)
        width = k
    return [r.items for r in results]


def _advance(state, rows, live, token, scores, n_rows: int, searching: bool):
    """The next step's (state, last tokens, live rows): the search's ``rows`` that go on
    (of ``n_rows``; ``live`` marks those of them that the state holds, None: all), of which
    only the live ones (finite ``scores``) stay in the state: a hypothesis that ended, or
    an empty slot, leaves it. ``searching``: any sentence left (else the state is kept)."""
    if live is not None:   # the state's row of each of the search's rows
        state_row = np.full(n_rows, -1)
        state_row[live] = np.arange(np.count_nonzero(live))
        rows = state_row[rows]
    live = np.isfinite(scores).reshape(-1)
    tokens = token.reshape(-1)[live]
    if searching:
        state = state.select(rows[live])
    return state, tokens, (None if live.all() else live)


def _hypothesis(history, log_prob, step: int, alpha: float) -> Hypothesis:
    """The finished hypothesis of the tokens ``history`` and ``</s>`` at ``step``."""
    log_prob = float(log_prob)
    return Hypothesis(tuple(history.tolist()), log_prob / length_penalty(step + 1, alpha),
                      log_prob)


def _done(scores, nbests, max_lens, step: int, alpha: float, stop_early: bool):
    """Which sentences stop searching after ``step``: those with no live hypothesis left
    (``scores``: (n, k), -inf where not live) and, with ``stop_early``, those whose n-best
    list no live hypothesis can still enter (``nbests``, ``max_lens``: one per sentence)."""
    best_live = scores.max(axis=1).astype(np.float64)  # (n,)
    # Best normalised score any live hypothesis can still reach: it gains no probability, and
    # its final length lies in [step + 2, max_len + 1]; lp is monotonic, so check both ends.
    with np.errstate(invalid="ignore"):
        bound = np.maximum(
            best_live / length_penalty(step + 2, alpha),
            best_live / length_penalty(max_lens + 1.0, alpha),
        )
    threshold = np.array([r.threshold() for r in nbests])
    done = ~np.isfinite(best_live)
    if stop_early:
        done |= threshold >= bound
    return done


def _extensions(scores, log_probs, live):
    """Summed log-probabilities of every extension: ``scores`` (n, width) of the search's
    rows plus ``log_probs`` (live rows, V) of the rows where ``live`` (NumPy bools; None:
    all), -inf for the others; (n * width, V), where the scores are."""
    xp = get_array_module(log_probs)
    if live is None:
        return xp.asarray(scores).reshape(-1, 1) + log_probs
    cand = xp.empty((scores.size, log_probs.shape[1]), log_probs.dtype)
    cand[xp.asarray(~live)] = NEG_INF
    cand[xp.asarray(live)] = xp.asarray(scores.reshape(-1)[live]).reshape(-1, 1) + log_probs
    return cand


def greedy_search(
    step_fn,
    state,
    batch_size: int,
    max_lens,
    *,
    bos_id: int = 1,
    eos_id: int = 2,
    banned_ids=(0, 1),
) -> list[Hypothesis]:
    """Greedy decoding (argmax at every step until ``</s>``): the reference beam size 1 must equal.

    Returns one hypothesis per sentence with ``score == log_prob`` (no length penalty).
    """
    if batch_size == 0:
        return []
    max_lens = np.asarray(max_lens, dtype=np.int64).reshape(batch_size)
    active = np.arange(batch_size)
    tokens = np.full(batch_size, bos_id, dtype=np.int64)
    out: list[list[int]] = [[] for _ in range(batch_size)]
    total = np.zeros(batch_size, dtype=np.float32)
    done: list[Hypothesis | None] = [None] * batch_size
    for step in range(int(max_lens.max(initial=0)) + 1):
        if len(active) == 0:
            break
        # Banning, forcing and the argmax run where the scores are; only the chosen token and
        # its log-probability come back (on a GPU, 2n numbers a step instead of n x V).
        log_probs = step_fn(tokens, state).copy()
        xp = get_array_module(log_probs)
        if len(banned_ids):
            log_probs[:, list(banned_ids)] = NEG_INF
        forced = np.flatnonzero(step >= max_lens[active])
        if len(forced):
            rows = xp.asarray(forced)
            log_probs[rows, :eos_id] = NEG_INF
            log_probs[rows, eos_id + 1:] = NEG_INF
        best_dev = log_probs.argmax(axis=1)
        best = to_numpy(best_dev)
        total[active] += to_numpy(xp.take_along_axis(log_probs, best_dev[:, None], axis=1))[:, 0]
        for i, s in enumerate(active):
            if best[i] == eos_id:
                done[s] = Hypothesis(tuple(out[s]), float(total[s]), float(total[s]))
            else:
                out[s].append(int(best[i]))
        keep = best != eos_id
        active, tokens = active[keep], best[keep]
        if len(active):
            state = state.select(np.flatnonzero(keep))
    return done
