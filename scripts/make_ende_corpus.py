"""Rebuild the shipped English-German corpus in ``data/ende/`` from Debian's ``trans-de-en``.

The source is the TU Chemnitz German-English dictionary by Frank Richter (GPL-2+), as packaged
by Debian (``apt-get download trans-de-en``; the text is ``usr/share/trans/de-en`` inside the
package). Each dictionary line is ``German :: English``; both sides are split by ``|`` into
aligned sub-entries (headword, inflections, then usage examples). Many usage examples are whole
sentences with a whole-sentence translation: those are the corpus.

Usage::

    python scripts/make_ende_corpus.py trans-de-en_1.9-6_all.deb          # or usr/share/trans/de-en
    python scripts/make_ende_corpus.py trans-de-en_1.9-6_all.deb --check  # compare, write nothing

The output is a pure function of the input bytes and ``--seed``: no RNG, no dates, no
dependence on the Python version, so re-running gives identical files (``MD5SUMS``).
"""

import argparse
import hashlib
import io
import os
import re
import sys
import tarfile

# The package version the shipped files were built from; another version gives other files.
KNOWN_SOURCE_MD5 = "595a99efc451255c4c765af683222ce6"  # usr/share/trans/de-en of trans-de-en 1.9-6
DEB_MEMBER = "usr/share/trans/de-en"

N_TEST = 1000
N_DEV = 500
MIN_WORDS = 4
PHRASE_MIN_WORDS = 3  # phrases of 1-2 words would double the size for little BPE benefit

# Dictionary notation that makes a line not a plain sentence: {grammar}, [register/domain],
# <search keywords>, (optional words), ";" alternatives, "/" alternatives, "|" separators.
NOT_IN_SENTENCE = set("{}[]<>();/|")
# Placeholders for "something"/"somebody" in their various cases; "so." is NOT one of them
# (German "Es scheint so." is a sentence).
PLACEHOLDER = re.compile(r"(?<!\w)(sth|smth|sb|smb|etw|jd|jdn|jdm|jds)\.", re.IGNORECASE)
SENTENCE_START = re.compile(r"[A-Z0-9ÄÖÜ]")
# Annotations removed from phrase pairs: {m}, [coll.], <keywords>, (optional words).
ANNOTATION = re.compile(r"\{[^{}]*\}|\[[^\[\]]*\]|<[^<>]*>|\([^()]*\)")


def read_source(path):
    """Return the dictionary text from ``path``: the ``de-en`` text file itself or the ``.deb``.

    A ``.deb`` is an ``ar`` archive holding ``data.tar.*``; it is read with the standard library
    so that the script needs neither ``dpkg`` nor root.
    """
    with open(path, "rb") as f:
        raw = f.read()
    if raw.startswith(b"!<arch>\n"):
        raw = _extract_from_deb(raw, path)
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise SystemExit(f"{path}: line {line}: invalid UTF-8 at byte offset {e.start}") from None


def _extract_from_deb(raw, path):
    """Return the bytes of ``usr/share/trans/de-en`` from the ``.deb`` archive ``raw``."""
    pos = 8
    while pos + 60 <= len(raw):
        header = raw[pos:pos + 60]
        name = header[:16].decode("ascii").strip().rstrip("/")
        size = int(header[48:58].decode("ascii").strip())
        body = raw[pos + 60:pos + 60 + size]
        if name.startswith("data.tar"):
            with tarfile.open(fileobj=io.BytesIO(body), mode="r:*") as tar:
                for member in tar.getmembers():
                    if member.name.lstrip("./") == DEB_MEMBER:
                        return tar.extractfile(member).read()
            raise SystemExit(f"{path}: {name} has no {DEB_MEMBER}")
        pos += 60 + size + (size & 1)  # ar pads members to an even offset
    raise SystemExit(f"{path}: not a Debian package with a data.tar member")


def aligned_pairs(text, path="<text>"):
    """Yield ``(german, english)`` for every aligned ``|`` sub-entry of the dictionary ``text``.

    Lines starting with ``#`` are comments. A line whose sides have different numbers of
    sub-entries cannot be aligned and is skipped (none do in 1.9-6).
    """
    for lineno, line in enumerate(text.split("\n"), 1):
        if not line or line.startswith("#"):
            continue
        german, sep, english = line.partition(" :: ")
        if not sep:
            raise SystemExit(f"{path}: line {lineno}: no ' :: ' separator")
        de_parts, en_parts = german.split("|"), english.split("|")
        if len(de_parts) != len(en_parts):
            continue
        for de, en in zip(de_parts, en_parts):
            yield normalise(de), normalise(en)


def normalise(s):
    """Strip and collapse runs of whitespace to one space."""
    return " ".join(s.split())


def is_sentence(s):
    """True if ``s`` is a plain, whole sentence.

    Starts with an uppercase letter or digit, ends with ``.``, ``!`` or ``?``, has at least
    MIN_WORDS words, no dictionary notation (NOT_IN_SENTENCE), no sth./etw. placeholders and only
    printable characters (the source has a few stray C1 control bytes).
    """
    return (
        len(s.split()) >= MIN_WORDS
        and SENTENCE_START.match(s) is not None
        and s[-1] in ".!?"
        and s.isprintable()
        and not NOT_IN_SENTENCE.intersection(s)
        and PLACEHOLDER.search(s) is None
    )


def clean_phrase(s):
    """Return the first ``;`` alternative of ``s`` with annotations removed, or "" if unusable."""
    s = normalise(ANNOTATION.sub(" ", s).split(";")[0])
    if not s.isprintable() or NOT_IN_SENTENCE.intersection(s):
        return ""
    return s


def dedupe(pairs):
    """Keep the first pair for each English and each German sentence (no sentence appears twice,
    so no test sentence can also be a training sentence)."""
    seen_en, seen_de, out = set(), set(), []
    for de, en in pairs:
        if en in seen_en or de in seen_de:
            continue
        seen_en.add(en)
        seen_de.add(de)
        out.append((de, en))
    return out


def shuffle_key(seed, de, en):
    """Order pairs by SHA-256 of (seed, pair): a seeded shuffle that never depends on an RNG
    implementation or on the input order."""
    return hashlib.sha256(f"{seed}\t{en}\t{de}".encode("utf-8")).digest()


def build(text, seed, path="<text>"):
    """Return ``{split: [(de, en), ...]}`` for ``test``, ``dev``, ``train`` and ``phrases``."""
    sentences, phrases = [], []
    for de, en in aligned_pairs(text, path):
        if is_sentence(de) and is_sentence(en):
            sentences.append((de, en))
        else:
            phrases.append((clean_phrase(de), clean_phrase(en)))
    sentences = dedupe(sentences)
    sentences.sort(key=lambda p: shuffle_key(seed, *p))
    splits = {
        "test": sentences[:N_TEST],
        "dev": sentences[N_TEST:N_TEST + N_DEV],
        "train": sentences[N_TEST + N_DEV:],
    }
    # Phrases are an extra training file: disjoint from every corpus sentence on either side.
    taken_de = {de for de, _ in sentences}
    taken_en = {en for _, en in sentences}
    phrases = [
        (de, en) for de, en in phrases
        if len(de.split()) >= PHRASE_MIN_WORDS and len(en.split()) >= PHRASE_MIN_WORDS
        and de not in taken_de and en not in taken_en
    ]
    splits["phrases"] = sorted(set(phrases), key=lambda p: shuffle_key(seed, *p))
    return splits


def render(splits):
    """Return ``{file name: bytes}`` for every output file, MD5SUMS included."""
    files = {}
    for split, pairs in splits.items():
        for lang, index in (("de", 0), ("en", 1)):
            files[f"{split}.{lang}"] = "".join(p[index] + "\n" for p in pairs).encode("utf-8")
    sums = "".join(f"{hashlib.md5(data).hexdigest()}  {name}\n"
                   for name, data in sorted(files.items()))
    files["MD5SUMS"] = sums.encode("ascii")
    return files


def main(argv=None):
    """Command line entry point; see the module docstring."""
    here = os.path.dirname(os.path.abspath(__file__))
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("source", help="trans-de-en .deb or its usr/share/trans/de-en")
    parser.add_argument("--out", default=os.path.join(here, "..", "data", "ende"),
                        help="output directory (default: data/ende of this repository)")
    parser.add_argument("--seed", type=int, default=1234, help="split seed (default: 1234)")
    parser.add_argument("--no-phrases", action="store_true", help="skip phrases.{de,en}")
    parser.add_argument("--check", action="store_true",
                        help="compare with the files in --out, write nothing; exit 1 on a diff")
    args = parser.parse_args(argv)

    text = read_source(args.source)
    digest = hashlib.md5(text.encode("utf-8")).hexdigest()
    if digest != KNOWN_SOURCE_MD5:
        print(f"warning: {args.source}: dictionary md5 {digest} is not the {KNOWN_SOURCE_MD5} "
              "the shipped files come from (trans-de-en 1.9-6); the output will differ",
              file=sys.stderr)
    splits = build(text, args.seed, args.source)
    if args.no_phrases:
        del splits["phrases"]
    files = render(splits)

    for split, pairs in splits.items():
        print(f"{split:8s} {len(pairs):6d} pairs")
    differ = []
    os.makedirs(args.out, exist_ok=True)
    for name, data in files.items():
        target = os.path.join(args.out, name)
        if args.check:
            old = open(target, "rb").read() if os.path.exists(target) else None
            if old != data:
                differ.append(name)
        else:
            with open(target, "wb") as f:
                f.write(data)
        print(f"{hashlib.md5(data).hexdigest()}  {len(data):8d} bytes  {name}")
    if differ:
        print(f"differs from {args.out}: {' '.join(differ)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
