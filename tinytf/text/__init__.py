"""Text processing: the byte-pair-encoding subword vocabulary (see `tinytf.text`).

Modules: `pretokenize` (cutting text into words and symbols), `learn` (counting words and the
incremental merge loop), `bpe` (the `BPE` model: encode, decode), `bpe_file` (JSON save/load),
`cli` (``python -m tinytf.commands.bpe``).
"""
from tinytf.text.bpe import BOS_ID, BPE, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID
from tinytf.text.bpe_file import BPEFileError

__all__ = ["BPE", "BPEFileError", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID", "SPECIAL_TOKENS"]
