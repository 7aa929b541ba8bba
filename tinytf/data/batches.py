"""Parallel text in, padded integer batches out.

Three steps, one class each:

1. :func:`read_parallel` reads two UTF-8 files, one sentence per line, and checks them (errors
   name the file, the line and the problem).
2. :class:`ParallelCorpus` encodes them with a BPE model and drops pairs longer than ``max_len``
   (counted in ``n_skipped_long`` so that train.py can log them).
3. :class:`BatchIterator` cuts the corpus into token-based batches: pairs are sorted by length and
   chunked so that a batch's *padded* size, ``B * max(len)``, stays within ``max_tokens`` for the
   source and for the target; the batch order is shuffled per epoch from ``(seed, epoch)``. Its
   position is a small JSON-able dict (``state_dict``) so that a resumed run continues exactly,
   and it shards batches over data-parallel ranks.

Sequences (the Transformer paper's setup)::

    src     = x_1 ... x_m </s>
    tgt_in  = <s> y_1 ... y_n          (decoder input)
    tgt_out = y_1 ... y_n </s>         (what the decoder must predict)

Everything here is NumPy integers; no Tensors.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from tinytf.text import BOS_ID, EOS_ID, PAD_ID


class DataError(ValueError):
    """A data file is unusable; the message names the file, the line and the problem."""


def text_problem(block: bytes, path, first_line: int = 0, at_start: bool = True) -> None:
    """A :class:`DataError` for bytes that are not one-sentence-a-line UTF-8 text, naming
    the file and line: a UTF-16 or UTF-32 byte-order mark (``at_start``: ``block`` opens the
    file), a NUL byte (never in text; binary, or UTF-16 without a mark), or carriage returns
    with no newline at all (CR-only line ends, which would read as one giant line).
    ``first_line``: the 0-based number of the line that ``block`` starts."""
    if at_start:
        for mark, name in ((b"\xff\xfe\x00\x00", "UTF-32"), (b"\x00\x00\xfe\xff", "UTF-32"),
                           (b"\xff\xfe", "UTF-16"), (b"\xfe\xff", "UTF-16")):
            if block.startswith(mark):
                raise DataError(f"{path}: {name} text (byte-order mark {mark.hex(' ')}); "
                                "tinytf reads UTF-8: convert it, e.g. iconv -f "
                                f"{name} -t UTF-8")
    nul = block.find(b"\0")
    if nul >= 0:
        line = first_line + block.count(b"\n", 0, nul) + 1
        raise DataError(f"{path}: line {line}: a NUL byte (0x00): not UTF-8 text (UTF-16 "
                        "without a byte-order mark, or a binary file?)")
    if at_start and b"\r" in block and b"\n" not in block:
        raise DataError(f"{path}: line ends are carriage returns (CR) only, with no newline: "
                        "one sentence a line needs \\n (or \\r\\n) line ends; convert them, "
                        "e.g. tr '\\r' '\\n'")


def read_lines(path) -> list[str]:
    """Read ``path`` as UTF-8, one sentence per line, and return the lines without ``\\n``.

    Only ``\\n`` ends a line (``\\r\\n`` is accepted too): ``str.splitlines`` would also split on
    U+2028, U+0085 and friends, which may appear inside a sentence and would misalign a pair.
    A leading byte-order mark is dropped. Raises :class:`DataError` for an empty file or invalid
    UTF-8 (with the line number and the byte offset).
    """
    with open(path, "rb") as f:
        raw = f.read()
    if not raw.strip():
        raise DataError(f"{path}: empty file (expected one sentence per line)")
    text_problem(raw, path)
    return decode_block(raw, path)


def decode_block(raw: bytes, path, first_line: int = 0, first_byte: int = 0) -> list[str]:
    """The lines of ``raw``, a block of whole lines of ``path`` that starts at line
    ``first_line`` (0-based) and byte ``first_byte`` of the file, decoded as :func:`read_lines`
    decodes a whole file (a byte-order mark is dropped at the file's start only). Errors name
    the file's line and byte offset, so that a file read in blocks reports as a whole one."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = first_line + raw.count(b"\n", 0, e.start) + 1
        nth = e.start - raw.rfind(b"\n", 0, e.start)  # 1 = the line's first byte
        raise DataError(
            f"{path}: line {line}: invalid UTF-8 at byte offset {first_byte + e.start} of the "
            f"file (byte {nth} of the line): {e.reason}") from None
    if first_byte == 0 and text.startswith("\ufeff"):
        text = text[1:]
    lines = text.split("\n")
    if lines[-1] == "":  # the usual final newline, not an extra empty line
        lines.pop()
    return [line[:-1] if line.endswith("\r") else line for line in lines]


def read_parallel(src_path, tgt_path) -> tuple[list[str], list[str]]:
    """Read a pair of parallel files; line i of one translates line i of the other.

    Returns ``(src_lines, tgt_lines)``. Raises :class:`DataError` if either file is empty or not
    UTF-8, or if the line counts differ (naming the first line that has no partner).
    """
    src, tgt = read_lines(src_path), read_lines(tgt_path)
    if len(src) != len(tgt):
        raise unpaired(src_path, tgt_path, len(src), len(tgt))
    return src, tgt


def unpaired(src_path, tgt_path, n_src: int, n_tgt: int) -> DataError:
    """The error for parallel files of ``n_src`` and ``n_tgt`` lines: it names the first line
    of the longer file that has no partner."""
    longer, shorter = (src_path, tgt_path) if n_src > n_tgt else (tgt_path, src_path)
    return DataError(f"{longer}: line {min(n_src, n_tgt) + 1}: no partner line in {shorter} "
                     f"({src_path} has {n_src} lines, {tgt_path} has {n_tgt})")


def count_lines(path, block_bytes=1 << 24) -> int:
    """The number of lines of ``path`` (a last line without ``\\n`` counts), read in blocks;
    a :class:`DataError` where the bytes are not text (:func:`text_problem`: checked on the
    first block for byte-order marks and CR-only line ends, on every block for NUL)."""
    count, last, first = 0, b"\n", True
    with open(path, "rb") as f:
        while block := f.read(block_bytes):
            text_problem(block, path, count, at_start=first)
            count += block.count(b"\n")
            last, first = block[-1:], False
    return count + (last != b"\n")


def check_parallel_files(src_path, tgt_path) -> int:
    """The number of pairs of two parallel files, streaming (memory bounded whatever their
    size); a :class:`DataError` for an empty file or unequal line counts, as
    :func:`read_parallel` words them. Decoding is checked by whoever reads the text."""
    n_src, n_tgt = count_lines(src_path), count_lines(tgt_path)
    for path, n in ((src_path, n_src), (tgt_path, n_tgt)):
        if n == 0:
            raise DataError(f"{path}: empty file (expected one sentence per line)")
    if n_src != n_tgt:
        raise unpaired(src_path, tgt_path, n_src, n_tgt)
    return n_src


class ParallelCorpus:
    """Sentence pairs encoded to token ids, stored flat (one int32 array per side plus offsets).

    ``src_lengths[i] = len(x_i) + 1`` (with ``</s>``) and ``tgt_lengths[i] = len(y_i) + 1`` (the
    length of both ``tgt_in`` and ``tgt_out``). A pair is skipped when either length exceeds
    ``max_len`` (counted in ``n_skipped_long``) or either side is an empty line (counted in
    ``n_skipped_empty``); ``kept`` maps corpus index to line index (0-based) in the files.
    """

    def __init__(self, src_lines, tgt_lines, bpe, max_len=256, name="corpus"):
        if len(src_lines) != len(tgt_lines):
            raise DataError(
                f"{name}: {len(src_lines)} source lines but {len(tgt_lines)} target lines")
        src_ids = bpe.encode_batch(list(src_lines))
        tgt_ids = bpe.encode_batch(list(tgt_lines))
        if len(src_ids) != len(src_lines) or len(tgt_ids) != len(tgt_lines):
            raise ValueError(f"{name}: bpe.encode_batch returned a different number of lines")
        n_skipped_long = n_skipped_empty = 0
        kept = []
        for i, (x, y) in enumerate(zip(src_ids, tgt_ids)):
            if len(x) == 0 or len(y) == 0:
                n_skipped_empty += 1
            elif max_len is not None and max(len(x), len(y)) + 1 > max_len:
                n_skipped_long += 1
            else:
                kept.append(i)
        src, src_off = _flatten([src_ids[i] for i in kept])
        tgt, tgt_off = _flatten([tgt_ids[i] for i in kept])
        self._set(src, src_off, tgt, tgt_off, np.asarray(kept, dtype=np.int64), name=name,
                  max_len=max_len, n_lines=len(src_lines), n_skipped_long=n_skipped_long,
                  n_skipped_empty=n_skipped_empty)

    @classmethod
    def from_arrays(cls, src, src_offsets, tgt, tgt_offsets, kept, *, name, max_len, n_lines,
                    n_skipped_long, n_skipped_empty) -> "ParallelCorpus":
        """A corpus over arrays already encoded and filtered (NumPy arrays or memory maps, as
        :mod:`tinytf.data.corpus_file` opens them): ``src[src_offsets[i]:src_offsets[i + 1]]`` is
        source sentence i without ``</s>``, the same for ``tgt``; ``kept[i]`` is its line."""
        corpus = cls.__new__(cls)
        corpus._set(src, src_offsets, tgt, tgt_offsets, kept, name=name, max_len=max_len,
                    n_lines=n_lines, n_skipped_long=n_skipped_long,
                    n_skipped_empty=n_skipped_empty)
        return corpus

    def _set(self, src, src_off, tgt, tgt_off, kept, *, name, max_len, n_lines,
             n_skipped_long, n_skipped_empty):
        self.name = name
        self.max_len = max_len
        self.n_lines = n_lines
        self.n_skipped_long = n_skipped_long
        self.n_skipped_empty = n_skipped_empty
        self.kept = kept
        self._src, self._src_off = src, src_off
        self._tgt, self._tgt_off = tgt, tgt_off
        self.src_lengths = np.diff(src_off) + 1  # + </s>
        self.tgt_lengths = np.diff(tgt_off) + 1  # + <s> on tgt_in, + </s> on tgt_out

    @classmethod
    def from_files(cls, src_path, tgt_path, bpe, max_len=256):
        """Read (:func:`read_parallel`) and encode a pair of parallel files."""
        src, tgt = read_parallel(src_path, tgt_path)
        return cls(src, tgt, bpe, max_len=max_len, name=f"{src_path} / {tgt_path}")

    def __len__(self):
        return len(self.src_lengths)

    def source(self, i) -> np.ndarray:
        """Token ids of source sentence ``i`` without ``</s>`` (int32)."""
        return self._src[self._src_off[i]:self._src_off[i + 1]]

    def target(self, i) -> np.ndarray:
        """Token ids of target sentence ``i`` without ``<s>``/``</s>`` (int32)."""
        return self._tgt[self._tgt_off[i]:self._tgt_off[i + 1]]

    def collate(self, indices) -> "Batch":
        """Build the padded :class:`Batch` of the pairs ``indices``."""
        indices = np.asarray(indices, dtype=np.int64)
        b = len(indices)
        s, t = int(self.src_lengths[indices].max()), int(self.tgt_lengths[indices].max())
        src = np.full((b, s), PAD_ID, dtype=np.int64)
        tgt_in = np.full((b, t), PAD_ID, dtype=np.int64)
        tgt_out = np.full((b, t), PAD_ID, dtype=np.int64)
        for row, i in enumerate(indices):
            x, y = self.source(i), self.target(i)
            src[row, :len(x)] = x
            src[row, len(x)] = EOS_ID
            tgt_in[row, 0] = BOS_ID
            tgt_in[row, 1:len(y) + 1] = y
            tgt_out[row, :len(y)] = y
            tgt_out[row, len(y)] = EOS_ID
        return Batch(src, tgt_in, tgt_out,
                     n_src_tokens=int(self.src_lengths[indices].sum()),
                     n_tgt_tokens=int(self.tgt_lengths[indices].sum()),
                     indices=indices)


def _flatten(seqs):
    """Concatenate int sequences into one int32 array plus (n + 1,) int64 offsets."""
    lengths = np.fromiter((len(q) for q in seqs), dtype=np.int64, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    flat = np.fromiter((t for q in seqs for t in q), dtype=np.int32, count=int(offsets[-1]))
    return flat, offsets


@dataclasses.dataclass
class Batch:
    """A padded batch. ``src`` (B, S), ``tgt_in`` and ``tgt_out`` (B, T) are int64, padded with
    PAD_ID; ``n_src_tokens`` / ``n_tgt_tokens`` count the non-pad tokens (``n_tgt_tokens`` is the
    number of predictions, the loss normaliser); ``indices`` are the corpus indices of the rows."""

    src: np.ndarray
    tgt_in: np.ndarray
    tgt_out: np.ndarray
    n_src_tokens: int
    n_tgt_tokens: int
    indices: np.ndarray

    def __len__(self):
        return len(self.indices)


def pack_by_length(src_lengths, tgt_lengths, max_tokens, max_sentences=None) -> np.ndarray:
    """Greedy cut of a length-sorted sequence of pairs into batches; returns the batch boundaries.

    Pairs ``boundaries[k]:boundaries[k+1]`` form batch k, chosen so that
    ``size * max(src_lengths) <= max_tokens`` and ``size * max(tgt_lengths) <= max_tokens``
    (padded tokens) and ``size <= max_sentences``: each batch takes as many pairs as fit.
    Raises ValueError if one pair alone is too big.

    The two bounds are one, ``size * max(longer side) <= max_tokens``, and along a batch both
    factors only grow, so the pairs that fit are a prefix of the window of at most
    ``max_tokens // longest[start]`` pairs: one vectorised test per batch, not a Python step
    per pair (a WMT-sized corpus has millions of pairs and tens of thousands of batches).
    """
    longest = np.maximum(np.asarray(src_lengths), np.asarray(tgt_lengths)).astype(np.int64)
    too_big = np.flatnonzero(longest > max_tokens)
    if len(too_big):
        raise ValueError(
            f"a pair has {longest[too_big[0]]} tokens on one side but max_tokens is "
            f"{max_tokens}: raise max_tokens or skip longer pairs (train_max_len)")
    boundaries, start, n = [0], 0, len(longest)
    while start < n:
        size_cap = max_tokens // int(longest[start])
        if max_sentences is not None:
            size_cap = min(size_cap, max_sentences)
        widest = np.maximum.accumulate(longest[start:start + size_cap])
        fits = np.arange(1, len(widest) + 1) * widest <= max_tokens
        start += int(np.count_nonzero(fits))
        boundaries.append(start)
    return np.asarray(boundaries, dtype=np.int64)


def _check_pairs_fit(corpus, max_tokens: int) -> None:
    """A ValueError naming the corpus's longest pair (file line) if some pair is longer than a
    batch of ``max_tokens`` on one side, with the two settings that make every pair fit."""
    longest = np.maximum(corpus.src_lengths, corpus.tgt_lengths)
    too_long = np.flatnonzero(longest > max_tokens)
    if not len(too_long):
        return
    i = too_long[np.argmax(longest[too_long])]
    raise ValueError(
        f"{corpus.name}: line {int(corpus.kept[i]) + 1}: a pair of {int(longest[i])} tokens on "
        f"its longer side (with </s>) cannot fit a batch of max_tokens={max_tokens} "
        f"(pairs that cannot: {len(too_long):,}): raise max_tokens (--max-tokens) to "
        f"{int(longest[i])}, or skip the longer pairs with train_max_len={max_tokens} "
        f"(--set train_max_len={max_tokens})")


class BatchIterator:
    """Token-based batches of a :class:`ParallelCorpus`, reshuffled every epoch, resumable.

    Batching: pairs are sorted by length (``_length_order``) and cut greedily
    (:func:`pack_by_length`), so a batch has ``B * max(len) <= max_tokens`` padded tokens on each
    side. With ``shuffle``, each epoch draws from ``np.random.default_rng([seed, epoch])`` an
    order for pairs of equal lengths (so batches mix differently every epoch, while the lengths,
    hence the batch boundaries and the number of batches, stay the same) and a permutation of the
    batches.

    Sharding: rank ``r`` of ``world_size`` takes batches ``r, r + world_size, ...`` of the epoch's
    order. With ``drop_uneven`` (training) the last ``n_batches % world_size`` batches of the
    epoch's order are left out so that every rank yields ``len(self)`` batches (which ones changes
    every epoch); without it (evaluation) every batch goes to some rank.

    Iterating yields the rest of the current epoch, then moves to the next one; ``epoch`` starts
    at 1 and ``index`` counts the batches this rank has been handed in the epoch.
    """

    def __init__(self, corpus, max_tokens, max_sentences=None, seed=0, shuffle=True,
                 rank=0, world_size=1, drop_uneven=True):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, {world_size})")
        if max_tokens < 1 or (max_sentences is not None and max_sentences < 1):
            raise ValueError(f"max_tokens ({max_tokens}) and max_sentences ({max_sentences}) "
                             "must be positive")
        self.corpus = corpus
        self.max_tokens = max_tokens
        self.seed = seed
        self.shuffle = shuffle
        self.rank = rank
        self.world_size = world_size
        self.drop_uneven = drop_uneven
        self.epoch = 1
        self.index = 0
        _check_pairs_fit(corpus, max_tokens)
        order = self._length_order(np.arange(len(corpus)))
        self._boundaries = pack_by_length(corpus.src_lengths[order], corpus.tgt_lengths[order],
                                          max_tokens, max_sentences)
        self.n_batches = len(self._boundaries) - 1
        if drop_uneven and self.n_batches < world_size:
            raise ValueError(f"{corpus.name}: {self.n_batches} batches of {max_tokens} tokens "
                             f"cannot feed {world_size} ranks: lower max_tokens")

    def _length_order(self, perm):
        """``perm`` sorted by (max(src, tgt) length, target length, source length).

        The longer side is the primary key because ``max_tokens`` bounds each side: this packs
        fewer, fuller batches than sorting by target length alone (on the shipped data at 4,096
        tokens: 31 batches with 7% padding instead of 36 with 13%). ``lexsort`` is stable, so
        pairs of equal lengths keep their order in ``perm``.
        """
        src, tgt = self.corpus.src_lengths[perm], self.corpus.tgt_lengths[perm]
        return perm[np.lexsort((src, tgt, np.maximum(src, tgt)))]

    def __len__(self):
        """Batches this rank yields per epoch."""
        if self.drop_uneven:
            return self.n_batches // self.world_size
        return len(range(self.rank, self.n_batches, self.world_size))

    def epoch_batches(self, epoch) -> list[np.ndarray]:
        """The corpus indices of every batch of ``epoch``, in order, before sharding."""
        if self.shuffle:
            rng = np.random.default_rng([self.seed, epoch])
            order = self._length_order(rng.permutation(len(self.corpus)))
            batch_order = rng.permutation(self.n_batches)
        else:
            order = self._length_order(np.arange(len(self.corpus)))
            batch_order = np.arange(self.n_batches)
        b = self._boundaries
        return [order[b[k]:b[k + 1]] for k in batch_order]

    def shard(self, batches) -> list[np.ndarray]:
        """This rank's share of one epoch's ``batches``."""
        if self.drop_uneven:
            batches = batches[:len(batches) - len(batches) % self.world_size]
        return batches[self.rank::self.world_size]

    def __iter__(self):
        """Yield this rank's remaining :class:`Batch` es of the current epoch, then move to the
        next epoch."""
        if self.index > 0 and self.index >= len(self):  # saved just after an epoch's last batch
            self.epoch, self.index = self.epoch + 1, 0
        mine = self.shard(self.epoch_batches(self.epoch))
        while self.index < len(mine):
            indices = mine[self.index]
            # Count the batch as handed out before yielding it: a state saved while the caller
            # trains on it resumes with the next one.
            self.index += 1
            yield self.corpus.collate(indices)
        self.epoch, self.index = self.epoch + 1, 0

    def state_dict(self) -> dict:
        """The position as a JSON-able dict (the same on every rank)."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.seed,
                "n_batches": self.n_batches, "world_size": self.world_size}

    def load_state_dict(self, state):
        """Continue from ``state``; refuses a state from a different corpus, batch size or
        seed, since the position would then point at other batches.

        A state saved by another number of ranks continues the epoch where those ranks had
        got to together: ``index * saved_world_size`` batches of the epoch's order, rounded
        up to whole rounds of this many ranks (so up to ``world_size - 1`` batches of that
        epoch are passed over, none is trained twice)."""
        for key in ("seed", "n_batches"):
            if state[key] != getattr(self, key):
                raise ValueError(
                    f"cannot resume the batch iterator: saved {key}={state[key]} but now "
                    f"{key}={getattr(self, key)} (resuming needs the same data, --max-tokens "
                    "and --seed)")
        index, saved_ranks = int(state["index"]), int(state["world_size"])
        if saved_ranks != self.world_size:
            index = min(-(-index * saved_ranks // self.world_size), len(self))
        self.epoch, self.index = int(state["epoch"]), index
