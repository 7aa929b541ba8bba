"""Encode a parallel corpus once, streaming and in parallel, into a prepared corpus on disk.

:func:`prepare_corpus` reads the two files in lock-step chunks of whole lines
(:func:`read_pair_chunks`; memory is bounded by the chunk size, whatever the corpus size),
hands the chunks to ``workers`` processes that decode, check and encode them with the BPE model
(:func:`encode_chunk`, through :func:`tinytf.utils.workers.ordered_map`: at most two chunks per
worker in flight), and appends the results in file order to a
:class:`tinytf.data.corpus_file.CorpusWriter`.

Errors name the file and line as :func:`tinytf.data.batches.read_parallel` does (invalid UTF-8, an
empty file, a line without partner); nothing is left behind by a failed preparation.
"""
from __future__ import annotations

import os
import time
from itertools import chain, islice

import numpy as np

from tinytf.data.batches import DataError, decode_block, unpaired
from tinytf.data.corpus_file import CorpusWriter, read_header, source_identity, token_dtype
from tinytf.text import BPE
from tinytf.utils.checkpoint import sha256_file
from tinytf.utils.log import format_seconds
from tinytf.utils.workers import available_cpus, ordered_map

CHUNK_BYTES = 4 << 20   # bytes of source text per chunk (the target side follows its lines)


def read_pair_chunks(src_path, tgt_path, chunk_bytes=CHUNK_BYTES):
    """Yield ``(first_line, src_offset, tgt_offset, src_bytes, tgt_bytes)`` for consecutive
    blocks of whole lines, the same lines of both files (``*_offset``: the block's first byte
    in its file). Raises :class:`DataError` for an empty file or unequal line counts."""
    with open(src_path, "rb") as fs, open(tgt_path, "rb") as ft:
        line, src_at, tgt_at = 0, 0, 0
        while True:
            src_lines = fs.readlines(chunk_bytes)
            if not src_lines:
                if ft.readline():  # the target side goes on
                    raise unpaired(src_path, tgt_path, line, line + 1 + sum(1 for _ in ft))
                break
            tgt_lines = list(islice(ft, len(src_lines)))
            if len(tgt_lines) < len(src_lines):
                raise unpaired(src_path, tgt_path, line + len(src_lines) + sum(1 for _ in fs),
                               line + len(tgt_lines))
            src, tgt = b"".join(src_lines), b"".join(tgt_lines)
            yield line, src_at, tgt_at, src, tgt
            line, src_at, tgt_at = line + len(src_lines), src_at + len(src), tgt_at + len(tgt)
        for path, size in ((src_path, src_at), (tgt_path, tgt_at)):
            if line == 0 or size == 0:
                raise DataError(f"{path}: empty file (expected one sentence per line)")


_worker = {}


def _init_worker(bpe_path, max_len, paths):
    """The BPE model of each worker process: loaded once, unless it holds it already (this
    process with one worker, or a forked worker that inherited it)."""
    if _worker.get("bpe_path") != bpe_path:
        _worker.update(bpe=BPE.load(bpe_path), bpe_path=bpe_path)
    _worker.update(max_len=max_len, paths=paths)


def _encode_in_worker(chunk):
    return encode_chunk(chunk, _worker["bpe"], _worker["max_len"], _worker["paths"])


def encode_chunk(chunk, bpe, max_len, paths):
    """Decode, check and encode one chunk of :func:`read_pair_chunks` of the files ``paths``;
    drop pairs with an empty side or with a side longer than ``max_len`` (``</s>`` included).
    Returns a dict of arrays: ``src``/``tgt`` (ids concatenated), ``src_lengths``/``tgt_lengths``
    and ``kept`` (line numbers) of the pairs kept, and the counts ``lines``, ``skipped_long``,
    ``skipped_empty`` and ``bytes`` (of text read)."""
    first, src_at, tgt_at, src_raw, tgt_raw = chunk
    src = bpe.encode_batch(decode_block(src_raw, paths[0], first, src_at))
    tgt = bpe.encode_batch(decode_block(tgt_raw, paths[1], first, tgt_at))
    src_len = np.fromiter(map(len, src), np.int64, len(src))
    tgt_len = np.fromiter(map(len, tgt), np.int64, len(tgt))
    empty = (src_len == 0) | (tgt_len == 0)
    long = ~empty & (np.maximum(src_len, tgt_len) + 1 > max_len if max_len else False)
    keep = np.flatnonzero(~(empty | long))
    dtype = token_dtype(len(bpe))

    def flat(seqs, lengths):
        return np.fromiter(chain.from_iterable(seqs[i] for i in keep), dtype,
                           int(lengths[keep].sum()))

    return {"src": flat(src, src_len), "src_lengths": src_len[keep],
            "tgt": flat(tgt, tgt_len), "tgt_lengths": tgt_len[keep],
            "kept": first + keep, "lines": len(src),
            "skipped_long": int(long.sum()), "skipped_empty": int(empty.sum()),
            "bytes": len(src_raw) + len(tgt_raw)}


def prepare_corpus(src_path, tgt_path, bpe_path, out, max_len, workers=None, log=None,
                   progress_seconds=30.0, chunk_bytes=CHUNK_BYTES) -> dict:
    """Encode the pair of files with the BPE model at ``bpe_path`` into a prepared corpus at
    ``out`` (:mod:`tinytf.data.corpus_file`); returns its header. ``log(str)`` gets a progress line
    every ``progress_seconds`` and a summary."""
    workers = workers or available_cpus()
    _worker.clear()
    _init_worker(bpe_path, max_len, (src_path, tgt_path))   # forked workers inherit it
    bpe = _worker["bpe"]
    t0 = last = time.perf_counter()
    total = os.path.getsize(src_path) + os.path.getsize(tgt_path)
    counts = {"lines": 0, "skipped_long": 0, "skipped_empty": 0}
    done = 0
    chunks = read_pair_chunks(src_path, tgt_path, chunk_bytes)
    with CorpusWriter(out, len(bpe)) as writer:
        for part in ordered_map(_encode_in_worker, chunks, workers, _init_worker,
                                (bpe_path, max_len, (src_path, tgt_path))):
            writer.add(part["src"], part["src_lengths"], part["tgt"], part["tgt_lengths"],
                       part["kept"])
            for key in counts:
                counts[key] += part[key]
            done += part["bytes"]
            now = time.perf_counter()
            if log and now - last >= progress_seconds:
                last = now
                rate = done / (now - t0)
                log(f"prepare: {counts['lines']:,} lines ({done / total:.0%}), "
                    f"{rate / 1e6:.1f} MB/s, {format_seconds(now - t0)} elapsed, "
                    f"{format_seconds((total - done) / rate)} to go")
        header = {"bpe_sha256": sha256_file(bpe_path), "max_len": max_len,
                  "sources": [source_identity(src_path), source_identity(tgt_path)],
                  "workers": workers, "seconds": round(time.perf_counter() - t0, 2), **counts}
        writer.finish(header)
    if log:
        log(f"prepared {out}: {writer.pairs:,} pairs of {counts['lines']:,} lines "
            f"({counts['skipped_long']:,} longer than {max_len} tokens, "
            f"{counts['skipped_empty']:,} with an empty side skipped), "
            f"{writer.tokens['src'] + writer.tokens['tgt']:,} tokens, {total / 1e6:,.0f} MB of "
            f"text in {format_seconds(time.perf_counter() - t0)} with {workers} worker(s)")
    return read_header(out)
