"""An encoded training corpus on disk, opened as memory maps.

A prepared corpus is a directory (``RUNDIR/corpus`` for train.py) of flat binary files, the
form of fairseq's indexed datasets:

==============  =================================================================================
``header.json`` format and version, the BPE model's SHA-256, ``max_len``, each source file's
                path, size, modification time and SHA-256 of its first and last MiB, the
                counts (lines, pairs kept, pairs skipped as too long or empty, tokens per side)
``src.bin``     the token ids of every kept source sentence, concatenated, without ``</s>``;
                ``uint16`` when the vocabulary has at most 65,536 pieces, else ``int32``
``src.idx``     ``int64`` offsets, one more than pairs: sentence i is ``bin[idx[i]:idx[i + 1]]``
``tgt.bin/idx`` the same for the target side (without ``<s>`` and ``</s>``)
``kept.bin``    ``int64``: the line (0-based) of the source files that each pair came from
==============  =================================================================================

:class:`CorpusWriter` appends encoded chunks to the files of a temporary directory and renames
it into place when the corpus is complete, so a directory with a header is always whole.
:func:`open_corpus` maps the files read-only (``numpy.memmap``): processes that open the same
corpus share its pages in the page cache, and nothing is read until a batch needs it.
:func:`stale_reason` says why a directory may not be used for a given BPE model and source
files (missing, another format, another BPE, changed sources, a truncated file), or ``None``.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np

from tinytf.data.batches import DataError, ParallelCorpus
from tinytf.utils.streams import write_all

FORMAT = "tinytf-corpus"
VERSION = 1
HEADER = "header.json"


def token_dtype(vocab_size: int) -> np.dtype:
    """The narrowest dtype that holds ids below ``vocab_size``: uint16, else int32."""
    return np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.int32)


def source_identity(path) -> dict:
    """What identifies a source file cheaply: its path, size, mtime and the SHA-256 of its
    first and last MiB (a changed file almost always changes one of them)."""
    size = os.path.getsize(path)
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        digest.update(f.read(1 << 20))
        if size > 1 << 20:
            f.seek(max(size - (1 << 20), 1 << 20))
            digest.update(f.read())
    return {"path": os.path.abspath(path), "size": size,
            "mtime_ns": os.stat(path).st_mtime_ns, "head_tail_sha256": digest.hexdigest()}


class CorpusWriter:
    """Writes a prepared corpus chunk by chunk; ``finish`` makes it visible atomically.

    Use as a context manager: leaving the block by an exception removes the temporary
    directory and leaves any previous corpus at ``path`` as it was.
    """

    def __init__(self, path, vocab_size: int):
        self.path = os.path.abspath(path)
        self.dtype = token_dtype(vocab_size)
        self.vocab_size = vocab_size
        parent = os.path.dirname(self.path)
        os.makedirs(parent, exist_ok=True)
        remove_leftovers(self.path)
        self.tmp = f"{self.path}.tmp-{os.getpid()}"
        shutil.rmtree(self.tmp, ignore_errors=True)
        os.makedirs(self.tmp)
        # Unbuffered, written by write_all: NumPy's tofile writes through a C stream whose
        # last buffer is written at its close, where a failure goes unreported.
        self._files = {name: open(os.path.join(self.tmp, name), "wb", buffering=0)
                       for name in ("src.bin", "src.idx", "tgt.bin", "tgt.idx", "kept.bin")}
        self.tokens = {"src": 0, "tgt": 0}
        self.pairs = 0
        try:
            for side in ("src", "tgt"):
                self._append(f"{side}.idx", np.zeros(1, np.int64))
        except OSError as e:
            self.__exit__(OSError, e, None)
            raise self._write_error(e) from None

    def _append(self, name: str, array) -> None:
        """Append ``array``'s bytes to file ``name``: all of them, or an OSError."""
        write_all(self._files[name], memoryview(np.ascontiguousarray(array)).cast("B"))

    def add(self, src, src_lengths, tgt, tgt_lengths, kept) -> None:
        """Append pairs: ``src``/``tgt`` their ids concatenated, ``*_lengths`` per pair,
        ``kept`` their line numbers. A write that fails (a full disk) is a DataError."""
        try:
            for side, ids, lengths in (("src", src, src_lengths), ("tgt", tgt, tgt_lengths)):
                self._append(f"{side}.bin", np.asarray(ids, dtype=self.dtype))
                offsets = self.tokens[side] + np.cumsum(lengths, dtype=np.int64)
                self._append(f"{side}.idx", offsets)
                self.tokens[side] += int(np.sum(lengths, dtype=np.int64))
            self._append("kept.bin", np.asarray(kept, dtype=np.int64))
        except OSError as e:
            raise self._write_error(e) from None
        self.pairs += len(kept)

    def _write_error(self, error: OSError) -> DataError:
        """One line for a write that failed: the corpus, the reason, what was written and
        what is free there (NumPy's short write says only "N requested and M written")."""
        try:
            written = sum(os.path.getsize(os.path.join(self.tmp, name)) for name in self._files)
            sizes = f" ({written / 2**20:,.1f} MiB written so far, " \
                    f"{shutil.disk_usage(self.tmp).free / 2**20:,.0f} MiB free there)"
        except OSError:
            sizes = ""
        return DataError(f"{self.path}: cannot write the encoded corpus: "
                         f"{error.strerror or error}{sizes}; nothing of it is kept, and the "
                         "next start encodes the text again")

    def finish(self, header: dict) -> None:
        """Write the header (``header`` plus the format and counts) and rename the directory
        into place, replacing an older corpus there."""
        try:
            self._finish(header)
        except OSError as e:
            raise self._write_error(e) from None

    def _finish(self, header: dict) -> None:
        for f in self._files.values():
            f.flush()
            os.fsync(f.fileno())
            f.close()
        header = dict(header, format=FORMAT, version=VERSION, dtype=self.dtype.name,
                      vocab_size=self.vocab_size, pairs=self.pairs,
                      src_tokens=self.tokens["src"], tgt_tokens=self.tokens["tgt"])
        with open(os.path.join(self.tmp, HEADER), "w", encoding="utf-8") as f:
            json.dump(header, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        old = f"{self.path}.old-{os.getpid()}"
        if os.path.lexists(self.path):
            os.rename(self.path, old)
        os.rename(self.tmp, self.path)
        _remove(old)

    def __enter__(self):
        return self

    def __exit__(self, kind, value, tb):
        if kind is not None:
            for f in self._files.values():
                f.close()
            shutil.rmtree(self.tmp, ignore_errors=True)
        return False


def _running(pid: int) -> bool:
    """Whether a process ``pid`` exists on this machine."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:     # someone else's
        return True
    return True


def remove_leftovers(path) -> None:
    """Delete what a :class:`CorpusWriter` killed before it finished (SIGKILL, a scheduler's
    SIGTERM) left beside ``path``: ``PATH.tmp-PID`` (the unfinished corpus) and
    ``PATH.old-PID`` (a replaced one), where process PID no longer runs. At WMT scale each
    holds hundreds of megabytes, and nothing else would ever remove them."""
    parent, name = os.path.split(os.path.abspath(path))
    for entry in sorted(os.listdir(parent)) if os.path.isdir(parent) else []:
        for tag in (".tmp-", ".old-"):
            pid = entry[len(name) + len(tag):]
            if (entry.startswith(name + tag) and pid.isdigit() and int(pid) != os.getpid()
                    and not _running(int(pid))):
                _remove(os.path.join(parent, entry))


def _remove(path) -> None:
    """Remove a corpus directory, or a link in its place (not what the link points to)."""
    if os.path.islink(path):
        os.unlink(path)
    else:
        shutil.rmtree(path, ignore_errors=True)


def read_header(path) -> dict | None:
    """The header of the corpus at ``path``, or ``None`` if it has none or cannot be read."""
    try:
        with open(os.path.join(path, HEADER), encoding="utf-8") as f:
            header = json.load(f)
    except (OSError, ValueError, RecursionError):   # RecursionError: nested too deeply
        return None
    return header if isinstance(header, dict) else None


def stale_reason(path, bpe_sha256: str, sources, max_len, check_mtime=True) -> str | None:
    """Why the corpus at ``path`` is not the encoding of ``sources`` (two file paths) by the
    BPE model ``bpe_sha256`` with ``max_len``; ``None`` when it is and its files are whole.
    ``check_mtime=False`` compares the sources' sizes and head/tail hashes only (another
    node's copy of the same files)."""
    header = read_header(path)
    if header is None:
        return "no readable header" if os.path.isdir(path) else "not prepared yet"
    if header.get("format") != FORMAT or header.get("version") != VERSION:
        return (f"format {header.get('format')} version {header.get('version')}, "
                f"expected {FORMAT} version {VERSION}")
    if header.get("bpe_sha256") != bpe_sha256:
        return "encoded with another BPE model"
    if header.get("max_len") != max_len:
        return f"prepared with max_len {header.get('max_len')}, this run uses {max_len}"
    recorded = header.get("sources") or [{}, {}]
    if not isinstance(recorded, list) or not all(isinstance(s, dict) for s in recorded):
        return "header field sources is not a list of files"
    for src, now in zip(recorded, sources):
        mine = source_identity(now)
        keys = ("size", "mtime_ns", "head_tail_sha256") if check_mtime else (
            "size", "head_tail_sha256")
        for key in keys:
            if src.get(key) != mine[key]:
                return f"{now} changed since it was prepared ({key.replace('_', ' ')} differs)"
    counts = ("pairs", "src_tokens", "tgt_tokens", "lines", "skipped_long", "skipped_empty")
    bad = [k for k in counts if type(header.get(k)) is not int or header[k] < 0]
    if bad:
        return f"header field {bad[0]} is not a count"
    if header.get("dtype") not in ("uint16", "int32"):
        return f"header field dtype {header.get('dtype')!r} is not uint16 or int32"
    itemsize = np.dtype(header["dtype"]).itemsize
    expected = {"src.bin": header["src_tokens"] * itemsize,
                "tgt.bin": header["tgt_tokens"] * itemsize,
                "src.idx": (header["pairs"] + 1) * 8, "tgt.idx": (header["pairs"] + 1) * 8,
                "kept.bin": header["pairs"] * 8}
    for name, size in expected.items():
        file = os.path.join(path, name)
        if not os.path.isfile(file) or os.path.getsize(file) != size:
            return f"{name} is missing or not {size:,} bytes"
    return None


def open_corpus(path, name: str | None = None) -> ParallelCorpus:
    """The prepared corpus at ``path`` as a :class:`ParallelCorpus` over read-only memory
    maps (call :func:`stale_reason` first; a file whose size contradicts the header is a
    ValueError here)."""
    header = read_header(path)
    if header is None:
        raise ValueError(f"{path}: not a prepared corpus (no {HEADER})")

    def mapped(file, dtype, count):
        if count == 0:
            return np.zeros(0, dtype)
        return np.memmap(os.path.join(path, file), dtype=dtype, mode="r", shape=(count,))

    pairs = header["pairs"]
    return ParallelCorpus.from_arrays(
        mapped("src.bin", header["dtype"], header["src_tokens"]),
        mapped("src.idx", np.int64, pairs + 1),
        mapped("tgt.bin", header["dtype"], header["tgt_tokens"]),
        mapped("tgt.idx", np.int64, pairs + 1),
        mapped("kept.bin", np.int64, pairs),
        name=name or path, max_len=header["max_len"], n_lines=header["lines"],
        n_skipped_long=header["skipped_long"], n_skipped_empty=header["skipped_empty"])
