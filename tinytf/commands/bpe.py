"""Command line: ``python -m tinytf.commands.bpe learn|encode|decode``.

    python -m tinytf.commands.bpe learn --input train.en train.de --vocab-size 8000 \
        --output bpe.json
    python -m tinytf.commands.bpe encode --model bpe.json [--ids] [--workers N] < text > pieces
    python -m tinytf.commands.bpe decode --model bpe.json < pieces_or_ids > text

Encoding writes one line per input line: space-separated pieces (or ids with ``--ids``).
Decoding reads such lines; a line of integers is read as ids (force with --ids / --pieces).
Lines are split on "\\n" only, so a "\\r" in a line round-trips like any other character.
"""
import argparse
import os
import pathlib
import sys
import time

from tinytf.utils.streams import drop_stdout, note, write_all
from tinytf.utils.workers import WorkerError, ordered_map
from tinytf.commands import start_process


class _OutputError(Exception):
    """The standard output refused a write (a full disk, a quota): its reason."""


def _write(text: str) -> None:
    """``text`` to the standard output, all of it (:func:`tinytf.utils.streams.write_all`); a
    refused write is an `_OutputError` (a closed pipe stays a BrokenPipeError, which ends
    the command quietly)."""
    try:
        sys.stdout.flush()
        write_all(sys.stdout.buffer, text.encode("utf-8"))
    except BrokenPipeError:
        raise
    except OSError as e:
        raise _OutputError(e.strerror or str(e)) from None


def _stdin_lines():
    """Lines of stdin without their "\\n", decoded as UTF-8 (error names the line)."""
    for line_no, raw in enumerate(sys.stdin.buffer, 1):
        if raw.endswith(b"\n"):
            raw = raw[:-1]
        try:
            yield raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise ValueError(f"<stdin>:{line_no}: not valid UTF-8 ({e.reason})") from None


def _batches(lines, size=10_000):
    """Lists of `size` lines: the blocks that the workers encode (large blocks let
    `encode_batch` encode more of their new words together)."""
    batch = []
    for line in lines:
        batch.append(line)
        if len(batch) == size:
            yield batch
            batch = []
    if batch:
        yield batch


def _learn(args):
    from tinytf.text.bpe import BPE
    start = time.perf_counter()
    for path in args.input:   # (BPE.learn would take a list of names that are not files as text)
        if not os.path.isfile(path):
            raise ValueError(f"--input {path}: " + ("a directory, not a file"
                                                    if os.path.isdir(path) else "no such file"))
        if os.path.exists(args.output) and os.path.samefile(path, args.output):
            raise ValueError(f"--output {args.output} is the --input file {path}: writing the "
                             "model would replace it; choose another --output")
    bpe = BPE.learn([pathlib.Path(p) for p in args.input], vocab_size=args.vocab_size,
                    min_frequency=args.min_frequency, workers=args.workers,
                    progress=note)
    bpe.save(args.output)
    short = ("", "") if bpe.vocab_size >= args.vocab_size else (
        f" of the {args.vocab_size:,} asked", f"no further pair occurs {args.min_frequency} "
        "times; ")
    print(f"learned {bpe.vocab_size:,} pieces{short[0]} ({short[1]}{len(bpe.alphabet)} alphabet "
          f"symbols, {len(bpe.merges):,} merges) from {len(args.input)} file(s) in "
          f"{time.perf_counter() - start:.1f} s -> {args.output}", file=sys.stderr)


_encoder = {}


def _load_encoder(model_path, ids):
    """The model into ``_encoder`` (once: forked workers inherit the parent's)."""
    from tinytf.text.bpe import BPE
    if _encoder.get("path") != model_path:
        _encoder.update(bpe=BPE.load(model_path), path=model_path)
    _encoder["ids"] = ids


def _encode_block(lines):
    """One block of lines encoded, as the text written for it (pieces or ids, one line each)."""
    bpe, pieces = _encoder["bpe"], _encoder["bpe"].pieces
    return "".join((" ".join(map(str, ids)) if _encoder["ids"] else
                    " ".join(pieces[i] for i in ids)) + "\n"
                   for ids in bpe.encode_batch(lines))


def _encode(args):
    _encoder.clear()                      # this invocation's model, read afresh ...
    _load_encoder(args.model, args.ids)   # ... here first: a bad model is one error, not N
    for text in ordered_map(_encode_block, _batches(_stdin_lines()), args.workers,
                            _load_encoder, (args.model, args.ids)):
        _write(text)


def _decode(args):
    from tinytf.text.bpe import BPE
    bpe = BPE.load(args.model)
    # Written in blocks of about 64 KiB; on a terminal line by line, as it is typed.
    block, size, limit = [], 0, 1 if sys.stdout.isatty() else 1 << 16
    for line_no, line in enumerate(_stdin_lines(), 1):
        tokens = line.split()
        as_ids = args.ids or (not args.pieces and all(t.isdigit() for t in tokens))
        try:
            if as_ids:
                bad = next((t for t in tokens if not t.lstrip("-").isdigit()), None)
                if bad is not None:
                    raise ValueError(f"{bad!r} is not an id (--ids reads integers)")
                text = bpe.decode(int(t) for t in tokens)
            else:
                text = bpe.decode_pieces(tokens)
        except ValueError as e:
            raise ValueError(f"<stdin>:{line_no}: {e}") from None
        block.append(text + "\n")
        size += len(text) + 1
        if size >= limit:
            _write("".join(block))
            block, size = [], 0
    _write("".join(block))


def build_parser():
    """The argparse parser of the three subcommands."""
    called = os.path.basename(sys.argv[0])           # tinytf-bpe, or python -m tinytf.commands.bpe
    parser = argparse.ArgumentParser(prog=called if called.startswith("tinytf-") else
                                     "python -m tinytf.commands.bpe",
                                     description="Learn, apply and invert a BPE vocabulary.")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("learn", help="learn a joint vocabulary from text files")
    p.add_argument("--input", nargs="+", required=True, help="UTF-8 text files, one line each")
    p.add_argument("--vocab-size", type=int, default=8000,
                   help="pieces in all, 4 special tokens and 256 bytes included (8000)")
    p.add_argument("--min-frequency", type=int, default=2,
                   help="stop when the best pair is rarer than this (2)")
    p.add_argument("--output", required=True, help="model file to write (JSON)")
    p.add_argument("--workers", type=int, default=1,
                   help="processes counting the words of the files (default: 1)")
    p.set_defaults(run=_learn)
    p = sub.add_parser("encode", help="text on stdin -> pieces (or ids) on stdout")
    p.add_argument("--model", required=True, help="the BPE model (a bpe.json)")
    p.add_argument("--ids", action="store_true", help="write ids instead of pieces")
    p.add_argument("--workers", type=int, default=1,
                   help="processes encoding blocks of 10,000 lines, output in input order "
                        "(default: 1)")
    p.set_defaults(run=_encode)
    p = sub.add_parser("decode", help="pieces or ids on stdin -> text on stdout")
    p.add_argument("--model", required=True, help="the BPE model (a bpe.json)")
    kind = p.add_mutually_exclusive_group()
    kind.add_argument("--ids", action="store_true", help="the input is ids")
    kind.add_argument("--pieces", action="store_true", help="the input is pieces")
    p.set_defaults(run=_decode)
    return parser


def main(argv=None):
    """Run the command line; returns the exit status, as every tinytf command: 0 done, 1 a
    worker process killed (one line: out of memory?), 2 a data or usage error (one line on
    stderr naming the file, no traceback), 130 Ctrl-C, 141 a closed output pipe (quietly)."""
    start_process()
    parser = build_parser()
    args = parser.parse_args(argv)
    if hasattr(sys.stdout, "reconfigure"):
        sys.stdout.reconfigure(encoding="utf-8", newline="\n")
    try:
        args.run(args)
    except BrokenPipeError:             # the reader went away (| head): a shell tool's end
        drop_stdout()
        return 128 + 13
    except _OutputError as e:
        drop_stdout()
        print(f"{parser.prog}: error: the standard output: cannot write: {e}",
              file=sys.stderr)
        return 2
    except OSError as e:
        print(f"{parser.prog}: error: {e.filename}: {e.strerror}" if e.filename and e.strerror
              else f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{parser.prog}: interrupted", file=sys.stderr)
        return 128 + 2                  # SIGINT
    except WorkerError as e:            # killed (out of memory?)
        print(f"{parser.prog}: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
