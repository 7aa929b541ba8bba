"""Tests for tinytf.fast.cpu.transposed: the weights' transposes copied for a search's products."""

from pathlib import Path

import numpy as np
import pytest

import tinytf
from tinytf import functional as F
from tinytf import nn
from tinytf.decoding.search import beam_search
from tinytf.decoding.translation import SearchOptions, Translator, pad_sources
from tinytf.engine.tensor import Tensor
from tinytf.fast.cpu.transposed import transposed, transposed_weights
from tinytf.models.transformer import Transformer, TransformerConfig
from tinytf.text import BOS_ID, BPE, EOS_ID
from tinytf.training.evaluate import greedy_translate

DATA = Path(__file__).resolve().parent.parent.parent / "data" / "ende"


def small_transformer(vocab=50):
    tinytf.manual_seed(7)
    config = TransformerConfig(vocab_size=vocab, d_model=32, n_heads=4, d_ff=64,
                               n_encoder_layers=2, n_decoder_layers=2, dropout=0.0, max_len=64)
    model = Transformer(config)
    model.eval()
    return model


def test_outside_a_block_the_transpose_is_the_view_and_inside_a_contiguous_copy():
    layer = nn.Linear(6, 5)
    w, b = layer.weight.data, layer.bias.data
    assert np.shares_memory(transposed(w), w)
    with transposed_weights(layer):
        wt = transposed(w)
        assert wt.flags.c_contiguous and not np.shares_memory(wt, w)
        np.testing.assert_array_equal(wt, w.T)
        assert np.shares_memory(transposed(b), b)          # vectors are not copied
        other = w.copy()                                   # equal, but not the layer's
        assert np.shares_memory(transposed(other), other)
    assert np.shares_memory(transposed(w), w)


def test_nested_blocks_keep_the_copies_until_the_block_that_made_them_ends():
    layer = nn.Linear(4, 3)
    w = layer.weight.data
    with transposed_weights(layer):
        outer = transposed(w)
        with transposed_weights(layer):
            assert transposed(w) is outer                   # not copied again
        assert transposed(w) is outer
    assert np.shares_memory(transposed(w), w)
    with pytest.raises(RuntimeError):
        with transposed_weights(layer):
            raise RuntimeError("inside")
    assert np.shares_memory(transposed(w), w)               # dropped on the way out too


@pytest.mark.parametrize("rows", [1, 4, 64, 300])
@pytest.mark.parametrize("relu", [False, True])
def test_a_linear_layer_inside_a_block_equals_the_product_by_the_view(rows, relu):
    rng = np.random.default_rng(rows)
    layer = nn.Linear(48, 40)
    x = Tensor(rng.standard_normal((rows, 48)).astype(np.float32))
    activation = "relu" if relu else None
    with tinytf.no_grad():
        plain = F.linear(x, layer.weight, layer.bias, activation=activation).data
        with transposed_weights(layer):
            copied = F.linear(x, layer.weight, layer.bias, activation=activation).data
    assert copied.dtype == np.float32 and copied.shape == plain.shape
    np.testing.assert_allclose(copied, plain, rtol=1e-5, atol=1e-5)


def test_a_search_inside_a_block_finds_what_it_finds_outside():
    model = small_transformer()
    src = pad_sources([[5, 6, 7, 8, 9], [10, 11, 12], [13, 14, 15, 16]])
    max_lens = np.array([9, 7, 8])

    def search():
        with tinytf.no_grad():
            state = model.start_decoding(model.encode(src), src)
            first = model.decode_step(np.full(len(src), BOS_ID), state)
            state = model.start_decoding(model.encode(src), src)
            hyps = beam_search(model.decode_step, state, len(src), max_lens, beam_size=4,
                               alpha=0.6, bos_id=BOS_ID, eos_id=EOS_ID, banned_ids=(0, 1, 3))
        return first, [[h.tokens for h in nbest] for nbest in hyps], hyps

    plain_first, plain_tokens, plain = search()
    with transposed_weights(model):
        copied_first, copied_tokens, copied = search()
    np.testing.assert_allclose(copied_first, plain_first, atol=1e-5, rtol=0)
    assert copied_tokens == plain_tokens
    for a, b in zip(plain, copied):
        assert abs(a[0].log_prob - b[0].log_prob) < 1e-4


def test_translation_and_validation_search_with_the_copies(monkeypatch):
    """The Translator's beam search and validation's greedy search run inside a block."""
    bpe = BPE.learn((DATA / "train.en").read_text().splitlines()[:200], vocab_size=400)
    model = small_transformer(vocab=len(bpe))
    seen = []
    step = model.decode_step

    def watching_step(tokens, state):
        seen.append(transposed(model.generator.data).flags.c_contiguous)
        return step(tokens, state)

    monkeypatch.setattr(model, "decode_step", watching_step)
    lines = ["A small house .", "Thank you ."]
    Translator(model, bpe).translate_lines(lines, SearchOptions(beam_size=2, max_len_b=3))
    greedy_translate(model, bpe, lines, max_len_b=3)
    assert seen and all(seen)
    assert np.shares_memory(transposed(model.generator.data), model.generator.data)
