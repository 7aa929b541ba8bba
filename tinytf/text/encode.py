"""Applying learned merges to text: the word encoder and its two caches.

BPE encoding of one word (Sennrich et al., 2016): start from its initial symbols and merge the
adjacent pair with the lowest merge rank, all its occurrences left to right, until no pair has
a merge. That is the same as applying every merge in learning order.

Text is encoded through caches, because a corpus repeats its words (Zipf):

* `Encoder.chunks`: the text between two single spaces -> ids. In a line with no whitespace but
  single spaces between non-spaces (nearly every line), each space starts the word after it,
  so the pre-tokens of the line are those of its chunks: ``line.split(" ")`` and one dict
  lookup per chunk, all in C, encode the whole line.
* `Encoder.words`: pre-token -> ids, for the other lines (tabs, runs of spaces, ...).
"""
import gc
from itertools import chain, islice, repeat

from tinytf.text.pretokenize import PRETOKEN, initial_units

NO_MERGE = (1 << 30) - 1  # the rank of a pair that has no merge; ranks stay one-digit ints


class _Cache(dict):
    """A dict that fills a missing key with ``compute(key)``; emptied when it holds `limit`."""

    def __init__(self, compute, limit):
        super().__init__()
        self.compute = compute
        self.limit = limit

    def __missing__(self, key):
        value = self.compute(key)
        if len(self) >= self.limit:
            self.clear()
        self[key] = value
        return value


def word_encoder(unit_ids, spell, ranks, merged):
    """``encode_word(word) -> tuple of ids``, closed over the model's tables.

    unit_ids: raw text of an alphabet symbol -> id (``" t"`` -> id of ``▁t``); spell(unit):
    the ids of any initial symbol (byte fallback); ranks: (left id, right id) -> merge rank;
    merged: rank -> id of the merged piece. A closure, so the hot loop reads fast locals.
    """
    get = ranks.get
    unit = unit_ids.__getitem__

    def encode_word(word):
        try:  # fast path: every initial symbol is in the alphabet
            if word[0] == " " and len(word) > 1:
                ids = [unit(word[:2]), *map(unit, word[2:])]
            else:
                ids = list(map(unit, word))
        except KeyError:
            ids = list(chain.from_iterable(map(spell, initial_units(word))))
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


class Encoder:
    """Text -> ids with a model's tables: `encode_word` plus the word and chunk caches."""

    def __init__(self, unit_ids, spell, ranks, merged, cache_size=1 << 20):
        self.encode_word = word_encoder(unit_ids, spell, ranks, merged)
        self.words = _Cache(self.encode_word, cache_size)
        self.chunks = _Cache(self.encode_chunk, cache_size)

    def encode_chunk(self, chunk):
        """Ids of ``" " + chunk``, where `chunk` holds no whitespace."""
        if chunk.isalpha():  # letters only: one word
            return self.encode_word(" " + chunk)
        words = PRETOKEN.findall(" " + chunk)
        if len(words) == 1:
            return self.encode_word(words[0])
        return tuple(chain.from_iterable(map(self.words.__getitem__, words)))

    def encode(self, text):
        """Ids of one line of text (with its dummy-prefix space); ``[]`` for ``""``."""
        if not text:
            return []
        if text.isprintable() and "  " not in text and text[0] != " " != text[-1]:
            # Only single spaces between non-spaces: isprintable() is False for every other
            # whitespace character (tests check this against the regex's \s).
            return list(chain.from_iterable(map(self.chunks.__getitem__, text.split(" "))))
        return list(chain.from_iterable(map(self.words.__getitem__,
                                            PRETOKEN.findall(" " + text))))

    def encode_batch(self, lines):
        """`encode` of each line (its fast path inlined). The garbage collector is paused
        meanwhile: encoding makes no reference cycles, and the collector's passes over the
        filling caches cost ~10% of a cold run."""
        enabled = gc.isenabled()
        gc.disable()
        try:
            chunk_ids, encode = self.chunks.__getitem__, self.encode
            return [list(chain.from_iterable(map(chunk_ids, line.split(" "))))
                    if line and line.isprintable() and "  " not in line
                    and line[0] != " " != line[-1] else encode(line)
                    for line in lines]
        finally:
            if enabled:
                gc.enable()
