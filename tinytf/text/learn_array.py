"""The BPE merge loop of `tinytf.text.merges.learn_merges`, with each merge done by NumPy.

Same merges, same order, same tie-breaking (tests check it against `learn_merges` and a full
recount); what changes is where the words live and who rewrites them. `learn_merges` keeps
each word as a Python list and visits the occurrences of a merged pair one by one, which is
most of a learning run's time. Here all words are one array of symbols linked into words:

* ``sym[i]``: the symbol at position i (-1 once merged into its left neighbour);
* ``nxt[i]``, ``prv[i]``: the positions of the next and previous live symbol of the same word
  (-1 at the word's ends); ``freq[i]``: the frequency of the word that position i is in;
* ``pair[i]``: the number of the pair that starts at position i (-1 if none). Pairs are
  numbered as they appear; ``count[n]`` is pair n's frequency, ``left[n]``, ``right[n]`` its
  symbols.

A pair appears in one go: the pairs of the initial words at the start, and a pair with the
piece ``new`` only in the merge that makes ``new``. So the positions where pair n ever was
are one slice of the positions listed when it appeared, and ``pair[i] == n`` says whether it
still is there.

A merge of ``(a, b)`` into ``new`` takes the positions that still hold the pair and rewrites
them all at once: ``x a b y -> x new y`` unlinks the ``b``, takes ``(x, a)`` and ``(b, y)``
off the counts and numbers the new pairs ``(x, new)`` and ``(new, y)``. Two cases need care,
both as in the sequential loop:

* **adjacent occurrences** ``a b a b -> new new``: the pair between them, ``(b, a)``, is
  removed once and becomes ``(new, new)``, not ``(new, a)`` plus ``(b, new)``;
* **overlapping occurrences** when ``a == b``: ``a a a -> aa a``, left to right, so of a run
  of occurrences every other one is merged.

The lazy heap of ``(-count, left piece, right piece, pair)`` is `learn_merges`'s, with a
waiting room for the many pairs counted too low to be merged soon (`PairQueue`); Python
touches only the pairs a merge makes (to queue them) and nothing per occurrence. A pair
made in a merge of a few words (`WordArray.merge_few`) with a count below ``min_frequency``
can never be merged: it is not numbered, and its positions hold ``DEAD`` instead.
"""
import heapq
from collections import defaultdict
from itertools import chain, compress

import numpy as np

from tinytf.text.merges import MASK, SHIFT, add_piece, best_pair

DEAD = 0  # the number of every pair made too rarely to be merged (its count is never read)


class WordArray:
    """Many words as one linked array of symbol ids, with their pairs numbered (see the
    module docstring)."""

    def __init__(self, words, freqs):
        """words: a list of lists of symbol ids, or ``(symbols, lengths)``: all words' ids
        one after the other and each word's length, as arrays; freqs: each word's count."""
        if isinstance(words, tuple):
            self.sym, lengths = np.array(words[0], dtype=np.int64), words[1]
            n = len(self.sym)
        else:
            lengths = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
            n = int(lengths.sum())
            self.sym = np.fromiter(chain.from_iterable(words), dtype=np.int64, count=n)
        self.freq = np.repeat(np.asarray(freqs, dtype=np.int64), lengths)
        index = np.arange(n, dtype=np.int64)
        last = (np.cumsum(lengths) - 1)[lengths > 0]  # the last position of each word
        first = last - lengths[lengths > 0] + 1
        self.nxt, self.prv = index + 1, index - 1
        self.nxt[last], self.prv[first] = -1, -1
        self.start = np.zeros(n, dtype=bool)  # scratch: positions merged in this merge
        self.end = np.zeros(n, dtype=bool)    # scratch: their right symbols
        # Number the initial pairs and list their positions.
        self.pair = np.full(n, -1, dtype=np.int64)
        pos = np.flatnonzero(self.nxt >= 0)
        self.pairs = 0  # pairs numbered so far; the arrays below grow by doubling
        self.left = self.right = self.count = self.batch = self.lo = self.hi = np.zeros(0, int)
        self._reserve(1)
        self.pairs = 1  # pair 0 is DEAD
        self._views()
        self.listed = []  # the positions listed, one array or list per merge and at the start
        self._number((self.sym[pos] << SHIFT) | self.sym[self.nxt[pos]], pos, self.freq[pos],
                     int(self.sym.max(initial=0)))

    def occurrences(self, n):
        """The positions that hold pair `n` now; of a run of overlapping ones (``a == b``)
        every other one, left to right."""
        listed = np.asarray(self.listed[self.batch[n]][self.lo[n]:self.hi[n]])
        pos = listed[(self.pair[listed] == n).nonzero()[0]]  # faster than a boolean index
        if self.left[n] == self.right[n] and len(pos) > 1:
            pos = np.sort(pos)
            right = self.nxt[pos]
            if (pos[1:] == right[:-1]).any():  # rare: "a a a"; resolve left to right
                keep = np.ones(len(pos), dtype=bool)
                taken = -1
                for k, (p, r) in enumerate(zip(pos.tolist(), right.tolist())):
                    if p == taken:
                        keep[k] = False
                    else:
                        taken = r
                pos = pos[keep]
        return pos

    def merge(self, pos, new):
        """Rewrite the occurrences at `pos` into symbol `new`, update the counts and number
        the pairs made. Returns the numbers of the new pairs."""
        if not len(pos):
            return pos
        sym, nxt, prv, pair, count = self.sym, self.nxt, self.prv, self.pair, self.count
        right = nxt[pos]
        x, y = prv[pos], nxt[right]
        f = self.freq[pos]
        self.start[pos] = True
        self.end[right] = True
        # The left pair (x, a) changes unless x is the b of an occurrence merged now (then
        # the occurrence before changed the pair between them as its right pair). Where
        # x is -1, end[-1] is read and masked off.
        with_left = ((x >= 0) & ~self.end[x]).nonzero()[0]
        with_right = (y >= 0).nonzero()[0]
        xl, at, yr = x[with_left], pos[with_right], y[with_right]
        made_f = np.concatenate((f[with_left], f[with_right]))
        # (x, a) and (b, y) are gone; (x, new) and (new, y) are made ((new, new) where y is
        # the a of an occurrence merged now).
        np.subtract.at(count, np.concatenate((pair[xl], pair[right[with_right]])), made_f)
        made = np.concatenate(((sym[xl] << SHIFT) | new,
                               (new << SHIFT) | np.where(self.start[yr], new, sym[yr])))
        made_at = np.concatenate((xl, at))
        self.start[pos] = False
        self.end[right] = False
        # Relink: x a b y -> x new y.
        sym[pos] = new
        sym[right] = -1
        nxt[pos] = y
        prv[yr] = at
        pair[right] = -1
        pair[pos] = -1  # the pair (new, y), where there is one, is numbered below
        return self._number(made, made_at, made_f, new)

    def merge_few(self, n, new, min_count=1):
        """`occurrences` and `merge` of pair `n` one occurrence at a time, left to right, in
        Python: faster than NumPy's fixed cost for a merge of a few words. Returns the new
        pairs as ``(number, count, left, right)``.

        The arrays are read and written through memoryviews of them (`_views`): an element
        is a Python int there, about 4x faster to read than an element of a NumPy array."""
        sym, nxt, prv, pair, freq = self.position_views
        lo, hi, left, right, batch, count = self.pair_views
        a, b = left[n], right[n]
        listed = self.listed[batch[n]][lo[n]:hi[n]]
        if not isinstance(listed, list):
            listed = listed.tolist()
        made = defaultdict(int)    # key of a pair made -> its count
        where = defaultdict(list)  # key of a pair made -> the positions where it was made
        new_left = new << SHIFT
        twice = []  # positions whose (new, a) became (new, new): "a b a b -> new new"
        last = -1   # the occurrence merged last
        for p in sorted(compress(listed, map(n.__eq__, map(pair.__getitem__, listed)))):
            q = nxt[p]
            if sym[p] != a or q < 0 or sym[q] != b:  # merged into an overlapping one
                continue
            x, y, f = prv[p], nxt[q], freq[p]
            if x >= 0:
                if x == last:  # the occurrence just before: its (new, a) becomes (new, new)
                    made[new_left | a] -= f
                    twice.append(x)
                    key = new_left | new
                else:
                    count[pair[x]] -= f
                    key = (sym[x] << SHIFT) | new
                made[key] += f
                where[key].append(x)
            if y >= 0:
                count[pair[q]] -= f
                key = new_left | sym[y]
                made[key] += f
                where[key].append(p)
                prv[y] = p
            sym[p], sym[q], nxt[p], pair[p], pair[q] = new, -1, y, -1, -1
            last = p
        return self._number_made(made, where, twice, new_left | new, min_count)

    def _number_made(self, made, where, twice, both_key, min_count):
        """`merge_few`'s second half: number the pairs it `made` (key -> count) at positions
        `where` (key -> list) that occur `min_count` times or more, list their positions,
        and point the positions of `twice` at the pair `both_key` (the new symbol twice).
        Returns the new pairs as ``(number, count, left, right)``."""
        m = self.pairs
        self._reserve(m + len(made))
        pair = self.position_views[3]
        lo, hi, left, right, batch, count = self.pair_views  # _reserve may have grown them
        positions, pairs, listing, both = [], [], len(self.listed), DEAD
        for key, c in made.items():
            at = where[key]
            if c < min_count:  # never merged (counts only fall): not numbered
                number = DEAD
            else:
                number, m = m, m + 1
                lo[number] = len(positions)
                positions += at
                hi[number] = len(positions)
                left[number], right[number] = key >> SHIFT, key & MASK
                count[number], batch[number] = c, listing
                pairs.append((number, c, key >> SHIFT, key & MASK))
            for p in at:
                pair[p] = number
            if key == both_key:
                both = number
        for x in twice:  # listed under (new, a) too; (new, new) is the pair there now
            pair[x] = both
        self.listed.append(positions)  # a list: most are read only here
        self.pairs = m
        return pairs

    def count_of(self, n):
        """Pair `n`'s count now, as a Python int."""
        return self.pair_views[5][n]

    def _reserve(self, size):
        """Room for `size` pairs in the per-pair arrays (doubling)."""
        if size > len(self.count):
            capacity = max(size, 2 * len(self.count))
            for name in ("left", "right", "count", "batch", "lo", "hi"):
                grown = np.zeros(capacity, dtype=np.int64)
                grown[:self.pairs] = getattr(self, name)[:self.pairs]
                setattr(self, name, grown)
            self._views()

    def _views(self):
        """Memoryviews of the per-position and the per-pair arrays, for `merge_few`."""
        self.position_views = tuple(map(memoryview, (
            self.sym, self.nxt, self.prv, self.pair, self.freq)))
        self.pair_views = tuple(map(memoryview, (
            self.lo, self.hi, self.left, self.right, self.batch, self.count)))

    def _number(self, keys, at, f, top):
        """Number the distinct pairs among `keys` (``left << SHIFT | right``, no symbol above
        `top`) at positions `at` of words of frequencies `f`, list their positions; returns
        their numbers.

        One sort of `keys` does it all: the distinct keys, in key order, are the runs of
        the sorted keys, numbered in that order, and the positions in sorted order list each
        pair's in one slice (cheaper than ``np.unique`` and a second sort). The order of the
        positions within a slice does not matter (`occurrences` and `merge_few` sort them
        where it would), so the sort need not be stable (`key_order`)."""
        if not len(keys):
            return keys
        order = key_order(keys, top)
        keys, at, f = keys[order], at[order], f[order]
        run_start = np.empty(len(keys), dtype=bool)
        run_start[0] = True
        np.not_equal(keys[1:], keys[:-1], out=run_start[1:])
        starts = run_start.nonzero()[0]
        first, end = self.pairs, self.pairs + len(starts)
        self._reserve(end)
        self.pairs = end
        number = run_start.cumsum()
        number += first - 1
        self.pair[at] = number
        self.lo[first:end] = starts
        self.hi[first:end - 1] = starts[1:]
        self.hi[end - 1] = len(keys)
        self.batch[first:end] = len(self.listed)
        self.listed.append(at)
        distinct = keys[starts]
        self.left[first:end], self.right[first:end] = distinct >> SHIFT, distinct & MASK
        self.count[first:end] = np.add.reduceat(f, starts)
        return np.arange(first, end)


RADIX_MIN = 2048  # keys from which `key_order` sorts by radix


def key_order(keys, top):
    """Indices that sort pair keys ``left << SHIFT | right`` of symbols up to `top` (equal
    keys in any order).

    NumPy sorts 16-bit integers by radix when asked for a stable sort, in linear time. So
    where every symbol fits in 16 bits, two such sorts do it, by the right symbol and then,
    stably, by the left: 10x faster than the int64 keys' own argsort on the 280,000 initial
    pairs of the shipped corpus (2.2 against 29 ms), 2x at 3,000 keys; below `RADIX_MIN`
    keys the argsort is faster."""
    if len(keys) < RADIX_MIN or top >= 1 << 16:
        return keys.argsort()
    order = (keys & MASK).astype(np.uint16).argsort(kind="stable")
    return order[(keys >> SHIFT).astype(np.uint16)[order].argsort(kind="stable")]


NUMBER_BITS = 32  # a waiting pair is the int -(count << NUMBER_BITS | number)
NUMBER_MASK = (1 << NUMBER_BITS) - 1


class PairQueue:
    """The pairs to merge, best first: `tinytf.text.merges`'s lazy heap of ``(-count, left
    piece, right piece, number)`` (`best_pair`), with a waiting room for pairs counted low.

    No pair made in a merge counts more than the pair merged (its occurrences are some of
    that pair's), so the merged pairs' counts never rise, and most pairs made late are never
    merged. A pair counted below ``floor`` therefore waits outside the heap, in a heap of
    plain ints ``-(count << NUMBER_BITS | number)``, cheaper to push than a tuple. The heap
    holds every pair counted at ``floor`` or more; when its best falls below ``floor``, the
    floor falls to that count and the pairs waiting at it or above join the heap. `pop` thus
    returns the pair that the lazy heap alone would."""

    def __init__(self, array, pieces, piece_ids, min_frequency):
        """Queue the pairs numbered in `array` (a `WordArray`); pieces, piece_ids: the piece
        strings by id and the ids by string, as `learn_merges` takes them."""
        self.array, self.pieces, self.piece_ids = array, pieces, piece_ids
        self.min_frequency = min_frequency
        self.heap, self.waiting, self.floor = [], [], 0
        self.add_numbers(np.arange(array.pairs))
        self.floor = max(-self.heap[0][0], min_frequency) if self.heap else min_frequency

    def add(self, pairs):
        """Queue new pairs, given as ``(number, count, left id, right id)``; a pair counted
        below `min_frequency` is never merged and is left out."""
        heap, waiting, pieces, floor = self.heap, self.waiting, self.pieces, self.floor
        for n, c, a, b in pairs:
            if c >= floor:
                heapq.heappush(heap, (-c, pieces[a], pieces[b], n))
            elif c >= self.min_frequency:
                heapq.heappush(waiting, -(c << NUMBER_BITS | n))

    def add_numbers(self, numbers):
        """`add` the pairs numbered `numbers` (an array), as `array` counts them."""
        array = self.array
        numbers = numbers[array.count[numbers] >= self.min_frequency]
        self.add(zip(numbers.tolist(), array.count[numbers].tolist(),
                     array.left[numbers].tolist(), array.right[numbers].tolist()))

    def pop(self):
        """The best pair that may be merged, ``(left piece, right piece, number)``, or None
        when none of `min_frequency` or more is left."""
        count_of = self.array.count_of
        while True:
            best = best_pair(self.heap, count_of, self.piece_ids, self.min_frequency)
            count = count_of(best[2]) if best else 0
            if count >= self.floor or not self.waiting:
                return best
            if best:  # a waiting pair may beat it
                heapq.heappush(self.heap, (-count, *best))
            self.floor = max(count, self.min_frequency)
            self._release()

    def _release(self):
        """Move the waiting pairs counted at `floor` or more into the heap, through `add`
        (counts only fall: some are counted lower now, and wait again)."""
        waiting, released = self.waiting, []
        while waiting and -waiting[0] >> NUMBER_BITS >= self.floor:
            released.append(-heapq.heappop(waiting) & NUMBER_MASK)
        _, _, left, right, _, count = self.array.pair_views
        self.add((n, count[n], left[n], right[n]) for n in released)


FEW = 16  # listed positions up to which a merge is done in Python (`WordArray.merge_few`)


def learn_merges_array(words, freqs, pieces, piece_ids, vocab_size, min_frequency, few=None,
                       report=None):
    """`tinytf.text.merges.learn_merges` with the words in a `WordArray` (the same arguments
    and result; `words` is left as it was, and may also be a pair of arrays, as `WordArray`
    takes it). Merges of pairs listed at more than `few`
    positions (default `FEW`) are done by NumPy (`WordArray.merge`), the others in Python.
    ``report``: a `tinytf.text.learn.Reporter` that hears how many pieces there are."""
    few = FEW if few is None else few
    array = WordArray(words, freqs)
    queue = PairQueue(array, pieces, piece_ids, min_frequency)
    merges = []
    while len(pieces) < vocab_size:
        if report is not None and len(merges) % 256 == 0:
            report(lambda: f"merging: {len(pieces):,} of {vocab_size:,} pieces")
        best = queue.pop()
        if best is None:
            break
        left, right, n = best
        new = add_piece(pieces, piece_ids, left, right)
        lo, hi, left_of, right_of = array.pair_views[:4]
        merges.append((left_of[n], right_of[n]))
        if hi[n] - lo[n] <= few:
            queue.add(array.merge_few(n, new, min_frequency))
        else:
            queue.add_numbers(array.merge(array.occurrences(n), new))
        array.count[n] = 0  # every occurrence is merged
    return merges
