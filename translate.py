#!/usr/bin/env python
"""Translate raw text with a trained tinytf run: beam search, detokenised output, optional BLEU.

    python translate.py --model runs/tiny --input data/ende/test.en --output out.de \\
        --reference data/ende/test.de

Writes exactly one output line per input line, in input order (an empty input line gives an
empty output line). With ``--nbest K > 1`` it writes K lines per input in Moses' n-best format
``LINE ||| translation ||| score`` (LINE counts from 0). Warnings, progress and errors go to
stderr; the BLEU line goes to stdout, or to stderr when the translations do. The work is done by
:mod:`tinytf.translation`; docs/decoding.md explains the search.
"""
from __future__ import annotations

import argparse
import os
import sys

from tinytf import backend
from tinytf.bpe import BPEFileError
from tinytf.search import Hypothesis
from tinytf.translation import (
    Progress, SearchOptions, TranslationError, Translator, corpus_bleu, read_references,
    read_text_lines)


def build_parser() -> argparse.ArgumentParser:
    """The command line (``python translate.py --help``)."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, metavar="RUNDIR|CHECKPOINT",
                   help="a run directory (its checkpoint_last.npz or newest checkpoint) or a "
                        "checkpoint file; the BPE model is found beside it")
    p.add_argument("--input", default="-", metavar="FILE|-", help="raw text, one sentence a line (default: stdin)")
    p.add_argument("--output", default="-", metavar="FILE|-", help="where translations go (default: stdout)")
    p.add_argument("--beam", type=int, default=4, help="beam size; 1 is greedy (default: 4)")
    p.add_argument("--alpha", type=float, default=0.6,
                   help="GNMT length penalty exponent: score = log P / ((5 + |Y|) / 6) ** alpha "
                        "(default: 0.6)")
    p.add_argument("--max-len-a", type=float, default=1.0,
                   help="at most a * source tokens + b output tokens (default: a=1, b=50)")
    p.add_argument("--max-len-b", type=int, default=50, help="see --max-len-a")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--batch-size", type=int, default=None, metavar="N",
                      help="sentences per batch (default 64 when --max-tokens is not given)")
    size.add_argument("--max-tokens", type=int, default=None, metavar="N",
                      help="padded source tokens per batch")
    p.add_argument("--nbest", type=int, default=1, metavar="K",
                   help="write the K best translations of each line (Moses n-best format; "
                        "default: 1)")
    p.add_argument("--average", type=int, default=1, metavar="K",
                   help="average the last K checkpoints of the run directory before decoding "
                        "(default: 1, no averaging)")
    p.add_argument("--reference", default=None, metavar="FILE",
                   help="print sacrebleu's BLEU against these references, with its signature")
    p.add_argument("--device", choices=("cpu", "gpu"), default=backend.default_device(),
                   help="where to run the model (default: $TINYTF_DEVICE or cpu)")
    p.add_argument("--precision", choices=("float32", "tf32", "bf16", "fp16"),
                   default="float32",
                   help="compute precision of the model's products (tinytf.amp; bf16 and "
                        "tf32 pay off on a GPU; default: float32)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="invalid UTF-8 in the input: stop with an error naming the line, or "
                        "replace the bad bytes with U+FFFD (default: strict)")
    p.add_argument("--print-attention", default=None, metavar="DIR",
                   help="write the encoder-decoder attention of every translation (last layer, "
                        "mean over heads) as DIR/line_<N>.svg")
    p.add_argument("--quiet", action="store_true", help="no progress or summary on stderr")
    return p


def _check(args, parser):
    for name in ("beam", "nbest", "average"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    if args.nbest > args.beam:
        parser.error(f"--nbest {args.nbest} is larger than --beam {args.beam}")
    if args.max_len_a < 0 or args.max_len_b < 0:
        parser.error("--max-len-a and --max-len-b must not be negative")
    for name in ("batch_size", "max_tokens"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def _write_svgs(translator, sources, results, directory):
    from tinytf.attention_svg import translation_attention_svg  # noqa: PLC0415

    os.makedirs(directory, exist_ok=True)
    for number, (ids, nbest) in enumerate(zip(sources, results), 1):
        if ids and nbest:
            svg = translation_attention_svg(translator.model, translator.bpe, ids,
                                            nbest[0].tokens, title=f"line {number}")
            with open(os.path.join(directory, f"line_{number}.svg"), "w", encoding="utf-8") as f:
                f.write(svg)


def main(argv=None) -> int:
    """Run the command line; returns the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    name = "<stdin>" if args.input == "-" else args.input
    try:
        lines = read_text_lines(args.input, args.errors)
        references = (read_references(args.reference, len(lines), args.errors)
                      if args.reference else None)
        translator = Translator.load(args.model, average=args.average, device=args.device,
                                     precision=args.precision)
        options = SearchOptions(beam_size=args.beam, alpha=args.alpha, max_len_a=args.max_len_a,
                                max_len_b=args.max_len_b, nbest=args.nbest)
        progress = Progress(every=5.0) if not args.quiet else None
        sources = translator.encode_lines(lines, name)
        results = translator.translate_ids(sources, options, args.batch_size, args.max_tokens,
                                           progress=progress)
        best = [translator.detokenize(nbest[0]) if nbest else "" for nbest in results]
        if args.nbest > 1:  # an empty line has no hypotheses: it still gets one entry
            out = [f"{i} ||| {translator.detokenize(h)} ||| {h.score:.4f}"
                   for i, nbest in enumerate(results) for h in nbest or [Hypothesis((), 0.0, 0.0)]]
        else:
            out = best
        data = "".join(line + "\n" for line in out).encode("utf-8")
        if args.output == "-":
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
        else:
            with open(args.output, "wb") as f:
                f.write(data)
        if progress is not None:
            print(progress.summary(len(lines)), file=sys.stderr)
        if args.print_attention:
            _write_svgs(translator, sources, results, args.print_attention)
        if references is not None:
            score, signature = corpus_bleu(best, references)
            stream = sys.stderr if args.output == "-" else sys.stdout
            print(score.format(signature=signature), file=stream)
    except (TranslationError, BPEFileError, OSError) as e:
        print(f"translate.py: error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
