"""Beam search in PyTorch with a key/value cache: the reference that bench/decode_speed.py races.

Runs ``bench/torch_transformer.TorchTransformer`` (same parameters as tinytf's model) one
position at a time, as a PyTorch user would write it: per-layer self-attention caches grown with
``torch.cat``, encoder-decoder keys/values projected once, ``F.scaled_dot_product_attention``,
``torch.topk`` over the beam. The search has the semantics of ``tinytf.decoding.search.beam_search``
(top-k extensions, finished hypotheses leave the beam, GNMT length penalty, the exact stopping
bound, finished sentences dropped from the batch), so both do the same number of steps.
Not part of tinytf; needs torch.
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F

PAD_ID, BOS_ID, EOS_ID = 0, 1, 2


class TorchIncrementalDecoder:
    """Incremental decoding for a ``TorchTransformer`` (eval mode, no dropout)."""

    def __init__(self, model):
        self.model = model.eval()
        self.c = model.c

    def _split(self, x, h):  # (N, T, d) -> (N, h, T, d_k)
        n, t, d = x.shape
        return x.view(n, t, h, d // h).transpose(1, 2)

    @torch.no_grad()
    def start(self, src):
        """Encode ``src`` (N, S) and project every layer's cross-attention keys/values once."""
        m, h = self.model, self.c.n_heads
        src_w = m.embed.weight if self.c.share_embeddings else m.src_embed.weight
        src_mask = (src != PAD_ID)[:, None, None, :]
        memory = m.encoder(m._embed(src_w, src), src_mask)
        cross = []
        for layer in m.decoder.layers:
            k, v = layer.cross_attn.kv(memory).chunk(2, dim=-1)
            cross.append((layer.cross_attn.norm_k(self._split(k, h)), self._split(v, h)))
        return {"src_mask": src_mask, "cross": cross, "self": [None] * len(cross), "length": 0}

    @torch.no_grad()
    def step(self, tokens, state):
        """Log-probs (N, V) of the next token after feeding ``tokens`` (N,); grows the caches."""
        m, c, h = self.model, self.c, self.c.n_heads
        t = state["length"]
        x = F.embedding(tokens[:, None], m.embed.weight) * math.sqrt(c.d_model) + m.pe[t:t + 1]
        for i, layer in enumerate(m.decoder.layers):
            def self_attn(y, i=i, layer=layer):
                q, k, v = (self._split(z, h) for z in layer.self_attn.qkv(y).chunk(3, dim=-1))
                q, k = layer.self_attn.norm_q(q), layer.self_attn.norm_k(k)
                if state["self"][i] is not None:
                    k = torch.cat([state["self"][i][0], k], dim=2)
                    v = torch.cat([state["self"][i][1], v], dim=2)
                state["self"][i] = (k, v)
                return layer.self_attn.out(_merge(F.scaled_dot_product_attention(q, k, v)))

            def cross_attn(y, i=i, layer=layer):
                q = layer.cross_attn.norm_q(self._split(layer.cross_attn.q(y), h))
                k, v = state["cross"][i]
                a = F.scaled_dot_product_attention(q, k, v, attn_mask=state["src_mask"])
                return layer.cross_attn.out(_merge(a))

            x = layer.sub1(x, self_attn)
            x = layer.sub2(x, cross_attn)
            x = layer.sub3(x, layer.ffn)
        if hasattr(m.decoder, "norm"):
            x = m.decoder.norm(x)
        state["length"] = t + 1
        return torch.log_softmax(x[:, 0] @ m.embed.weight.t(), dim=-1)

    @staticmethod
    def select(state, rows):
        """Keep / repeat / reorder the rows of every cached tensor."""
        pick = lambda a: a.index_select(0, rows)  # noqa: E731
        return {"src_mask": pick(state["src_mask"]),
                "cross": [(pick(k), pick(v)) for k, v in state["cross"]],
                "self": [None if kv is None else (pick(kv[0]), pick(kv[1]))
                         for kv in state["self"]],
                "length": state["length"]}


def _merge(y):  # (N, h, T, d_k) -> (N, T, d)
    n, h, t, dk = y.shape
    return y.transpose(1, 2).reshape(n, t, h * dk)


def _lp(length, alpha):
    return ((5.0 + length) / 6.0) ** alpha


@torch.no_grad()
def torch_beam_search(decoder, src, max_lens, beam_size=4, alpha=0.6, banned=(0, 1, 3)):
    """Best hypothesis (list of token ids) for every row of ``src`` (N, S), padded with 0.

    ``max_lens`` (N,) ints: most tokens before a forced ``</s>``. Same algorithm as
    ``tinytf.decoding.search.beam_search`` with nbest = 1.
    """
    n_sent, k = src.shape[0], beam_size
    max_lens = torch.as_tensor(max_lens, dtype=torch.long)
    best = [None] * n_sent  # (score, tokens)
    active = torch.arange(n_sent)
    state = decoder.select(decoder.start(src), active.repeat_interleave(k))
    tokens = torch.full((n_sent * k,), BOS_ID, dtype=torch.long)
    history = torch.zeros((n_sent * k, 0), dtype=torch.long)
    scores = torch.full((n_sent, k), -math.inf)
    scores[:, 0] = 0.0
    for step in range(int(max_lens.max()) + 1):
        if len(active) == 0:
            break
        logp = decoder.step(tokens, state)
        n, vocab = len(active), logp.shape[-1]
        cand = scores[:, :, None] + logp.view(n, k, vocab)
        cand[:, :, list(banned)] = -math.inf
        forced = step >= max_lens[active]
        if forced.any():
            eos = cand[forced, :, EOS_ID].clone()
            cand[forced] = -math.inf
            cand[forced, :, EOS_ID] = eos
        vals, flat = cand.view(n, k * vocab).topk(k, dim=1)
        parent = torch.arange(n)[:, None] * k + flat // vocab
        token = flat % vocab
        alive = torch.isfinite(vals)
        ended = alive & (token == EOS_ID)
        for i, j in ended.nonzero().tolist():
            s = int(active[i])
            score = float(vals[i, j]) / _lp(step + 1, alpha)
            if best[s] is None or score > best[s][0]:
                best[s] = (score, history[parent[i, j]].tolist())
        scores = torch.where(alive & ~ended, vals, torch.tensor(-math.inf))
        best_live = scores.max(dim=1).values.double()
        bound = torch.maximum(best_live / _lp(step + 2, alpha),
                              best_live / _lp(max_lens[active].double() + 1, alpha))
        threshold = torch.tensor([best[int(s)][0] if best[int(s)] else -math.inf
                                  for s in active], dtype=torch.float64)
        done = ~torch.isfinite(best_live) | (threshold >= bound)
        keep = ~done
        active = active[keep]
        rows = parent[keep].reshape(-1)
        history = torch.cat([history[rows], token[keep].reshape(-1, 1)], dim=1)
        tokens = token[keep].reshape(-1)
        scores = scores[keep]
        if len(active):
            state = decoder.select(state, rows)
    return [b[1] if b else [] for b in best]
