"""`tinytf.text.encode.word_encoder`'s merge loop for many words at once, by NumPy.

Same pieces for every word (tests check it against `encode_word`); what changes is who runs
the rounds. `encode_word` merges one word in Python, one round per merge, ~15 microseconds for
a typical word: most of a cold encoding run, where most chunks are seen for the first time.
Here all the words of a batch are one array of ids, and each round merges, in every word at
once, the occurrences of that word's best pair:

1. ``rank[i]``: the merge rank of the pair ``(ids[i], ids[i + 1])``, looked up in
   `PairRanks`, a hash table (``NO_MERGE`` where there is no merge and at each word's last
   position): for all positions at once before the first round, then only for the two pairs
   beside each new piece, the only ones a merge changes;
2. ``best[w]``: the lowest rank in word w (`np.minimum.reduceat` over the words' segments).
   Words whose best is ``NO_MERGE`` are finished and leave the array, so later rounds shrink;
3. every position where ``rank[i] == best[word[i]]`` is merged: ``ids[i]`` becomes the new
   piece, ``ids[i + 1]`` is dropped. This is `encode_word`'s loop, which merges the leftmost
   occurrence per round, run to the end of that rank: a pair with the new piece has a later
   rank, so the other occurrences of the best pair are the next ones it merges. Occurrences
   overlap only when the pair is ``(a, a)``: ``a a a -> aa a``, left to right, so of a run of
   consecutive positions every other one is merged, starting with the first.

The number of rounds is the most merges any one word takes (about 20 at 8k pieces), not the
number of words or merges.
"""
import numpy as np

NO_MERGE = (1 << 30) - 1  # the rank of a pair that has no merge; ranks stay one-digit ints


class PairRanks:
    """The merge table as an open-addressing hash table of int64 keys ``left * size + right``
    (``size``: the number of pieces), looked up for whole arrays of pairs at once.

    A key's home slot is the top bits of ``key * HASH_FACTOR`` (Fibonacci hashing); a taken
    slot sends it to the next one (linear probing). With the table at most 1/4 full, a lookup
    is one gather and compare for nearly every pair: ~5x faster than `np.searchsorted` over
    the sorted keys, whose random accesses miss the cache.
    """

    HASH_FACTOR = np.uint64(0x9E3779B97F4A7C15)
    HASH_FACTOR_INT64 = HASH_FACTOR.astype(np.int64)   # the same 64 bits, as int64
    EMPTY = -1

    def __init__(self, ranks, merged, size):
        """ranks: (left id, right id) -> merge rank; merged: rank -> id of the merged piece."""
        self.size = size
        pairs = np.array(list(ranks.keys()), dtype=np.int64).reshape(-1, 2)
        keys = pairs[:, 0] * size + pairs[:, 1]
        values = np.fromiter(ranks.values(), dtype=np.int64, count=len(ranks))
        self.bits = max(4, (4 * len(keys)).bit_length())
        self.mask = (1 << self.bits) - 1
        self.keys = np.full(1 << self.bits, self.EMPTY, dtype=np.int64)
        self.ranks = np.full(1 << self.bits, NO_MERGE, dtype=np.int64)
        slot = self.home(keys)
        while len(keys):  # place keys whose slot is free, one per slot; the rest probe on
            free = self.keys[slot] == self.EMPTY
            _, first = np.unique(slot[free], return_index=True)
            placed = np.flatnonzero(free)[first]
            self.keys[slot[placed]], self.ranks[slot[placed]] = keys[placed], values[placed]
            rest = np.ones(len(keys), dtype=bool)
            rest[placed] = False
            keys, values, slot = keys[rest], values[rest], (slot[rest] + 1) & self.mask
        self.merged = np.asarray(merged, dtype=np.int64)

    def home(self, keys):
        """The home slot of each key: the top `bits` bits of the 64-bit product, computed
        in int64 (the product wraps as in uint64; the arithmetic shift's sign bits are
        masked off), ~4x faster than through uint64 arrays and back."""
        return ((keys * self.HASH_FACTOR_INT64) >> (64 - self.bits)) & self.mask

    def lookup(self, left, right):
        """The merge rank of each pair ``(left[i], right[i])``; NO_MERGE where none."""
        query = left * self.size + right
        slot = self.home(query)
        found = self.keys[slot]
        rank = self.ranks[slot]  # right where found == query, NO_MERGE where the slot is empty
        probe = np.flatnonzero((found != query) & (found != self.EMPTY))
        while len(probe):        # collisions: walk on to the key or an empty slot
            slot[probe] = (slot[probe] + 1) & self.mask
            found = self.keys[slot[probe]]
            rank[probe] = self.ranks[slot[probe]]
            probe = probe[(found != query[probe]) & (found != self.EMPTY)]
        return rank


class Speller:
    """`tinytf.text.encode.word_speller`'s initial ids for many words at once: each code point
    looked up in a table indexed by code point (-1: not in the alphabet), one gather for all
    the characters of the words."""

    def __init__(self, unit_ids):
        """unit_ids: raw text of an alphabet symbol (one character, or a space glued to one)
        -> id."""
        alone = {ord(u): i for u, i in unit_ids.items() if len(u) == 1}
        glued = {ord(u[1]): i for u, i in unit_ids.items() if len(u) == 2 and u[0] == " "}
        self.alone = self._table(alone)
        self.glued = self._table(glued)

    @staticmethod
    def _table(ids):
        """code point -> id as an array up to the largest code point (at most 4.4 MB, for an
        alphabet that reaches U+10FFFF; a few hundred KB for the scripts of a corpus)."""
        table = np.full(max(ids, default=0) + 1, -1, dtype=np.int64)
        table[list(ids)] = list(ids.values())
        return table

    @staticmethod
    def _lookup(table, points):
        return np.where(points < len(table), table[np.minimum(points, len(table) - 1)], -1)

    def spell(self, words):
        """``(ids, lengths, spelled)``: the initial ids of the words whose every symbol is in
        the alphabet, one word after the other, with their counts; ``spelled[w]`` says
        whether word w is among them (the others need `word_speller`'s byte fallback)."""
        points = np.frombuffer("".join(words).encode("utf-32-le", "surrogatepass"),
                               dtype=np.uint32).astype(np.int64)
        chars = np.fromiter(map(len, words), dtype=np.int64, count=len(words))
        start = np.cumsum(chars) - chars
        ids = self._lookup(self.alone, points)
        glued = np.flatnonzero((points[start] == 0x20) & (chars > 1))  # " x": one symbol,
        glue = start[glued]                                            # x's glued id
        ids[glue + 1] = self._lookup(self.glued, points[glue + 1])
        keep = np.ones(len(ids), dtype=bool)
        keep[glue] = False
        lengths = chars.copy()
        lengths[glued] -= 1
        unknown = ids < 0
        unknown[glue] = False
        if not unknown.any():  # the common case: every word spelled
            return ids[keep], lengths, np.ones(len(words), dtype=bool)
        word = np.repeat(np.arange(len(words)), chars)
        spelled = np.bincount(word[unknown], minlength=len(words)) == 0
        keep &= spelled[word]
        return ids[keep], lengths[spelled], spelled


def select(mask, *arrays):
    """``[a[mask] for a in arrays]`` through the positions of `mask`, found once: NumPy 2.4's
    boolean index is slower than `np.flatnonzero` and an integer index (300k int64
    elements: 1.3x where 90 % are kept, as here, 4x where half are)."""
    at = np.flatnonzero(mask)
    return [a[at] for a in arrays]


def merge_words(ids, lengths, table):
    """Encode many words at once: ``ids`` holds each word's initial ids one word after the
    other, ``lengths`` each word's count of them (all >= 1); returns the encoded words in the
    same layout, ``(ids, lengths)``, as int64 arrays."""
    ids = np.asarray(ids, dtype=np.int64)
    lengths = np.asarray(lengths, dtype=np.int64)
    n_words = len(lengths)
    word = np.repeat(np.arange(n_words), lengths)  # the word of each position, 0..active-1
    original = np.arange(n_words)                  # each active word's index in the input
    done_words, done_ids = [], []
    rank = np.empty(len(ids), dtype=np.int64)      # rank[i]: of the pair (ids[i], ids[i + 1])
    rank[:-1] = table.lookup(ids[:-1], ids[1:])
    last = np.cumsum(lengths) - 1
    rank[last] = NO_MERGE                          # no pair across a word boundary
    while len(ids):
        best = np.minimum.reduceat(rank, last - lengths + 1)
        finished = best == NO_MERGE
        if finished.any():                         # finished words leave the array
            gone = finished[word]
            done = np.flatnonzero(gone)
            done_words.append(original[word[done]])
            done_ids.append(ids[done])
            ids, rank, word = select(~gone, ids, rank, word)
            renumber = np.cumsum(~finished) - 1
            word = renumber[word]
            original, lengths, best = select(~finished, original, lengths, best)
            if not len(ids):
                break
        at = np.flatnonzero(rank == best[word])
        follows = at[1:] == at[:-1] + 1            # (a, a) occurrences that overlap
        if follows.any():
            run_start = np.ones(len(at), dtype=bool)
            run_start[1:] = ~follows
            index = np.arange(len(at))
            first = np.maximum.accumulate(np.where(run_start, index, 0))
            at = at[(index - first) % 2 == 0]
        ids[at] = table.merged[rank[at]]
        keep = np.ones(len(ids), dtype=bool)
        keep[at + 1] = False
        lengths = lengths - np.bincount(word[at], minlength=len(lengths))
        ids, word, rank = select(keep, ids, word, rank)
        # Only the pairs next to a new piece changed: (left neighbour, new), (new, right
        # neighbour). `at` moved left by the positions dropped before it, one per merge.
        new = at - np.arange(len(at))
        changed = np.concatenate([new[new > 0] - 1, new])
        changed = changed[changed < len(ids) - 1]
        rank[changed] = table.lookup(ids[changed], ids[changed + 1])
        last = np.cumsum(lengths) - 1
        rank[last] = NO_MERGE
    if not done_words:
        return np.zeros(0, dtype=np.int64), np.zeros(n_words, dtype=np.int64)
    words, out = np.concatenate(done_words), np.concatenate(done_ids)
    order = np.argsort(words, kind="stable")       # positions of a word stay in order
    return out[order], np.bincount(words, minlength=n_words)
