"""Saving and loading a `BPE` model as a readable JSON file.

Format version 1::

    {
     "format": "tinytf-bpe",
     "version": 1,
     "pretokenizer": "tinytf-1",
     "special_tokens": ["<pad>", "<s>", "</s>", "<unk>"],
     "byte_pieces": "<0x00> .. <0xFF> at ids 4 .. 259",
     "vocab_size": 8000,
     "alphabet": ["▁", "e", ...],
     "merges": ["e s", "es t", ...]
    }

Ids are implicit: special tokens, then the 256 bytes, then the alphabet in order, then the
piece of each merge (``left + right``) unless an earlier entry already is that piece. A merge
is written ``"left right"``: pieces never contain a space (a space is ``▁``).
"""
import json
import os

from tinytf.text.ids import BYTE_OFFSET, SPECIAL_TOKENS
from tinytf.text.pretokenize import SPACE

FORMAT = "tinytf-bpe"
VERSION = 1
PRETOKENIZER = "tinytf-1"  # bump when pretokenize.PRETOKEN or initial_units changes


class BPEFileError(ValueError):
    """A BPE model file that cannot be read; the message names the file and the problem."""

    def __init__(self, path, problem):
        super().__init__(f"{path}: {problem}")
        self.path = path


def save(bpe, path):
    """Write `bpe` to `path` atomically (a temporary file, then a rename)."""
    doc = {
        "format": FORMAT,
        "version": VERSION,
        "pretokenizer": PRETOKENIZER,
        "space": SPACE,
        "special_tokens": list(SPECIAL_TOKENS),
        "byte_pieces": f"<0x00> .. <0xFF> at ids {BYTE_OFFSET} .. {BYTE_OFFSET + 255}",
        "vocab_size": bpe.vocab_size,
        "alphabet": bpe.alphabet,
        "merges": [f"{left} {right}" for left, right in bpe.merges],
    }
    path = os.fspath(path)
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(doc, f, ensure_ascii=False, indent=1)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as e:   # named after the model's file, not the temporary one
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise OSError(e.errno, e.strerror, path) from None


def _read_json(path):
    with open(path, "rb") as f:
        data = f.read()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise BPEFileError(path, f"not UTF-8 text (byte {e.start}: {e.reason}); "
                                 "not a tinytf BPE model") from None
    if not text.strip():
        raise BPEFileError(path, "the file is empty")
    try:
        return json.loads(text)
    except RecursionError:
        raise BPEFileError(path, "JSON nested too deeply; not a tinytf BPE model") from None
    except json.JSONDecodeError as e:
        if not text.lstrip().startswith("{"):
            problem = "not JSON; not a tinytf BPE model"
        elif not text.rstrip().endswith("}"):
            problem = "the JSON ends early: the file is truncated"
        else:
            problem = "invalid JSON"
        raise BPEFileError(path, f"{problem} (line {e.lineno}, column {e.colno}: {e.msg})") \
            from None
    except ValueError as e:    # an integer of over 4,300 digits (Python 3.11's limit)
        what = "a number of over 4,300 digits" if "digits" in str(e) else str(e)[:120]
        raise BPEFileError(path, f"{what}; not a tinytf BPE model") from None


def load(cls, path):
    """Read a model file written by `save` and return ``cls(alphabet, merges)``."""
    path = os.fspath(path)
    doc = _read_json(path)
    if not isinstance(doc, dict) or doc.get("format") != FORMAT:
        hint = ""
        if isinstance(doc, dict) and isinstance(doc.get("model"), dict):
            hint = " (it looks like a HuggingFace tokenizers file)"
        raise BPEFileError(path, f'not a tinytf BPE model: no "format": "{FORMAT}" field{hint}')
    version = doc.get("version")
    if version != VERSION:
        raise BPEFileError(path, f"format version {version!r} is not supported "
                                 f"(this tinytf reads version {VERSION})")
    if doc.get("pretokenizer") != PRETOKENIZER:
        raise BPEFileError(path, f"pre-tokenizer {doc.get('pretokenizer')!r} does not match "
                                 f"this tinytf's {PRETOKENIZER!r}")
    if doc.get("special_tokens") != list(SPECIAL_TOKENS):
        raise BPEFileError(path, f"special tokens {doc.get('special_tokens')!r} differ from "
                                 f"the fixed {list(SPECIAL_TOKENS)!r}")
    for field, kind in (("vocab_size", int), ("alphabet", list), ("merges", list)):
        if not isinstance(doc.get(field), kind):
            raise BPEFileError(path, f'field "{field}" is missing or not a {kind.__name__}')
    merges = []
    for i, m in enumerate(doc["merges"]):
        parts = m.split(" ") if isinstance(m, str) else []
        if len(parts) != 2 or not all(parts):
            raise BPEFileError(path, f'merges[{i}] = {m!r} is not "left right"')
        merges.append(tuple(parts))
    try:
        bpe = cls(doc["alphabet"], merges)
    except ValueError as e:
        raise BPEFileError(path, str(e)) from None
    if bpe.vocab_size != doc["vocab_size"]:
        raise BPEFileError(path, f'"vocab_size" is {doc["vocab_size"]} but the alphabet and '
                                 f"merges give {bpe.vocab_size} pieces: the file was edited "
                                 "or cut")
    return bpe
