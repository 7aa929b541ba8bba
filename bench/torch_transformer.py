"""The same Transformer as tinytf/models/transformer.py, in PyTorch: a reference for tests and
benchmarks.

Not part of tinytf (which never imports torch). Parameter names and shapes equal
tinytf's, so ``load_tinytf_state(model, tinytf_model.state_dict())`` copies weights across.
Written as a PyTorch user would write it in eager mode: one fused QKV Linear, heads split by
view/transpose, and ``F.scaled_dot_product_attention`` (``sdpa=True``, the default) or the
explicit softmax(QK^T/sqrt(d_k))V (``sdpa=False``).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

PAD_ID = 0


def sinusoid_table(max_len: int, d_model: int) -> torch.Tensor:
    """(max_len, d) float32 table of section 3.5, computed as tinytf does."""
    pos = torch.arange(max_len, dtype=torch.float64)[:, None]
    inv_freq = torch.exp(torch.arange(0, d_model, 2, dtype=torch.float64)
                         * (-math.log(10000.0) / d_model))
    table = torch.zeros(max_len, d_model, dtype=torch.float64)
    table[:, 0::2] = torch.sin(pos * inv_freq)
    table[:, 1::2] = torch.cos(pos * inv_freq[: d_model // 2])
    return table.float()


class MultiHeadAttention(nn.Module):
    """Fused-projection multi-head attention (qkv for self-attention, q + kv for cross)."""

    def __init__(self, d_model, n_heads, attention_dropout=0.0, self_attention=True, sdpa=True,
                 qk_norm=False, eps=1e-5):
        super().__init__()
        self.h, self.p, self.sdpa, self.qk_norm = n_heads, attention_dropout, sdpa, qk_norm
        if qk_norm:  # LayerNorm of each head's queries and keys over d_k
            self.q_norm = nn.LayerNorm(d_model // n_heads, eps=eps)
            self.k_norm = nn.LayerNorm(d_model // n_heads, eps=eps, bias=False)
        if self_attention:
            self.qkv = nn.Linear(d_model, 3 * d_model)
        else:
            self.q = nn.Linear(d_model, d_model)
            self.kv = nn.Linear(d_model, 2 * d_model)
        self.out = nn.Linear(d_model, d_model)

    def _split(self, x):  # (B, T, d) -> (B, h, T, d_k)
        b, t, d = x.shape
        return x.view(b, t, self.h, d // self.h).transpose(1, 2)

    def norm_q(self, q):  # (B, h, T, d_k), normalised with qk_norm
        return self.q_norm(q) if self.qk_norm else q

    def norm_k(self, k):
        return self.k_norm(k) if self.qk_norm else k

    def forward(self, x, mask, memory=None):
        if memory is None:
            q, k, v = self.qkv(x).chunk(3, dim=-1)
        else:
            q = self.q(x)
            k, v = self.kv(memory).chunk(2, dim=-1)
        q, k, v = self.norm_q(self._split(q)), self.norm_k(self._split(k)), self._split(v)
        p = self.p if self.training else 0.0
        if self.sdpa:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=p)
        else:
            s = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
            s = s.masked_fill(~mask, torch.finfo(s.dtype).min)
            y = F.dropout(s.softmax(-1), p, self.training) @ v
        b, h, t, dk = y.shape
        return self.out(y.transpose(1, 2).reshape(b, t, h * dk))


class FeedForward(nn.Module):
    def __init__(self, d_model, d_ff, relu_dropout=0.0, activation="relu"):
        super().__init__()
        self.w_1, self.w_2 = nn.Linear(d_model, d_ff), nn.Linear(d_ff, d_model)
        self.p, self.activation = relu_dropout, activation

    def forward(self, x):
        h = self.w_1(x)
        h = F.gelu(h, approximate="tanh") if self.activation == "gelu" else F.relu(h)
        return self.w_2(F.dropout(h, self.p, self.training))


class SublayerConnection(nn.Module):
    def __init__(self, d_model, dropout, pre_norm, eps):
        super().__init__()
        self.norm, self.p, self.pre_norm = nn.LayerNorm(d_model, eps=eps), dropout, pre_norm

    def forward(self, x, sublayer):
        if self.pre_norm:
            return x + F.dropout(sublayer(self.norm(x)), self.p, self.training)
        return self.norm(x + F.dropout(sublayer(x), self.p, self.training))


class EncoderLayer(nn.Module):
    def __init__(self, c, sdpa):
        super().__init__()
        self.self_attn = MultiHeadAttention(c.d_model, c.n_heads, c.attention_dropout, True, sdpa,
                                            c.qk_norm, c.eps)
        self.ffn = FeedForward(c.d_model, c.d_ff, c.relu_dropout, c.activation)
        self.sub1 = SublayerConnection(c.d_model, c.dropout, c.pre_norm, c.eps)
        self.sub2 = SublayerConnection(c.d_model, c.dropout, c.pre_norm, c.eps)

    def forward(self, x, src_mask):
        x = self.sub1(x, lambda y: self.self_attn(y, src_mask))
        return self.sub2(x, self.ffn)


class DecoderLayer(nn.Module):
    def __init__(self, c, sdpa):
        super().__init__()
        self.self_attn = MultiHeadAttention(c.d_model, c.n_heads, c.attention_dropout, True, sdpa,
                                            c.qk_norm, c.eps)
        self.cross_attn = MultiHeadAttention(c.d_model, c.n_heads, c.attention_dropout, False,
                                             sdpa, c.qk_norm, c.eps)
        self.ffn = FeedForward(c.d_model, c.d_ff, c.relu_dropout, c.activation)
        self.sub1 = SublayerConnection(c.d_model, c.dropout, c.pre_norm, c.eps)
        self.sub2 = SublayerConnection(c.d_model, c.dropout, c.pre_norm, c.eps)
        self.sub3 = SublayerConnection(c.d_model, c.dropout, c.pre_norm, c.eps)

    def forward(self, x, memory, src_mask, tgt_mask):
        x = self.sub1(x, lambda y: self.self_attn(y, tgt_mask))
        x = self.sub2(x, lambda y: self.cross_attn(y, src_mask, memory))
        return self.sub3(x, self.ffn)


class Stack(nn.Module):
    def __init__(self, layers, c):
        super().__init__()
        self.layers = nn.ModuleList(layers)
        if c.pre_norm:
            self.norm = nn.LayerNorm(c.d_model, eps=c.eps)

    def forward(self, x, *args):
        for layer in self.layers:
            x = layer(x, *args)
        return self.norm(x) if hasattr(self, "norm") else x


class TorchTransformer(nn.Module):
    """The section-3 Transformer; ``c`` is a tinytf TransformerConfig (or has its fields)."""

    def __init__(self, c, sdpa=True):
        super().__init__()
        self.c = c
        self.embed = nn.Module()
        self.embed.weight = nn.Parameter(torch.randn(c.vocab_size, c.d_model) * c.d_model ** -0.5)
        if not c.share_embeddings:
            self.src_embed = nn.Module()
            self.src_embed.weight = nn.Parameter(
                torch.randn(c.vocab_size, c.d_model) * c.d_model ** -0.5)
        self.register_buffer("pe", sinusoid_table(c.max_len, c.d_model), persistent=False)
        self.encoder = Stack([EncoderLayer(c, sdpa) for _ in range(c.n_encoder_layers)], c)
        self.decoder = Stack([DecoderLayer(c, sdpa) for _ in range(c.n_decoder_layers)], c)

    def _embed(self, weight, ids):
        x = F.embedding(ids, weight) * math.sqrt(self.c.d_model) + self.pe[: ids.shape[1]].to(
            weight.dtype)
        return F.dropout(x, self.c.dropout, self.training)

    def forward(self, src, tgt_in):
        src_w = self.embed.weight if self.c.share_embeddings else self.src_embed.weight
        src_mask = (src != PAD_ID)[:, None, None, :]
        t = tgt_in.shape[1]
        tgt_mask = torch.ones(t, t, dtype=torch.bool, device=tgt_in.device).tril()[None, None]
        memory = self.encoder(self._embed(src_w, src), src_mask)
        x = self.decoder(self._embed(self.embed.weight, tgt_in), memory, src_mask, tgt_mask)
        return x @ self.embed.weight.t()


def load_tinytf_state(model: TorchTransformer, state: dict, dtype=torch.float32) -> None:
    """Copy a tinytf ``state_dict()`` (name -> ndarray) into ``model`` (names must match)."""
    tensors = {k: torch.tensor(v, dtype=dtype) for k, v in state.items()}
    model.to(dtype)
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    if missing or unexpected:
        raise KeyError(f"torch_transformer.py: missing {missing}, unexpected {unexpected}")


def label_smoothed_loss(logits, target, eps=0.1):
    """Summed label-smoothed CE over non-pad targets (PyTorch's smoothing convention)."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1),
                           ignore_index=PAD_ID, label_smoothing=eps, reduction="sum")
