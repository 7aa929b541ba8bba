"""Ensembles: several models of one BPE searched as one, as fairseq's ``--path a.pt:b.pt``.

At every step each model scores the next token given the same prefix; the ensemble's
log-probability is that of the models' mean probability (fairseq's ``EnsembleModel``):

    log p(y_t | y_<t, x) = log (1/M) sum_m p_m(y_t | y_<t, x) = logsumexp_m(log p_m) - log M

and beam search runs on it unchanged (:func:`tinytf.decoding.search.beam_search`): the state
it keeps and reorders is one decoder state per model (:class:`EnsembleState`). The models
must share the BPE (the same pieces, so the same ids mean the same text); their sizes and
depths may differ.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from tinytf.decoding.search import Hypothesis, beam_search
from tinytf.decoding.translation import (
    BANNED_IDS,
    BOS_ID,
    EOS_ID,
    SearchOptions,
    TranslationError,
    Translator,
    pad_sources,
)
from tinytf.engine import backend
from tinytf.engine.tensor import no_grad
from tinytf.fast.cpu.transposed import transposed_weights
from tinytf.nn import amp
from tinytf.ops.softmax import logsumexp


class EnsembleState:
    """One decoder state per model, selected together."""

    def __init__(self, states: list):
        self.states = states

    def select(self, rows) -> "EnsembleState":
        """Keep hypotheses ``rows`` in every model's state."""
        self.states = [state.select(rows) for state in self.states]
        return self


def mean_probability_log(log_probs: list):
    """log of the mean of the models' probabilities, from their log-probabilities (each
    (B, V)): logsumexp over the models minus log M (-inf where every model says -inf)."""
    xp = backend.get_array_module(log_probs[0])
    out = logsumexp(xp.stack(log_probs), axis=0) - math.log(len(log_probs))
    return out.astype(log_probs[0].dtype, copy=False)


class EnsembleTranslator(Translator):
    """Translators of one BPE searched as one model (:func:`mean_probability_log` at each
    step). ``model`` is the first member's (for the shared limits); ``members`` all of them."""

    def __init__(self, members: list):
        first = members[0]
        for other in members[1:]:
            if other.bpe.pieces != first.bpe.pieces:
                raise TranslationError("the ensemble's models were trained with different BPE "
                                       "models (their pieces differ): an id would mean "
                                       "different text in each")
        self.members = members
        super().__init__(first.model, first.bpe, first.device, first.precision.name)

    @classmethod
    def load_all(cls, paths, average: int = 1, device: str = "cpu",
                 precision: str = "float32") -> "EnsembleTranslator":
        """The ensemble of the checkpoints or run directories ``paths``."""
        return cls([Translator.load(p, average, device, precision) for p in paths])

    @property
    def max_source_len(self) -> int:
        return min(m.model.config.max_len for m in self.members) - 1

    def max_output_lens(self, source_lengths, options: SearchOptions) -> np.ndarray:
        return np.minimum.reduce([m.max_output_lens(source_lengths, options)
                                  for m in self.members])

    def translate_batch(self, sources, options: SearchOptions) -> list[list[Hypothesis]]:
        """Beam search for one batch over the ensemble's mean probabilities."""
        src = backend.to_device(pad_sources(sources), self.device)
        models = [m.model for m in self.members]
        with amp.autocast(self.precision), no_grad():
            states = [m.start_decoding(m.encode(src), src) for m in models]

        def step(tokens, state: EnsembleState):
            tokens = backend.to_device(tokens, self.device)
            with amp.autocast(self.precision):
                return mean_probability_log([m.decode_step(tokens, s)
                                             for m, s in zip(models, state.states)])

        with contextlib.ExitStack() as stack:
            for m in models:
                stack.enter_context(transposed_weights(m))
            return beam_search(
                step, EnsembleState(states), len(sources),
                self.max_output_lens([len(s) for s in sources], options),
                beam_size=options.beam_size, alpha=options.alpha, nbest=options.nbest,
                bos_id=BOS_ID, eos_id=EOS_ID, banned_ids=BANNED_IDS)

    def score_ids(self, sources, targets, batch_size: int = 64) -> list[float]:
        raise TranslationError("--score-reference scores with one model, not an ensemble")
