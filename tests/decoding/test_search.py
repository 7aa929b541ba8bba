"""Tests for tinytf.decoding.search on hand-made scorers (no model needed).

The scorers here look at the whole prefix of every row, so a wrong ``state.select`` (beam
reordering, dropping finished sentences) changes the scores and shows up in the results.
"""

import itertools
import math
import zlib

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tinytf.decoding.search import (
    Hypothesis,
    beam_search,
    greedy_search,
    length_penalty,
    top_k,
    top_k_by_bound,
)

BOS, EOS = 1, 2


class PrefixState:
    """Decoder state of the test scorers: the tokens fed so far, one row per hypothesis."""

    def __init__(self, sentence_ids, prefixes):
        self.sentence_ids = np.asarray(sentence_ids)  # which source sentence each row decodes
        self.prefixes = prefixes  # (N, t) int64

    @classmethod
    def start(cls, sentence_ids):
        return cls(sentence_ids, np.zeros((len(sentence_ids), 0), dtype=np.int64))

    def select(self, rows):
        return PrefixState(self.sentence_ids[rows], self.prefixes[rows])


def prefix_step(score_fn):
    """Step function calling ``score_fn(sentence_id, prefix_tuple) -> (V,) log-probs`` per row."""

    def step(tokens, state):
        state.prefixes = np.concatenate([state.prefixes, tokens[:, None]], axis=1)
        rows = [score_fn(int(s), tuple(p[1:].tolist()))
                for s, p in zip(state.sentence_ids, state.prefixes)]
        return np.stack(rows).astype(np.float32)

    return step


def random_scorer(vocab, eos_bias=0.0, peak=3.0):
    """Deterministic pseudo-random log-softmax over ``vocab`` tokens for every (sentence,
    prefix)."""

    def score(sentence, prefix):
        seed = zlib.crc32(repr((sentence, prefix)).encode())
        logits = np.random.default_rng(seed).standard_normal(vocab) * peak
        logits[EOS] += eos_bias
        logits -= logits.max()
        return (logits - np.log(np.exp(logits).sum())).astype(np.float32)

    return score


def markov_scorer():
    """A bigram model where greedy decoding misses the most probable sentence.

    Tokens: 3 = "a", 4 = "b". From <s>: a 0.6, b 0.4; after a: b 0.45, </s> 0.3, a 0.25; after
    b: </s> 0.9. Greedy says "a b </s>" (P = 0.6 * 0.45 * 0.9 = 0.243); the most probable
    sentence is "b </s>" (P = 0.4 * 0.9 = 0.36). Rows that already ended (fed </s>) get any
    distribution: the search ignores them.
    """
    table = {
        BOS: {3: 0.6, 4: 0.4},
        3: {EOS: 0.3, 3: 0.25, 4: 0.45},
        4: {EOS: 0.9, 3: 0.06, 4: 0.04},
        EOS: {EOS: 0.5, 3: 0.25, 4: 0.25},
    }
    tiny = 1e-30

    def score(sentence, prefix):
        prev = prefix[-1] if prefix else BOS
        probs = np.full(5, tiny)
        for tok, p in table[prev].items():
            probs[tok] = p
        return np.log(probs).astype(np.float32)

    return score


def run_beam(score_fn, n_sent, max_lens, **kw):
    state = PrefixState.start(np.arange(n_sent))
    return beam_search(prefix_step(score_fn), state, n_sent, max_lens, **kw)


def run_greedy(score_fn, n_sent, max_lens, **kw):
    state = PrefixState.start(np.arange(n_sent))
    return greedy_search(prefix_step(score_fn), state, n_sent, max_lens, **kw)


def test_length_penalty_formula():
    for length in [1, 2, 7, 30]:
        for alpha in [0.0, 0.6, 1.0, 2.0]:
            assert length_penalty(length, alpha) == pytest.approx(((5 + length) / 6) ** alpha)
    assert length_penalty(1, 0.6) == 1.0
    np.testing.assert_allclose(length_penalty(np.array([1.0, 7.0]), 1.0), [1.0, 2.0])


def test_scores_are_log_prob_over_length_penalty():
    score_fn = random_scorer(9, eos_bias=1.0)
    for alpha in [0.0, 0.6, 1.5]:
        for nbest in run_beam(score_fn, 4, [6] * 4, beam_size=4, alpha=alpha, nbest=4):
            assert 1 <= len(nbest) <= 4
            for hyp in nbest:
                expected = hyp.log_prob / length_penalty(len(hyp.tokens) + 1, alpha)
                assert hyp.score == pytest.approx(expected, rel=1e-12)
            assert [h.score for h in nbest] == sorted((h.score for h in nbest), reverse=True)


def test_log_prob_is_sum_of_step_log_probs():
    score_fn = random_scorer(7, eos_bias=0.5)
    (nbest,) = run_beam(score_fn, 1, [5], beam_size=3, nbest=3)
    for hyp in nbest:
        full = hyp.tokens + (EOS,)
        total = sum(float(score_fn(0, full[:i])[tok]) for i, tok in enumerate(full))
        assert hyp.log_prob == pytest.approx(total, abs=1e-5)


def test_beam_four_beats_greedy_on_markov_model():
    greedy = run_greedy(markov_scorer(), 1, [10])[0]
    assert greedy.tokens == (3, 4)
    assert greedy.log_prob == pytest.approx(math.log(0.6 * 0.45 * 0.9), rel=1e-5)
    beam1 = run_beam(markov_scorer(), 1, [10], beam_size=1, alpha=0.0)[0][0]
    assert beam1.tokens == greedy.tokens
    beam4 = run_beam(markov_scorer(), 1, [10], beam_size=4, alpha=0.0)[0][0]
    assert beam4.tokens == (4,)
    assert beam4.log_prob == pytest.approx(math.log(0.4 * 0.9), rel=1e-5)
    assert beam4.log_prob > greedy.log_prob


@pytest.mark.parametrize("alpha", [0.0, 0.6, 2.0])
def test_beam_one_equals_greedy(alpha):
    score_fn = random_scorer(11, eos_bias=1.5)
    max_lens = [3, 8, 0, 12, 5, 20]
    greedy = run_greedy(score_fn, 6, max_lens)
    beam = run_beam(score_fn, 6, max_lens, beam_size=1, alpha=alpha)
    for g, (b,) in zip(greedy, beam):
        assert b.tokens == g.tokens
        assert b.log_prob == g.log_prob
        assert len(b.tokens) <= 20


def test_max_len_forces_eos():
    score_fn = random_scorer(6, eos_bias=-20.0)  # the scorer all but never ends by itself
    results = run_beam(score_fn, 3, [0, 2, 5], beam_size=3, nbest=3)
    for nbest, max_len in zip(results, [0, 2, 5]):
        assert nbest and all(len(h.tokens) == max_len for h in nbest)


def test_banned_tokens_never_generated():
    score_fn = random_scorer(6, peak=0.1)
    for nbest in run_beam(score_fn, 5, [6] * 5, beam_size=4, nbest=4):
        for hyp in nbest:
            assert not {0, 1, EOS} & set(hyp.tokens)


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.0, -0.5])
def test_stopping_rule_is_exact(alpha):
    """Stopping early gives the same n-best lists as running every beam until it is empty."""
    score_fn = random_scorer(10, eos_bias=1.0, peak=2.0)
    max_lens = [4, 9, 15, 2, 11]
    early = run_beam(score_fn, 5, max_lens, beam_size=4, alpha=alpha, nbest=2)
    full = run_beam(score_fn, 5, max_lens, beam_size=4, alpha=alpha, nbest=2, stop_early=False)
    assert early == full


def test_stopping_rule_saves_steps():
    score_fn = random_scorer(10, eos_bias=4.0)
    calls = []
    step = prefix_step(score_fn)

    def counting_step(tokens, state):
        calls.append(len(tokens))
        return step(tokens, state)

    beam_search(counting_step, PrefixState.start([0]), 1, [40], beam_size=4)
    assert len(calls) < 40


def test_only_live_hypotheses_are_extended():
    """Step 0 extends the empty prefix once per sentence; later steps extend the live
    hypotheses alone: one that ended in </s> leaves the state, and its beam runs fewer rows
    in the next step (the result is the same: the other tests compare it with greedy
    decoding and exhaustive search)."""
    score_fn = random_scorer(10, eos_bias=-1.0)
    fed = []
    step = prefix_step(score_fn)

    def recording_step(tokens, state):
        fed.append(tokens.copy())
        return step(tokens, state)

    beam_search(recording_step, PrefixState.start(np.arange(3)), 3, [6, 6, 6], beam_size=4,
                stop_early=False)
    assert fed[0].tolist() == [BOS] * 3
    rows = [len(tokens) for tokens in fed[1:]]
    assert rows and all(0 < n <= 12 for n in rows) and any(n % 4 for n in rows)
    assert all(tokens.min() > EOS for tokens in fed[1:])   # no </s>, <s> or <pad> fed


def exhaustive_best(score_fn, vocab, max_len, alpha):
    """Best normalised score over every sentence of at most ``max_len`` real tokens."""
    best = None
    for length in range(max_len + 1):
        for toks in itertools.product(range(3, vocab), repeat=length):
            full = toks + (EOS,)
            lp = sum(float(score_fn(0, full[:i])[t]) for i, t in enumerate(full))
            score = lp / length_penalty(length + 1, alpha)
            if best is None or score > best[0]:
                best = (score, toks)
    return best


@pytest.mark.parametrize("alpha", [0.0, 0.6, 1.5])
def test_wide_beam_is_exact_search(alpha):
    """A beam wider than the number of prefixes keeps them all: the result is the true optimum."""
    vocab, max_len = 6, 3  # 3 real tokens: at most 27 live prefixes
    score_fn = random_scorer(vocab, eos_bias=0.0, peak=1.5)
    (nbest,) = run_beam(score_fn, 1, [max_len], beam_size=27 * 2, alpha=alpha)
    score, toks = exhaustive_best(score_fn, vocab, max_len, alpha)
    assert nbest[0].tokens == toks
    assert nbest[0].score == pytest.approx(score, abs=1e-5)


def test_batch_composition_does_not_matter():
    score_fn = random_scorer(12, eos_bias=1.0)
    max_lens = [5, 9, 3, 14, 7, 7, 1]
    batched = run_beam(score_fn, 7, max_lens, beam_size=4, nbest=3)
    for i, max_len in enumerate(max_lens):
        state = PrefixState.start([i])
        alone = beam_search(prefix_step(score_fn), state, 1, [max_len], beam_size=4, nbest=3)
        assert alone[0] == batched[i]


def test_top_k_breaks_ties_by_index():
    scores = np.array([[1.0, 3.0, 3.0, 2.0, 3.0, 3.0], [0.0, 0.0, 0.0, 0.0, 0.0, 0.0]], np.float32)
    idx, vals = top_k(scores, 3)
    assert idx.tolist() == [[1, 2, 4], [0, 1, 2]]
    assert vals.tolist() == [[3.0, 3.0, 3.0], [0.0, 0.0, 0.0]]


def test_top_k_is_the_definition_with_many_ties():
    """Sorted by value, ties by index, quantised scores making many ties."""
    rng = np.random.default_rng(0)
    scores = np.round(rng.standard_normal((37, 500)) * 4).astype(np.float32)
    expected = []
    for row in scores:   # the definition: value descending, then index ascending
        order = sorted(range(len(row)), key=lambda j: (-row[j], j))[:6]
        expected.append(order)
    idx, vals = top_k(scores, 6)
    assert idx.tolist() == expected
    assert (vals == np.take_along_axis(scores, idx, axis=1)).all()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 6), st.integers(1, 700), st.integers(1, 8), st.integers(0, 2 ** 32 - 1),
       st.sampled_from([0.0, 0.3, 0.97, 1.0]), st.sampled_from([64, 256]))
def test_top_k_by_bound_is_top_k(n, m, k, seed, dead, samples):
    """The definition (value descending, then index ascending), ties (quantised scores) and
    -inf entries included, whole rows of -inf too (``dead`` 1), for any row length and
    sample count; so `top_k`'s result wherever that is finite (`top_k` leaves the choice
    among -inf entries to argpartition)."""
    k = min(k, m)
    rng = np.random.default_rng(seed)
    scores = np.round(rng.standard_normal((n, m)) * 3).astype(np.float32)
    scores[rng.random((n, m)) < dead] = -np.inf
    idx, vals = top_k_by_bound(scores, k, samples=samples)
    expected = [sorted(range(m), key=lambda j: (-row[j], j))[:k] for row in scores]
    assert idx.tolist() == expected
    np.testing.assert_array_equal(vals, np.take_along_axis(scores, idx, axis=1))
    ref_idx, ref_vals = top_k(scores, k)
    finite = np.isfinite(ref_vals)
    np.testing.assert_array_equal(vals, ref_vals)
    np.testing.assert_array_equal(idx[finite], ref_idx[finite])


def test_top_k_by_bound_leaves_nans_to_top_k():
    scores = np.arange(24, dtype=np.float32).reshape(2, 12)
    scores[0, 3] = scores[1, 11] = np.nan   # the second in the tail past the sampled columns
    idx, vals = top_k_by_bound(scores, 3, samples=5)
    ref_idx, ref_vals = top_k(scores, 3)
    np.testing.assert_array_equal(idx, ref_idx)
    np.testing.assert_array_equal(vals, ref_vals)


def test_argument_checks_and_empty_batch():
    with pytest.raises(ValueError, match="nbest"):
        run_beam(random_scorer(5), 1, [3], beam_size=2, nbest=3)
    assert run_beam(random_scorer(5), 0, [], beam_size=2) == []
    assert isinstance(run_beam(random_scorer(5, eos_bias=9), 1, [3])[0][0], Hypothesis)
