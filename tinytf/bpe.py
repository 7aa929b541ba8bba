"""Byte-pair encoding (Sennrich et al., 2016): the joint subword vocabulary of the model.

    from tinytf.bpe import BPE, PAD_ID, BOS_ID, EOS_ID, UNK_ID   # 0, 1, 2, 3
    bpe = BPE.learn(["data/ende/train.en", "data/ende/train.de"], vocab_size=8000)
    ids = bpe.encode("Das Kind entwickelt sich normal.")
    assert bpe.decode(ids) == "Das Kind entwickelt sich normal."
    bpe.save("bpe.json"); bpe = BPE.load("bpe.json")

Command line: ``python -m tinytf.bpe learn|encode|decode`` (see `tinytf.text.cli`).
The code lives in `tinytf.text`; docs/bpe.md explains the scheme and the file format.
"""
import sys

from tinytf.text import BOS_ID, BPE, EOS_ID, PAD_ID, SPECIAL_TOKENS, UNK_ID, BPEFileError

__all__ = ["BPE", "BPEFileError", "PAD_ID", "BOS_ID", "EOS_ID", "UNK_ID", "SPECIAL_TOKENS"]

if __name__ == "__main__":
    from tinytf.text.cli import main
    sys.exit(main())
