"""From raw text to translations: load a trained run, batch by length, beam search, detokenise.

``translate.py`` is a thin command-line shell over this module::

    translator = Translator.load("runs/tiny")             # or a checkpoint file; average=K
    lines = read_text_lines("test.en")                    # only "\\n" ends a line
    outputs = translator.translate_lines(lines, SearchOptions(beam_size=4, alpha=0.6))

Pipeline: BPE-encode every line (truncating sources longer than the model's positions), sort the
sentences by length and cut them into batches (little padding, and a batch's source padding is
masked everywhere), run the encoder once per batch and
:func:`tinytf.decoding.search.beam_search` with
the model's incremental decoder, then put the results back in input order and detokenise.
Outputs never contain a line break, so one input line gives exactly one output line.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import re
import sys
import time

import numpy as np

from tinytf.decoding.search import Hypothesis, beam_search
from tinytf.decoding.workers import translate_batches
from tinytf.engine import backend
from tinytf.engine.tensor import Tensor, no_grad
from tinytf.fast.cpu.transposed import transposed_weights
from tinytf.models.transformer import Transformer, TransformerConfig
from tinytf.nn import amp
from tinytf.nn import functional as F
from tinytf.text import BOS_ID, BPE, EOS_ID, PAD_ID, UNK_ID
from tinytf.utils import checkpoint
from tinytf.utils.streams import note

# Tokens the decoder may never emit: padding, the start symbol, and <unk> (the byte-fallback
# BPE never produces it, so the model was never taught when to).
BANNED_IDS = (PAD_ID, BOS_ID, UNK_ID)
_LOG = logging.getLogger("tinytf.decoding")
logging.getLogger("tinytf").addHandler(logging.NullHandler())   # a library's default: quiet
# Every character that str.splitlines() or a text-mode reader treats as a line break.
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
_NO_BREAKS = str.maketrans({c: " " for c in LINE_BREAKS})
_SURROGATE = re.compile("[\ud800-\udfff]")


class TranslationError(ValueError):
    """Unusable input, model or reference; the message names the file, the line and the problem."""


@dataclasses.dataclass
class SearchOptions:
    """Decoding settings (the paper's: beam 4, alpha 0.6, max length = source length + 50)."""

    beam_size: int = 4
    alpha: float = 0.6
    max_len_a: float = 1.0  # max output tokens = max_len_a * source tokens + max_len_b
    max_len_b: int = 50
    nbest: int = 1


# ------------------------------------------------------------------------------ reading text


def read_text_lines(path, errors: str = "strict", data: bytes | None = None) -> list[str]:
    """The lines of a UTF-8 file (``path`` "-" is stdin), without their line ends.

    Only ``\\n`` ends a line (``\\r\\n`` too): ``str.splitlines`` would also split at U+2028,
    U+0085, form feeds and friends, which can sit inside a sentence. A missing final newline is
    fine; a leading byte-order mark is dropped. Invalid UTF-8 raises :class:`TranslationError`
    naming the line, unless ``errors="replace"`` (U+FFFD for each bad byte sequence).
    ``data`` gives the bytes directly (``path`` then only names them in messages).
    """
    if errors not in ("strict", "replace"):
        raise ValueError(f"errors must be 'strict' or 'replace', got {errors!r}")
    if data is None:
        if path == "-":
            data = sys.stdin.buffer.read()
        else:
            try:
                with open(path, "rb") as f:
                    data = f.read()
            except OSError as e:
                raise TranslationError(f"{path}: cannot read: {e.strerror}") from None
    name = "<stdin>" if path == "-" else path
    raw_lines = data.split(b"\n")
    if raw_lines[-1] == b"":  # the final newline ends the last line; it does not start one
        raw_lines.pop()
    return decode_lines(raw_lines, name, errors)


def decode_lines(raw_lines, name: str, errors: str = "strict", first: int = 1) -> list[str]:
    """UTF-8 byte lines (without ``\n``) as text: a trailing ``\r`` dropped, a byte-order mark
    on line 1 dropped; invalid UTF-8 is a :class:`TranslationError` naming ``name`` and the
    line number (``first`` is the number of the first line), or U+FFFD with "replace"."""
    lines = []
    for number, raw in enumerate(raw_lines, first):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            if errors == "strict":
                raise TranslationError(
                    f"{name}: line {number}: invalid UTF-8 (byte 0x{raw[e.start]:02x} at byte "
                    f"{e.start + 1} of the line: {e.reason}); pass --errors replace to "
                    "translate it with U+FFFD in place of the bad bytes") from None
            line = raw.decode("utf-8", "replace")
        if number == 1 and line.startswith("\ufeff"):
            line = line[1:]
        lines.append(line[:-1] if line.endswith("\r") else line)
    return lines


def stream_line_blocks(fd: int, size: int, name: str, errors: str = "strict"):
    """Yield the lines of file descriptor ``fd`` as lists of at most ``size`` lines (text,
    as :func:`decode_lines` makes them), without waiting for more input than is there: a
    block ends early when the lines read so far are all that can be read without blocking
    (a line typed on a terminal, or written to a pipe that stays open, is yielded at once).
    From a regular file every block but the last is full."""
    import select  # noqa: PLC0415 - POSIX; only the streaming reader needs it
    pending, block, first = b"", [], 1
    while True:
        while len(block) < size and b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            block.append(line)
        if len(block) >= size or (block and not select.select([fd], [], [], 0)[0]):
            yield decode_lines(block, name, errors, first)
            first += len(block)
            block = []
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:      # end of input: a last line without its newline still counts
            if pending:
                block.append(pending)
            if block:
                yield decode_lines(block, name, errors, first)
            return
        pending += chunk


def one_line(text: str) -> str:
    """``text`` on one line and encodable: line breaks become spaces, lone surrogates U+FFFD.

    A model can emit the byte pieces of a newline or of half a surrogate pair; written out
    as they are, they would split an output line or fail to encode as UTF-8.
    """
    return _SURROGATE.sub("\ufffd", text.translate(_NO_BREAKS))


# ------------------------------------------------------------------------------ batching


def make_batches(lengths, batch_size: int | None = None, max_tokens: int | None = None):
    """Cut sentence indices, sorted by length, into batches; returns a list of index arrays.

    Sorting keeps padding small (the speed part); correctness never depends on the grouping,
    because padding is masked. A batch holds at most ``batch_size`` sentences and at most
    ``max_tokens`` padded source tokens (``len(batch) * longest``); a sentence longer than
    ``max_tokens`` gets a batch of its own. Ties in length keep input order.
    """
    if batch_size is None and max_tokens is None:
        batch_size = 64
    if (batch_size is not None and batch_size < 1) or (max_tokens is not None and max_tokens < 1):
        raise ValueError("batch_size and max_tokens must be at least 1")
    lengths = np.asarray(lengths, dtype=np.int64)
    order = np.argsort(lengths, kind="stable")
    batches, start = [], 0
    for end in range(1, len(order) + 1):
        size, longest = end - start, max(int(lengths[order[end - 1]]), 1)
        too_many = batch_size is not None and size > batch_size
        too_big = max_tokens is not None and size * longest > max_tokens and size > 1
        if too_many or too_big:
            batches.append(order[start:end - 1])
            start = end - 1
    if start < len(order):
        batches.append(order[start:])
    return batches


def pad_sources(sources) -> np.ndarray:
    """(B, S) int64: each source's ids followed by ``</s>``, right-padded with ``<pad>``."""
    longest = max(len(s) for s in sources) + 1
    out = np.full((len(sources), longest), PAD_ID, dtype=np.int64)
    for row, ids in enumerate(sources):
        out[row, :len(ids)] = ids
        out[row, len(ids)] = EOS_ID
    return out


# ------------------------------------------------------------------------------ loading


def bpe_path_of(ckpt: checkpoint.Checkpoint, ckpt_path: str) -> str:
    """The BPE file of a checkpoint: its recorded file (absolute, or beside the checkpoint),
    else ``bpe.json`` in the checkpoint's directory."""
    directory = os.path.dirname(os.path.abspath(ckpt_path))
    recorded = (ckpt.meta.get("bpe") or {}).get("file")
    candidates = []
    if recorded:
        candidates += [recorded, os.path.join(directory, recorded),
                       os.path.join(directory, os.path.basename(recorded))]
    candidates.append(os.path.join(directory, "bpe.json"))
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise TranslationError(f"{ckpt_path}: cannot find the BPE model (looked for "
                           f"{', '.join(dict.fromkeys(candidates))}): copy the bpe.json of "
                           "the run that wrote it beside it")


def load_checkpoint(path, average: int = 1) -> tuple[checkpoint.Checkpoint, str]:
    """The checkpoint at ``path`` (a file or a run directory) and the file it came from.

    With ``average=K > 1``, ``path`` must be a run directory and the result is the average of its
    last K numbered checkpoints ``checkpoint_<step>.npz`` (the paper averages the last 5 or 20).
    """
    try:
        if average > 1:
            if not os.path.isdir(path):
                raise TranslationError(f"{path}: --average needs a run directory, not a file")
            paths = checkpoint.list_checkpoints(path)
            if len(paths) < average:
                raise TranslationError(f"{path}: --average {average} needs {average} numbered "
                                       f"checkpoints, found {len(paths)}")
            return checkpoint.average(paths[-average:]), paths[-1]
        if not os.path.exists(path):
            raise TranslationError(f"{path}: no such checkpoint file or run directory")
        resolved = checkpoint.resolve(path)
        return checkpoint.load(resolved, with_optim=False), resolved
    except checkpoint.CheckpointError as e:
        raise TranslationError(str(e)) from None


class Translator:
    """A Transformer and its BPE model, ready to translate text on ``device`` ("cpu"/"gpu").

    ``precision`` ("float32", "tf32", "bf16", "fp16"; see :mod:`tinytf.nn.amp`) is the policy
    the search runs under: bf16 halves the memory traffic of the products on a GPU.

    From Python (``tinytf.Translator``)::

        translator = tinytf.Translator.load("runs/ende-tiny")      # or a checkpoint file
        translator.translate(["Good morning.", "Thank you."])       # -> ["Guten Morgen.", ...]
        translator.translate("Good morning.", beam=8, nbest=2, with_scores=True)
        # -> [("Guten Morgen.", -0.41), ("Guten Morgen!", -1.73)]
    """

    def __init__(self, model: Transformer, bpe: BPE, device: str = "cpu",
                 precision: str = "float32"):
        self.model = model.to(device) if device != "cpu" else model
        self.model.eval()
        self.bpe = bpe
        self.device = device
        self.precision = amp.Policy(precision)
        self.warn = _LOG.warning      # "tinytf.decoding": translate.py shows it on stderr

    @classmethod
    def load(cls, path, average: int = 1, device: str = "cpu",
             precision: str = "float32") -> "Translator":
        """Build the model of a checkpoint (or of a run directory's newest / averaged ones)."""
        ckpt, ckpt_path = load_checkpoint(path, average)
        if "model_config" not in ckpt.meta:
            raise TranslationError(f"{ckpt_path}: checkpoint has no model_config metadata")
        try:
            config = TransformerConfig.from_dict(ckpt.meta["model_config"])
        except (TypeError, ValueError) as e:
            raise TranslationError(f"{ckpt_path}: bad model_config: {e}") from None
        problem = config.mismatch(ckpt.model)
        if problem:
            raise TranslationError(f"{ckpt_path}: {problem}")
        bpe_path = bpe_path_of(ckpt, ckpt_path)
        expected = (ckpt.meta.get("bpe") or {}).get("sha256")
        if expected and checkpoint.sha256_file(bpe_path) != expected:
            raise TranslationError(f"{bpe_path}: not the BPE model {ckpt_path} was trained with "
                                   "(SHA-256 differs)")
        bpe = BPE.load(bpe_path)
        if len(bpe) != config.vocab_size:
            raise TranslationError(f"{bpe_path}: {len(bpe)} pieces, but the model of "
                                   f"{ckpt_path} has {config.vocab_size}: not the BPE model "
                                   "it was trained with")
        model = Transformer(config)
        try:
            model.load_state_dict(ckpt.model)
        except (KeyError, ValueError) as e:
            raise TranslationError(f"{ckpt_path}: {e}") from None
        try:
            return cls(model, bpe, device, precision)
        except RuntimeError as e:  # e.g. --device gpu without CuPy
            raise TranslationError(f"device {device!r}: {e}") from None

    # -------------------------------------------------------------------------- ids level

    @property
    def max_source_len(self) -> int:
        """Most source tokens a sentence may have (the model's positions, minus ``</s>``)."""
        return self.model.config.max_len - 1

    def max_output_lens(self, source_lengths, options: SearchOptions) -> np.ndarray:
        """``floor(a * |x| + b)`` tokens per sentence, capped by the decoder's positions."""
        lengths = np.asarray(source_lengths, dtype=np.float64)
        wanted = np.floor(options.max_len_a * lengths + options.max_len_b).astype(np.int64)
        return np.clip(wanted, 0, self.model.config.max_len - 1)

    def translate_batch(self, sources, options: SearchOptions) -> list[list[Hypothesis]]:
        """Beam search for one batch of token-id lists (without ``</s>``; none empty)."""
        src = pad_sources(sources)
        src_dev = backend.to_device(src, self.device)
        with amp.autocast(self.precision), transposed_weights(self.model):
            with no_grad():
                memory = self.model.encode(src_dev)
                state = self.model.start_decoding(memory, src_dev)
            step = self.model.decode_step
            if self.device != "cpu":  # the search hands over NumPy tokens; the model wants
                step = lambda tokens, state: self.model.decode_step(  # noqa: E731
                    backend.to_device(tokens, self.device), state)  # device ones
            return beam_search(
                step, state, len(sources),
                self.max_output_lens([len(s) for s in sources], options),
                beam_size=options.beam_size, alpha=options.alpha, nbest=options.nbest,
                bos_id=BOS_ID, eos_id=EOS_ID, banned_ids=BANNED_IDS)

    def translate_ids(self, sources, options: SearchOptions, batch_size=None, max_tokens=None,
                      progress=None, workers: int = 1) -> list[list[Hypothesis]]:
        """N-best lists for token-id sources, in input order; an empty source gets ``[]``.

        Sentences are sorted by length and batched (:func:`make_batches`); ``workers > 1``
        decodes the batches in that many processes (:mod:`tinytf.decoding.workers`; the same
        results). ``progress(done, total)`` is called after every batch.
        """
        results: list[list[Hypothesis]] = [[] for _ in sources]
        todo = [i for i, s in enumerate(sources) if len(s)]
        done = len(sources) - len(todo)
        batches = [[todo[j] for j in batch] for batch in
                   make_batches([len(sources[i]) for i in todo], batch_size, max_tokens)]
        searched = translate_batches(self, [[sources[i] for i in index] for index in batches],
                                     options, workers)
        with transposed_weights(self.model):  # once for all batches (and forked workers)
            for index, nbests in zip(batches, searched):
                for i, nbest in zip(index, nbests):
                    results[i] = nbest
                done += len(index)
                if progress is not None:
                    progress(done, len(sources))
        return results

    # -------------------------------------------------------------------------- text level

    def score_ids(self, sources, targets, batch_size: int = 64) -> list[float]:
        """Forced decoding: log P(target </s> | source) under the model, natural log, per
        pair (as ``fairseq-generate --score-reference`` and ``marian-scorer``). Equal, to
        float rounding, to the ``log_prob`` of a :class:`Hypothesis` with those tokens."""
        scores = []
        for lo in range(0, len(sources), batch_size):
            src, tgt = sources[lo:lo + batch_size], targets[lo:lo + batch_size]
            width = max(len(t) for t in tgt) + 1
            tgt_in = np.full((len(tgt), width), PAD_ID, dtype=np.int64)
            tgt_out = np.full((len(tgt), width), PAD_ID, dtype=np.int64)
            for row, ids in enumerate(tgt):
                tgt_in[row, :len(ids) + 1] = [BOS_ID, *ids]
                tgt_out[row, :len(ids) + 1] = [*ids, EOS_ID]
            with amp.autocast(self.precision), no_grad():
                logits = self.model(backend.to_device(pad_sources(src), self.device),
                                    backend.to_device(tgt_in, self.device))
                logp = backend.to_numpy(F.log_softmax(logits, axis=-1).data)
            picked = np.take_along_axis(logp, tgt_out[:, :, None], axis=-1)[:, :, 0]
            picked = np.where(tgt_out != PAD_ID, picked.astype(np.float64), 0.0)
            scores += [float(x) for x in picked.sum(axis=1)]
        return scores

    def encode_lines(self, lines, name: str = "<input>") -> list[list[int]]:
        """BPE ids of every line (stripped); too long ones are truncated with a warning."""
        sources = []
        for number, line in enumerate(lines, 1):
            ids = self.bpe.encode(line.strip())
            if len(ids) > self.max_source_len:
                self.warn(f"{name}: line {number}: {len(ids)} source tokens exceed the model's "
                          f"{self.model.config.max_len} positions; truncated to the first "
                          f"{self.max_source_len}")
                ids = ids[:self.max_source_len]
            sources.append(ids)
        return sources

    def detokenize(self, hyp: Hypothesis) -> str:
        """The text of a hypothesis, on one line."""
        return one_line(self.bpe.decode(hyp.tokens))

    def translate(self, lines, beam: int = 4, alpha: float = 0.6, nbest: int = 1,
                  with_scores: bool = False, max_len_a: float = 1.0, max_len_b: int = 50,
                  batch_size: int | None = None, max_tokens: int | None = None):
        """Translate a sentence or a list of them: a string each (``nbest=1``), a list of
        ``nbest`` strings each, or with ``with_scores`` a list of (text, score) pairs each
        (score: log P / ((5 + |Y|) / 6) ** alpha, what the beam ranks by). A single string in
        gives a single result out. ``beam=1`` is greedy search."""
        single = isinstance(lines, str)
        batch = [lines] if single else list(lines)
        if not all(isinstance(line, str) for line in batch):
            raise TypeError("translate takes a string or a list of strings")
        if beam < 1 or not 1 <= nbest <= beam:
            raise ValueError(f"need beam >= 1 and 1 <= nbest <= beam, got beam {beam}, "
                             f"nbest {nbest}")
        options = SearchOptions(beam_size=beam, alpha=alpha, max_len_a=max_len_a,
                                max_len_b=max_len_b, nbest=nbest)
        results = self.translate_lines(batch, options, batch_size, max_tokens)
        if with_scores:
            out = [list(r) for r in results]
        elif nbest == 1:
            out = [r[0][0] for r in results]
        else:
            out = [[text for text, _ in r] for r in results]
        return out[0] if single else out

    def translate_lines(self, lines, options: SearchOptions, batch_size=None, max_tokens=None,
                        progress=None, name: str = "<input>",
                        workers: int = 1) -> list[list[tuple[str, float]]]:
        """(text, score) n-best lists, one per input line and in input order.

        An empty or whitespace-only line gives ``[("", 0.0)]``.
        """
        sources = self.encode_lines(lines, name)
        results = self.translate_ids(sources, options, batch_size, max_tokens, progress, workers)
        return [[(self.detokenize(h), h.score) for h in nbest] or [("", 0.0)]
                for nbest in results]


# ------------------------------------------------------------------------------ scoring


def read_references(path, n_lines: int, errors: str = "strict") -> list[str]:
    """The reference lines of ``path``; there must be one per input line."""
    references = read_text_lines(path, errors)
    if len(references) != n_lines:
        raise TranslationError(f"{path}: {len(references)} reference lines for {n_lines} "
                               "input lines")
    return references


def corpus_bleu(hypotheses, references):
    """sacrebleu's corpus BLEU (13a tokenisation, mixed case) and its signature string."""
    import sacrebleu  # noqa: PLC0415 (only needed with --reference)

    bleu = sacrebleu.metrics.BLEU()
    score = bleu.corpus_score(list(hypotheses), [list(references)])
    return score, str(bleu.get_signature())


def corpus_chrf(hypotheses, references):
    """sacrebleu's corpus chrF (character 6-grams, beta 2) and its signature string."""
    import sacrebleu  # noqa: PLC0415 (only needed with --reference)

    chrf = sacrebleu.metrics.CHRF()
    score = chrf.corpus_score(list(hypotheses), [list(references)])
    return score, str(chrf.get_signature())


class DecodeProgress:
    """Prints ``done/total sentences, rate, elapsed, time to go`` to stderr at most every
    ``every`` seconds."""

    def __init__(self, every: float = 5.0, stream=None):
        self.every = every
        self.stream = stream or sys.stderr
        self.start = self.last = time.perf_counter()

    def __call__(self, done: int, total: int | None) -> None:
        """Report ``done`` of ``total`` sentences (None: a stream of unknown length)."""
        now = time.perf_counter()
        if now - self.last >= self.every and (total is None or done < total):
            self.last = now
            elapsed = max(now - self.start, 1e-9)
            rate = done / elapsed
            of = "" if total is None else f"/{total:,}"
            left = "" if total is None or not done else \
                f", about {(total - done) / rate:.0f} s to go"
            note(f"translated {done:,}{of} sentences, {rate:.1f} sentences/s, "
                 f"{elapsed:.0f} s elapsed{left}", self.stream)

    def summary(self, total: int) -> str:
        """The closing line: sentences, seconds, sentences per second."""
        elapsed = time.perf_counter() - self.start
        return (f"translated {total:,} sentence{'' if total == 1 else 's'} in {elapsed:.1f} s, "
                f"{total / max(elapsed, 1e-9):.1f} sentences/s")


def full_prefix_step(model: Transformer):
    """A step function that recomputes the decoder over the whole prefix (no cache).

    Same interface as ``model.decode_step`` with a :class:`PrefixState`; used to measure what
    the key/value cache saves, and to test that it changes nothing.
    """

    def step(tokens, state: "PrefixState"):
        xp = backend.get_array_module(state.memory.data)
        state.prefix = xp.concatenate([state.prefix, xp.asarray(tokens)[:, None]], axis=1)
        with no_grad():
            logits = model.decode(state.prefix, state.memory, state.src_ids)  # (N, t, V)
            return (logits[:, -1].log_softmax(axis=-1)).data

    return step


class PrefixState:
    """State of :func:`full_prefix_step`: the encoder output, the source ids, the prefix so far."""

    def __init__(self, memory: Tensor, src_ids, prefix=None):
        self.memory = memory
        self.src_ids = src_ids
        xp = backend.get_array_module(src_ids)
        self.prefix = xp.zeros((len(src_ids), 0), dtype=np.int64) if prefix is None else prefix

    def select(self, rows) -> "PrefixState":
        """Keep, repeat or reorder rows, as ``DecoderState.select``."""
        rows = np.asarray(rows)
        return PrefixState(Tensor(self.memory.data[rows]), self.src_ids[rows], self.prefix[rows])
