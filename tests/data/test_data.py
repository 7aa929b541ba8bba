"""Tests for tinytf.data.batches: file checks, token batching, per-epoch shuffling, resume,
sharding, and the shipped corpus in data/ende/."""
import json
import os

import numpy as np
import pytest

from tinytf.data.batches import (
    BatchIterator,
    DataError,
    ParallelCorpus,
    pack_by_length,
    read_lines,
    read_parallel,
)
from tinytf.text import BOS_ID, EOS_ID, PAD_ID

DATA = os.path.join(os.path.dirname(__file__), "..", "..", "data", "ende")


class WordTokenizer:
    """Whitespace "BPE": data.py needs only ``encode_batch``; ids start after the specials."""

    def __init__(self):
        self.vocab = {}

    def encode_batch(self, lines):
        return [[self.vocab.setdefault(w, 4 + len(self.vocab)) for w in line.split()]
                for line in lines]


def write(path, data):
    with open(path, "wb") as f:
        f.write(data)
    return str(path)


def random_corpus(n=300, seed=0, max_words=30, max_len=None):
    """n pairs of random lengths; words encode their pair index so rows can be checked."""
    rng = np.random.default_rng(seed)
    src = [" ".join(f"s{i}" for _ in range(rng.integers(1, max_words))) for i in range(n)]
    tgt = [" ".join(f"t{i}" for _ in range(rng.integers(1, max_words))) for i in range(n)]
    return ParallelCorpus(src, tgt, WordTokenizer(), max_len=max_len)


def epoch_indices(it):
    """All corpus indices of one epoch of ``it``, in order."""
    return [i for batch in it for i in batch.indices.tolist()]


# --- reading files ---------------------------------------------------------------------------

def test_read_parallel_reads_lines(tmp_path):
    src = write(tmp_path / "a.en", "Hello world.\r\nSecond line\u2028still second.\n".encode())
    tgt = write(tmp_path / "a.de", "\ufeffHallo Welt.\nZweite Zeile.".encode())
    assert read_parallel(src, tgt) == (
        ["Hello world.", "Second line\u2028still second."], ["Hallo Welt.", "Zweite Zeile."])


def test_mismatched_line_counts_name_file_and_line(tmp_path):
    src = write(tmp_path / "train.en", b"one\ntwo\nthree\n")
    tgt = write(tmp_path / "train.de", b"eins\nzwei\n")
    with pytest.raises(DataError, match=r"train\.en: line 3: no partner line in .*train\.de"):
        read_parallel(src, tgt)
    with pytest.raises(DataError,
                       match=r"train\.en: line 3: .*train\.de has 2 lines, .*train\.en has 3\)"):
        read_parallel(tgt, src)


def test_invalid_utf8_names_file_line_and_offset(tmp_path):
    path = write(tmp_path / "bad.de", "gut\nnoch gut\nschl\xe4cht\n".encode("latin-1"))
    with pytest.raises(DataError, match=r"bad\.de: line 3: invalid UTF-8 at byte offset 17 "
                                        r"of the file \(byte 5 of the line\)"):
        read_lines(path)


@pytest.mark.parametrize("content", [b"", b"\n\n  \n"])
def test_empty_file_is_an_error(tmp_path, content):
    path = write(tmp_path / "empty.en", content)
    other = write(tmp_path / "full.de", b"a\n")
    with pytest.raises(DataError, match=r"empty\.en: empty file"):
        read_parallel(path, other)


# --- corpus ----------------------------------------------------------------------------------

def test_sequences_and_padding():
    corpus = ParallelCorpus(["a b c", "d", ""], ["x y", "z w v u", "q"], WordTokenizer())
    assert corpus.n_skipped_empty == 1 and len(corpus) == 2
    batch = corpus.collate([0, 1])
    a, b, c, d = 4, 5, 6, 7
    assert batch.src.dtype == np.int64 and batch.tgt_in.dtype == np.int64
    np.testing.assert_array_equal(batch.src, [[a, b, c, EOS_ID], [d, EOS_ID, PAD_ID, PAD_ID]])
    x, y, z, w, v, u = range(8, 14)
    np.testing.assert_array_equal(batch.tgt_in, [[BOS_ID, x, y, PAD_ID, PAD_ID],
                                                 [BOS_ID, z, w, v, u]])
    np.testing.assert_array_equal(batch.tgt_out, [[x, y, EOS_ID, PAD_ID, PAD_ID],
                                                  [z, w, v, u, EOS_ID]])
    assert batch.n_src_tokens == 6 and batch.n_tgt_tokens == 8
    assert batch.n_tgt_tokens == int((batch.tgt_out != PAD_ID).sum())


def test_long_pairs_are_skipped_and_counted():
    src = ["a " * 5, "a " * 9, "a " * 2, "a"]
    tgt = ["b " * 5, "b " * 2, "b " * 10, "b"]
    corpus = ParallelCorpus(src, tgt, WordTokenizer(), max_len=10)  # lengths include </s>
    assert corpus.n_skipped_long == 1
    assert corpus.kept.tolist() == [0, 1, 3]
    assert corpus.src_lengths.tolist() == [6, 10, 2]


# --- batching --------------------------------------------------------------------------------

@pytest.mark.parametrize("max_tokens", [40, 97, 500])
def test_max_tokens_counts_padded_tokens(max_tokens):
    corpus = random_corpus(max_len=40)
    it = BatchIterator(corpus, max_tokens=max_tokens, seed=3)
    sizes = []
    for batch in it:
        assert batch.src.size <= max_tokens and batch.tgt_out.size <= max_tokens
        assert batch.tgt_in.shape == batch.tgt_out.shape
        sizes.append(max(batch.src.size, batch.tgt_out.size))
    # greedy packing: batches are not needlessly small on average
    assert np.mean(sizes) > 0.5 * max_tokens


def test_every_pair_once_per_epoch_and_rows_are_the_right_pairs():
    corpus = random_corpus(n=500, max_len=25)
    assert corpus.n_skipped_long > 0
    it = BatchIterator(corpus, max_tokens=120, seed=1)
    for epoch in (1, 2):
        seen = []
        for batch in it:
            for row, i in enumerate(batch.indices):
                src = batch.src[row][batch.src[row] != PAD_ID]
                assert len(src) == corpus.src_lengths[i] and src[-1] == EOS_ID
                assert np.array_equal(src[:-1], corpus.source(i))
                assert np.array_equal(batch.tgt_out[row][:len(corpus.target(i))], corpus.target(i))
            seen += batch.indices.tolist()
        assert sorted(seen) == list(range(len(corpus)))
        assert it.epoch == epoch + 1 and it.index == 0


def _pack_pair_by_pair(src, tgt, max_tokens, max_sentences=None):
    """The greedy cut written plainly, one pair at a time: the reference for pack_by_length."""
    boundaries, start, ms, mt = [0], 0, 0, 0
    for i, (s, t) in enumerate(zip(src.tolist(), tgt.tolist())):
        size, ms2, mt2 = i - start + 1, max(ms, s), max(mt, t)
        if size * ms2 > max_tokens or size * mt2 > max_tokens or (
                max_sentences is not None and size > max_sentences):
            boundaries.append(i)
            start, ms2, mt2 = i, s, t
        ms, mt = ms2, mt2
    return boundaries + [len(src)] if len(src) else [0]


@pytest.mark.parametrize("sort", [True, False])
@pytest.mark.parametrize("max_tokens,max_sentences", [(64, None), (300, None), (300, 7),
                                                      (50, 1)])
def test_pack_by_length_equals_the_pair_by_pair_cut(sort, max_tokens, max_sentences):
    rng = np.random.default_rng(3)
    src, tgt = rng.integers(1, 50, 2000), rng.integers(1, 50, 2000)
    if sort:
        order = np.lexsort((src, tgt, np.maximum(src, tgt)))
        src, tgt = src[order], tgt[order]
    got = pack_by_length(src, tgt, max_tokens, max_sentences).tolist()
    assert got == _pack_pair_by_pair(src, tgt, max_tokens, max_sentences)
    assert pack_by_length(src[:0], tgt[:0], max_tokens).tolist() == [0]
    with pytest.raises(ValueError, match="49 tokens on one side but max_tokens is 40"):
        pack_by_length(np.array([3, 5, 49]), np.array([4, 2, 3]), 40)


def test_a_pair_longer_than_a_batch_is_named_with_its_line():
    """A corpus whose longest pair cannot fit max_tokens: the error names the corpus, the
    pair's line in the files, its length and the settings that fix it."""
    lines = [["c", "d"], ["", "dropped: an empty side"], ["a b", "a b c d e f g h i j"],
             ["e f g h", "e"], ["x", "y"]]
    corpus = ParallelCorpus([p[0] for p in lines], [p[1] for p in lines], WordTokenizer(),
                            name="train.en / train.de")
    longest = 11                            # line 3's target: 10 words and </s>
    with pytest.raises(ValueError) as e:
        BatchIterator(corpus, max_tokens=longest - 1)
    message = str(e.value)
    assert message.startswith(f"train.en / train.de: line 3: a pair of {longest} tokens")
    assert f"raise max_tokens (--max-tokens) to {longest}" in message
    assert f"--set train_max_len={longest - 1}" in message
    assert len(BatchIterator(corpus, max_tokens=longest, shuffle=False)) >= 1


def test_batches_are_grouped_by_length():
    corpus = random_corpus(n=500)
    it = BatchIterator(corpus, max_tokens=200, seed=0)
    padded = sum(b.src.size + b.tgt_out.size for b in it)
    real = int(corpus.src_lengths.sum() + corpus.tgt_lengths.sum())
    # Independent random source and target lengths, so the shorter side of a pair pads a lot
    # anyway; batches of the same sizes drawn at random pad 1.65x.
    assert padded < 1.3 * real


def test_shuffle_is_deterministic_and_changes_per_epoch():
    corpus = random_corpus()
    a, b = BatchIterator(corpus, 150, seed=7), BatchIterator(corpus, 150, seed=7)
    a1, b1 = epoch_indices(a), epoch_indices(b)
    assert a1 == b1
    assert epoch_indices(a) != a1  # epoch 2 differs from epoch 1
    assert epoch_indices(BatchIterator(corpus, 150, seed=8)) != a1
    assert len(a) == len(b) and sum(1 for _ in a) == len(a)  # same batch count every epoch
    unshuffled = BatchIterator(corpus, 150, shuffle=False)
    order = epoch_indices(unshuffled)
    lengths = np.maximum(corpus.src_lengths, corpus.tgt_lengths)[order]
    assert (np.diff(lengths) >= 0).all()


def test_resume_mid_epoch_is_exact():
    corpus = random_corpus()
    straight = BatchIterator(corpus, 150, seed=5)
    expected = [b.indices.tolist() for _ in range(3) for b in straight]

    first = BatchIterator(corpus, 150, seed=5)
    got = []
    for batch in first:  # one full epoch, then stop in the middle of the second
        got.append(batch.indices.tolist())
    for batch in first:
        got.append(batch.indices.tolist())
        if first.index == 4:
            break
    state = json.loads(json.dumps(first.state_dict()))
    assert state["epoch"] == 2 and state["index"] == 4

    resumed = BatchIterator(corpus, 150, seed=5)
    resumed.load_state_dict(state)
    for _ in range(2):
        got += [b.indices.tolist() for b in resumed]
    assert got == expected


def test_resume_just_after_an_epochs_last_batch():
    corpus = random_corpus()
    it = BatchIterator(corpus, 150, seed=5)
    batches = []
    for batch in it:
        batches.append(batch)
        if it.index == len(it):
            break  # the generator has not yet moved to the next epoch
    resumed = BatchIterator(corpus, 150, seed=5)
    resumed.load_state_dict(it.state_dict())
    reference = BatchIterator(corpus, 150, seed=5)
    reference.load_state_dict({**reference.state_dict(), "epoch": 2})
    assert epoch_indices(resumed) == epoch_indices(reference)


def test_resume_refuses_a_different_setup():
    corpus = random_corpus()
    state = BatchIterator(corpus, 150, seed=5).state_dict()
    with pytest.raises(ValueError, match="n_batches"):
        BatchIterator(corpus, 300, seed=5).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        BatchIterator(corpus, 150, seed=6).load_state_dict(state)


@pytest.mark.parametrize("saved_ranks,ranks", [(2, 1), (1, 2), (3, 2), (2, 4)])
def test_resume_on_another_number_of_ranks_goes_on_from_the_global_position(saved_ranks, ranks):
    """A state saved by ``saved_ranks`` ranks after k batches each (k * saved_ranks of the
    epoch's order) resumed on ``ranks`` ranks: they take the epoch's next batches, from the
    first whole round of ``ranks`` at or after that position, none twice and fewer than
    ``ranks`` passed over; the next epoch is whole."""
    corpus = random_corpus(n=600)
    before = [BatchIterator(corpus, 100, seed=2, rank=r, world_size=saved_ranks)
              for r in range(saved_ranks)]
    k = 3
    seen = []
    for it in before:
        for batch in it:
            seen.append(batch.indices.tolist())
            if it.index == k:
                break
    state = before[0].state_dict()
    after = [BatchIterator(corpus, 100, seed=2, rank=r, world_size=ranks) for r in range(ranks)]
    for it in after:
        it.load_state_dict(state)
    order = [b.tolist() for b in after[0].epoch_batches(1)]
    assert sorted(seen) == sorted(order[:k * saved_ranks])
    start = -(-k * saved_ranks // ranks) * ranks      # the first whole round of `ranks`
    assert start - k * saved_ranks < ranks
    rest = [b.indices.tolist() for it in after for b in it]
    kept = len(order) - len(order) % ranks
    assert sorted(rest) == sorted(order[start:kept])
    assert not set(map(tuple, rest)) & set(map(tuple, seen))
    assert all(it.epoch == 2 and it.index == 0 for it in after)


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_sharding_is_disjoint_covering_and_even(world_size):
    corpus = random_corpus()
    ranks = [BatchIterator(corpus, 100, seed=2, rank=r, world_size=world_size)
             for r in range(world_size)]
    single = BatchIterator(corpus, 100, seed=2)
    for _ in range(2):
        order = [b.tolist() for b in single.epoch_batches(single.epoch)]
        shards = [[b.indices.tolist() for b in it] for it in ranks]
        assert len({len(s) for s in shards}) == 1  # every rank steps the same number of times
        taken = [batch for s in shards for batch in s]
        flat = [i for batch in taken for i in batch]
        assert len(flat) == len(set(flat))  # disjoint
        kept = len(order) - len(order) % world_size
        assert sorted(taken) == sorted(order[:kept])  # covering, minus < world_size batches
        assert shards[1][0] == order[1]
        list(single)
    everything = [BatchIterator(corpus, 100, seed=2, rank=r, world_size=world_size,
                                drop_uneven=False) for r in range(world_size)]
    flat = sorted(i for it in everything for i in epoch_indices(it))
    assert flat == list(range(len(corpus)))


# --- the shipped corpus ----------------------------------------------------------------------

@pytest.mark.parametrize("split,n", [("train", 12098), ("dev", 500), ("test", 1000),
                                     ("phrases", 37152)])
def test_shipped_corpus_line_counts(split, n):
    en, de = read_parallel(os.path.join(DATA, f"{split}.en"), os.path.join(DATA, f"{split}.de"))
    assert len(en) == len(de) == n
    assert all(en) and all(de)


def test_shipped_splits_do_not_overlap():
    sets = {split: set(read_lines(os.path.join(DATA, f"{split}.en")))
            for split in ("train", "dev", "test")}
    assert len(sets["test"]) == 1000 and len(sets["dev"]) == 500
    assert not sets["test"] & sets["train"] and not sets["dev"] & sets["train"]
    assert not sets["test"] & sets["dev"]


def test_shipped_corpus_batches():
    en, de = read_parallel(os.path.join(DATA, "dev.en"), os.path.join(DATA, "dev.de"))
    corpus = ParallelCorpus(en, de, WordTokenizer(), max_len=64)
    it = BatchIterator(corpus, max_tokens=1024, seed=1)
    assert sorted(epoch_indices(it)) == list(range(len(corpus)))


# --- scripts/make_ende_corpus.py -------------------------------------------------------------

def load_corpus_script():
    import importlib.util
    path = os.path.join(os.path.dirname(__file__), "..", "..", "scripts", "make_ende_corpus.py")
    spec = importlib.util.spec_from_file_location("make_ende_corpus", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DICTIONARY = """\
# Version :: test
Haus {n} | Das Haus ist sehr alt. | Er kauft sich ein Haus. :: house | The house is very old. | He buys himself a house.
etw. tun | Sie hat etw. gesagt, oder? | Ich tue es jetzt gleich. :: to do sth. | She said sth., didn't she? | I am doing it right now.
Katze | Die Katze schläft auf dem Sofa. :: cat | The cat is sleeping on the sofa [Br.].
Hund | Der Hund bellt. | das ist ein kleiner Hund. | Der Hund bellt sehr laut! :: dog | The dog barks. | that is a small dog. | The dog barks very loudly!
Baum | Der Baum ist grün; er wächst. :: tree | The tree is green.
Vogel | Der Vogel singt am Morgen. | Ein Vogel singt / pfeift am Morgen. :: bird | The bird sings in the morning. | A bird sings in the morning.
Schiff | Das Haus ist sehr alt. :: ship | The ship is very old.
Zahl | 42 ist eine gute Zahl. :: number | 42 is a good number.
kaputt | Das ist leider kaputt. :: broken | That is (sadly) broken.
das Auto fahren; den Wagen fahren {vt} :: to drive the car; to drive the automobile
"""


def test_corpus_filters_keep_only_whole_sentences():
    script = load_corpus_script()
    splits = script.build(DICTIONARY, seed=1234)
    sentences = sorted(p for split in ("train", "dev", "test") for p in splits[split])
    assert sentences == sorted([
        ("Das Haus ist sehr alt.", "The house is very old."),
        ("Er kauft sich ein Haus.", "He buys himself a house."),
        ("Ich tue es jetzt gleich.", "I am doing it right now."),
        ("Der Hund bellt sehr laut!", "The dog barks very loudly!"),
        ("Der Vogel singt am Morgen.", "The bird sings in the morning."),
        ("42 ist eine gute Zahl.", "42 is a good number."),
    ])  # the second "Das Haus ist sehr alt." (a duplicate German side) is dropped
    phrases = set(splits["phrases"])
    assert ("das Auto fahren", "to drive the car") in phrases
    assert ("Das ist leider kaputt.", "That is broken.") in phrases
    assert not any(de == "Das Haus ist sehr alt." for de, _ in phrases)
    assert script.build(DICTIONARY, seed=1234) == splits


def test_corpus_script_reads_a_deb(tmp_path):
    import io
    import tarfile
    script = load_corpus_script()
    payload = DICTIONARY.encode("utf-8")
    tar_bytes = io.BytesIO()
    with tarfile.open(fileobj=tar_bytes, mode="w:xz") as tar:
        info = tarfile.TarInfo("./usr/share/trans/de-en")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    members = [("debian-binary", b"2.0\n"), ("data.tar.xz", tar_bytes.getvalue())]
    deb = b"!<arch>\n"
    for name, body in members:
        header = f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(body):<10}`\n".encode("ascii")
        deb += header + body + (b"\n" if len(body) % 2 else b"")
    path = write(tmp_path / "trans-de-en_test_all.deb", deb)
    assert script.read_source(path) == DICTIONARY


@pytest.mark.skipif(not os.environ.get("TINYTF_ENDE_DEB"),
                    reason="set TINYTF_ENDE_DEB to trans-de-en_1.9-6_all.deb to check the rebuild")
def test_shipped_corpus_rebuilds_byte_for_byte():
    script = load_corpus_script()
    assert script.main([os.environ["TINYTF_ENDE_DEB"], "--out", DATA, "--check"]) == 0
