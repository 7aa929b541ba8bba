"""Applying learned merges to text: the word encoder and its two caches.

BPE encoding of one word (Sennrich et al., 2016): start from its initial symbols and merge the
adjacent pair with the lowest merge rank, all its occurrences left to right, until no pair has
a merge. That is the same as applying every merge in learning order.

Text is encoded through caches, because a corpus repeats its words (Zipf):

* `PieceEncoder.chunks`: the text between two single spaces -> ids. In a line with no whitespace but
  single spaces between non-spaces (nearly every line), each space starts the word after it,
  so the pre-tokens of the line are those of its chunks: ``line.split(" ")`` and one dict
  lookup per chunk, all in C, encode the whole line.
* `PieceEncoder.words`: pre-token -> ids, for the other lines (tabs, runs of spaces, ...).
"""
import gc
from functools import partial
from itertools import chain, compress, islice, repeat
from operator import not_

import numpy as np

from tinytf.text.encode_array import NO_MERGE, PairRanks, Speller, merge_words
from tinytf.text.pretokenize import PRETOKEN, initial_units, one_word, single_spaced

MISSING = (-1,)  # what a deferring cache returns for a key it lacks; no id is -1


class _Cache(dict):
    """A dict that fills a missing key with ``compute(key)``; emptied when it holds `limit`.

    While `deferred` is a list, a missing key is appended to it instead and read as
    `MISSING`, so that a batch can compute all its missing keys together.
    """

    def __init__(self, compute, limit):
        super().__init__()
        self.compute = compute
        self.limit = limit
        self.deferred = None

    def put(self, items):
        """Insert (key, value) pairs, emptying the cache first if they would overfill it."""
        items = list(items)
        if len(self) + len(items) > self.limit:
            self.clear()
        self.update(items[len(items) - self.limit:] if len(items) > self.limit else items)

    def __missing__(self, key):
        if self.deferred is not None:
            self.deferred.append(key)
            return MISSING
        value = self.compute(key)
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


def word_speller(unit_ids, spell):
    """``initial_ids(word) -> list of ids``: the ids of a pre-token's initial symbols.

    unit_ids: raw text of an alphabet symbol -> id (``" t"`` -> id of ``▁t``); spell(unit):
    the ids of any initial symbol (byte fallback).
    """
    unit = unit_ids.__getitem__

    def initial_ids(word):
        try:  # fast path: every initial symbol is in the alphabet
            if word[0] == " " and len(word) > 1:
                return [unit(word[:2]), *map(unit, word[2:])]
            return list(map(unit, word))
        except KeyError:
            return list(chain.from_iterable(map(spell, initial_units(word))))

    return initial_ids


def word_encoder(initial_ids, ranks, merged):
    """``encode_word(word) -> tuple of ids``, closed over the model's tables.

    initial_ids: `word_speller`'s function; ranks: (left id, right id) -> merge rank; merged:
    rank -> id of the merged piece. A closure, so the hot loop reads fast locals.
    """
    get = ranks.get

    def encode_word(word):
        ids = initial_ids(word)
        # pair_ranks[i] is the rank of (ids[i], ids[i + 1]); a merge at i changes only its
        # neighbours pair_ranks[i - 1] and pair_ranks[i]. Merging the leftmost occurrence of
        # the best pair, one per round, is merging all of them left to right: a pair with the
        # new piece has a later rank (merges only use pieces made before them), so the next
        # occurrence of the same pair is again the best one.
        pair_ranks = list(map(get, zip(ids, islice(ids, 1, None)), repeat(NO_MERGE)))
        while pair_ranks:
            best = min(pair_ranks)
            if best == NO_MERGE:
                break
            new = merged[best]
            i = pair_ranks.index(best)
            ids[i] = new
            del ids[i + 1]
            del pair_ranks[i]
            if i:
                pair_ranks[i - 1] = get((ids[i - 1], new), NO_MERGE)
            if i < len(pair_ranks):
                pair_ranks[i] = get((new, ids[i + 1]), NO_MERGE)
        return tuple(ids)

    return encode_word


def chunk_words(chunk):
    """The pre-tokens of ``" " + chunk``, where `chunk` holds no whitespace; a chunk that
    `one_word` recognises is one, without the regex."""
    return [" " + chunk] if one_word(chunk) else PRETOKEN.findall(" " + chunk)


class PieceEncoder:
    """Text -> ids with a model's tables: `encode_word` plus the word and chunk caches.

    `encode_batch` first encodes the chunks that a block of lines misses in the cache at once
    (`encode_words`, by `tinytf.text.encode_array.merge_words`), then reads the lines that
    missed again; `encode` fills the caches one word at a time.
    """

    BLOCK = 10_000   # lines whose missing chunks `encode_batch` encodes together
    MANY = 64        # `encode_words` runs the NumPy rounds from this many words on

    def __init__(self, unit_ids, spell, ranks, merged, cache_size=1 << 20):
        self.initial_ids = word_speller(unit_ids, spell)
        self.encode_word = word_encoder(self.initial_ids, ranks, merged)
        size = max([*unit_ids.values(), *merged], default=0) + 1
        self.table = PairRanks(ranks, merged, size)
        self.id_objects = list(range(size))  # one int object per id, shared by all tuples
        self.speller = Speller(unit_ids)
        self.words = _Cache(self.encode_word, cache_size)
        self.chunks = _Cache(self.encode_chunk, cache_size)

    def encode_words(self, words):
        """`encode_word` of each of a list of pre-tokens, as a list of tuples."""
        if len(words) < self.MANY:
            return list(map(self.encode_word, words))
        ids, lengths, spelled = self.speller.spell(words)
        ids, lengths = merge_words(ids, lengths, self.table)
        flat = list(map(self.id_objects.__getitem__, ids.tolist()))
        ends = np.cumsum(lengths).tolist()
        encoded = iter([tuple(flat[a:b]) for a, b in zip([0, *ends], ends)])
        if spelled.all():
            return list(encoded)
        return [next(encoded) if ok else self.encode_word(w)  # byte fallback: one by one
                for w, ok in zip(words, spelled.tolist())]

    def encode_chunk(self, chunk):
        """Ids of ``" " + chunk``, where `chunk` holds no whitespace."""
        words = chunk_words(chunk)
        if len(words) == 1:
            return self.encode_word(words[0])
        return tuple(chain.from_iterable(map(self.words.__getitem__, words)))

    def encode_chunks(self, chunks):
        """Put `encode_chunk` of each chunk (a collection without repeats) into the chunk
        cache, the words of all of them encoded together by `encode_words`."""
        # `chunk_words` of every chunk, unrolled: the chunks that `one_word` recognises are
        # one word each, the others are cut by the regex.
        alone = list(map(one_word, chunks))
        single = list(compress(chunks, alone))
        multiple = [(c, PRETOKEN.findall(" " + c)) for c in compress(chunks, map(not_, alone))]
        new = list(dict.fromkeys(w for _, words in multiple for w in words
                                 if w not in self.words))
        encoded = self.encode_words(list(map(" ".__add__, single)) + new)
        self.words.put(zip(new, encoded[len(single):]))
        self.chunks.put(zip(single, encoded))
        get = self.words.__getitem__
        self.chunks.put([(c, tuple(chain.from_iterable(map(get, words))))
                         for c, words in multiple])

    def encode(self, text):
        """Ids of one line of text (with its dummy-prefix space); ``[]`` for ``""``."""
        if not text:
            return []
        if single_spaced(text):
            return list(chain.from_iterable(map(self.chunks.__getitem__, text.split(" "))))
        return list(chain.from_iterable(map(self.words.__getitem__,
                                            PRETOKEN.findall(" " + text))))

    def encode_batch(self, lines):
        """`encode` of each line, `BLOCK` lines at a time, a block's missing chunks encoded
        together (`encode_chunks`). A block is read in one of two ways:

        * **misses first** (`_new_chunks`), while the cache is cold: split the lines, look
          each distinct chunk up once, encode the missing ones, then read every line;
        * **deferred** (`_read_deferring`), once most chunks are cached: read the lines,
          the chunks the cache lacks recorded instead of computed, encode those and read
          again only the lines that had one.

        The first block is read misses first if the cache holds fewer chunks than a block
        has lines, a later one if the block before it had at least one new chunk per line.
        The garbage collector is paused meanwhile: encoding makes no reference cycles, and
        the collector's passes over the filling caches cost ~10% of a cold run."""
        lines = lines if isinstance(lines, list) else list(lines)
        enabled = gc.isenabled()
        gc.disable()
        try:
            out, cold = [], len(self.chunks) < self.BLOCK
            for start in range(0, len(lines), self.BLOCK):
                block = lines[start:start + self.BLOCK]
                # `encode`'s fast path; every line is on it iff the lines joined by spaces are
                fast = [True] * len(block) if single_spaced(" ".join(block)) else \
                    list(map(single_spaced, block))
                # Only single spaces in those lines: their split() is their chunks.
                chunks = list(map(str.split, block))
                if cold:
                    new = self._new_chunks(chunks)
                    if new:
                        self.encode_chunks(new)
                    ids = self._read(block, fast, chunks)
                else:
                    ids, new = self._read_deferring(block, fast, chunks)
                cold = len(new) >= len(block)
                out.extend(ids)
            return out
        finally:
            if enabled:
                gc.enable()

    def _new_chunks(self, chunks):
        """The distinct chunks among `chunks` (each line's split()) that the chunk cache
        lacks, in order of appearance."""
        seen = dict.fromkeys(chain.from_iterable(chunks))
        if not self.chunks:
            return list(seen)
        return [chunk for chunk in seen if chunk not in self.chunks]

    def _read(self, block, fast, chunks):
        """`encode` of each line of `block`: every line read from the chunk cache by its
        `chunks` (by maps of maps: no Python code runs per line, ~17% faster than a list
        comprehension), then the lines off the `fast` path, whose split() is not their
        chunks, encoded again by `encode`."""
        read = partial(map, self.chunks.__getitem__)
        ids = list(map(list, map(chain.from_iterable, map(read, chunks))))
        for i in compress(range(len(block)), map(not_, fast)):
            ids[i] = self.encode(block[i])
        return ids

    def _read_deferring(self, block, fast, chunks):
        """`_read` with the chunk cache's misses deferred, then encoded together and their
        lines read again. Returns (the lines' ids, the new chunks)."""
        self.chunks.deferred = deferred = []
        try:
            ids = self._read(block, fast, chunks)
        finally:
            self.chunks.deferred = None
        new = list(dict.fromkeys(deferred))   # in order of appearance
        if new:
            self.encode_chunks(new)
            encode = self.encode
            for i, line_ids in enumerate(ids):
                if fast[i] and -1 in line_ids:   # only fast-path lines read the chunk cache
                    ids[i] = encode(block[i])
        return ids, new
