"""The fixed ids at the start of every BPE vocabulary (the layout in :mod:`tinytf.text.bpe`)."""

PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
SPECIAL_TOKENS = ("<pad>", "<s>", "</s>", "<unk>")
BYTE_OFFSET = len(SPECIAL_TOKENS)          # id of <0x00>
FIRST_SYMBOL_ID = BYTE_OFFSET + 256         # id of the first alphabet symbol
