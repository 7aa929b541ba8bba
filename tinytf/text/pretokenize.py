"""Pre-tokenisation: cut text into words, and words into the initial symbols BPE merges.

Scheme (SentencePiece-like, lossless):

* A space is written ``▁`` (U+2581) inside pieces. Before cutting, one space is prepended to the
  text (the *dummy prefix*, removed again by decoding), so a word at the start of a line looks
  the same as one in the middle: ``"The cat"`` -> ``"▁The", "▁cat"``.
* `PRETOKEN` cuts text by Unicode class: a *word* is a run of letters (with their combining
  marks) or a run of digits, together with the punctuation and symbols that touch it on either
  side (``"(wirklich)"``, ``"Juli."``, ``"there’"``) and at most one space before it. Punctuation
  that touches no word stands alone; whitespace runs and line breaks are tokens of their own.
  Merges never cross these cuts. Keeping touching punctuation with its word matters for
  compression: cutting every punctuation run off costs ~1.4 pieces per sentence on
  data/ende (+3.8% pieces against subword-nmt at equal merges); see docs/bpe.md.
* The initial symbols of a word are its characters, except that a leading space is glued to
  the first character (``▁T``), just as subword-nmt glues its end-of-word marker to the last
  one (``t</w>``): one symbol per character, and word boundaries cost no merges.
* Characters that cannot be a piece (`can_be_piece`) and characters never seen in training are
  written as their UTF-8 bytes, one piece ``<0xNN>`` per byte, so *any* string round-trips.
  Whitespace other than the plain space, control characters, lone surrogates and ``▁`` itself
  always take this byte path: pieces therefore never contain whitespace, and ``▁`` in a piece
  always means a space.
"""
import string
import unicodedata

import regex

SPACE = "▁"  # U+2581 LOWER ONE EIGHTH BLOCK, how a space is shown inside a piece

# Alternatives are tried in order; together they match every character, so the tokens of a
# text concatenate back to it. "\n" is its own token so that a block of lines cuts exactly as
# each line would on its own (learning reads files in blocks; encoding sees one line).
PRETOKEN = regex.compile(r"""
      \n                          # line break
    | \ ?[^\s\p{L}\p{M}\p{N}]*      # a word: a run of letters (with their combining marks)
      (?:[\p{L}\p{M}]+|\p{N}+)     # or of digits, the punctuation and symbols that touch it
      [^\s\p{L}\p{M}\p{N}]*        # on either side, and an optional leading space
    | \ ?[^\s\p{L}\p{M}\p{N}]+      # punctuation, symbols, controls standing alone
    | [^\S\n]+(?!\S)              # whitespace, leaving the last space to a following word
    | [^\S\n]+                    # whitespace before a non-space that took no space
""", regex.VERBOSE)

# A dummy-prefix space at the start of every non-empty line of a block (learning).
LINE_START = regex.compile(r"(?m)^(?=[^\n])")


def pretokenize(text):
    """Cut one line of text into words; ``"".join(pretokenize(t)) == " " + t`` for t != ""."""
    return PRETOKEN.findall(" " + text) if text else []


def single_spaced(text):
    """True if `text` is not empty and holds no whitespace but single spaces between
    non-spaces, so its pre-tokens are those of its ``text.split(" ")`` chunks, each with the
    space before it (``isprintable()`` is False for every other whitespace character; the
    tests check this against the regex's ``\\s``)."""
    return bool(text) and text.isprintable() and "  " not in text and \
        text[0] != " " != text[-1]


# Punctuation and symbols common at the edges of words; none is a letter, mark, digit or
# whitespace (the tests check their Unicode categories).
EDGE_MARKS = string.punctuation + "“”„‘’‚«»‹›–—…¿¡"


def one_word(chunk):
    """True if ``" " + chunk`` is a single pre-token by a test cheaper than the regex: the
    chunk (which holds no whitespace) is letters, or decimal digits, between runs of
    `EDGE_MARKS`, as in ``"Tom."`` or ``"(1990),"`` (`PRETOKEN`'s word alternative). False
    leaves it to the regex (``"don't"`` is two pre-tokens)."""
    core = chunk.strip(EDGE_MARKS)
    return core.isalpha() or core.isdecimal()


def can_be_piece(char):
    """True if `char` may appear in a piece; the others are always spelled as bytes."""
    if char == " ":
        return True
    if char == SPACE or char.isspace():
        return False
    return unicodedata.category(char) not in ("Cc", "Cs")


def show(text):
    """The piece spelling of raw text: spaces become ``▁``."""
    return text.replace(" ", SPACE)


def unshow(piece):
    """The raw text of a (non-byte) piece: ``▁`` becomes a space."""
    return piece.replace(SPACE, " ")


def initial_units(word):
    """The raw text of each initial symbol of a pre-token: ``" the" -> [" t", "h", "e"]``.

    The leading space of a word is glued to its first character; a whitespace run stays one
    character per symbol (``"   " -> [" ", " ", " "]``).
    """
    if word[0] == " " and len(word) > 1 and not word[1].isspace():
        return [word[:2], *word[2:]]
    return list(word)


def byte_piece(value):
    """The piece of one raw byte, ``<0xNN>``."""
    return "<0x%02X>" % value
