"""How good a model is on held-out text: dev loss, greedy translation, sacrebleu BLEU."""
from __future__ import annotations

import math
import time

import numpy as np

from tinytf.data.batches import BatchIterator
from tinytf.decoding.search import greedy_search
from tinytf.decoding.translation import BANNED_IDS, SearchOptions, Translator, one_line
from tinytf.engine import backend
from tinytf.engine.tensor import no_grad
from tinytf.fast.cpu.transposed import transposed_weights
from tinytf.models.transformer import label_smoothed_loss
from tinytf.nn import amp
from tinytf.text import BOS_ID, EOS_ID, PAD_ID
from tinytf.utils.log import log_samples


def greedy_translate(model, bpe, lines, device="cpu", batch_size=100,
                     max_len_b=50) -> list[str]:
    """Translate raw text lines greedily (beam 1), in input order; the encoder runs once per
    batch and the decoder step by step with its key/value caches. Output length is at most
    ``len(source) + max_len_b`` tokens (the paper's limit). An empty line gives ""."""
    max_src = model.config.max_len - 1
    sources = [bpe.encode(line.strip())[:max_src] for line in lines]
    outputs = [""] * len(lines)
    todo = sorted((i for i, s in enumerate(sources) if s), key=lambda i: len(sources[i]))
    was_training = model.training
    model.eval()
    try:
        with no_grad(), transposed_weights(model):
            for start in range(0, len(todo), batch_size):
                rows = todo[start:start + batch_size]
                lengths = np.array([len(sources[i]) for i in rows], dtype=np.int64)
                src = np.full((len(rows), int(lengths.max()) + 1), PAD_ID, dtype=np.int64)
                for r, i in enumerate(rows):
                    src[r, :lengths[r]] = sources[i]
                    src[r, lengths[r]] = EOS_ID
                src = backend.to_device(src, device)
                state = model.start_decoding(model.encode(src), src)
                max_lens = np.minimum(lengths + max_len_b, model.config.max_len - 1)
                hyps = greedy_search(model.decode_step, state, len(rows), max_lens,
                                     bos_id=BOS_ID, eos_id=EOS_ID, banned_ids=BANNED_IDS)
                for i, hyp in zip(rows, hyps):
                    outputs[i] = one_line(bpe.decode(list(hyp.tokens))) if hyp else ""
    finally:
        model.train(was_training)
    return outputs


def bleu(hypotheses, references) -> float:
    """sacrebleu corpus BLEU (13a tokenisation, mixed case) of detokenised text."""
    import sacrebleu  # noqa: PLC0415 - a runtime dependency, imported where it is used
    return float(sacrebleu.corpus_bleu(list(hypotheses), [list(references)]).score)


def evaluate_loss(model, corpus, max_tokens, label_smoothing, device="cpu") -> dict:
    """Dev loss on ``corpus`` in eval mode: the label-smoothed loss per target token (what
    training minimises, so the two curves compare) and the plain NLL per token and its
    perplexity."""
    batches = BatchIterator(corpus, max_tokens, shuffle=False, drop_uneven=False)
    total = {"loss": 0.0, "nll": 0.0, "tokens": 0}
    was_training = model.training
    model.eval()
    try:
        with no_grad():
            for batch in batches:
                src = backend.to_device(batch.src, device)
                tgt_in = backend.to_device(batch.tgt_in, device)
                logits = model(src, tgt_in)
                loss, n = label_smoothed_loss(logits, batch.tgt_out, eps=label_smoothing)
                nll, _ = label_smoothed_loss(logits, batch.tgt_out, eps=0.0)
                total["loss"] += float(loss.item())
                total["nll"] += float(nll.item())
                total["tokens"] += n
    finally:
        model.train(was_training)
    n = max(total["tokens"], 1)
    return {"dev_loss": total["loss"] / n, "dev_nll": total["nll"] / n,
            "dev_ppl": math.exp(min(total["nll"] / n, 50.0))}


def validate(model, bpe, dev_data, dev_lines, *, max_tokens, label_smoothing, device="cpu",
             precision="float32", bleu_sentences=0, samples=3) -> dict:
    """What training validates with: :func:`evaluate_loss` on ``dev_data`` (the encoded
    dev pairs) and greedy BLEU on ``dev_lines`` (sources, references), on the first
    ``bleu_sentences`` of them (all if 0), with ``samples`` (source, reference,
    hypothesis) triples and the seconds it took."""
    t0 = time.perf_counter()
    with amp.autocast(precision):
        metrics = evaluate_loss(model, dev_data, max_tokens, label_smoothing, device)
        src, ref = dev_lines
        if bleu_sentences:
            src, ref = src[:bleu_sentences], ref[:bleu_sentences]
        hyps = greedy_translate(model, bpe, src, device)
    metrics["dev_bleu"] = bleu(hyps, ref)
    metrics["dev_bleu_sentences"] = len(src)
    metrics["valid_seconds"] = time.perf_counter() - t0
    metrics["samples"] = list(zip(src, ref, hyps))[:samples]
    return metrics


def test_scores(model, bpe, lines, log, device="cpu", precision="float32", beam=4,
                samples=3, workers=1) -> dict:
    """Test BLEU of ``lines`` (sources, references): greedy, and with ``beam`` > 1 the
    paper's beam search (length penalty 0.6, source + 50) in ``workers`` processes
    (:mod:`tinytf.decoding.workers`); logs the scores and a few translations. ``test_bleu``
    is the beam's (greedy's with ``beam`` 1)."""
    src, ref = lines
    out = {}
    t0 = time.perf_counter()
    with amp.autocast(precision):
        hyps = greedy_translate(model, bpe, src, device)
    out["test_bleu_greedy"] = round(bleu(hyps, ref), 2)
    log.info(f"test BLEU {out['test_bleu_greedy']:.2f} (greedy, {len(hyps)} sentences, "
             f"{time.perf_counter() - t0:.0f}s)")
    if beam > 1:
        t0 = time.perf_counter()
        options = SearchOptions(beam_size=beam)
        translator = Translator(model, bpe, device, precision)
        hyps = [nbest[0][0] for nbest in translator.translate_lines(src, options,
                                                                    workers=workers)]
        out["test_bleu_beam"] = round(bleu(hyps, ref), 2)
        log.info(f"test BLEU {out['test_bleu_beam']:.2f} (beam {options.beam_size}, "
                 f"alpha {options.alpha}, {len(hyps)} sentences, "
                 f"{time.perf_counter() - t0:.0f}s)")
    out["test_bleu"] = out.get("test_bleu_beam", out["test_bleu_greedy"])
    log_samples(log, "test", list(zip(src, ref, hyps))[:samples])
    return out
