"""Tests of tinytf/models/transformer.py: config, shapes, masks, gradients, incremental decoding,
learning a small task, and (when torch is installed) agreement with bench/torch_transformer.py.
"""
import os
import sys
import time

import numpy as np
import pytest

import tinytf
from tinytf import optim
from tinytf.engine import backend
from tinytf.engine.gradcheck import gradcheck_random
from tinytf.engine.tensor import Tensor, no_grad
from tinytf.models.transformer import (
    PAD_ID,
    DecoderState,
    Transformer,
    TransformerConfig,
    causal_mask,
    label_smoothed_loss,
    padding_mask,
    sinusoid_table,
)

BOS, EOS = 1, 2


def small_config(**kw):
    """A model small enough for finite differences and quick tests."""
    base = dict(vocab_size=13, d_model=16, n_heads=2, d_ff=24, n_encoder_layers=2,
                n_decoder_layers=2, dropout=0.0, max_len=64)
    base.update(kw)
    return TransformerConfig(**base)


def make_model(seed=0, **kw):
    backend.manual_seed(seed)
    return Transformer(small_config(**kw))


def random_batch(rng, b, s, t, vocab, pad_tail=True):
    """Source (B, S) and target-in (B, T) ids in [3, vocab), right-padded with PAD_ID."""
    src = rng.integers(3, vocab, size=(b, s))
    tgt = rng.integers(3, vocab, size=(b, t))
    tgt[:, 0] = BOS
    if pad_tail:
        for i in range(b):
            src[i, rng.integers(s // 2, s + 1):] = PAD_ID
            tgt[i, rng.integers(t // 2 + 1, t + 1):] = PAD_ID
        src[0, :] = np.maximum(src[0, :], 3)  # one row without padding
    return src, tgt


def to_float64(model):
    """Cast every parameter of ``model`` to float64 in place (for finite differences)."""
    return model.astype(np.float64)


# ----------------------------------------------------------------------------------------
# configuration
# ----------------------------------------------------------------------------------------

def test_presets_match_the_paper():
    base = TransformerConfig.preset("base")
    assert (base.d_model, base.n_heads, base.d_ff, base.n_encoder_layers,
            base.n_decoder_layers, base.dropout, base.label_smoothing) == \
        (512, 8, 2048, 6, 6, 0.1, 0.1)
    big = TransformerConfig.preset("big")
    assert (big.d_model, big.n_heads, big.d_ff, big.n_encoder_layers, big.dropout) == \
        (1024, 16, 4096, 6, 0.3)
    tiny = TransformerConfig.preset("tiny")
    assert (tiny.d_model, tiny.n_heads, tiny.d_ff, tiny.n_encoder_layers,
            tiny.n_decoder_layers) == (256, 4, 1024, 3, 3)
    small = TransformerConfig.preset("small")
    assert (small.d_model, small.n_heads, small.d_ff, small.n_encoder_layers) == (512, 8, 2048, 3)
    for c in (small, base, big):  # the paper's defaults
        assert c.pre_norm is False and c.qk_norm is False
    assert tiny.pre_norm is True and tiny.qk_norm is True  # the measured CPU recipe
    n_norm = sum(name.endswith(("q_norm.weight", "q_norm.bias", "k_norm.weight"))
                 for name, _ in Transformer(tiny).named_parameters())
    assert n_norm == 3 * 9  # each of the 9 attentions: q gain and bias, k gain (no k bias)
    for c in (tiny, small, base, big):
        assert c.share_embeddings is True
        assert c.d_model // c.n_heads == 64  # d_k = d_v = 64 in every paper configuration


def test_preset_overrides_and_round_trip():
    c = TransformerConfig.preset("tiny", vocab_size=500, dropout=0.2)
    assert c.vocab_size == 500 and c.dropout == 0.2 and c.d_model == 256
    assert TransformerConfig.from_dict(c.to_dict()) == c
    import json
    assert TransformerConfig.from_dict(json.loads(json.dumps(c.to_dict()))) == c


def test_config_errors_name_the_problem():
    with pytest.raises(ValueError, match="unknown config keys.*d_modle"):
        TransformerConfig.preset("tiny", d_modle=128)
    with pytest.raises(ValueError, match="unknown preset"):
        TransformerConfig.preset("huge")
    with pytest.raises(ValueError, match="not divisible"):
        TransformerConfig(d_model=10, n_heads=3)
    with pytest.raises(ValueError, match="dropout"):
        TransformerConfig(dropout=1.5)
    with pytest.raises(ValueError, match="activation='swish'.*relu, gelu"):
        TransformerConfig(activation="swish")


def test_base_parameter_count():
    """Base with a 37k shared vocabulary: 63.1M parameters (the paper's table 3 says 65M)."""
    c = TransformerConfig.preset("base", vocab_size=37000)
    d, f, n = c.d_model, c.d_ff, c.n_encoder_layers
    attn = 4 * d * d + 4 * d
    ffn = 2 * d * f + f + d
    enc = n * (attn + ffn + 2 * 2 * d)
    dec = n * (2 * attn + ffn + 3 * 2 * d)
    expected = c.vocab_size * d + enc + dec
    backend.manual_seed(0)
    model = Transformer(c)
    count = sum(p.size for _, p in model.named_parameters())
    assert count == expected == 63_082_496
    assert 60e6 < count < 66e6


def test_tiny_initialisation_statistics():
    """fairseq's init: E ~ N(0, d^-1/2), each projection xavier-uniform, biases 0, LayerNorm
    1/0; so embedded tokens have unit variance, logits start near unit scale and the first
    loss is close to ln V (an N(0, 1) table would give logits of std ~sqrt(d) and loss ~100)."""
    backend.manual_seed(1)
    c = TransformerConfig.preset("tiny", vocab_size=4000, dropout=0.0)
    model = Transformer(c)
    d = c.d_model
    for name, p in model.named_parameters():
        w = p.data
        if name == "embed.weight":
            assert abs(w.std() - d ** -0.5) < 0.01 * d ** -0.5
        elif name.endswith("norm.weight"):
            assert np.all(w == 1.0), name
        elif name.endswith("bias"):
            assert np.all(w == 0.0), name
        else:
            fan_out = {"qkv": 3, "kv": 2}.get(name.split(".")[-2], 1)
            bound = np.sqrt(6.0 / (w.shape[0] // fan_out + w.shape[1]))
            assert np.abs(w).max() <= bound and w.std() > 0.95 * bound / np.sqrt(3), name
    rng = np.random.default_rng(0)
    src, tgt = random_batch(rng, 8, 12, 10, c.vocab_size)
    logits = model(src, tgt)
    assert 0.8 < float(logits.data.std()) < 1.25
    loss, n = label_smoothed_loss(logits, np.roll(tgt, -1, axis=1), 0.1)
    assert abs(loss.item() / n - np.log(c.vocab_size)) < 1.0


# ----------------------------------------------------------------------------------------
# shapes, dtypes, masks
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pre_norm,qk_norm", [(False, False), (True, False), (True, True)])
def test_shapes_and_float32(pre_norm, qk_norm):
    model = make_model(pre_norm=pre_norm, qk_norm=qk_norm, dropout=0.1)
    rng = np.random.default_rng(0)
    src, tgt = random_batch(rng, 3, 7, 5, 13)
    memory = model.encode(src)
    assert memory.shape == (3, 7, 16) and memory.dtype == np.float32
    logits = model(src, tgt)
    assert logits.shape == (3, 5, 13) and logits.dtype == np.float32
    loss, n = label_smoothed_loss(logits, np.roll(tgt, -1, axis=1), 0.1)
    loss.backward()
    assert n == int((np.roll(tgt, -1, axis=1) != PAD_ID).sum())
    for name, p in model.named_parameters():
        assert p.grad is not None and p.grad.dtype == np.float32, name
        assert p.grad.shape == p.shape, name


def _reference_name(node) -> str:
    """The name of the reference op (tinytf.ops) that ``node`` runs, fast variant or not."""
    return next(c.__name__ for c in type(node).__mro__ if c.__module__.startswith("tinytf.ops"))


def test_a_training_step_builds_the_expected_autograd_nodes():
    # Every node costs host time on a GPU (docs/gpu.md), so the count is part of the design.
    # Per encoder layer 11: qkv Linear, SplitHeads, Attention, MergeHeads, out Linear,
    # DropoutAdd, LayerNorm, then w_1 Linear (with its ReLU), w_2 Linear, DropoutAdd,
    # LayerNorm. Per decoder layer those 11 plus 9 for the cross-attention (q Linear,
    # SplitHeads, kv Linear, SplitHeads, Attention, MergeHeads, out Linear, DropoutAdd,
    # LayerNorm). Plus 11: two embeddings with their scaling, position adds and dropouts,
    # the output projection, the logits' reshape and the loss.
    from collections import Counter

    from tinytf.engine.tensor import _topological_order
    model = make_model(dropout=0.1).train()
    src, tgt = random_batch(np.random.default_rng(0), 2, 5, 6, 13)
    loss, _ = label_smoothed_loss(model(src, tgt), tgt)
    nodes = {id(t._ctx): _reference_name(t._ctx) for t in _topological_order(loss)
             if t._ctx is not None}
    counts = Counter(nodes.values())
    n_enc, n_dec = 2, 2
    assert counts["Linear"] == 4 * n_enc + 7 * n_dec + 1             # + the output projection
    assert counts["SplitHeads"] == n_enc + 3 * n_dec                  # qkv; qkv, q, kv
    assert counts["MergeHeads"] == counts["Attention"] == n_enc + 2 * n_dec
    assert counts["DropoutAdd"] == counts["LayerNorm"] == 2 * n_enc + 3 * n_dec
    assert "ReLU" not in counts                                       # inside w_1's Linear
    assert "Cast" not in counts and "Transpose" not in counts and "Reshape" in counts
    per_layer = 11 * n_enc + 20 * n_dec
    assert sum(counts.values()) == per_layer + 11, counts


def test_set_dropout_equals_a_model_built_with_that_rate():
    """``set_dropout(p)`` on a built model trains, bitwise, as a model built with P_drop p
    (the same masks), and leaves the attention and ReLU dropouts alone."""
    src, tgt = random_batch(np.random.default_rng(1), 3, 6, 7, 13)

    def loss_and_grads(model):
        tinytf.manual_seed(7)
        loss, _ = label_smoothed_loss(model.train()(src, tgt), tgt)
        loss.backward()
        return [loss.data] + [p.grad for p in model.parameters()]

    built = make_model(dropout=0.3, attention_dropout=0.05, relu_dropout=0.05)
    changed = make_model(dropout=0.1, attention_dropout=0.05, relu_dropout=0.05)
    changed.set_dropout(0.3)
    assert changed.config == built.config
    for a, b in zip(loss_and_grads(built), loss_and_grads(changed)):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()
    assert changed.decoder.layers[0].ffn.dropout.p == 0.05


def test_masks():
    m = padding_mask(np.array([[5, 6, 0], [7, 0, 0]]))
    assert m.shape == (2, 1, 1, 3) and m.dtype == bool
    assert m[:, 0, 0].tolist() == [[True, True, False], [True, False, False]]
    c = causal_mask(3)
    assert c.shape == (1, 1, 3, 3)
    assert c[0, 0].tolist() == [[True, False, False], [True, True, False], [True, True, True]]


@pytest.mark.parametrize("pre_norm,qk_norm", [(False, False), (True, False), (True, True)])
def test_padded_source_positions_are_ignored(pre_norm, qk_norm):
    """Whatever sits at source PAD positions changes neither memory nor logits elsewhere."""
    model = make_model(pre_norm=pre_norm, qk_norm=qk_norm).eval()
    rng = np.random.default_rng(1)
    src, tgt = random_batch(rng, 4, 9, 6, 13)
    pad = src == PAD_ID
    assert pad.any()
    with no_grad():
        memory = model.encode(src)
        ref = model.decode(tgt, memory, src).data
        # encoder self-attention: change what a PAD token embeds to
        saved = model.embed.weight.data.copy()
        model.embed.weight.data[PAD_ID] += 5.0
        memory2 = model.encode(src).data
        model.embed.weight.data[...] = saved
        # encoder-decoder attention: garbage in the memory at PAD positions
        noisy = memory.data.copy()
        noisy[pad] = rng.standard_normal((int(pad.sum()), noisy.shape[-1]))
        out = model.decode(tgt, Tensor(noisy), src).data
    np.testing.assert_allclose(memory2[~pad], memory.data[~pad], rtol=1e-5, atol=1e-5)
    assert not np.allclose(memory2[pad], memory.data[pad])
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-5)


def test_source_padding_length_does_not_matter():
    """Extra PAD columns on the source change nothing (attention weight 0 on them)."""
    model = make_model().eval()
    rng = np.random.default_rng(2)
    src, tgt = random_batch(rng, 3, 6, 5, 13)
    longer = np.concatenate([src, rng.integers(3, 13, (3, 4)) * 0], axis=1)  # 4 more pads
    with no_grad():
        a = model(src, tgt).data
        b = model(longer, tgt).data
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("pre_norm,qk_norm", [(False, False), (True, False), (True, True)])
def test_future_target_tokens_are_not_seen(pre_norm, qk_norm):
    model = make_model(pre_norm=pre_norm, qk_norm=qk_norm).eval()
    rng = np.random.default_rng(3)
    src, tgt = random_batch(rng, 2, 6, 8, 13, pad_tail=False)
    with no_grad():
        ref = model(src, tgt).data
        for j in range(1, 8):
            changed = tgt.copy()
            changed[:, j:] = rng.integers(3, 13, size=changed[:, j:].shape)
            out = model(src, changed).data
            np.testing.assert_allclose(out[:, :j], ref[:, :j], rtol=1e-5, atol=1e-5)
            assert not np.allclose(out[:, j:], ref[:, j:])


def test_output_projection_is_the_shared_embedding():
    model = make_model()
    names = [n for n, _ in model.named_parameters()]
    assert sum("embed" in n for n in names) == 1  # one matrix for source, target and output
    assert model.generator is model.embed.weight
    # with the decoder's output fixed, logits are linear in E: logits(2E) - 2 logits(E) = 0
    # only for the projection part, so check the gradient route instead: E gets gradient
    # from the output projection even for ids never fed in.
    src = np.array([[3, 4, 0]])
    tgt = np.array([[1, 3]])
    logits = model(src, tgt)
    logits[0, 1, 12].backward()
    assert np.abs(model.embed.weight.grad[12]).sum() > 0  # id 12 appears only as an output


def test_separate_source_embedding_option():
    model = make_model(share_embeddings=False)
    names = [n for n, _ in model.named_parameters()]
    assert "src_embed.weight" in names and "embed.weight" in names
    rng = np.random.default_rng(5)
    src, tgt = random_batch(rng, 2, 5, 4, 13)
    assert model(src, tgt).shape == (2, 4, 13)


def test_sinusoid_table():
    t = sinusoid_table(50, 8)
    assert t.dtype == np.float32 and t.shape == (50, 8)
    pos, i = 7, 1
    np.testing.assert_allclose(t[pos, 2 * i], np.sin(pos / 10000 ** (2 * i / 8)), rtol=1e-6)
    np.testing.assert_allclose(t[pos, 2 * i + 1], np.cos(pos / 10000 ** (2 * i / 8)), rtol=1e-6)


def test_label_smoothed_loss_by_hand():
    rng = np.random.default_rng(6)
    logits = Tensor(rng.standard_normal((2, 3, 5)).astype(np.float32))
    target = np.array([[1, 4, 0], [2, 0, 0]])
    loss, n = label_smoothed_loss(logits, target, eps=0.1)
    assert n == 3
    z = logits.data.reshape(-1, 5).astype(np.float64)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    t = target.reshape(-1)
    expected = sum(0.9 * -logp[r, t[r]] + 0.1 * -logp[r].mean() for r in range(6) if t[r] != 0)
    np.testing.assert_allclose(loss.item(), expected, rtol=1e-5)


# ----------------------------------------------------------------------------------------
# gradients
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pre_norm,qk_norm,activation", [
    (False, False, "relu"), (True, False, "relu"), (True, True, "relu"), (True, True, "gelu")])
def test_gradcheck_end_to_end_float64(pre_norm, qk_norm, activation):
    """Finite differences of the summed smoothed loss w.r.t. every parameter, with dropout."""
    model = to_float64(make_model(vocab_size=11, d_model=8, n_heads=2, d_ff=12,
                                  n_encoder_layers=1, n_decoder_layers=1, dropout=0.1,
                                  attention_dropout=0.1, relu_dropout=0.1, pre_norm=pre_norm,
                                  qk_norm=qk_norm, activation=activation))
    rng = np.random.default_rng(7)
    src, tgt = random_batch(rng, 2, 5, 4, 11)
    gold = np.roll(tgt, -1, axis=1)

    def fn(*params):  # the params are the model's own tensors, perturbed in place
        tinytf.manual_seed(123)  # the same dropout masks in every call
        logits = model(src, tgt)
        assert logits.dtype == np.float64
        return label_smoothed_loss(logits, gold, 0.1)[0]

    params = [p for _, p in model.named_parameters()]
    gradcheck_random(fn, params, n_dirs=2, eps=1e-6, atol=1e-6, rtol=1e-4)


# ----------------------------------------------------------------------------------------
# incremental decoding
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype,qk_norm",
                         [(np.float32, False), (np.float64, False), (np.float32, True)])
def test_decode_step_equals_full_decode(dtype, qk_norm):
    model = make_model(pre_norm=False, qk_norm=qk_norm, dropout=0.3).eval()
    if dtype == np.float64:
        to_float64(model)
    rng = np.random.default_rng(8)
    src, _ = random_batch(rng, 3, 7, 2, 13)
    tokens = rng.integers(3, 13, size=(3, 6))
    tokens[:, 0] = BOS
    with no_grad():
        memory = model.encode(src)
        full = model.decode(tokens, memory, src).log_softmax(-1).data
        state = model.start_decoding(memory, src)
        assert isinstance(state, DecoderState) and state.length == 0
        for t in range(tokens.shape[1]):
            logp = model.decode_step(tokens[:, t], state)
            assert logp.shape == (3, 13) and logp.dtype == dtype
            np.testing.assert_allclose(logp, full[:, t], rtol=1e-5, atol=1e-5)
            assert state.length == t + 1
    cache = state.caches[0]
    assert (cache.rows, cache.length) == (3, 6) and cache.k.shape[:2] == (3, 2)
    assert cache.k.shape[2] >= 6 and cache.k.shape[3] == 8


def test_decoder_state_select_reorders_rows():
    model = make_model(pre_norm=True).eval()
    rng = np.random.default_rng(9)
    src, _ = random_batch(rng, 3, 6, 2, 13)
    tokens = rng.integers(3, 13, size=(3, 4))
    tokens[:, 0] = BOS
    order = np.array([2, 0, 0])
    with no_grad():
        memory = model.encode(src)
        full = model.decode(tokens[order], model.encode(src[order]), src[order])
        full = full.log_softmax(-1).data
        state = model.start_decoding(memory, src)
        model.decode_step(tokens[:, 0], state)
        model.decode_step(tokens[:, 1], state)
        state = state.select(order)
        # runs of unequal length ([2], [0, 0]): one memory row each, laid out in 2 places
        assert state.length == 2 and state.src_mask.shape[0] == 2 and state.group == 2
        assert state.padding is not None
        logp = model.decode_step(tokens[order, 2], state)
        np.testing.assert_allclose(logp, full[:, 2], rtol=1e-5, atol=1e-5)
        # dropping rows works the same way
        state = state.select([1])
        logp = model.decode_step(tokens[order][1:2, 3], state)
        np.testing.assert_allclose(logp, full[1:2, 3], rtol=1e-5, atol=1e-5)
        # more rows than the caches hold after some steps: they grow, keeping the rows
        wide = np.array([2, 2, 0, 1, 0])
        full = model.decode(tokens[wide], model.encode(src[wide]), src[wide])
        state = model.start_decoding(memory, src)
        model.decode_step(tokens[:, 0], state)
        state = state.select(wide)
        logp = model.decode_step(tokens[wide, 1], state)
        np.testing.assert_allclose(logp, full.log_softmax(-1).data[:, 1], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("qk_norm", [False, True])
def test_grouped_hypotheses_share_their_sentence_memory(qk_norm):
    """As beam search selects rows (up to k consecutive hypotheses per sentence, reordered
    within their sentence, fewer where hypotheses ended, sentences leaving): the
    encoder-decoder keys stay one row per sentence, the self-attention caches are written in
    place past their first capacity, and every step equals the full decode of the rows'
    prefixes."""
    model = make_model(pre_norm=False, qk_norm=qk_norm).eval()
    rng = np.random.default_rng(10)
    src, _ = random_batch(rng, 3, 6, 2, 13)
    k, steps = 4, 20                       # 20 steps: past the caches' first capacity (16)
    tokens = rng.integers(3, 13, size=(3 * k, steps + 1))
    tokens[:, 0] = BOS

    def check_step(state, rows, sentence, t):
        logp = model.decode_step(tokens[rows, t], state)
        full = model.decode(tokens[rows, :t + 1], model.encode(src[sentence]), src[sentence])
        np.testing.assert_allclose(logp, full.log_softmax(-1).data[:, -1],
                                   rtol=2e-5, atol=2e-5)

    with no_grad():
        memory = model.encode(src)
        state = model.start_decoding(memory, src).select(np.repeat(np.arange(3), k))
        assert state.group == k and state.cross_kv[0][0].shape[0] == 3
        assert state.padding is None
        rows = np.arange(3 * k)           # which original hypothesis each row now follows
        sentence = np.repeat(np.arange(3), k)
        ragged_steps = 0
        for t in range(steps):
            check_step(state, rows, sentence, t)
            # Each sentence keeps 1 to k of its rows, in any order (every other step all k);
            # at step 10 the middle sentence leaves.
            runs = [np.flatnonzero(sentence == s) for s in dict.fromkeys(sentence)]
            if t == 10:
                runs = [runs[0], runs[2]]
            sizes = [k if t % 2 else rng.integers(1, k + 1) for _ in runs]
            pick = np.concatenate([rng.choice(run, size) for run, size in zip(runs, sizes)])
            state = state.select(pick)
            rows, sentence = rows[pick], sentence[pick]
            assert state.group == max(sizes) and state.cross_kv[0][0].shape[0] == len(runs)
            assert (state.padding is None) == (min(sizes) == max(sizes))
            ragged_steps += state.padding is not None
        assert ragged_steps >= 3 and state.cross_kv[0][0].shape[0] == 2
        assert state.caches[0].length == steps and state.caches[0].k.shape[2] >= steps
        # A sentence in two runs: one memory row per hypothesis, the same numbers.
        first, last = np.flatnonzero(sentence == 0)[0], np.flatnonzero(sentence == 2)[0]
        pick = np.array([first, last, first])
        state.select(pick)
        assert state.group == 1 and state.cross_kv[0][0].shape[0] == 3
        check_step(state, rows[pick], sentence[pick], steps)


# ----------------------------------------------------------------------------------------
# learning
# ----------------------------------------------------------------------------------------

def reverse_batch(rng, b, vocab, min_len=3, max_len=8):
    """Random sequences over [3, vocab); the target is the reversed sequence then </s>."""
    lengths = rng.integers(min_len, max_len + 1, size=b)
    src = np.zeros((b, max_len), dtype=np.int64)
    tgt_in = np.zeros((b, max_len + 1), dtype=np.int64)
    gold = np.zeros((b, max_len + 1), dtype=np.int64)
    for i, n in enumerate(lengths):
        seq = rng.integers(3, vocab, size=n)
        src[i, :n] = seq
        out = np.concatenate([seq[::-1], [EOS]])
        gold[i, :n + 1] = out
        tgt_in[i, 0] = BOS
        tgt_in[i, 1:n + 1] = out[:-1]
    return src, tgt_in, gold


def test_learns_to_reverse_sequences():
    start = time.perf_counter()
    cfg = TransformerConfig(vocab_size=14, d_model=32, n_heads=2, d_ff=64,
                            n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                            label_smoothing=0.0, max_len=32)
    backend.manual_seed(0)
    model = Transformer(cfg)
    opt = optim.Adam(model.named_parameters(), lr=3e-3, betas=(0.9, 0.98), eps=1e-9)
    rng = np.random.default_rng(0)
    steps = 300
    for step in range(1, steps + 1):
        opt.lr = 3e-3 * min(1.0, step / 30)  # short warmup
        src, tgt_in, gold = reverse_batch(rng, 32, cfg.vocab_size)
        loss, n = label_smoothed_loss(model(src, tgt_in), gold, 0.0)
        opt.zero_grad()
        (loss * (1.0 / n)).backward()
        opt.step()
    model.eval()
    src, tgt_in, gold = reverse_batch(np.random.default_rng(1), 200, cfg.vocab_size)
    with no_grad():  # teacher-forced token accuracy
        pred = model(src, tgt_in).data.argmax(-1)
        mask = gold != PAD_ID
        acc = float((pred == gold)[mask].mean())
        # and greedy decoding with the incremental API
        state = model.start_decoding(model.encode(src), src)
        tok = np.full(len(src), BOS)
        out = []
        for _ in range(gold.shape[1]):
            tok = model.decode_step(tok, state).argmax(-1)
            out.append(tok)
        greedy = np.stack(out, axis=1)
        greedy_acc = float((greedy == gold)[mask].mean())
    elapsed = time.perf_counter() - start
    print(f"reverse task: teacher-forced accuracy {acc:.3f}, greedy {greedy_acc:.3f}, "
          f"final loss {loss.item() / n:.3f}, {elapsed:.1f}s")
    assert acc > 0.9 and greedy_acc > 0.85


# ----------------------------------------------------------------------------------------
# agreement with PyTorch (optional oracle)
# ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("pre_norm,sdpa,qk_norm,activation", [
    (False, False, False, "relu"), (True, False, False, "relu"), (False, True, False, "relu"),
    (True, True, True, "relu"), (True, True, True, "gelu")])
def test_matches_pytorch_float64(pre_norm, sdpa, qk_norm, activation):
    """Same weights in bench/torch_transformer.py: same logits, loss and gradients."""
    torch = pytest.importorskip("torch")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "bench"))
    try:
        from torch_transformer import TorchTransformer, load_tinytf_state
        from torch_transformer import label_smoothed_loss as torch_loss
    finally:
        sys.path.pop(0)
    model = to_float64(make_model(pre_norm=pre_norm, qk_norm=qk_norm, activation=activation))
    ref = TorchTransformer(model.config, sdpa=sdpa)
    load_tinytf_state(ref, model.state_dict(), dtype=torch.float64)
    rng = np.random.default_rng(10)
    src, tgt = random_batch(rng, 3, 7, 6, 13)
    gold = np.roll(tgt, -1, axis=1)

    logits = model(src, tgt)
    loss, _ = label_smoothed_loss(logits, gold, 0.1)
    loss.backward()
    t_logits = ref(torch.tensor(src), torch.tensor(tgt))
    t_loss = torch_loss(t_logits, torch.tensor(gold), 0.1)
    t_loss.backward()
    np.testing.assert_allclose(logits.data, t_logits.detach().numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(loss.item(), t_loss.item(), rtol=1e-10)
    t_grads = {n: p.grad.numpy() for n, p in ref.named_parameters()}
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.grad, t_grads[name], rtol=1e-5, atol=1e-5, err_msg=name)


def test_two_models_are_two_objects():
    """A Transformer is a module, not a value: two models built alike are not equal, and a
    model can key a dict (a @dataclass on the class made every pair equal and none hashable)."""
    cfg = TransformerConfig(vocab_size=20, d_model=8, d_ff=16, n_heads=2, n_encoder_layers=1,
                            n_decoder_layers=1)
    a, b = Transformer(cfg), Transformer(cfg)
    assert a != b and a == a and len({a: 1, b: 2}) == 2
