"""Translate raw text with a trained tinytf run: beam search, detokenised output, optional BLEU.

    python translate.py --model runs/ende-tiny --input data/ende/test.en --output out.de \\
        --reference data/ende/test.de
    python translate.py --model runs/a runs/b --output-format jsonl   # an ensemble, JSON lines

Writes exactly one output line per input line, in input order (an empty input line gives an
empty output line). With ``--nbest K > 1`` it writes K lines per input in Moses' n-best
format ``LINE ||| translation ||| LogProb=... Len=... ||| score`` (LINE counts from 0);
``--output-format tsv`` writes each hypothesis with its score and log-probability, ``jsonl``
one JSON object per input line. On a terminal it prompts for sentences.
Warnings, progress and errors go to stderr; the BLEU and chrF lines go to stdout, or to
stderr when the translations do. The input is read and translated ``--buffer-size`` lines
at a time and each block is written at once, so the command also serves interactively (a
line in, its translation out) and in pipes. ``--score-reference FILE`` scores given
translations instead of searching. The work is done by :mod:`tinytf.decoding.translation`;
docs/decoding.md explains the search.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import sys
import threading

from tinytf.commands import device_default, start_process
from tinytf.decoding.ensemble import EnsembleTranslator
from tinytf.decoding.search import Hypothesis
from tinytf.decoding.translation import (
    DecodeProgress,
    SearchOptions,
    TranslationError,
    Translator,
    corpus_bleu,
    corpus_chrf,
    read_text_lines,
    stream_line_blocks,
)
from tinytf.engine import backend
from tinytf.fast.cpu.transposed import transposed_weights
from tinytf.nn import amp
from tinytf.text import BPEFileError
from tinytf.training.signals import StopRequested
from tinytf.utils.streams import drop_stdout, note, write_all
from tinytf.utils.workers import (
    STOP_SIGNALS,
    WorkerError,
    signal_words,
    stop_signals_held,
    thread_budget,
)


def _model_options(p) -> None:
    """The model and the search."""
    p.add_argument("--model", required=True, nargs="+", metavar="RUNDIR|CHECKPOINT",
                   help="run directories or checkpoints (the BPE beside them); several: an "
                        "ensemble of one BPE")
    p.add_argument("--average", type=int, default=1, metavar="K",
                   help="average the last K checkpoints of the run directory before decoding "
                        "(default: 1, no averaging)")
    p.add_argument("--beam", type=int, default=4, help="beam size; 1 is greedy (default: 4)")
    p.add_argument("--alpha", type=float, default=0.6,
                   help="GNMT length penalty exponent: score = log P / ((5 + |Y|) / 6) ** alpha "
                        "(default: 0.6)")
    p.add_argument("--max-len-a", type=float, default=1.0,
                   help="at most a * source tokens + b output tokens (default: a=1, b=50)")
    p.add_argument("--max-len-b", type=int, default=50, help="see --max-len-a")
    p.add_argument("--nbest", type=int, default=1, metavar="K",
                   help="write the K best translations of each line (default: 1)")


def _io_options(p) -> None:
    """Where the lines come from and go, and how many at a time."""
    p.add_argument("--input", default="-", metavar="FILE|-",
                   help="raw text, one sentence a line (default: stdin)")
    p.add_argument("--output", default="-", metavar="FILE|-",
                   help="where translations go (default: stdout)")
    p.add_argument("--output-format", choices=("text", "tsv", "jsonl"), default="text",
                   help="text, tsv (translation, score, log P) or jsonl (docs/decoding.md; "
                        "default: text)")
    p.add_argument("--errors", choices=("strict", "replace"), default="strict",
                   help="invalid UTF-8: an error naming the line, or U+FFFD (default: "
                        "strict)")
    p.add_argument("--buffer-size", type=int, default=1000, metavar="N",
                   help="lines read, translated and written at a time (default: 1000)")
    size = p.add_mutually_exclusive_group()
    size.add_argument("--batch-size", type=int, default=None, metavar="N",
                      help="sentences per batch (default 64 when --max-tokens is not given)")
    size.add_argument("--max-tokens", type=int, default=None, metavar="N",
                      help="padded source tokens per batch")
    p.add_argument("--print-attention", default=None, metavar="DIR",
                   help="the cross-attention of each translation as DIR/line_<N>.svg")
    p.add_argument("--quiet", action="store_true", help="no progress or summary on stderr")


def _score_options(p) -> None:
    """Scores against references."""
    p.add_argument("--reference", default=None, metavar="FILE",
                   help="print sacrebleu's BLEU and chrF against these references, with "
                        "their signatures")
    p.add_argument("--bleu-format", choices=("text", "json"), default="text",
                   help="the scores with --reference: sacrebleu's text lines, or one JSON "
                        "object (default: text)")
    p.add_argument("--score-reference", default=None, metavar="FILE",
                   help="no search: the log-probability of each line of FILE as the "
                        "translation of its input line (forced decoding)")


def _device_options(p) -> None:
    """Where and how the model runs."""
    p.add_argument("--device", choices=("cpu", "gpu"), default=device_default(),
                   help="where to run the model (default: $TINYTF_DEVICE or cpu)")
    p.add_argument("--precision", choices=("float32", "tf32", "bf16", "fp16"),
                   default="float32",
                   help="the products' arithmetic (docs/gpu.md; default: float32)")
    p.add_argument("--workers", type=int, default=None, metavar="N",
                   help="processes that decode the batches (docs/decoding.md, \"Cores\"; "
                        "default: the threads allowed, 1 on a GPU)")


def build_parser() -> argparse.ArgumentParser:
    """The command line (``python translate.py --help``), in groups."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for title, add in (("model and search", _model_options),
                       ("input and output", _io_options), ("scores", _score_options),
                       ("device", _device_options)):
        add(p.add_argument_group(title))
    return p


def _check(args, parser):
    for name in ("beam", "nbest", "average", "buffer_size"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")
    if args.nbest > args.beam:
        parser.error(f"--nbest {args.nbest} is larger than --beam {args.beam}")
    if args.max_len_a < 0 or args.max_len_b < 0:
        parser.error("--max-len-a and --max-len-b must not be negative")
    if len(args.model) > 1 and (args.score_reference or args.print_attention):
        parser.error("--score-reference and --print-attention take one --model, not an "
                     "ensemble")
    for name in ("batch_size", "max_tokens", "workers"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1")


def _write_svgs(translator, sources, results, directory, first: int = 1):
    from tinytf.decoding.attention_svg import translation_attention_svg  # noqa: PLC0415

    for number, (ids, nbest) in enumerate(zip(sources, results), first):
        if ids and nbest:
            svg = translation_attention_svg(translator.model, translator.bpe, ids,
                                            nbest[0].tokens, title=f"line {number}")
            with open(os.path.join(directory, f"line_{number}.svg"), "w", encoding="utf-8") as f:
                f.write(svg)


def _open_input(path):
    """The input's file descriptor (stdin for "-"), read as a stream of line blocks."""
    if path == "-":
        if sys.stdin is None:
            raise TranslationError("the standard input is closed: give --input FILE")
        return sys.stdin.fileno(), None
    try:
        f = open(path, "rb")
    except OSError as e:
        raise TranslationError(f"{path}: cannot read: {e.strerror}") from None
    return f.fileno(), f


def _open_output(path, keep=()):
    """Where translations go, opened before any decoding (an unwritable path fails first);
    refused if it is one of the files ``keep`` names (opening it would empty it)."""
    if path == "-":
        return sys.stdout.buffer
    for option, other in keep:
        if other not in (None, "-") and os.path.exists(path) and os.path.exists(other) \
                and os.path.samefile(path, other):
            raise TranslationError(f"--output {path} is the {option} file: writing would erase "
                                   "it; choose another --output")
    try:
        return open(path, "wb")
    except OSError as e:
        raise TranslationError(f"{path}: cannot write: {e.strerror}") from None


def _write(out, lines, path, whole: int) -> None:
    """Write ``lines`` (each with its newline) to ``out``, all of them
    (:func:`tinytf.utils.streams.write_all`); a write the file system refuses (a full disk) is a
    TranslationError naming the output and the ``whole`` lines written before these, which
    are complete in it."""
    try:
        write_all(out, "".join(lines).encode("utf-8"))
    except BrokenPipeError:
        raise                           # the reader went away: main ends quietly
    except OSError as e:
        where = "the standard output" if path == "-" else path
        raise TranslationError(f"{where}: cannot write the output: {e.strerror or e} (the "
                               f"first {whole:,} lines are whole in it)") from None


def _close(out) -> None:
    """Close an output file. Every block was flushed when it was written, so a failure here
    is that of a block whose write already failed and was reported: nothing more to say."""
    try:
        out.close()
    except OSError:
        pass


def _format(translator, results, nbest: int, first: int, fmt: str = "text",
            lines=None) -> list[str]:
    """Output lines: the best translation per input line, or Moses n-best lines
    ``LINE ||| text ||| LogProb=log P Len=tokens ||| score`` (LINE counting from 0 over the
    whole input; score is the length-penalised log P the beam ranks by); ``fmt`` "tsv":
    ``translation TAB score TAB log P`` per hypothesis; "jsonl": one JSON object per input
    line (its ``source`` from ``lines``)."""
    empty = Hypothesis((), 0.0, 0.0)
    if fmt == "tsv":
        return [f"{translator.detokenize(h)}\t{h.score:.4f}\t{h.log_prob:.4f}"
                for n in results for h in n or [empty]]
    if fmt == "jsonl":
        out = []
        for i, (n, source) in enumerate(zip(results, lines), first + 1):
            hyps = [{"translation": translator.detokenize(h), "score": round(h.score, 4),
                     "log_prob": round(h.log_prob, 4)} for h in n or [empty]]
            doc = {"line": i, "source": source, **hyps[0]}
            if nbest > 1:
                doc["nbest"] = hyps
            out.append(json.dumps(doc, ensure_ascii=False))
        return out
    if nbest == 1:
        return [translator.detokenize(n[0]) if n else "" for n in results]
    return [f"{i} ||| {translator.detokenize(h)} ||| LogProb={h.log_prob:.4f} "
            f"Len={len(h.tokens)} ||| {h.score:.4f}"          # an empty line: one entry
            for i, n in enumerate(results, first) for h in n or [Hypothesis((), 0.0, 0.0)]]


def _score_reference(args, translator, fd, out, name) -> int:
    """--score-reference: one log-probability per input line (read from ``fd`` to its end),
    of its reference line."""
    lines = [line for block in stream_line_blocks(fd, args.buffer_size, name, args.errors)
             for line in block]
    targets = read_text_lines(args.score_reference, args.errors)
    if len(targets) != len(lines):
        raise TranslationError(f"{args.score_reference}: {len(targets)} lines for "
                               f"{len(lines)} input lines")
    sources = translator.encode_lines(lines, name)
    limit = translator.model.config.max_len - 1
    encoded = []
    for number, text in enumerate(targets, 1):
        ids = translator.bpe.encode(text.strip())
        if len(ids) > limit:
            raise TranslationError(f"{args.score_reference}: line {number}: {len(ids)} tokens; "
                                   f"the model scores at most {limit}")
        encoded.append(ids)
    scores = translator.score_ids(sources, encoded, args.batch_size or 64)
    _write(out, [f"{x:.4f}\n" for x in scores], args.output, 0)
    return len(lines)


def _print_scores(args, best, references, done) -> None:
    """BLEU and chrF of the translations against --reference (text lines or one JSON)."""
    if len(references) != done:
        raise TranslationError(f"{args.reference}: {len(references)} reference lines for "
                               f"{done} input lines")
    bleu, bleu_sig = corpus_bleu(best, references)
    chrf, chrf_sig = corpus_chrf(best, references)
    stream = sys.stderr if args.output == "-" else sys.stdout
    if args.bleu_format == "json":
        print(json.dumps({"bleu": round(bleu.score, 4), "chrf": round(chrf.score, 4),
                          "bleu_signature": bleu_sig, "chrf_signature": chrf_sig,
                          "bleu_detail": bleu.format(signature=bleu_sig),
                          "sentences": done}, sort_keys=True), file=stream)
    else:
        print(bleu.format(signature=bleu_sig), file=stream)
        print(chrf.format(signature=chrf_sig), file=stream)


def _stop_on_signals() -> dict:
    """SIGTERM and SIGUSR1 (a scheduler's stop) raise :class:`StopRequested` where the
    command is, as SIGINT raises KeyboardInterrupt: it ends with the lines written so far
    whole, and says how many. Returns the handlers replaced (none outside the main
    thread)."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    def stop(signum, frame):
        raise StopRequested(signum)

    return {sig: signal.signal(sig, stop) for sig in STOP_SIGNALS if sig != signal.SIGINT}


def _prog() -> str:
    """The program's name for messages: ``translate.py`` or ``tinytf-translate``, as it was
    called."""
    return os.path.basename(sys.argv[0]) or "translate.py"


def _open_files(args):
    """Everything that can fail before the first line is decoded, in that order: the device,
    the references, the input, the model, the output (never one of the inputs, and opened
    only once all before it succeeded: a failure leaves an existing output as it was) and
    the attention directory. Returns (references or None, input descriptor, input file or
    None, translator, output)."""
    problem = backend.gpu_unusable() if args.device == "gpu" else None
    if problem is not None:     # before any file is opened or written
        raise TranslationError(f"--device gpu {problem}")
    references = read_text_lines(args.reference, args.errors) if args.reference else None
    if references is not None and args.input != "-" and os.path.isfile(args.input):
        lines = count_input_lines(args.input)
        if lines != len(references):     # before any decoding, not after it all
            raise TranslationError(f"{args.reference}: {len(references)} reference lines for "
                                   f"{lines} input lines in {args.input}")
    fd, infile = _open_input(args.input)
    try:
        if len(args.model) > 1:
            translator = EnsembleTranslator.load_all(args.model, average=args.average,
                                                     device=args.device,
                                                     precision=args.precision)
        else:
            translator = Translator.load(args.model[0], average=args.average,
                                         device=args.device, precision=args.precision)
    except BaseException:
        if infile is not None:
            infile.close()
        raise
    out = _open_output(args.output, [("--input", args.input),
                                     ("--reference", args.reference),
                                     ("--score-reference", args.score_reference)])
    if args.print_attention:   # made before any decoding, as the output is opened
        try:
            os.makedirs(args.print_attention, exist_ok=True)
        except OSError as e:
            why = "a file, not a directory" if os.path.isfile(args.print_attention) \
                else f"cannot make the directory: {e.strerror}"
            raise TranslationError(f"--print-attention {args.print_attention}: {why}") \
                from None
    return references, fd, infile, translator, out


def _is_terminal(fd: int) -> bool:
    """Whether ``fd`` is a terminal (someone typing)."""
    try:
        return os.isatty(fd)
    except OSError:
        return False


def _prompt() -> None:
    """``> `` on stderr, without a newline: the next sentence, please."""
    try:
        sys.stderr.write("> ")
        sys.stderr.flush()
    except (OSError, ValueError):
        pass


def count_input_lines(path: str) -> int:
    """The lines of file ``path`` as :func:`read_text_lines` counts them (only ``\n`` ends
    a line; a last line without one counts), read in blocks of 1 MiB."""
    count, last = 0, b"\n"
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            count += block.count(b"\n")
            last = block[-1:]
    return count + (last != b"\n")


@dataclasses.dataclass
class Written:
    """The input lines whose translations are written whole so far."""
    lines: int = 0


def _translate_blocks(args, translator, fd, out, name, written: Written) -> list[str]:
    """Read a block of lines, translate it (sorted by length inside), write and flush it in
    input order, then the next: bounded memory, and answers before the input ends. Returns
    the best translations where --reference asks for them (else an empty list)."""
    options = SearchOptions(beam_size=args.beam, alpha=args.alpha, max_len_a=args.max_len_a,
                            max_len_b=args.max_len_b, nbest=args.nbest)
    workers = args.workers or thread_budget()
    progress = DecodeProgress(every=5.0) if not args.quiet else None
    best = []
    prompt = args.input == "-" and not args.quiet and _is_terminal(fd)
    if prompt:
        note(f"{_prog()}: type a sentence and Enter to translate it; Ctrl-D ends")
        _prompt()
    # The weights are fixed for the whole command: their transposes are copied once for all
    # the blocks, not once per block (docs/decoding.md, "Cores").
    with transposed_weights(translator.model):
        for lines in stream_line_blocks(fd, args.buffer_size, name, args.errors):
            sources = translator.encode_lines(lines, name)
            results = translator.translate_ids(sources, options, args.batch_size,
                                               args.max_tokens, workers=workers)
            first = written.lines
            with stop_signals_held():   # a block is written whole and counted, or not
                _write(out, [line + "\n" for line in _format(
                    translator, results, args.nbest, first, args.output_format, lines)],
                       args.output, first)
                written.lines += len(lines)
            if args.print_attention:
                _write_svgs(translator, sources, results, args.print_attention, first + 1)
            if args.reference:
                best += [translator.detokenize(n[0]) if n else "" for n in results]
            if progress is not None:
                progress(written.lines, None)
            if prompt:
                _prompt()
    if progress is not None:
        note(progress.summary(written.lines))
    return best


def main(argv=None) -> int:
    """Run the command line; returns the exit status: 0 done, 2 usage or data error (one
    line naming the file), 141 the output pipe closed (128 + SIGPIPE), 130 interrupted
    (Ctrl-C: the lines translated so far are written), 143 or 138 stopped by SIGTERM or
    SIGUSR1 (the same); 1 is a decoding worker killed (one line: out of memory?) or an
    internal error (a traceback)."""
    start_process()
    parser = build_parser()
    args = parser.parse_args(argv)
    _check(args, parser)
    name = "<stdin>" if args.input == "-" else args.input
    out = infile = None
    written = Written()
    handlers = {}
    try:
        references, fd, infile, translator, out = _open_files(args)
        warning = amp.speed_warning(args.precision, args.device)
        if warning:
            note(warning)
        if args.score_reference:
            _score_reference(args, translator, fd, out, name)
            return 0
        handlers = _stop_on_signals()   # a scheduler's SIGTERM or SIGUSR1: as a Ctrl-C
        best = _translate_blocks(args, translator, fd, out, name, written)
        if references is not None:
            _print_scores(args, best, references, written.lines)
    except BrokenPipeError:
        # The reader went away (| head, | true): end quietly, as a shell tool does.
        drop_stdout()
        return 128 + 13
    except (TranslationError, BPEFileError, OSError) as e:
        print(f"{_prog()}: error: {e}", file=sys.stderr)
        return 2
    except WorkerError as e:            # killed (out of memory?); the blocks written are whole
        print(f"{_prog()}: error: {e}; the first {written.lines:,} lines are written",
              file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        # Every block written so far is complete and flushed; the workers ignore SIGINT and
        # are killed as the map of blocks stops.
        print(f"{_prog()}: interrupted after {written.lines:,} lines", file=sys.stderr)
        return 128 + 2                  # SIGINT
    except StopRequested as stop:
        number = stop.args[0]
        print(f"{_prog()}: stopped by {signal_words(number)} after {written.lines:,} lines",
              file=sys.stderr)
        return 128 + number
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)
        if infile is not None:
            infile.close()
        if out is not None and out is not sys.stdout.buffer:
            _close(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
