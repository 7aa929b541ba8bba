"""Checkpoints as plain NumPy ``.npz`` archives: atomic, pickle-free, averageable.

A checkpoint is a zip of ``.npy`` arrays that ``numpy.load(path, allow_pickle=False)`` reads, so
loading one from a stranger cannot run code (pickle-based formats can). Layout:

    model/<parameter name>    float32 arrays, one per parameter (``model.state_dict()``)
    optim/<path>              the ndarrays of ``optimizer.state_dict()`` (Adam moments ...)
    meta/<key>                0-d unicode arrays holding one JSON document each:
                              format, step, data_state, rng_state, model_config, train_config,
                              bpe ({"file", "sha256"}), optim (the optimizer's non-array state,
                              with ``{"__array__": key}`` where an array was), metrics

Writes are atomic (temporary file in the same directory, fsync, ``os.replace``, fsync of the
directory), so a crash mid-write leaves the previous file intact: readers see the old checkpoint
or the new one, never half of one. ``CheckpointManager`` names files ``checkpoint_<step>.npz``,
keeps the last K of them, ``checkpoint_last.npz`` and ``checkpoint_best.npz`` (lowest dev loss).
"""

from __future__ import annotations

import errno
import hashlib
import json
import math
import os
import re
import shutil
import tempfile
import zipfile

import numpy as np

from tinytf.engine.backend import to_numpy

FORMAT = "tinytf-checkpoint-1"
LAST = "checkpoint_last.npz"
BEST = "checkpoint_best.npz"
_NUMBERED = re.compile(r"^checkpoint_(\d+)\.npz$")


class CheckpointError(RuntimeError):
    """A checkpoint file is missing, truncated, not a tinytf checkpoint, or does not fit."""


def _is_array(value) -> bool:
    return isinstance(value, (np.ndarray, np.generic)) or (
        type(value).__module__.startswith("cupy") and hasattr(value, "shape"))


def pack_tree(tree, prefix: str, arrays: dict):
    """Split a nested dict/list of arrays and JSON scalars into ``arrays`` plus a JSON skeleton.

    Every array leaf goes into ``arrays[prefix + "/" + path]`` and is replaced in the skeleton by
    ``{"__array__": key}``, so the exact structure (key types aside: dict keys become strings)
    and dtypes round-trip; NumPy scalars (``np.float32(…)``) are kept as 0-d arrays for the same
    reason. ``unpack_tree`` inverts it.
    """
    def walk(node, path):
        if _is_array(node):
            key = f"{prefix}/{path}" if path else prefix
            if key in arrays:
                raise CheckpointError(f"duplicate checkpoint key {key!r}")
            arrays[key] = to_numpy(node)
            return {"__array__": key, "__scalar__": isinstance(node, np.generic)}
        if isinstance(node, dict):
            return {"__dict__": [[str(k), walk(v, f"{path}/{k}" if path else str(k))]
                                 for k, v in node.items()]}
        if isinstance(node, (list, tuple)):
            return [walk(v, f"{path}/{i}" if path else str(i)) for i, v in enumerate(node)]
        if node is None or isinstance(node, (bool, int, float, str)):
            return node
        raise CheckpointError(f"cannot store {type(node).__name__} at {prefix}/{path} in a "
                              "checkpoint (only arrays, dicts, lists and JSON scalars)")
    return walk(tree, "")


def unpack_tree(skeleton, arrays):
    """Rebuild the tree that ``pack_tree`` split, taking arrays from the mapping ``arrays``."""
    if isinstance(skeleton, dict) and "__array__" in skeleton:
        value = arrays[skeleton["__array__"]]
        return value[()] if skeleton.get("__scalar__") else value
    if isinstance(skeleton, dict) and "__dict__" in skeleton:
        return {k: unpack_tree(v, arrays) for k, v in skeleton["__dict__"]}
    if isinstance(skeleton, list):
        return [unpack_tree(v, arrays) for v in skeleton]
    return skeleton


def sha256_file(path) -> str:
    """Hex SHA-256 of a file's bytes (used to pin the BPE model a checkpoint was trained with)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_dir(directory):
    # The rename itself lives in the directory: without this, a power cut can forget it.
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - platforms without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover
        pass
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _publish(path, fill) -> None:
    """Let ``fill(tmp)`` make a file at a fresh temporary name beside ``path``, then
    ``os.replace`` it over ``path`` and fsync the directory. Readers see the old file or the
    new one, never half of one; on any failure the temporary file is removed and ``path`` is
    left as it was."""
    path = os.fspath(path)
    directory = os.path.dirname(os.path.abspath(path))
    fd, tmp = tempfile.mkstemp(prefix="." + os.path.basename(path) + ".", suffix=".tmp",
                               dir=directory)
    os.close(fd)
    try:
        fill(tmp)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    _fsync_dir(directory)


def atomic_write(path, write_fn):
    """Call ``write_fn(file_object)`` on a temporary file beside ``path``, fsync it, then
    rename it over ``path`` (see :func:`_publish`)."""
    def fill(tmp):
        os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a checkpoint is not a secret
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
    _publish(path, fill)


def save(path, model_state: dict, *, optim_state=None, meta: dict | None = None):
    """Write a checkpoint atomically.

    ``model_state`` maps parameter names to arrays (``model.state_dict()``); ``optim_state`` is
    ``optimizer.state_dict()`` (any nesting of dicts, lists, arrays and JSON scalars) or None;
    ``meta`` maps keys to JSON-serialisable values, each stored as ``meta/<key>``.
    """
    arrays = {}
    for name, value in model_state.items():
        arrays[f"model/{name}"] = to_numpy(value)
    meta = dict(meta or {})
    meta["format"] = FORMAT
    if optim_state is not None:
        meta["optim"] = pack_tree(optim_state, "optim", arrays)
    for key, value in meta.items():
        try:
            text = json.dumps(value, sort_keys=True, allow_nan=True)
        except TypeError as e:
            raise CheckpointError(f"checkpoint metadata {key!r} is not JSON-serialisable: {e}")
        arrays[f"meta/{key}"] = np.array(text)  # 0-d unicode array: no pickle needed
    try:
        atomic_write(path, lambda f: np.savez(f, **arrays))
    except OSError as e:
        # Disk full, quota, permissions: one line naming the file; the old file stays.
        needed = sum(a.nbytes for a in arrays.values())
        raise CheckpointError(f"{os.fspath(path)}: cannot write the checkpoint: "
                              f"{why_not_written(e, path, needed)}; a file already at that "
                              "path stays intact") from None


def why_not_written(error: OSError, path, needed: int) -> str:
    """Why ``path`` could not be written, for a one-line message: the OS's reason, and when
    the disk or quota is full, what the file needs (``needed`` bytes) and what is free."""
    why = error.strerror or str(error)
    if error.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):    # not out of room
        return why
    directory = os.path.dirname(os.path.abspath(os.fspath(path)))
    try:
        free = f", {_size(shutil.disk_usage(directory).free)} free there"
    except OSError:
        free = ""
    return f"{why} (it needs about {_size(needed)}{free})"


def _size(n: int) -> str:
    """``n`` bytes in MiB, or in KiB below one MiB."""
    return f"{n / 2**20:,.1f} MiB" if n >= 2**20 else f"{n / 2**10:,.0f} KiB"


class Checkpoint:
    """A loaded checkpoint: ``model`` (name -> ndarray), ``optim`` (the optimizer's state dict or
    None), ``meta`` (key -> decoded JSON value), ``path``."""

    def __init__(self, path, model, optim, meta):
        self.path, self.model, self.optim, self.meta = path, model, optim, meta

    @property
    def step(self) -> int:
        """The number of optimizer updates this checkpoint was taken after (0 if unknown)."""
        return int(self.meta.get("step", 0))

    def __repr__(self):
        return f"Checkpoint({self.path!r}, step={self.step}, {len(self.model)} tensors)"


def check_members(path) -> None:
    """Refuse an archive whose ``.npy`` members claim more than they hold, before anything
    is allocated from those claims: each member's shape and dtype are read from its header
    alone and checked against the member's real size (as safetensors checks its header
    against the file's), and object arrays (pickles) are refused. A CheckpointError names
    the file and the member."""
    with zipfile.ZipFile(path) as archive:
        for info in archive.infolist():
            with archive.open(info) as member:
                try:
                    version = np.lib.format.read_magic(member)
                    read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                            else np.lib.format.read_array_header_2_0)
                    shape, _, dtype = read(member, max_header_size=1 << 16)
                except Exception as e:  # noqa: BLE001 - NumPy parses the header with
                    # ast.literal_eval: a forged one raises ValueError, SyntaxError, TokenError...
                    raise CheckpointError(f"{path}: member {info.filename}: not a NumPy array "
                                          f"({type(e).__name__}: {str(e)[:100]})") from None
                if dtype.hasobject:
                    raise CheckpointError(f"{path}: member {info.filename}: an object array "
                                          "(a pickle), which tinytf never writes nor loads")
                claimed = math.prod(shape) * dtype.itemsize
                if claimed + member.tell() > info.file_size:
                    raise CheckpointError(
                        f"{path}: member {info.filename}: its header claims shape "
                        f"{tuple(shape)} of {dtype} ({_size(claimed)}), but the member holds "
                        f"{_size(info.file_size)}: a damaged or forged checkpoint")


def load(path, *, with_optim: bool = True) -> Checkpoint:
    """Read a checkpoint written by ``save`` with ``allow_pickle=False``.

    Raises ``CheckpointError`` naming the file when it is missing, truncated, not an npz, or not
    a tinytf checkpoint.
    """
    path = os.fspath(path)
    if not os.path.isfile(path):
        raise CheckpointError(f"{path}: no such checkpoint file")
    try:
        with open(path, "rb") as f:
            if f.read(4) != b"PK\x03\x04":   # a zip archive's first bytes, as .npz files have
                raise CheckpointError(f"{path}: not a checkpoint (not a NumPy .npz archive)")
        check_members(path)
        with np.load(path, allow_pickle=False) as npz:
            keys = list(npz.files)
            if "meta/format" not in keys:
                raise CheckpointError(f"{path}: not a tinytf checkpoint (no meta/format entry)")
            meta = {k[5:]: json.loads(str(npz[k][()])) for k in keys if k.startswith("meta/")}
            if meta["format"] != FORMAT:
                raise CheckpointError(f"{path}: unsupported checkpoint format {meta['format']!r}"
                                      f" (this tinytf reads {FORMAT!r})")
            model = {k[6:]: npz[k] for k in keys if k.startswith("model/")}
            optim = None
            if with_optim and "optim" in meta:
                optim = unpack_tree(meta["optim"],
                                    {k: npz[k] for k in keys if k.startswith("optim/")})
    except CheckpointError:
        raise
    except zipfile.BadZipFile as e:
        raise CheckpointError(f"{path}: unreadable checkpoint: the .npz archive is truncated "
                              f"or damaged ({e})") from e
    except (ValueError, OSError, EOFError, KeyError, RecursionError) as e:
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(e).__name__}: "
                              f"{str(e)[:200]})") from None
    meta.pop("optim", None)
    return Checkpoint(path, model, optim, meta)


def step_of(path) -> int | None:
    """The step in a numbered checkpoint's name (``checkpoint_<step>.npz``), else None."""
    m = _NUMBERED.match(os.path.basename(os.fspath(path)))
    return int(m.group(1)) if m else None


def list_checkpoints(run_dir) -> list[str]:
    """Paths of the numbered checkpoints ``checkpoint_<step>.npz`` in ``run_dir``, oldest first
    (by step number, not by name or mtime)."""
    found = []
    for name in os.listdir(run_dir):
        m = _NUMBERED.match(name)
        if m:
            found.append((int(m.group(1)), os.path.join(run_dir, name)))
    return [p for _, p in sorted(found)]


def resolve(path_or_dir) -> str:
    """A checkpoint path from a file or a run directory (its ``checkpoint_last.npz``, else its
    newest numbered checkpoint)."""
    if os.path.isdir(path_or_dir):
        last = os.path.join(path_or_dir, LAST)
        if os.path.isfile(last):
            return last
        numbered = list_checkpoints(path_or_dir)
        if not numbered:
            raise CheckpointError(f"{path_or_dir}: no checkpoint in this directory")
        return numbered[-1]
    return os.fspath(path_or_dir)


def average(paths) -> Checkpoint:
    """Average the model parameters of several checkpoints (the paper averages the last 5 or 20).

    Sums in float64 and casts back to each parameter's dtype, so the result does not depend on
    the order of the files beyond rounding. All checkpoints must hold the same names and shapes,
    and those that record their BPE model the same one (its SHA-256): rows of the embedding
    of two vocabularies of one size are other pieces.
    The returned checkpoint carries the metadata of the last one (config, BPE), no optimizer
    state, and ``meta["averaged_from"]`` listing the inputs.
    """
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise CheckpointError("average: no checkpoints given")
    total, dtypes, last, first_bpe = None, None, None, None   # first_bpe: (sha, path)
    for path in paths:
        ckpt = load(path, with_optim=False)
        sha = (ckpt.meta.get("bpe") or {}).get("sha256")
        if sha is not None and first_bpe is None:
            first_bpe = (sha, path)
        elif sha is not None and sha != first_bpe[0]:
            raise CheckpointError(f"{path}: trained with another BPE model than "
                                  f"{first_bpe[1]} (SHA-256 differs): only checkpoints of "
                                  "one vocabulary average")
        if total is None:
            total = {k: v.astype(np.float64) for k, v in ckpt.model.items()}
            dtypes = {k: v.dtype for k, v in ckpt.model.items()}
        else:
            if set(ckpt.model) != set(total):
                diff = sorted(set(ckpt.model) ^ set(total))
                raise CheckpointError(f"{path}: parameters differ from {paths[0]}: {diff[:5]}")
            for k, v in ckpt.model.items():
                if v.shape != total[k].shape:
                    raise CheckpointError(f"{path}: {k} has shape {v.shape}, "
                                          f"{paths[0]} has {total[k].shape}")
                total[k] += v
        last = ckpt
    n = float(len(paths))
    model = {k: (v / n).astype(dtypes[k]) for k, v in total.items()}
    meta = dict(last.meta)
    meta["averaged_from"] = [os.path.basename(p) for p in paths]
    return Checkpoint(None, model, None, meta)


class CheckpointManager:
    """Writes ``checkpoint_<step>.npz`` into a run directory and keeps the last ``keep_last``
    numbered files, plus ``checkpoint_last.npz`` (newest) and ``checkpoint_best.npz`` (the
    best ``meta["metrics"][metric]`` seen so far: the lowest, or the highest with
    ``higher_is_better``; remembered across restarts through the best file's own metadata)."""

    def __init__(self, run_dir, keep_last: int = 5, metric: str = "dev_loss",
                 higher_is_better: bool = False):
        self.run_dir = os.fspath(run_dir)
        self.keep_last = keep_last
        self.metric, self.higher_is_better = metric, higher_is_better
        os.makedirs(self.run_dir, exist_ok=True)
        for name in os.listdir(self.run_dir):
            stray = os.path.join(self.run_dir, name)
            # A file (or link) left by a killed writer goes; anything else of that name, a
            # directory say, is not ours to remove and is left alone.
            if name.startswith(".checkpoint_") and name.endswith(".tmp") and (
                    os.path.islink(stray) or not os.path.isdir(stray)):
                os.unlink(stray)
        self.best = None
        best = os.path.join(self.run_dir, BEST)
        if os.path.isfile(best):
            try:
                self.best = load(best, with_optim=False).meta.get("metrics", {}).get(metric)
            except CheckpointError:
                self.best = None  # a damaged best file is replaced at the next validation

    def path(self, name) -> str:
        """Path of ``name`` inside the run directory."""
        return os.path.join(self.run_dir, name)

    def improves(self, score) -> bool:
        """Whether ``score`` (of the manager's metric) beats the best so far."""
        if score is None or not np.isfinite(score):
            return False
        if self.best is None:
            return True
        return score > self.best if self.higher_is_better else score < self.best

    def save(self, step, model_state, optim_state, meta, score=None) -> str:
        """Write the step's checkpoint, refresh last (and best when ``score``, the value of
        the metric, improves), prune old numbered files; returns the numbered path."""
        meta = dict(meta)
        meta["step"] = int(step)
        if score is not None:
            meta.setdefault("metrics", {})[self.metric] = float(score)
        numbered = self.path(f"checkpoint_{int(step)}.npz")
        save(numbered, model_state, optim_state=optim_state, meta=meta)
        self._copy(numbered, LAST)
        if self.improves(score):
            self.best = float(score)
            self._copy(numbered, BEST)
        self._prune()
        return numbered

    def _copy(self, source, name):
        # A hard link is instant and atomic to publish; fall back to a byte copy where links are
        # not supported. Either way the target name is replaced atomically.
        def fill(tmp):
            os.unlink(tmp)  # os.link needs a free name
            try:
                os.link(source, tmp)
            except OSError:
                shutil.copyfile(source, tmp)
                with open(tmp, "rb+") as f:
                    os.fsync(f.fileno())
        _publish(self.path(name), fill)

    def _prune(self):
        if self.keep_last is None or self.keep_last <= 0:
            return
        for old in list_checkpoints(self.run_dir)[:-self.keep_last]:
            os.unlink(old)
