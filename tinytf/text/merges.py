"""Learning BPE merges: the incremental merge loop, one word at a time in Python lists.

The merge loop is the fast algorithm of subword-nmt's ``learn_bpe.py`` (Sennrich et al., 2016)
and HuggingFace tokenizers' ``BpeTrainer``, not a full recount per merge:

* ``counts[pair]`` = sum of the frequencies of the words that contain the pair, per occurrence;
* ``where[pair]`` = the words that contain (or once contained) the pair;
* a heap of ``(-count, left, right)``. A pair's count only *falls* once it exists (only pairs
  with the piece just made are new, and they are pushed after each merge), so a popped entry
  whose count is stale is pushed back with its true count, and the first entry popped with an
  up-to-date count is the true best pair (a "lazy" heap).

A merge touches only the words listed in ``where[pair]``, and in each only the neighbours of
the merged occurrences: ``x a b y -> x ab y`` removes ``(x, a)`` and ``(b, y)`` and adds
``(x, ab)`` and ``(ab, y)``.

Ties are broken deterministically: the highest count wins, then the pair whose left piece, then
right piece, sorts first (Python string order). The same input always gives the same merges.
A pair whose merged string already is a piece (possible only in odd cases) is never merged, so
every merge makes a new piece and pieces stay unique.
"""
import heapq
from collections import defaultdict

SHIFT = 24  # a pair of symbol ids (a, b) is the int key (a << SHIFT) | b: faster than a tuple
MASK = (1 << SHIFT) - 1
MAX_SYMBOLS = 1 << SHIFT


def best_pair(heap, count_of, piece_ids, min_frequency):
    """Pop the lazy heap's best pair that may be merged: ``(left, right, key)``, or None when
    no pair of `min_frequency` or more is left. `count_of(key)` is a pair's true count; a
    stale entry goes back with it, and a pair whose merged string already is a piece is
    dropped (never merged)."""
    while heap:
        neg_count, left, right, key = heap[0]
        count = count_of(key)
        if count != -neg_count:  # stale entry: put it back with its true count
            if count >= min_frequency:
                heapq.heapreplace(heap, (-count, left, right, key))  # pop and push in one
            else:
                heapq.heappop(heap)
            continue
        heapq.heappop(heap)
        if left + right not in piece_ids:
            return left, right, key
    return None


def add_piece(pieces, piece_ids, left, right):
    """Append the piece ``left + right``; returns its id."""
    new = len(pieces)
    if new >= MAX_SYMBOLS:
        raise ValueError(f"BPE.learn: more than {MAX_SYMBOLS} pieces")
    pieces.append(left + right)
    piece_ids[left + right] = new
    return new


def pair_counts(words, freqs):
    """(count of each adjacent pair ``a << SHIFT | b`` over `words` weighted by `freqs`,
    the indices of the words it occurs in: once per occurrence)."""
    counts = defaultdict(int)
    where = defaultdict(list)
    for idx, word in enumerate(words):
        f = freqs[idx]
        for a, b in zip(word, word[1:]):
            key = (a << SHIFT) | b
            counts[key] += f
            where[key].append(idx)
    return counts, where


def learn_merges(words, freqs, pieces, piece_ids, vocab_size, min_frequency):
    """Greedily merge the most frequent adjacent pair until `pieces` holds `vocab_size` pieces.

    words: list of lists of symbol ids (changed in place); freqs: their counts; pieces: list of
    piece strings by id (appended to); piece_ids: piece string -> id (updated). Stops early when
    the best pair occurs fewer than `min_frequency` times. Returns the merges as id pairs, in
    order. A pair whose merged string already is a piece is skipped (never merged)."""
    counts, where = pair_counts(words, freqs)
    heap = [(-c, pieces[k >> SHIFT], pieces[k & MASK], k)
            for k, c in counts.items() if c >= min_frequency]
    heapq.heapify(heap)
    merges = []
    last_merge = [0] * len(words)  # the merge that last rewrote word i: skips repeats in where
    while len(pieces) < vocab_size:
        best = best_pair(heap, lambda k: counts.get(k, 0), piece_ids, min_frequency)
        if best is None:
            break
        left, right, key = best
        a, b = key >> SHIFT, key & MASK
        new = add_piece(pieces, piece_ids, left, right)
        merges.append((a, b))
        step = len(merges)
        grown = set()  # the new pairs (with the new piece); they go into the heap
        for idx in where.pop(key):
            if last_merge[idx] == step:
                continue
            last_merge[idx] = step
            word = words[idx]
            left_count = word.count(a)  # occurrences of `a` still to look at (index, no raise)
            f = freqs[idx]
            i = 0
            while left_count:
                i = word.index(a, i)
                left_count -= 1
                if i + 1 < len(word) and word[i + 1] == b:
                    if i > 0:  # x a b -> x ab
                        x = word[i - 1]
                        counts[(x << SHIFT) | a] -= f
                        k = (x << SHIFT) | new
                        counts[k] += f
                        where[k].append(idx)
                        grown.add(k)
                    if i + 2 < len(word):  # a b y -> ab y
                        y = word[i + 2]
                        counts[(b << SHIFT) | y] -= f
                        k = (new << SHIFT) | y
                        counts[k] += f
                        where[k].append(idx)
                        grown.add(k)
                    word[i] = new
                    del word[i + 1]
                    if a == b:  # the merged b was one of the a's: "a a a" -> "aa a"
                        left_count -= 1
                i += 1
        del counts[key]  # every occurrence was merged
        for k in grown:
            c = counts[k]
            if c >= min_frequency:
                heapq.heappush(heap, (-c, pieces[k >> SHIFT], pieces[k & MASK], k))
    return merges
