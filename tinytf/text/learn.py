"""Learning BPE from text: counting the words, then the merges.

`learn_bpe` counts the pre-tokens of the input (`count_words`, in parallel processes over byte
ranges of the files), spells each distinct word in its initial symbols, cuts the alphabet to
the budget, and hands the words and their counts to the merge loop:
`tinytf.text.learn_array.learn_merges_array`, which does the large first merges with NumPy and
the rest with `tinytf.text.merges.learn_merges`, the sequential loop (the same merges; see
those modules for the algorithm and its tie-breaking).
"""
import errno
import os
import re
import time
from collections import Counter
from itertools import compress
from operator import not_

import numpy as np

from tinytf.text.learn_array import learn_merges_array
from tinytf.text.merges import MAX_SYMBOLS, learn_merges  # noqa: F401 (re-exported)
from tinytf.text.pretokenize import (
    LINE_START,
    PRETOKEN,
    can_be_piece,
    one_word,
    show,
    single_spaced,
)
from tinytf.utils.workers import ordered_map


class TextError(ValueError):
    """A text file to learn from is unusable; the message names the file and the line."""


PROGRESS_SECONDS = 30.0


class Reporter:
    """Progress lines of a long learning: ``report(line_fn)`` passes ``line_fn()`` to ``say``
    at most once every ``every`` seconds (default :data:`PROGRESS_SECONDS`; ``now=True``: at
    once); nothing without ``say``."""

    def __init__(self, say=None, every=None):
        self.say, self.every = say, PROGRESS_SECONDS if every is None else every
        self.start = self.last = time.perf_counter()

    def __call__(self, line_fn, now=False) -> None:
        if self.say is None:
            return
        t = time.perf_counter()
        if now or t - self.last >= self.every:
            self.last = t
            self.say(f"{line_fn()} ({t - self.start:,.0f} s)")


def count_words_in_text(text, counter):
    """Add the pre-tokens of a block of lines to `counter` ("\n" tokens included).

    Each non-empty line gets the dummy-prefix space, as `pretokenize` gives a single line.
    Fast path, as in encoding (`tinytf.text.encode`): when the lines hold no whitespace but
    single spaces between non-spaces, count the space-separated chunks in C and cut only each
    distinct chunk that `one_word` does not recognise with the regex.
    """
    if text.endswith("\n"):
        text = text[:-1]
    flat = text.replace("\n", " ")
    if single_spaced(flat):
        chunks = Counter(flat.split(" "))
        alone = list(map(one_word, chunks))  # each distinct chunk that is one word: one key
        counter.update(dict(zip(map(" ".__add__, compress(chunks, alone)),
                                compress(chunks.values(), alone))))
        for chunk, count in compress(chunks.items(), map(not_, alone)):
            for word in PRETOKEN.findall(" " + chunk):
                counter[word] += count
    else:
        counter.update(PRETOKEN.findall(LINE_START.sub(" ", text)))


def count_words_in_file(path, counter, block_bytes=1 << 22, start=0, end=None,
                        on_block=None):
    """Count the pre-tokens of a UTF-8 text file, read in blocks of whole lines: the whole
    file, or the lines that start in bytes ``[start, end)`` (``start`` a line's first byte).
    ``on_block(n)`` is called after each block of ``n`` bytes.

    Raises :class:`TextError` naming the file and line if the file is not valid UTF-8.
    """
    with open(path, "rb") as f:
        f.seek(start)
        at = start
        while end is None or at < end:
            data = f.read(block_bytes if end is None else min(block_bytes, end - at))
            if not data:
                break
            if not data.endswith(b"\n"):
                data += f.readline()  # whole lines; `end` is a line's start, so not past it
            try:
                text = data.decode("utf-8")
            except UnicodeDecodeError as e:
                bad_line = _lines_before(path, at) + data.count(b"\n", 0, e.start) + 1
                raise TextError(f"{path}: line {bad_line}: invalid UTF-8 ({e.reason})") from None
            if at == 0 and text.startswith("\ufeff"):
                text = text[1:]  # a byte-order mark is not text
            if "\r" in text:
                text = text.replace("\r\n", "\n")  # as Python's universal newlines would
            at += len(data)
            count_words_in_text(text, counter)
            if on_block is not None:
                on_block(len(data))


def _lines_before(path, offset):
    """The number of line breaks in the first ``offset`` bytes of ``path`` (for messages)."""
    count = 0
    with open(path, "rb") as f:
        while offset > 0:
            block = f.read(min(1 << 24, offset))
            if not block:
                break
            count += block.count(b"\n")
            offset -= len(block)
    return count


def line_ranges(path, parts):
    """Cut ``path`` into at most ``parts`` byte ranges ``(start, end)`` of whole lines."""
    size = os.path.getsize(path)
    cuts = [0]
    with open(path, "rb") as f:
        for k in range(1, parts):
            f.seek(max(size * k // parts, cuts[-1]))
            if f.tell() > 0:
                f.seek(f.tell() - 1)
                f.readline()  # to the start of the next line
            if cuts[-1] < f.tell() < size:
                cuts.append(f.tell())
    return list(zip(cuts, cuts[1:] + [size]))


def _count_range(job):
    path, start, end = job
    counter = Counter()
    count_words_in_file(path, counter, start=start, end=end)
    return counter


def count_words(inputs, workers=1, report=None):
    """Pre-token frequencies of files (list of paths) or of an iterable of lines. Files are
    counted by ``workers`` processes at once, each over byte ranges of whole lines (the counts
    add up to a single pass's); ``report`` (a :class:`Reporter`) hears how far."""
    report = report or Reporter()
    counter = Counter()
    paths = as_paths(inputs)
    if paths is not None:
        total, done = sum(os.path.getsize(path) for path in paths), [0]

        def counted(n):
            done[0] += n
            report(lambda: f"counting words: {done[0] / max(total, 1):.0%} of "
                           f"{total / 1e6:,.0f} MB")
    if paths is not None and workers > 1:
        jobs = [(path, start, end) for path in paths
                for start, end in line_ranges(path, 4 * workers)]
        for job, part in zip(jobs, ordered_map(_count_range, jobs, workers)):
            counter.update(part)
            counted(job[2] - job[1])
    elif paths is not None:
        for path in paths:
            count_words_in_file(path, counter, on_block=counted)
    else:
        block = []
        for line in inputs:
            if not isinstance(line, str):
                raise TypeError(f"BPE.learn: lines must be str, got {type(line).__name__}")
            block.append(line[:-1] if line.endswith("\n") else line)
            if len(block) == 10000:
                count_words_in_text("\n".join(block), counter)
                block.clear()
        count_words_in_text("\n".join(block), counter)
    counter.pop("\n", None)  # line ends are not part of the lines
    return counter


_WHITESPACE = re.compile(r"\s")


def _in_a_directory(name: str) -> bool:
    """Whether ``name`` reads as a file in an existing directory other than the root
    (``data/ende/trian.en``; not ``and/or`` nor ``/x``)."""
    folder, base = os.path.split(name)
    return bool(folder and base) and os.path.isdir(folder) and \
        os.path.dirname(os.path.abspath(folder)) != os.path.abspath(folder)


def as_paths(inputs):
    """`inputs` as a list of file paths, or None if it is an iterable of lines.

    A str or path-like object is one file. A list or tuple is a list of files if its first
    item is path-like or names an existing file; anything else is read as lines of text.
    A list that reads as lines but looks like paths (an item without a space names an
    existing file, or every item is a name without a space in an existing directory other
    than the root) raises FileNotFoundError for the first missing one: a mistyped file name
    is not a line of text to learn from.
    """
    if isinstance(inputs, (str, os.PathLike)):
        return [inputs]
    if isinstance(inputs, (list, tuple)) and inputs:
        first = inputs[0]
        if isinstance(first, os.PathLike) or (
                isinstance(first, str) and "\n" not in first and os.path.isfile(first)):
            return list(inputs)
        if all(isinstance(item, str) for item in inputs):
            # (Names without a space and with a "." or "/": a CJK corpus costs no stat.)
            names = [item for item in inputs
                     if ("." in item or "/" in item) and not _WHITESPACE.search(item)]
            if (len(names) == len(inputs) and all(map(_in_a_directory, names))) or \
                    any(map(os.path.isfile, names)):
                missing = next(item for item in inputs if not os.path.isfile(item))
                raise FileNotFoundError(errno.ENOENT, "no such file (a list of lines that "
                                        "looks like file paths)", missing)
    return None


GLUED = 0x110000  # unit code of a space glued to character c: GLUED + ord(c)


def spell_words(word_counts):
    """The initial symbols (`initial_units`) of every word of `word_counts`, as arrays:
    ``(units, lengths, counts)``: the units of all words one after the other, each a code
    (``ord(c)`` for a character, ``GLUED + ord(c)`` for a space glued to c), the number of
    units of each word, and each word's count."""
    text = "".join(word_counts)
    chars = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), dtype=np.uint32)
    chars = chars.astype(np.int64)
    sizes = np.fromiter(map(len, word_counts), dtype=np.int64, count=len(word_counts))
    counts = np.fromiter(word_counts.values(), dtype=np.int64, count=len(word_counts))
    starts = np.cumsum(sizes) - sizes
    # A leading space is glued to the next character unless that one is whitespace too.
    glue = (sizes > 1) & (chars[starts] == 32)
    second = chars[starts[glue] + 1]
    distinct, number = distinct_codes(second)
    space = np.array([chr(c).isspace() for c in distinct.tolist()], dtype=bool)
    glue[glue] = ~space[number]
    chars[starts[glue] + 1] += GLUED
    keep = np.ones(len(chars), dtype=bool)
    keep[starts[glue]] = False
    return chars[keep], sizes - glue, counts


def unit_text(code):
    """The raw text of a unit code of `spell_words`."""
    return " " + chr(code - GLUED) if code >= GLUED else chr(code)


def cut_at_bytes(ids, lengths, counts):
    """Words of symbol ids (``ids``: all words' one after the other, ``lengths`` units each,
    -1 for a unit spelled in bytes) cut at their byte-spelled units, which are never merged;
    pieces of one symbol are left out (they hold no pair). Returns ``(symbols, lengths,
    counts)`` of the pieces, as arrays."""
    if not len(ids):
        return ids, lengths[:0], counts[:0]
    word_start = np.zeros(len(ids), dtype=bool)
    word_start[(np.cumsum(lengths) - lengths)[lengths > 0]] = True
    new = word_start.copy()
    new[1:] |= ids[:-1] < 0  # a new piece after each byte-spelled unit
    piece = np.cumsum(new) - 1
    piece_count = np.repeat(counts, lengths)[new]
    live = ids >= 0
    size = np.bincount(piece[live], minlength=len(piece_count))
    keep = live & (size[piece] > 1)
    return ids[keep], size[size > 1], piece_count[size > 1]


def distinct_codes(codes):
    """``np.unique(codes, return_inverse=True)`` for non-negative integer codes below a few
    million (the characters and units of `spell_words`): a table indexed by code instead of
    a sort, 40x faster on the 318,000 units of the shipped corpus."""
    if not len(codes):
        return codes[:0], codes[:0]
    seen = np.zeros(int(codes.max()) + 1, dtype=bool)
    seen[codes] = True
    distinct = np.flatnonzero(seen)
    rank = np.empty(len(seen), dtype=np.int64)
    rank[distinct] = np.arange(len(distinct))
    return distinct, rank[codes]


def learn_bpe(inputs, vocab_size, min_frequency, first_id, workers=1, progress=None):
    """Learn ``(alphabet, merges)`` from files or lines; see `tinytf.text.bpe.BPE.learn`.

    first_id: the id of the first alphabet symbol (ids below are special tokens and bytes).
    alphabet: piece strings, most frequent first; merges: (left, right) piece strings in order.
    progress: None, or ``progress(line)`` for a line every 30 s and one when counting ends.
    """
    report = Reporter(progress)
    word_counts = count_words(inputs, workers, report)
    counted = f"counted {len(word_counts):,} distinct words, {sum(word_counts.values()):,} " \
              "in all"
    report(lambda: counted, now=True)
    units, lengths, counts = spell_words(word_counts)
    # The alphabet: every initial symbol that may be a piece, most frequent first (ties: string
    # order), cut to the budget; the lone space always (for runs of spaces). The rest is
    # spelled in bytes and never merged.
    distinct, number = distinct_codes(units)
    unit_counts = np.bincount(number, weights=np.repeat(counts, lengths),
                              minlength=len(distinct)).astype(np.int64).tolist()
    unit_count = dict(zip(map(unit_text, distinct.tolist()), unit_counts))
    unit_count.setdefault(" ", 0)
    alphabet_units = sorted((u for u in unit_count if all(map(can_be_piece, u))),
                            key=lambda u: (-unit_count[u], show(u)))[:vocab_size - first_id]
    pieces = [None] * first_id + [show(u) for u in alphabet_units]
    unit_ids = {u: first_id + i for i, u in enumerate(alphabet_units)}
    ids = np.array([unit_ids.get(unit_text(c), -1) for c in distinct.tolist()], dtype=np.int64)
    words = cut_at_bytes(ids[number], lengths, counts)
    del word_counts, units, number  # the merge loop needs only the words and their counts
    alphabet = pieces[first_id:]
    piece_ids = {p: i for i, p in enumerate(pieces) if p is not None}
    merges = learn_merges_array(words[:2], words[2], pieces, piece_ids, vocab_size,
                                min_frequency, report=report)
    return alphabet, [(pieces[a], pieces[b]) for a, b in merges]
