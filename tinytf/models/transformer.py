"""The Transformer of Vaswani et al. (2017), section 3, assembled from small named modules.

Read top to bottom: configuration and presets, then the parts in the order of section 3
(embeddings and positions, attention, feed-forward, the two layer kinds, the two stacks),
then :class:`Transformer`, which ties them together and adds incremental decoding for
search. ``docs/transformer.md`` maps every equation of the paper to the code below.

Shapes: ``B`` batch, ``S`` source length, ``T`` target length, ``d`` = d_model,
``h`` heads, ``d_k = d / h``, ``V`` vocabulary.

The default is the paper (post-LN, one embedding matrix shared by the encoder, the decoder
and the output projection, embeddings scaled by sqrt(d_model)). Departures are named in
comments where they occur: the optional ``pre_norm`` and the optional attention / ReLU
dropout (tensor2tensor's, zero by default).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from tinytf.engine import backend
from tinytf.engine.tensor import Tensor, no_grad
from tinytf.models.decoder_state import DecoderState, SelfAttentionCache
from tinytf.nn import functional as F
from tinytf.nn import modules as nn

PAD_ID = 0  # the BPE's fixed id of <pad> (tinytf.text.PAD_ID); padding is masked everywhere


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------

@dataclass
class TransformerConfig:
    """Every hyper-parameter of the model; stored in full in each checkpoint.

    Defaults are the paper's base model (table 3) with an 8k joint BPE vocabulary.
    ``attention_dropout`` and ``relu_dropout`` are not in the paper (section 5.4 drops only
    sub-layer outputs and embedding sums); they exist because tensor2tensor has them and
    default to 0.0. ``eps`` is LayerNorm's epsilon (the paper does not give one; PyTorch's).
    """

    vocab_size: int = 8000
    d_model: int = 512
    n_heads: int = 8
    d_ff: int = 2048
    n_encoder_layers: int = 6
    n_decoder_layers: int = 6
    dropout: float = 0.1            # P_drop, section 5.4
    attention_dropout: float = 0.0  # not in the paper
    relu_dropout: float = 0.0       # not in the paper
    label_smoothing: float = 0.1    # epsilon_ls, section 5.4
    max_len: int = 1024             # rows of the sinusoid table (longest sentence)
    pre_norm: bool = False          # True departs from the paper (see EncoderLayer)
    share_embeddings: bool = True   # one matrix for source, target and output (section 3.4)
    qk_norm: bool = False           # True departs from the paper (see MultiHeadAttention)
    activation: str = "relu"        # the FFN's: "relu" (eq. 2) or "gelu" (see FeedForward)
    eps: float = 1e-5

    MAX_TABLE_FLOATS = 1 << 28
    """The most floats the sinusoid table (max_len x d_model) may take: 1 GiB."""

    def mismatch(self, arrays) -> str | None:
        """Why this config cannot be the model of ``arrays`` (a checkpoint's parameters by
        name, only their shapes read), else None: checked before building the model, which
        allocates every parameter, so that a config that claims more than the file holds
        allocates nothing."""
        def shape(name):
            return tuple(arrays[name].shape) if name in arrays else None
        embed, d = shape("embed.weight"), self.d_model
        if embed is None:
            return "no embed.weight array"
        if embed != (self.vocab_size, d):
            return (f"model_config says vocab_size {self.vocab_size} and d_model {d}, but "
                    f"embed.weight has shape {embed}")
        for side, n in (("encoder", self.n_encoder_layers), ("decoder", self.n_decoder_layers)):
            layers = {k.split(".")[2] for k in arrays if k.startswith(f"{side}.layers.")}
            if layers != {str(i) for i in range(n)}:
                return (f"model_config says {n} {side} layers, but the arrays hold "
                        f"{len(layers)}")
            ffn = shape(f"{side}.layers.0.ffn.w_1.weight")
            if n and ffn != (self.d_ff, d):
                return (f"model_config says d_ff {self.d_ff}, but {side}.layers.0.ffn.w_1."
                        f"weight has shape {ffn}")
        if not 0 < self.max_len * d <= self.MAX_TABLE_FLOATS:
            return (f"model_config's max_len {self.max_len} makes a sinusoid table of "
                    f"{self.max_len * d:,} floats (at most {self.MAX_TABLE_FLOATS:,})")
        return None

    PRESETS = {  # section 6.1 / table 3; tiny and small are ours, for CPUs
        # tiny departs from the paper with pre-LN: in a CPU budget of minutes post-LN stays
        # near the unigram plateau (docs/training.md, "The tiny recipe"); --set
        # pre_norm=false restores the paper's post-LN. And with QK-norm: without it a short
        # warm-up collapses the attention (docs/experiments/2026-12-tiny-recipe.md, "QK-norm").
        "tiny": dict(d_model=256, n_heads=4, d_ff=1024, n_encoder_layers=3, n_decoder_layers=3,
                     pre_norm=True, qk_norm=True),
        "small": dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=3, n_decoder_layers=3),
        "base": dict(d_model=512, n_heads=8, d_ff=2048, n_encoder_layers=6, n_decoder_layers=6),
        "big": dict(d_model=1024, n_heads=16, d_ff=4096, n_encoder_layers=6, n_decoder_layers=6,
                    dropout=0.3),
    }

    def __post_init__(self):
        if self.d_model % self.n_heads:
            raise ValueError(f"transformer.py: d_model={self.d_model} is not divisible by "
                             f"n_heads={self.n_heads}")
        for name in ("dropout", "attention_dropout", "relu_dropout", "label_smoothing"):
            p = getattr(self, name)
            if not 0.0 <= p < 1.0:
                raise ValueError(f"transformer.py: {name}={p} must be in [0, 1)")
        if self.activation not in FeedForward.ACTIVATIONS:
            raise ValueError(f"transformer.py: activation={self.activation!r}: choose from "
                             f"{', '.join(FeedForward.ACTIVATIONS)}")
        for name in ("vocab_size", "d_model", "n_heads", "d_ff", "max_len"):
            if getattr(self, name) < 1:
                raise ValueError(f"transformer.py: {name}={getattr(self, name)} must be >= 1")

    @classmethod
    def preset(cls, name: str, **overrides) -> "TransformerConfig":
        """The named preset (tiny, small, base, big) with ``overrides`` applied."""
        if name not in cls.PRESETS:
            raise ValueError(f"transformer.py: unknown preset {name!r}; "
                             f"choose from {sorted(cls.PRESETS)}")
        return cls.from_dict({**cls.PRESETS[name], **overrides})

    def to_dict(self) -> dict:
        """A JSON-serialisable dict of every field."""
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "TransformerConfig":
        """Inverse of :meth:`to_dict`; unknown keys are an error (a typo must not pass)."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"transformer.py: unknown config keys {unknown}; "
                             f"known keys are {sorted(names)}")
        return cls(**d)


# --------------------------------------------------------------------------------------
# Masks
# --------------------------------------------------------------------------------------

def padding_mask(src_ids: np.ndarray) -> np.ndarray:
    """(B, 1, 1, S) bool, True where the source token is real (attend), False at PAD_ID."""
    return (src_ids != PAD_ID)[:, None, None, :]


def causal_mask(t: int, xp=np) -> np.ndarray:
    """(1, 1, T, T) bool, True on and below the diagonal: position i sees positions <= i.

    Targets are right-padded, so the causal mask alone keeps every real position away
    from padding (pads only ever come after it); outputs at pad positions are ignored by
    the loss.
    """
    return xp.tril(xp.ones((t, t), dtype=bool))[None, None]


def _ids(ids, device: str = "cpu"):
    """Token ids as an integer array on ``device`` (accepts a Tensor or a nested list)."""
    data = ids.data if isinstance(ids, Tensor) else ids
    if not hasattr(data, "dtype"):
        data = np.asarray(data)
    if data.dtype.kind not in "iu":
        raise TypeError(f"transformer.py: token ids must be integers, got {data.dtype}")
    return backend.to_device(data, device)


# --------------------------------------------------------------------------------------
# Section 3.4 and 3.5: embeddings and positional encoding
# --------------------------------------------------------------------------------------

class Embeddings(nn.Module):
    """Token embedding scaled by sqrt(d_model) (section 3.4): x = E[ids] * sqrt(d)."""

    def __init__(self, vocab_size: int, d_model: int):
        super().__init__()
        # Normal(0, d^-1/2) as fairseq / tensor2tensor: after the sqrt(d) scale the
        # embedded tokens have unit variance per component, like the sinusoids.
        self.weight = nn.Parameter(
            backend.rng(np).standard_normal((vocab_size, d_model), dtype=np.float32)
            * np.float32(d_model ** -0.5))
        self.scale = math.sqrt(d_model)

    def forward(self, ids) -> Tensor:
        return F.embedding(ids, self.weight) * self.scale   # (B, T, d)


def sinusoid_table(max_len: int, d_model: int) -> np.ndarray:
    """(max_len, d) float32: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...).

    Built once in float64 (for accurate arguments at large positions) and stored as float32.
    """
    pos = np.arange(max_len, dtype=np.float64)[:, None]
    inv_freq = np.exp(np.arange(0, d_model, 2, dtype=np.float64) * (-math.log(10000.0) / d_model))
    table = np.zeros((max_len, d_model), dtype=np.float64)
    table[:, 0::2] = np.sin(pos * inv_freq)
    table[:, 1::2] = np.cos(pos * inv_freq[: d_model // 2])
    return table.astype(np.float32)


class PositionalEncoding(nn.Module):
    """Adds the sinusoids of section 3.5 and applies dropout to the sum (section 5.4)."""

    def __init__(self, d_model: int, dropout: float, max_len: int):
        super().__init__()
        self.table = sinusoid_table(max_len, d_model)  # a constant, not a parameter
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: Tensor, start: int = 0) -> Tensor:
        t = x.shape[1]
        if start + t > self.table.shape[0]:
            raise ValueError(f"transformer.py: position {start + t} exceeds max_len="
                             f"{self.table.shape[0]}; raise TransformerConfig.max_len")
        pe = self.table[start:start + t]
        if pe.dtype != x.dtype:  # a float64 copy of the model (gradient checks)
            pe = pe.astype(x.dtype)
        return self.dropout(x + pe)                       # (B, T, d)


# --------------------------------------------------------------------------------------
# Section 3.2: attention
# --------------------------------------------------------------------------------------

def xavier_uniform_blocks_(weight: Tensor, n_blocks: int) -> None:
    """Xavier-uniform init of each of ``n_blocks`` stacked (d_out, d_in) row blocks.

    A fused projection [W_Q; W_K; W_V] is three d x d matrices; initialising it as one
    (3d, d) matrix would give each a smaller bound than the separate matrices of the paper.
    """
    rows, cols = weight.shape
    r = rows // n_blocks
    bound = math.sqrt(6.0 / (r + cols))
    weight.data[...] = backend.rng(np).uniform(-bound, bound, (rows, cols)).astype(weight.dtype)


def split_heads(x: Tensor, n_heads: int) -> Tensor:
    """(B, T, h*d_k) -> (B, h, T, d_k)."""
    return F.split_heads(x, n_heads)


def split_projections(x: Tensor, n: int, n_heads: int) -> list:
    """(B, T, n*h*d_k), n projections side by side -> n tensors (B, h, T, d_k), views of x.

    One node (``F.split_heads`` with ``parts=n``) rather than a reshape, n slices and n
    transposes: its backward writes the n gradients straight into one (B, T, n*h*d_k) array.
    """
    parts = F.split_heads(x, n_heads, parts=n)
    return [parts] if n == 1 else list(parts)


def merge_heads(x: Tensor) -> Tensor:
    """(B, h, T, d_k) -> (B, T, h*d_k): the Concat(head_1, ..., head_h) of eq. (4)."""
    return F.merge_heads(x)


class MultiHeadAttention(nn.Module):
    """MultiHead(Q, K, V) = Concat(head_1..head_h) W^O, head_i = Attention(QW_i^Q, KW_i^K, VW_i^V).

    The per-head matrices of eq. (4) are stored side by side, so one GEMM projects all
    heads at once. For self-attention W^Q, W^K and W^V are also stacked into one (3d, d)
    ``qkv`` Linear (one GEMM instead of three; the same maths); for encoder-decoder
    attention ``q`` projects the decoder state and ``kv`` the encoder output. With
    ``qk_norm`` each head's queries and keys are layer-normalised over d_k first.
    """

    def __init__(self, d_model: int, n_heads: int, attention_dropout: float = 0.0,
                 self_attention: bool = True, qk_norm: bool = False, eps: float = 1e-5):
        super().__init__()
        self.n_heads = n_heads
        self.attention_dropout = attention_dropout
        self.self_attention = self_attention
        self.qk_norm = qk_norm
        if qk_norm:
            # Departure: LayerNorm of every head's queries and keys over d_k before the dot
            # product ("QK-norm": Henry et al. 2020, Dehghani et al. 2023, Wortsman et al.
            # 2023), which bounds the attention logits by the learned gains instead of by
            # the growth of W^Q and W^K. The keys' norm has no bias: q . b adds the same
            # number to all of a query's scores, which the softmax ignores, so its gradient
            # is zero but for rounding, and Adam would turn that rounding into full steps.
            self.q_norm = nn.LayerNorm(d_model // n_heads, eps=eps)
            self.k_norm = nn.LayerNorm(d_model // n_heads, eps=eps, bias=False)
        if self_attention:
            self.qkv = nn.Linear(d_model, 3 * d_model)
            xavier_uniform_blocks_(self.qkv.weight, 3)
            nn.init.zeros_(self.qkv.bias)
        else:
            self.q = nn.Linear(d_model, d_model)
            self.kv = nn.Linear(d_model, 2 * d_model)
            xavier_uniform_blocks_(self.q.weight, 1)
            xavier_uniform_blocks_(self.kv.weight, 2)
            nn.init.zeros_(self.q.bias)
            nn.init.zeros_(self.kv.bias)
        self.out = nn.Linear(d_model, d_model)
        xavier_uniform_blocks_(self.out.weight, 1)
        nn.init.zeros_(self.out.bias)

    def project_kv(self, memory: Tensor) -> tuple[Tensor, Tensor]:
        """Keys and values of encoder-decoder attention, each (B, h, S, d_k).

        Computed once per source sentence and reused at every decoding step.
        """
        k, v = split_projections(self.kv(memory), 2, self.n_heads)   # kv: (B, S, 2d)
        return (self.k_norm(k) if self.qk_norm else k), v

    def cross_queries(self, x: Tensor) -> Tensor:
        """Queries of encoder-decoder attention, (B, T, d) -> (B, h, T, d_k)."""
        q = split_heads(self.q(x), self.n_heads)
        return self.q_norm(q) if self.qk_norm else q

    def forward(self, x: Tensor, mask=None, memory_kv=None, cache=None,
                padding=None) -> Tensor:
        """x (B, T, d) -> (B, T, d).

        Self-attention when ``memory_kv`` is None, else attention to the given
        (keys, values) of the encoder output, one row per memory row: B queries' rows may
        come in groups of B / M consecutive rows per memory row (a beam), or in shorter runs
        laid out by ``padding`` (a beam that lost hypotheses; :class:`DecoderState`).
        ``cache`` (self-attention only) is a
        :class:`tinytf.models.decoder_state.SelfAttentionCache` with the keys and values of
        earlier positions; the new positions' are written into it.
        """
        h = self.n_heads
        if memory_kv is None:
            q, k, v = split_projections(self.qkv(x), 3, h)  # qkv (B, T, 3d) -> (B, h, T, d_k)
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if cache is not None:                           # keys, values of t + T positions
                k, v = map(Tensor, cache.append(k.data, v.data))
        else:
            q = self.cross_queries(x)                      # (B, h, T, d_k)
            k, v = memory_kv                               # (M, h, S, d_k)
        if padding is not None:                            # runs of up to g rows
            fill, slots = padding
            y = self._grouped(q[fill], k, v, mask)[slots]
        elif k.shape[0] != q.shape[0]:                     # B = M * g: grouped queries
            y = self._grouped(q, k, v, mask)
        else:
            y = F.attention(q, k, v, mask=mask, dropout=self.attention_dropout,
                            training=self.training)        # (B, h, T, d_k)
        return self.out(merge_heads(y))                    # (B, T, d)

    def _grouped(self, q, k, v, mask) -> Tensor:
        """Attention of queries (M*g, h, T, d_k), consecutive groups of g rows per memory row,
        to keys and values (M, h, S, d_k): each memory row's g*T queries as one block (a
        sentence's whole beam against its source, read once), the same numbers as repeating
        every memory row g times."""
        (b, h, t, d), m = q.shape, k.shape[0]
        g = b // m
        blocks = q.reshape(m, g, h, t, d).permute(0, 2, 1, 3, 4).reshape(m, h, g * t, d)
        y = F.attention(blocks, k, v, mask=mask, dropout=self.attention_dropout,
                        training=self.training)            # (M, h, g*T, d_k)
        return y.reshape(m, h, g, t, d).permute(0, 2, 1, 3, 4).reshape(b, h, t, d)


# --------------------------------------------------------------------------------------
# Section 3.3: position-wise feed-forward network
# --------------------------------------------------------------------------------------

class FeedForward(nn.Module):
    """FFN(x) = max(0, x W_1 + b_1) W_2 + b_2, eq. (2); inner size d_ff.

    ``activation="gelu"`` departs from the paper: GELU in place of max(0, .), whose units,
    once pushed below 0 for every input, get no gradient again
    (docs/experiments/2026-12-tiny-recipe.md, "GELU").
    """

    ACTIVATIONS = ("relu", "gelu")

    def __init__(self, d_model: int, d_ff: int, relu_dropout: float = 0.0,
                 activation: str = "relu"):
        super().__init__()
        self.activation = activation
        self.w_1 = nn.Linear(d_model, d_ff)
        self.w_2 = nn.Linear(d_ff, d_model)
        for lin in (self.w_1, self.w_2):
            xavier_uniform_blocks_(lin.weight, 1)
            nn.init.zeros_(lin.bias)
        self.dropout = nn.Dropout(relu_dropout)  # not in the paper; 0 by default

    def forward(self, x: Tensor) -> Tensor:
        if self.activation == "gelu":
            hidden = F.gelu(self.w_1(x))
        else:   # relu(x W_1 + b_1) as one node: F.linear's activation (= F.relu(self.w_1(x)))
            hidden = F.linear(x, self.w_1.weight, self.w_1.bias, activation="relu")
        return self.w_2(self.dropout(hidden))              # (B, T, d_ff) -> (B, T, d)


# --------------------------------------------------------------------------------------
# Section 3.1: the layers and the stacks
# --------------------------------------------------------------------------------------

class SublayerConnection(nn.Module):
    """LayerNorm(x + Dropout(Sublayer(x))) (section 3.1 with the dropout of section 5.4).

    With ``pre_norm`` it computes x + Dropout(Sublayer(LayerNorm(x))) instead, a departure
    from the paper (Xiong et al. 2020; tensor2tensor's later default) that trains without
    warmup; the stack then ends with a final LayerNorm.
    """

    def __init__(self, d_model: int, dropout: float, pre_norm: bool, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(d_model, eps=eps)
        self.dropout = nn.Dropout(dropout)
        self.pre_norm = pre_norm

    def forward(self, x: Tensor, sublayer) -> Tensor:
        # F.dropout_add(y, x, p) is x + Dropout(y), as one node.
        p, training = self.dropout.p, self.training
        if self.pre_norm:
            return F.dropout_add(sublayer(self.norm(x)), x, p, training)
        return self.norm(F.dropout_add(sublayer(x), x, p, training))


class EncoderLayer(nn.Module):
    """Self-attention then feed-forward, each wrapped in a SublayerConnection."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout,
                                            qk_norm=cfg.qk_norm, eps=cfg.eps)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout, cfg.activation)
        self.sub1 = SublayerConnection(cfg.d_model, cfg.dropout, cfg.pre_norm, cfg.eps)
        self.sub2 = SublayerConnection(cfg.d_model, cfg.dropout, cfg.pre_norm, cfg.eps)

    def forward(self, x: Tensor, src_mask) -> Tensor:
        x = self.sub1(x, lambda y: self.self_attn(y, src_mask))   # (B, S, d)
        return self.sub2(x, self.ffn)


class DecoderLayer(nn.Module):
    """Masked self-attention, encoder-decoder attention, feed-forward (section 3.1)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.self_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout,
                                            qk_norm=cfg.qk_norm, eps=cfg.eps)
        self.cross_attn = MultiHeadAttention(cfg.d_model, cfg.n_heads, cfg.attention_dropout,
                                             self_attention=False, qk_norm=cfg.qk_norm,
                                             eps=cfg.eps)
        self.ffn = FeedForward(cfg.d_model, cfg.d_ff, cfg.relu_dropout, cfg.activation)
        self.sub1 = SublayerConnection(cfg.d_model, cfg.dropout, cfg.pre_norm, cfg.eps)
        self.sub2 = SublayerConnection(cfg.d_model, cfg.dropout, cfg.pre_norm, cfg.eps)
        self.sub3 = SublayerConnection(cfg.d_model, cfg.dropout, cfg.pre_norm, cfg.eps)

    def forward(self, x: Tensor, memory_kv, src_mask, tgt_mask, cache=None,
                padding=None) -> Tensor:
        x = self.sub1(x, lambda y: self.self_attn(y, tgt_mask, cache=cache))     # (B, T, d)
        x = self.sub2(x, lambda y: self.cross_attn(y, src_mask, memory_kv=memory_kv,
                                                   padding=padding))
        return self.sub3(x, self.ffn)


class Encoder(nn.Module):
    """N identical EncoderLayers (plus a final LayerNorm when pre_norm)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList([EncoderLayer(cfg) for _ in range(cfg.n_encoder_layers)])
        self.pre_norm = cfg.pre_norm
        if cfg.pre_norm:
            self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.eps)

    def forward(self, x: Tensor, src_mask) -> Tensor:
        for layer in self.layers:
            x = layer(x, src_mask)
        return self.norm(x) if self.pre_norm else x          # (B, S, d)


class Decoder(nn.Module):
    """N identical DecoderLayers (plus a final LayerNorm when pre_norm)."""

    def __init__(self, cfg: TransformerConfig):
        super().__init__()
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.n_decoder_layers)])
        self.pre_norm = cfg.pre_norm
        if cfg.pre_norm:
            self.norm = nn.LayerNorm(cfg.d_model, eps=cfg.eps)

    def forward(self, x: Tensor, memory_kvs, src_mask, tgt_mask, caches=None,
                padding=None) -> Tensor:
        for i, layer in enumerate(self.layers):
            x = layer(x, memory_kvs[i], src_mask, tgt_mask,
                      cache=None if caches is None else caches[i], padding=padding)
        return self.norm(x) if self.pre_norm else x          # (B, T, d)


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------

class Transformer(nn.Module):
    """The encoder-decoder Transformer of figure 1 with one shared embedding matrix.

    ``forward(src, tgt_in)`` returns logits (B, T, V) = decoder output @ E^T: the output
    projection is the (unscaled) transpose of the shared embedding (section 3.4).
    """

    def __init__(self, config: TransformerConfig):
        super().__init__()
        self.config = config
        d = config.d_model
        self.embed = Embeddings(config.vocab_size, d)          # target side and output
        if not config.share_embeddings:
            # Departure: a separate source table (the paper shares all three). The target
            # embedding stays tied to the output projection (Press & Wolf 2017).
            self.src_embed = Embeddings(config.vocab_size, d)
        self.pos = PositionalEncoding(d, config.dropout, config.max_len)
        self.encoder = Encoder(config)
        self.decoder = Decoder(config)

    def set_dropout(self, p: float) -> None:
        """Make ``p`` the model's P_drop (section 5.4: the sub-layer outputs and the
        embedding sums), in ``config`` too; ``attention_dropout`` and ``relu_dropout``
        keep theirs. The trainer sets a rate chosen for the budget this way, after the
        model is built (docs/experiments/2026-12-tiny-recipe.md, "The rate of a long budget")."""
        self.config = dataclasses.replace(self.config, dropout=p)
        for _, module in self.named_modules():
            if isinstance(module, (SublayerConnection, PositionalEncoding)):
                module.dropout.p = p

    @property
    def generator(self) -> Tensor:
        """The (V, d) matrix of the output projection: the shared embedding E."""
        return self.embed.weight

    def encode(self, src_ids) -> Tensor:
        """src_ids (B, S) int, PAD_ID-padded -> memory (B, S, d)."""
        src_ids = _ids(src_ids, self.embed.weight.device)
        embed = self.embed if self.config.share_embeddings else self.src_embed
        x = self.pos(embed(src_ids))                            # (B, S, d)
        return self.encoder(x, padding_mask(src_ids))

    def decode(self, tgt_in, memory: Tensor, src_ids) -> Tensor:
        """tgt_in (B, T) int (BOS-shifted target), memory (B, S, d) -> logits (B, T, V)."""
        device = self.embed.weight.device
        tgt_in = _ids(tgt_in, device)
        src_mask = padding_mask(_ids(src_ids, device))
        memory_kvs = [layer.cross_attn.project_kv(memory) for layer in self.decoder.layers]
        x = self.pos(self.embed(tgt_in))                        # (B, T, d)
        tgt_mask = causal_mask(tgt_in.shape[1], backend.get_array_module(tgt_in))
        x = self.decoder(x, memory_kvs, src_mask, tgt_mask)
        return F.linear(x, self.generator)                      # (B, T, V)

    def forward(self, src_ids, tgt_in) -> Tensor:
        """Logits (B, T, V) for teacher-forced targets ``tgt_in``."""
        return self.decode(tgt_in, self.encode(src_ids), src_ids)

    # ---- incremental decoding (used by tinytf.decoding.search) -------------------------------

    def start_decoding(self, memory: Tensor, src_ids) -> DecoderState:
        """Project every layer's encoder-decoder keys/values once; empty self-attention caches."""
        with no_grad():
            cross_kv = []
            for layer in self.decoder.layers:
                k, v = layer.cross_attn.project_kv(memory)
                cross_kv.append((k.data, v.data))               # (B, h, S, d_k) each
        src_mask = padding_mask(_ids(src_ids, self.embed.weight.device))
        return DecoderState(src_mask, cross_kv, [SelfAttentionCache() for _ in self.decoder.layers])

    def decode_step(self, tokens, state: DecoderState) -> np.ndarray:
        """Feed one token per row at position ``state.length``; return log-probs (B, V).

        Equal (to rounding) to the last position of :meth:`decode` on the whole prefix;
        appends this position's keys and values to ``state`` and advances ``state.length``.
        """
        tokens = _ids(tokens, self.embed.weight.device)
        with no_grad():
            x = self.pos(self.embed(tokens[:, None]), start=state.length)   # (B, 1, d)
            memory_kvs = [(Tensor(k), Tensor(v)) for k, v in state.cross_kv]
            # The new position may attend to every cached one: no causal mask needed.
            x = self.decoder(x, memory_kvs, state.src_mask, None, caches=state.caches,
                             padding=state.padding)
            logits = F.linear(x[:, 0], self.generator)           # (B, V)
            logp = F.log_softmax(logits, axis=-1)
        state.length += 1
        return logp.data


def label_smoothed_loss(logits: Tensor, target, eps: float = 0.1,
                        pad_id: int = PAD_ID, count: int | None = None) -> tuple[Tensor, int]:
    """Summed label-smoothed cross-entropy over non-pad targets, and their count.

    loss = sum_t [(1 - eps) * -log p(y_t) + eps * mean_v -log p(v)] (section 5.4, PyTorch's
    convention); divide by the (global) token count to get the per-token loss.
    The count is taken where ``target`` lives: NumPy ids (the trainer's host batches) cost a
    GPU model no round trip. A caller that knows it passes ``count`` (the trainer: device
    targets copied ahead, and the batch's host count), and nothing is read back.
    """
    given = target.data if isinstance(target, Tensor) else target
    ids = _ids(target, backend.device_of(given))
    if count is None:
        count = int((ids != pad_id).sum())
    v = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, v),
                           backend.to_device(ids, logits.device).reshape(-1),
                           label_smoothing=eps, ignore_index=pad_id, reduction="sum")
    return loss, count
