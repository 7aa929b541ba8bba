"""Tests for tinytf.text: lossless round trips, the textbook merges, the incremental learner
against a full-recount reference, determinism, vocabulary size, save/load and file errors, CLI.
"""
import hashlib
import io
import json
import os
import subprocess
import sys
from collections import Counter
from itertools import chain

import numpy as np
import pytest
import regex
from hypothesis import given
from hypothesis import strategies as st

from tinytf.text import BOS_ID, BPE, EOS_ID, PAD_ID, UNK_ID, BPEFileError
from tinytf.text.bpe import FIRST_SYMBOL_ID
from tinytf.text.learn import TextError, count_words, line_ranges
from tinytf.text.pretokenize import (
    EDGE_MARKS,
    PRETOKEN,
    can_be_piece,
    initial_units,
    one_word,
    pretokenize,
    show,
    single_spaced,
)

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")
DATA = os.path.join(ROOT, "data", "ende")
SAMPLE_LINES = 2000  # per language: learning on 4000 real lines takes well under a second


def read_sample(n=SAMPLE_LINES):
    lines = []
    for lang in ("en", "de"):
        with open(os.path.join(DATA, f"train.{lang}"), encoding="utf-8") as f:
            lines += [line.rstrip("\n") for _, line in zip(range(n), f)]
    return lines


@pytest.fixture(scope="module")
def sample():
    return read_sample()


@pytest.fixture(scope="module")
def bpe(sample):
    """A small model learned once per session from real English and German lines."""
    return BPE.learn(sample, vocab_size=1000)


# ---------------------------------------------------------------- references

def reference_learn(lines, vocab_size, min_frequency=2):
    """Textbook BPE: recount every pair after every merge (slow, obviously right).

    Same pre-tokens, alphabet and tie-breaking as BPE.learn: the highest count, then the
    smallest (left, right) strings.
    """
    words = Counter()
    for word, count in count_words(lines).items():
        units = [show(u) if all(map(can_be_piece, u)) else None for u in initial_units(word)]
        symbols = []
        for s in units + [None]:  # byte-spelled symbols split words, as in BPE.learn
            if s is None:
                if symbols:
                    words[tuple(symbols)] += count
                symbols = []
            else:
                symbols.append(s)
    pieces = {s for w in words for s in w} | {"▁"}  # the alphabet
    merges = []
    while FIRST_SYMBOL_ID + len(pieces) < vocab_size:
        pairs = Counter()
        for w, count in words.items():
            for pair in zip(w, w[1:]):
                if pair[0] + pair[1] not in pieces:  # would repeat a piece: never merged
                    pairs[pair] += count
        if not pairs:
            break
        best = min(pairs, key=lambda p: (-pairs[p], p))
        if pairs[best] < min_frequency:
            break
        merges.append(best)
        new = best[0] + best[1]
        pieces.add(new)
        merged = Counter()
        for w, count in words.items():
            out, i = [], 0
            while i < len(w):
                if w[i:i + 2] == best:
                    out.append(new)
                    i += 2
                else:
                    out.append(w[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return merges


def reference_encode_word(bpe, word):
    """Apply every merge in learning order to one pre-token (slow, obviously right)."""
    symbols = [bpe.pieces[i] for i in chain.from_iterable(map(bpe._spell, initial_units(word)))]
    for left, right in bpe.merges:
        out, i = [], 0
        while i < len(symbols):
            if i + 1 < len(symbols) and symbols[i] == left and symbols[i + 1] == right:
                out.append(left + right)
                i += 2
            else:
                out.append(symbols[i])
                i += 1
        symbols = out
    return [bpe.piece_ids[s] for s in symbols]


# ---------------------------------------------------------------- round trips

TRICKY = ["\t", "  ", "   ", "\n", "\r\n", "\x00", "\x1b", "\x7f", "\u00a0", "\u3000", "\u2028",
          "\u200b", "\u200d", "\ufeff", "▁", "▁▁", " ▁", "<0x41>", "<s>", "</s>", "<unk>", "@@",
          "e\u0301", "\u0301", "👩‍👩‍👧", "🎉", "中文", "日本語", "한국어", "שלום", "مرحبا",
          "\u202e", "ß", "İ", "ﬁ", "x" * 50, "Straße.", "(wirklich)", "don't", "A-Dur"]


@st.composite
def tricky_text(draw):
    """Concatenations of arbitrary characters, real words, and tricky fragments."""
    parts = draw(st.lists(st.one_of(st.text(max_size=8), st.sampled_from(TRICKY),
                                    st.sampled_from(["The", " the", "Haus", " und", " ", "."])),
                          max_size=12))
    return "".join(parts)


@given(st.text())
def test_roundtrip_arbitrary_unicode(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


@given(tricky_text())
def test_roundtrip_tricky_text(bpe, text):
    ids = bpe.encode(text)
    assert bpe.decode(ids) == text
    assert all(FIRST_SYMBOL_ID > i >= 4 or i >= FIRST_SYMBOL_ID for i in ids)  # no specials
    assert bpe.decode_pieces(bpe.encode_pieces(text)) == text


@given(tricky_text())
def test_fast_path_matches_pretokens(bpe, text):
    """encode's space-chunk fast path gives exactly the ids of the pre-token path."""
    expected = list(chain.from_iterable(bpe.encode_word(w) for w in pretokenize(text)))
    assert bpe.encode(text) == expected


@given(st.lists(st.one_of(tricky_text(), st.sampled_from(["a b", "a", "", " ", "a "])),
                min_size=1))
def test_a_block_is_single_spaced_iff_every_line_is(lines):
    """`encode_batch` tests a block's lines for the fast path at once, joined by spaces."""
    assert single_spaced(" ".join(lines)) == all(map(single_spaced, lines))


@pytest.mark.parametrize("text", TRICKY + ["", " ", "a", " a ", "\ud800", "x\udfffy",
                                           "\t lead and trail \t", "a\n\nb\n"])
def test_roundtrip_examples(bpe, text):
    assert bpe.decode(bpe.encode(text)) == text


def test_pieces_never_hold_whitespace(bpe):
    """Space-separated pieces (the CLI's output) can be split back unambiguously."""
    text = "a\tb  c\u00a0d\u3000e\r\nf \u2028 g"
    pieces = bpe.encode_pieces(text)
    assert all(p and not any(c.isspace() for c in p) for p in pieces)
    assert bpe.decode_pieces(" ".join(pieces).split()) == text


def test_regex_whitespace_is_str_whitespace():
    """The fast path trusts str.isprintable()/split(" "): every regex \\s must be unprintable."""
    every_char = "".join(map(chr, range(0x110000)))
    for c in regex.findall(r"\s", every_char):
        if c != " ":
            assert not c.isprintable() and c.isspace(), hex(ord(c))


def test_one_word_trusts_str_classes_that_are_the_regex_classes():
    """`one_word` trusts str.isalpha()/isdecimal() and `EDGE_MARKS`: every character they
    accept is in the regex's letters, digits and word-edge class respectively."""
    every_char = "".join(map(chr, range(0x110000)))
    assert regex.fullmatch(r"\p{L}*", "".join(filter(str.isalpha, every_char)))
    assert regex.fullmatch(r"\p{N}*", "".join(filter(str.isdecimal, every_char)))
    assert regex.fullmatch(r"[^\s\p{L}\p{M}\p{N}]*", EDGE_MARKS)


@given(st.text(st.sampled_from(EDGE_MARKS[::3] + "’“¿aZéé́ß19٣²-_x"),
               min_size=1))
def test_one_word_is_one_pretoken(chunk):
    if one_word(chunk):
        assert PRETOKEN.findall(" " + chunk) == [" " + chunk]


def test_one_word_on_the_shipped_corpus(sample):
    """Most chunks with punctuation are recognised, and every one recognised is one word."""
    chunks = {c for line in sample for c in line.split(" ") if c and not c.isalpha()}
    recognised = [c for c in chunks if one_word(c)]
    assert len(recognised) > 0.8 * len(chunks)
    assert all(PRETOKEN.findall(" " + c) == [" " + c] for c in recognised)


def test_decode_skips_special_ids(bpe):
    ids = bpe.encode("Das Kind entwickelt sich normal.")
    assert bpe.decode([BOS_ID] + ids + [EOS_ID, PAD_ID, PAD_ID]) == \
        "Das Kind entwickelt sich normal."
    assert bpe.decode([UNK_ID]) == ""
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    assert bpe.pieces[:4] == ["<pad>", "<s>", "</s>", "<unk>"]


def test_decode_rejects_unknown_ids(bpe):
    with pytest.raises(ValueError, match="id -1 is outside"):
        bpe.decode([5, -1])
    with pytest.raises(ValueError, match=f"id {len(bpe)} is outside"):
        bpe.decode([len(bpe)])


def test_decode_of_bad_bytes_does_not_raise(bpe):
    assert bpe.decode([4 + 0xFF, 4 + 0x41]) == "\ufffdA"


# ---------------------------------------------------------------- learning

TEXTBOOK = ["low"] * 5 + ["lower"] * 2 + ["newest"] * 6 + ["widest"] * 3


def test_textbook_merges():
    """Sennrich et al.'s dictionary, by hand (▁ marks a word start; ties: smaller strings).

    Pairs: (e,s)=(s,t)=9, (w,e)=8, (▁l,o)=(o,w)=7, (▁n,e)=(e,w)=6, ... so "e s" (tie with
    "s t", "e" < "s"), then "es t"=9, then "o w" (tie with "▁l o"; "o" < "▁"), "▁l ow"=7,
    "e w"=6 (ties "▁n e", "w est"), "ew est", "▁n ewest", "d est"=3 (ties "i d", "▁w i"),
    "i dest", "▁w idest", "e r"=2, "▁low er"; then no pair is left.
    """
    bpe = BPE.learn(TEXTBOOK, vocab_size=1000, min_frequency=2)
    assert bpe.merges == [("e", "s"), ("es", "t"), ("o", "w"), ("▁l", "ow"), ("e", "w"),
                          ("ew", "est"), ("▁n", "ewest"), ("d", "est"), ("i", "dest"),
                          ("▁w", "idest"), ("e", "r"), ("▁low", "er")]
    # Symbol counts: e 17, w 13, s 9, t 9, o 7, ▁l 7, ▁n 6, d 3, i 3, ▁w 3, r 2, then the
    # lone space that is always there (0).
    assert bpe.alphabet == ["e", "w", "s", "t", "o", "▁l", "▁n", "d", "i", "▁w", "r", "▁"]
    assert bpe.encode_pieces("lowest newer") == ["▁low", "est", "▁n", "ew", "er"]
    assert bpe.merges == reference_learn(TEXTBOOK, 1000)


def test_min_frequency_and_vocab_size_stop_learning():
    assert len(BPE.learn(TEXTBOOK, vocab_size=1000, min_frequency=3).merges) == 10
    small = BPE.learn(TEXTBOOK, vocab_size=FIRST_SYMBOL_ID + 12 + 3)
    assert len(small) == FIRST_SYMBOL_ID + 12 + 3 and len(small.merges) == 3


def test_vocab_size_respected(sample):
    for size in (300, 700):
        bpe = BPE.learn(sample[:1000], vocab_size=size)
        assert len(bpe) == bpe.vocab_size == size
        assert len(set(bpe.pieces)) == size


def test_vocab_size_too_small():
    with pytest.raises(ValueError, match="at least 260"):
        BPE.learn(TEXTBOOK, vocab_size=100)


def test_alphabet_cut_to_budget():
    """More distinct characters than the budget: the rare ones are spelled in bytes."""
    lines = ["".join(chr(0x4E00 + i) for i in range(j, j + 20)) for j in range(300)]
    bpe = BPE.learn(lines, vocab_size=FIRST_SYMBOL_ID + 50)
    assert len(bpe) <= FIRST_SYMBOL_ID + 50
    assert all(bpe.decode(bpe.encode(line)) == line for line in lines)


@pytest.mark.parametrize("few", [None, 0, 10**9])
def test_pair_that_would_repeat_a_piece_is_skipped(few):
    """Every merge makes a new piece: a pair spelling an existing piece is never merged."""
    from tinytf.text.learn import learn_merges as sequential
    from tinytf.text.learn_array import learn_merges_array

    def learn_merges(*args):
        return sequential(*args) if few is None else learn_merges_array(*args, few=few)
    pieces = [None] * FIRST_SYMBOL_ID + ["▁", "x", "▁x", "y"]
    ids = {p: i for i, p in enumerate(pieces) if p}
    words = [[ids["▁"], ids["x"]], [ids["▁x"], ids["y"]]]  # "▁ x" would make "▁x" again
    merges = learn_merges(words, [5, 1], list(pieces), dict(ids), 1000, 1)
    assert [(pieces[a], pieces[b]) for a, b in merges] == [("▁x", "y")]
    words = [[ids["▁"], ids["x"], ids["y"]], [ids["▁x"], ids["y"]]]  # then "▁x y" would
    merges = learn_merges(words, [5, 1], pieces, ids, 1000, 1)     # repeat "▁xy"
    assert [(pieces[a], pieces[b]) for a, b in merges] == [("x", "y"), ("▁", "xy")]


def test_incremental_learner_matches_full_recount(sample):
    lines = sample[:150] + sample[-150:]
    assert BPE.learn(lines, vocab_size=450).merges == reference_learn(lines, 450)


@given(st.lists(st.text(alphabet="aab b.", max_size=12), max_size=30),
       st.integers(1, 3))
def test_incremental_learner_matches_full_recount_on_repeats(lines, min_frequency):
    """Tiny alphabets give ties and overlapping pairs ("a a a"), where updates go wrong."""
    assert BPE.learn(lines, vocab_size=400, min_frequency=min_frequency).merges == \
        reference_learn(lines, 400, min_frequency)


@pytest.mark.parametrize("few", [0, 4, 10**9])
@pytest.mark.parametrize("min_frequency", [1, 3])
def test_array_learner_equals_sequential(sample, few, min_frequency, monkeypatch):
    """Every merge by NumPy (few=0), every merge in Python (10**9), or both: the merges of
    the sequential `learn_merges`, on real text. At ``min_frequency=3`` many pairs are made
    too rarely to be merged (`learn_array.DEAD`) and wait outside the heap."""
    from tinytf.text import learn, learn_array
    monkeypatch.setattr(learn_array, "FEW", few)
    array = BPE.learn(sample[:1500], vocab_size=1200, min_frequency=min_frequency)

    def sequential_loop(words, freqs, *rest, report=None):  # learn_bpe's arrays as lists
        symbols, lengths = words
        ends = np.cumsum(lengths).tolist()
        lists = [symbols[e - n:e].tolist() for n, e in zip(lengths.tolist(), ends)]
        return learn.learn_merges(lists, freqs.tolist(), *rest)

    monkeypatch.setattr(learn, "learn_merges_array", sequential_loop)
    sequential = BPE.learn(sample[:1500], vocab_size=1200, min_frequency=min_frequency)
    assert len(array.merges) > 800 and array.merges == sequential.merges


@pytest.mark.parametrize("few", [0, 10**9])
@given(lines=st.lists(st.text(alphabet="aab b.", max_size=12), max_size=30),
       min_frequency=st.integers(1, 3))
def test_array_learner_matches_full_recount_on_repeats(few, lines, min_frequency):
    """Ties, adjacent ("abab") and overlapping ("a a a") occurrences in both merge paths."""
    from tinytf.text import learn_array
    saved, learn_array.FEW = learn_array.FEW, few
    try:
        merges = BPE.learn(lines, vocab_size=400, min_frequency=min_frequency).merges
    finally:
        learn_array.FEW = saved
    assert merges == reference_learn(lines, 400, min_frequency)


@given(st.lists(st.text(st.characters(exclude_categories=()), max_size=6)
                | st.sampled_from([" ", "  x", " \tx", " \ud800", " ab", "\u00a0b"]), max_size=20))
def test_spelled_words_are_initial_units(words):
    """`spell_words` (arrays, used by learning) gives `initial_units` of every word, lone
    surrogates and whitespace runs included."""
    from tinytf.text.learn import spell_words, unit_text
    counts = {w: k + 1 for k, w in enumerate(dict.fromkeys(w for w in words if w))}
    units, lengths, counted = spell_words(counts)
    assert [unit_text(u) for u in units.tolist()] == \
        [u for w in counts for u in initial_units(w)]
    assert lengths.tolist() == [len(initial_units(w)) for w in counts]
    assert counted.tolist() == list(counts.values())


@pytest.mark.parametrize("n", [0, 1, 100, 2047, 2048, 50_000])
@pytest.mark.parametrize("largest", [300, 65535, 65536, 1 << 20])
def test_key_order_sorts_pair_keys(n, largest):
    """`key_order` (radix sorts of 16-bit symbols from RADIX_MIN keys on, else an argsort)
    is a permutation that sorts the keys, whichever path it takes (`largest`: the largest
    symbol id there may be)."""
    from tinytf.text.learn_array import key_order
    from tinytf.text.merges import SHIFT
    rng = np.random.default_rng(n + largest)
    left = rng.integers(260, largest + 1, n)
    right = rng.integers(260, min(largest, 600) + 1, n)  # many repeated keys
    keys = (left << SHIFT) | right
    order = key_order(keys, largest)
    assert sorted(order.tolist()) == list(range(n))
    assert (np.diff(keys[order]) >= 0).all()


@given(st.lists(st.integers(0, 0x220000), max_size=50))
def test_distinct_codes_is_numpy_unique(codes):
    """`distinct_codes` (the learner's table of unit codes) equals ``np.unique(...,
    return_inverse=True)``, for every code a unit may have."""
    from tinytf.text.learn import distinct_codes
    codes = np.array(codes, dtype=np.int64)
    distinct, number = distinct_codes(codes)
    expected, expected_number = np.unique(codes, return_inverse=True)
    assert distinct.tolist() == expected.tolist()
    assert number.tolist() == expected_number.ravel().tolist()
    assert distinct.dtype == number.dtype == np.int64


@given(st.lists(st.sampled_from(["Haus", "Häuser", "ein", "einer", "Straße.", "newest",
                                 "aaaa", "abab"]), min_size=1, max_size=8).map(" ".join))
def test_encode_matches_sequential_merges(bpe, text):
    expected = list(chain.from_iterable(reference_encode_word(bpe, w) for w in pretokenize(text)))
    assert bpe.encode(text) == expected


def test_encode_matches_sequential_merges_on_real_words(bpe, sample):
    words = sorted({w for line in sample[:200] for w in pretokenize(line)})
    for w in words:
        assert list(bpe.encode_word(w)) == reference_encode_word(bpe, w), w


def test_array_encoding_equals_encode_word_on_real_words(bpe, sample):
    """`encode_words` (all words at once by NumPy) gives `encode_word` of every pre-token of
    real text, and words with characters outside the alphabet (byte fallback) too."""
    words = list(dict.fromkeys(w for line in sample for w in pretokenize(line)))
    words += [" 中文", "€uro", " x\ud800y", " \t", "  ", " İstanbul"]
    encoder = bpe._encoder
    assert len(words) > 5000
    assert encoder.encode_words(words) == [encoder.encode_word(w) for w in words]


AAB = BPE.learn(["aaaa aab ab.ab aaa b.b"] * 3 + ["a a a", "aaaaaaa ba"], vocab_size=300,
                min_frequency=1)


@given(st.lists(st.text(alphabet="aab.é\t", max_size=10).map(lambda w: " " + w)
                | st.text(alphabet="aab.", min_size=1, max_size=10), min_size=1, max_size=40))
def test_array_encoding_of_repeats_and_overlaps(words):
    """Runs of one symbol ("aaaaaaa": overlapping (a, a) pairs), ties and unknown characters:
    `merge_words` merges as `encode_word` does."""
    from tinytf.text.encode_array import merge_words
    encoder = AAB._encoder
    assert any(len(AAB.pieces[i]) > 2 for i in encoder.encode_word(" aaaaaaa"))
    ids, lengths, spelled = encoder.speller.spell(words)
    known = [w for w, ok in zip(words, spelled.tolist()) if ok]
    merged, counts = merge_words(ids, lengths, encoder.table)
    ends = np.cumsum(counts).tolist()
    assert [tuple(merged[e - n:e].tolist()) for n, e in zip(counts.tolist(), ends)] == \
        [encoder.encode_word(w) for w in known]
    saved, encoder.MANY = encoder.MANY, 0  # the rest by byte fallback, in order
    try:
        assert encoder.encode_words(words) == [encoder.encode_word(w) for w in words]
    finally:
        encoder.MANY = saved


@pytest.mark.parametrize("block, cache_size", [(50_000, 1 << 20), (7, 1 << 20), (100, 300)])
def test_encode_batch_in_blocks_with_small_caches(sample, block, cache_size, monkeypatch):
    """`encode_batch` (a block's missing chunks encoded together, caches emptied when full)
    gives `encode` of each line, lines off the fast path (tabs, double spaces, edges) too."""
    from tinytf.text.encode import PieceEncoder
    monkeypatch.setattr(PieceEncoder, "BLOCK", block)
    lines = sample[:400] + ["a\tb c", "  double  spaces ", " lead", "trail ", "", "x  y",
                            "中文 und €", "Haus Haus Haus"] + sample[:50]
    reference = BPE.learn(sample, vocab_size=1000)
    model = BPE(reference.alphabet, reference.merges, cache_size=cache_size)
    expected = [reference.encode(line) for line in lines]
    ways = []   # how each block was read: misses first, or deferred
    for way in ("_new_chunks", "_read_deferring"):
        method = getattr(PieceEncoder, way)
        monkeypatch.setattr(PieceEncoder, way, lambda self, *a, _m=method, _w=way:
                            ways.append(_w) or _m(self, *a))
    assert model.encode_batch(lines) == expected
    assert ways[0] == "_new_chunks"                # the cold cache's first block
    assert model.encode_batch(lines) == expected  # again, from the filled caches
    assert len(model._encoder.chunks) <= cache_size
    if block == 7:                                # both ways, in blocks of 7 lines
        assert {"_new_chunks", "_read_deferring"} <= set(ways)


def test_training_corpus_has_no_unknown_and_no_bytes(bpe, sample):
    """Every character of the training lines is in the alphabet: no <unk>, no byte pieces."""
    for ids, line in zip(bpe.encode_batch(sample), sample):
        assert min(ids) >= FIRST_SYMBOL_ID, line
        assert bpe.decode(ids) == line


def test_compresses_training_text(bpe, sample):
    chars = sum(len(line) for line in sample)
    pieces = sum(len(ids) for ids in bpe.encode_batch(sample))
    assert pieces < chars / 2.2  # measured 2.44 characters per piece at 1000 pieces


def test_encode_batch_equals_encode(bpe, sample):
    assert bpe.encode_batch(sample[:50]) == [bpe.encode(line) for line in sample[:50]]


def test_files_and_lines_learn_the_same(tmp_path, sample):
    path = tmp_path / "corpus.txt"
    path.write_text("\n".join(sample[:500]) + "\n", encoding="utf-8")
    from_lines = BPE.learn(sample[:500], vocab_size=500)
    assert BPE.learn([str(path)], vocab_size=500).merges == from_lines.merges
    assert BPE.learn(path, vocab_size=500).merges == from_lines.merges
    assert BPE.learn(iter(line + "\n" for line in sample[:500]), vocab_size=500).merges == \
        from_lines.merges


def test_deterministic_across_runs(sample):
    assert BPE.learn(sample[:800], vocab_size=500).merges == \
        BPE.learn(sample[:800], vocab_size=500).merges


def test_deterministic_across_processes(tmp_path):
    """Different hash seeds (set and dict order) must not change the merges."""
    script = ("import hashlib, sys; from tinytf.text import BPE; "
              "b = BPE.learn(sys.stdin.read().split('\\n'), vocab_size=500); "
              "print(hashlib.sha256(repr(b.merges).encode()).hexdigest())")
    lines = read_sample(300)
    digests = set()
    for seed in ("1", "2"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, check=True,
                             input="\n".join(lines), capture_output=True,
                             encoding="utf-8").stdout.strip()
        digests.add(out)
    local = BPE.learn(lines, vocab_size=500)
    digests.add(hashlib.sha256(repr(local.merges).encode()).hexdigest())
    assert len(digests) == 1


@given(st.lists(tricky_text(), max_size=6))
def test_word_counts_fast_path_matches_regex(lines):
    """count_words' space-chunk fast path counts exactly the pre-tokens of every line."""
    lines = [line.replace("\n", " ") for line in lines]
    plain = [line for line in lines  # lines that take the fast path together
             if line and line.isprintable() and "  " not in line and line.strip(" ") == line]
    for block in (lines, plain):
        assert count_words(block) == Counter(w for line in block for w in pretokenize(line))


def test_bad_input_file_names_file_and_line(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    with pytest.raises(TextError, match=r"bad\.txt: line 3: invalid UTF-8"):
        BPE.learn([str(path)], vocab_size=300)
    # Counted in parallel, the error still names the file's line (not the part's).
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(5000)) + b"bad \xff\n")
    with pytest.raises(TextError, match=r"bad\.txt: line 5001: invalid UTF-8"):
        BPE.learn([str(path)], vocab_size=300, workers=2)


def test_parallel_word_counts_equal_one_pass(tmp_path):
    """Byte ranges of whole lines, counted by two processes, add up to one pass's counts
    (a byte-order mark, CRLF ends and a last line without its newline included)."""
    en, de = os.path.join(DATA, "train.en"), os.path.join(DATA, "train.de")
    odd = tmp_path / "odd.txt"
    odd.write_bytes(b"\xef\xbb\xbf" + open(en, "rb").read()[:200000].replace(b"\n", b"\r\n")
                    + b"no newline at the end")
    for paths in ([en, de], [str(odd)]):
        assert count_words(paths, workers=2) == count_words(paths)
    for parts in (1, 3, 8, 1000):
        ranges = line_ranges(en, parts)
        assert ranges[0][0] == 0 and ranges[-1][1] == os.path.getsize(en)
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        with open(en, "rb") as f:
            data = f.read()
        assert all(start == 0 or data[start - 1:start] == b"\n" for start, _ in ranges)
    assert BPE.learn([en, de], 1000, workers=2).merges == BPE.learn([en, de], 1000).merges


# ---------------------------------------------------------------- files

def test_save_load_identical(bpe, sample, tmp_path):
    path = tmp_path / "bpe.json"
    bpe.save(path)
    loaded = BPE.load(path)
    assert loaded.pieces == bpe.pieces and loaded.merges == bpe.merges
    assert loaded.encode_batch(sample) == bpe.encode_batch(sample)
    text = "\t Grüße 🎉 e\u0301 \x00"
    assert loaded.encode(text) == bpe.encode(text)
    doc = json.loads(path.read_text(encoding="utf-8"))
    assert doc["format"] == "tinytf-bpe" and doc["version"] == 1
    assert doc["vocab_size"] == len(bpe) and doc["merges"][0] == " ".join(bpe.merges[0])


def edit(path, change):
    doc = json.loads(path.read_text(encoding="utf-8"))
    change(doc)
    path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")


@pytest.mark.parametrize("damage, message", [
    (lambda p: p.write_text(p.read_text(encoding="utf-8")[:5000], encoding="utf-8"),
     "truncated"),
    (lambda p: p.write_text("", encoding="utf-8"), "empty"),
    (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00"), "not UTF-8"),
    (lambda p: p.write_text("e s\nes t\n", encoding="utf-8"), "not JSON"),
    (lambda p: p.write_text('{"model": {"type": "BPE"}}', encoding="utf-8"), "HuggingFace"),
    (lambda p: p.write_text("[1, 2]", encoding="utf-8"), "not a tinytf BPE model"),
    (lambda p: edit(p, lambda d: d.update(version=2)), "version 2 is not supported"),
    (lambda p: edit(p, lambda d: d.update(special_tokens=["<unk>", "<s>", "</s>", "<pad>"])),
     "special tokens"),
    (lambda p: edit(p, lambda d: d.update(vocab_size=d["vocab_size"] + 1)), "vocab_size"),
    (lambda p: edit(p, lambda d: d["merges"].__delitem__(slice(-5, None))), "vocab_size"),
    (lambda p: edit(p, lambda d: d["merges"].insert(0, "zz qq")), r"merge 0 \('zz' 'qq'\)"),
    (lambda p: edit(p, lambda d: d["merges"].insert(3, "e")), r'merges\[3\]'),
    (lambda p: edit(p, lambda d: d.pop("alphabet")), '"alphabet" is missing'),
])
def test_bad_files_give_clear_errors(bpe, tmp_path, damage, message):
    path = tmp_path / "model.json"
    bpe.save(path)
    damage(path)
    with pytest.raises(BPEFileError, match=message) as info:
        BPE.load(path)
    assert str(path) in str(info.value)


def test_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nothing.json"):
        BPE.load(tmp_path / "nothing.json")


@pytest.mark.parametrize("workers", [1, 2])
def test_learning_reports_its_progress(tmp_path, sample, workers, monkeypatch):
    """``progress`` hears the counting (by bytes of the files), its end, and the merges;
    the model is the one learnt without it."""
    from tinytf.text import learn
    paths = []
    for name, lines in (("a", sample[:300]), ("b", sample[300:600])):
        paths.append(tmp_path / name)
        paths[-1].write_text("\n".join(lines) + "\n", encoding="utf-8")
    quiet = BPE.learn(paths, vocab_size=400, workers=workers)
    monkeypatch.setattr(learn, "PROGRESS_SECONDS", 0.0)
    heard = []
    assert BPE.learn(paths, vocab_size=400, workers=workers, progress=heard.append).merges \
        == quiet.merges
    counting = [line for line in heard if line.startswith("counting words: ")]
    assert counting and counting[-1].startswith("counting words: 100% of 0 MB (")
    assert sum(line.startswith("counted ") and " distinct words, " in line
               for line in heard) == 1
    merging = [line for line in heard if line.startswith("merging: ")]
    assert merging and merging[0].startswith(
        f"merging: {260 + len(quiet.alphabet)} of 400 pieces ("), heard
    assert heard.index(counting[-1]) < heard.index(merging[0])


def test_a_mistyped_file_name_is_not_learnt_as_text(tmp_path, monkeypatch):
    """A list of names of which one is missing, or of paths none of which exists, is an
    error naming the first missing one: not a corpus of file names to learn from. Lines
    with spaces, or a slash among other lines, are text; an iterator is always text."""
    real = tmp_path / "train.en"
    real.write_text("a small text\n", encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    for inputs, missing in (([str(tmp_path / "trian.en"), str(real)], "trian.en"),
                            ([str(tmp_path / "trian.en")], "trian.en"),
                            (["trian.en", "train.en"], "trian.en"),
                            ([str(real), "train.de"], "train.de")):
        with pytest.raises(FileNotFoundError, match=missing):
            BPE.learn(inputs, vocab_size=300)
    for text in (["Hello world.", "and/or", "x/y"], ["a small text", "a/b"],
                 ["one", "two"]):
        assert BPE.learn(text, vocab_size=300).vocab_size > 260
    assert BPE.learn(iter(["a/b", "c/d"]), vocab_size=300).vocab_size > 260


# ---------------------------------------------------------------- command line

def run_cli(monkeypatch, args, data=b""):
    """Run the command line in this process: (exit status, stdout bytes)."""
    from tinytf.commands.bpe import main
    out = io.BytesIO()
    stdout = io.TextIOWrapper(out, encoding="utf-8", newline="\n")
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))
    monkeypatch.setattr(sys, "stdout", stdout)
    status = main(args)
    stdout.flush()
    return status, out.getvalue()


def test_command_line(tmp_path, sample, monkeypatch, capsys):
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(sample[:400]) + "\n", encoding="utf-8")
    model = tmp_path / "bpe.json"
    subprocess.run([sys.executable, "-m", "tinytf.commands.bpe", "learn", "--input", str(corpus),
                    "--vocab-size", "400", "--output", str(model)], cwd=ROOT, check=True,
                   capture_output=True)
    bpe = BPE.load(model)
    assert bpe.merges == BPE.learn(sample[:400], vocab_size=400).merges

    text = "Das Kind entwickelt sich normal.\n\tTabs, \u00a0 and 🎉\r\n\n"
    lines = text.split("\n")[:-1]
    status, pieces = run_cli(monkeypatch, ["encode", "--model", str(model)], text.encode())
    assert status == 0
    assert pieces.decode().split("\n")[:-1] == [" ".join(bpe.encode_pieces(t)) for t in lines]
    assert run_cli(monkeypatch, ["decode", "--model", str(model)], pieces) == (0, text.encode())
    status, ids = run_cli(monkeypatch, ["encode", "--model", str(model), "--ids"], text.encode())
    assert ids.decode().split("\n")[0] == " ".join(map(str, bpe.encode(lines[0])))
    assert run_cli(monkeypatch, ["decode", "--model", str(model)], ids) == (0, text.encode())
    # Two worker processes, many blocks: the same output, in input order.
    many = ("\n".join(sample) + "\n").encode() * 2
    one = run_cli(monkeypatch, ["encode", "--model", str(model)], many)
    assert one[0] == 0 and one[1].count(b"\n") == 2 * len(sample)
    assert run_cli(monkeypatch, ["encode", "--model", str(model), "--workers", "2"], many) == one

    capsys.readouterr()
    good = " ".join(bpe.encode_pieces("ok")).encode()
    assert run_cli(monkeypatch, ["decode", "--model", str(model)],
                   good + b"\nno_such_piece\n")[0] == 2
    assert "<stdin>:2: " in capsys.readouterr().err
    for workers in ("1", "2"):   # with workers: one line from this process, no worker's
        assert run_cli(monkeypatch, ["encode", "--model", str(tmp_path / "none.json"),
                                     "--workers", workers])[0] == 2
        err = capsys.readouterr().err
        assert f"error: {tmp_path / 'none.json'}: No such file" in err and "Trace" not in err
    assert run_cli(monkeypatch, ["decode", "--model", str(model), "--ids"], b"5 x\n")[0] == 2
    assert "<stdin>:1: 'x' is not an id (--ids reads integers)" in capsys.readouterr().err
    # An --input that is no file is an error, not a line of text to learn from.
    missing = tmp_path / "missing.txt"
    for workers in ("1", "2"):
        assert run_cli(monkeypatch, ["learn", "--input", str(corpus), str(missing), "--output",
                                     str(tmp_path / "m.json"), "--workers", workers])[0] == 2
        assert f"--input {missing}: no such file" in capsys.readouterr().err
    assert run_cli(monkeypatch, ["learn", "--input", str(tmp_path), "--output",
                                 str(tmp_path / "m.json")])[0] == 2
    assert f"--input {tmp_path}: a directory, not a file" in capsys.readouterr().err
    assert not (tmp_path / "m.json").exists()
    nowhere = tmp_path / "no_such_dir" / "m.json"
    assert run_cli(monkeypatch, ["learn", "--input", str(corpus), "--output", str(nowhere)])[0] == 2
    assert f"error: {nowhere}: No such file or directory" in capsys.readouterr().err
    before = corpus.read_bytes()
    assert run_cli(monkeypatch, ["learn", "--input", str(corpus), "--output", str(corpus)])[0] == 2
    assert "is the --input file" in capsys.readouterr().err and corpus.read_bytes() == before
    # A vocabulary the text cannot fill: the pieces learnt, of how many asked, and why.
    few = tmp_path / "few.txt"
    few.write_text("a b c\n", encoding="utf-8")
    assert run_cli(monkeypatch, ["learn", "--input", str(few), "--output",
                                 str(tmp_path / "few.json")])[0] == 0
    assert "learned 264 pieces of the 8,000 asked (no further pair occurs 2 times; " in \
        capsys.readouterr().err
