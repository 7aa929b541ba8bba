"""The `BPE` model: a joint subword vocabulary that encodes any text and decodes it losslessly.

Vocabulary layout (ids are fixed by position):

====================  ===========================================================
0, 1, 2, 3            special tokens ``<pad>``, ``<s>``, ``</s>``, ``<unk>``
4 .. 259              the 256 byte pieces ``<0x00>`` .. ``<0xFF>`` (byte fallback)
260 ..                the alphabet: initial symbols seen in training, most frequent first
then                  one new piece per merge, in the order the merges were learned
====================  ===========================================================

Encoding never produces a special token; ``<unk>`` is reserved (byte fallback leaves nothing
unknown) and ``<s>``/``</s>``/``<pad>`` are for the model's batches. See docs/bpe.md.
"""
from tinytf.text.encode import PieceEncoder
from tinytf.text.ids import (  # noqa: F401
    BOS_ID,
    BYTE_OFFSET,
    EOS_ID,
    FIRST_SYMBOL_ID,
    PAD_ID,
    SPECIAL_TOKENS,
    UNK_ID,
)
from tinytf.text.learn import MAX_SYMBOLS, learn_bpe
from tinytf.text.pretokenize import byte_piece, can_be_piece, show, unshow


class BPE:
    """Byte-pair-encoding subword model (Sennrich et al., 2016) with byte fallback.

    Build one with `BPE.learn` or `BPE.load`; ``BPE(alphabet, merges)`` builds it from the
    alphabet symbols (in id order) and the merges as (left piece, right piece) string pairs,
    raising ValueError if they do not form a vocabulary.
    """

    def __init__(self, alphabet, merges, cache_size=1 << 20):
        pieces = list(SPECIAL_TOKENS) + [byte_piece(v) for v in range(256)]
        piece_ids = {p: i for i, p in enumerate(pieces)}
        for symbol in alphabet:
            if not isinstance(symbol, str) or not symbol or symbol in piece_ids:
                raise ValueError(f"alphabet symbol {symbol!r} is empty, not a str, or repeated")
            if not all(map(can_be_piece, unshow(symbol))):
                raise ValueError(f"alphabet symbol {symbol!r} holds a character that is always "
                                 "spelled in bytes")
            piece_ids[symbol] = len(pieces)
            pieces.append(symbol)
        ranks, merged = {}, []  # (left id, right id) -> rank; rank -> id of the merged piece
        for rank, (left, right) in enumerate(merges):
            a, b = piece_ids.get(left), piece_ids.get(right)
            if a is None or b is None or a < FIRST_SYMBOL_ID or b < FIRST_SYMBOL_ID:
                raise ValueError(f"merge {rank} ({left!r} {right!r}) uses a piece that is not "
                                 "in the vocabulary before it")
            if left + right in piece_ids:
                raise ValueError(f"merge {rank} ({left!r} {right!r}) makes a piece that "
                                 "already exists")
            ranks[a, b] = rank
            merged.append(len(pieces))
            piece_ids[left + right] = len(pieces)
            pieces.append(left + right)
        if len(pieces) > MAX_SYMBOLS:
            raise ValueError(f"more than {MAX_SYMBOLS} pieces")
        self.alphabet = list(alphabet)
        self.merges = [tuple(m) for m in merges]  # (left, right) piece strings, learning order
        self.pieces = pieces                      # id -> piece string
        self.piece_ids = piece_ids                # piece string -> id
        # id -> the UTF-8 bytes it stands for; special tokens stand for nothing.
        self._bytes = [b""] * BYTE_OFFSET + [bytes([v]) for v in range(256)] + [
            unshow(p).encode("utf-8") for p in pieces[FIRST_SYMBOL_ID:]]
        # raw text of an alphabet symbol -> its id, e.g. " t" -> id of "▁t"
        unit_ids = {unshow(s): piece_ids[s] for s in self.alphabet}
        self._encoder = PieceEncoder(unit_ids, self._spell, ranks, merged, cache_size)

    @classmethod
    def learn(cls, inputs, vocab_size=8000, min_frequency=2, workers=1, progress=None):
        """Learn a vocabulary of at most `vocab_size` pieces (special tokens and bytes included).

        inputs: a list of file paths (one joint vocabulary over all of them, e.g. the source
        and target sides; a single path works too) or an iterable of lines of text. A list
        counts as paths when its first item is a path-like object or an existing file; one
        that names a missing file among existing ones, or holds only names of files in
        existing directories, none of them a file, is a FileNotFoundError (pass an iterator
        to learn from such lines). Merges
        stop early when the best pair occurs fewer than `min_frequency` times. `workers`
        processes count the words of files (the merges are learnt in this process); the
        result does not depend on it. ``progress(line)``, if given, hears how far the
        counting and the merges are, every 30 s, and once when the counting ends.
        """
        if vocab_size < FIRST_SYMBOL_ID:
            raise ValueError(f"vocab_size must be at least {FIRST_SYMBOL_ID} (4 special "
                             f"tokens + 256 bytes), got {vocab_size}")
        if min_frequency < 1:
            raise ValueError(f"min_frequency must be at least 1, got {min_frequency}")
        return cls(*learn_bpe(inputs, vocab_size, min_frequency, FIRST_SYMBOL_ID, workers,
                              progress))

    # ---------------------------------------------------------------- encoding
    def _spell(self, unit):
        """Ids of one initial symbol (raw text); unknown characters are spelled in bytes."""
        i = self.piece_ids.get(show(unit)) if all(map(can_be_piece, unit)) else None
        if i is not None:
            return (i,)
        ids = []
        for char in unit:  # " x" unknown: try " " and "x" alone, then their bytes
            i = self.piece_ids.get(show(char)) if can_be_piece(char) else None
            if i is not None and i >= FIRST_SYMBOL_ID:
                ids.append(i)
            else:
                ids.extend(BYTE_OFFSET + v for v in char.encode("utf-8", "surrogatepass"))
        return tuple(ids)

    def encode(self, text):
        """Text -> list of piece ids (no <s>/</s> added). ``decode(encode(t)) == t``."""
        return self._encoder.encode(text)

    def encode_batch(self, lines):
        """A list of texts -> a list of lists of ids."""
        return self._encoder.encode_batch(lines)

    def encode_pieces(self, text):
        """Text -> list of piece strings (a space shows as ``▁``, a raw byte as ``<0xNN>``)."""
        pieces = self.pieces
        return [pieces[i] for i in self.encode(text)]

    def encode_word(self, word):
        """The ids of one pre-token (see `tinytf.text.pretokenize`), without the caches."""
        return list(self._encoder.encode_word(word))

    # ---------------------------------------------------------------- decoding
    def decode(self, ids):
        """Ids -> text. Special ids are skipped; the dummy-prefix space is removed.

        Bytes that do not form valid UTF-8 (possible only for ids that `encode` did not make)
        become U+FFFD.
        """
        ids = list(ids)
        if ids and (min(ids) < 0 or max(ids) >= len(self.pieces)):
            bad = next(i for i in ids if not 0 <= i < len(self.pieces))
            raise ValueError(f"BPE.decode: id {bad} is outside the vocabulary "
                             f"(0..{len(self.pieces) - 1})")
        data = b"".join(map(self._bytes.__getitem__, ids))
        try:
            text = data.decode("utf-8", "surrogatepass")  # lone surrogates round-trip too
        except UnicodeDecodeError:
            text = data.decode("utf-8", "replace")
        return text[1:] if text.startswith(" ") else text

    def decode_pieces(self, pieces):
        """Piece strings -> text (the inverse of `encode_pieces`)."""
        ids = []
        for p in pieces:
            i = self.piece_ids.get(p)
            if i is None:
                raise ValueError(f"BPE.decode_pieces: {p!r} is not a piece of this model")
            ids.append(i)
        return self.decode(ids)

    # ---------------------------------------------------------------- vocabulary
    @property
    def vocab_size(self):
        """Number of pieces, special tokens and the 256 bytes included."""
        return len(self.pieces)

    def __len__(self):
        return len(self.pieces)

    def __repr__(self):
        return (f"BPE(vocab_size={len(self.pieces)}, alphabet={len(self.alphabet)}, "
                f"merges={len(self.merges)})")

    def id_to_piece(self, i):
        """The piece string of id `i`."""
        return self.pieces[i]

    def piece_to_id(self, piece):
        """The id of a piece string (KeyError if it is not one)."""
        return self.piece_ids[piece]

    # ---------------------------------------------------------------- files
    def save(self, path):
        """Write the model as readable JSON (see `tinytf.text.bpe_file`)."""
        from tinytf.text.bpe_file import save
        save(self, path)

    @classmethod
    def load(cls, path):
        """Read a model written by `save`; BPEFileError names the file and the problem."""
        from tinytf.text.bpe_file import load
        return load(cls, path)
