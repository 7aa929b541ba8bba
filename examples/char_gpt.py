"""A character-level GPT (decoder-only Transformer language model) built only from tinytf.

    python examples/char_gpt.py          # ~4 minutes on one CPU core, dev loss ~1.6
    python examples/char_gpt.py --steps 300 --n-layer 1 --n-embd 64 --block-size 16 \
        --batch-size 64 --lr 5e-3       # seconds, dev loss ~2.1 (the test's settings)

It learns to continue text one character at a time from the shipped sentences in
``data/ende/train.en`` (``--langs en,de`` adds the German side), prints the training and
dev loss in nats per character as it goes, and ends by sampling a few new lines.

The model is GPT-2's (Radford et al. 2019) at toy scale, written in the style of Karpathy's
nanoGPT ``model.py``: token plus learned position embeddings, a stack of pre-LayerNorm
blocks (causal self-attention, then an MLP, each added to a residual stream), a final
LayerNorm, and an output layer that shares the token-embedding matrix. Departures from
GPT-2 are named where they occur (ReLU instead of GELU; plain Adam, no weight decay).

Everything here is ordinary tinytf: ``nn.Module`` subclasses holding ``nn.Parameter``s,
``tinytf.nn.functional`` ops (``F.attention`` does the fused masked softmax attention), and
``optim.Adam``. ``docs/extending.md`` walks through this file.

Shapes: ``B`` batch, ``T`` positions (at most ``block_size``), ``C`` = n_embd,
``h`` heads, ``V`` vocabulary (distinct characters + 1 for unknown).
"""
from __future__ import annotations

import argparse
import dataclasses
import math
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

import tinytf
from tinytf import functional as F
from tinytf import nn, optim
from tinytf.engine.tensor import Tensor
from tinytf.utils import checkpoint

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "ende"


# --------------------------------------------------------------------------------------
# Data: the text as one long array of character ids
# --------------------------------------------------------------------------------------

class CharVocab:
    """Characters <-> ids. Id 0 stands for any character not seen in training."""

    UNK = 0

    def __init__(self, chars):
        self.chars = list(chars)                  # chars[i] is the character of id i
        self.index = {c: i for i, c in enumerate(self.chars)}

    @classmethod
    def from_text(cls, text: str) -> "CharVocab":
        """Every distinct character of ``text``, sorted, after the unknown mark U+FFFD."""
        return cls(["\ufffd"] + sorted(set(text)))

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> np.ndarray:
        """int32 array of ids, one per character."""
        return np.fromiter((self.index.get(c, self.UNK) for c in text), dtype=np.int32,
                           count=len(text))

    def decode(self, ids) -> str:
        """The characters of ``ids`` joined into a string."""
        return "".join(self.chars[int(i)] for i in ids)


def read_text(data_dir: Path, split: str, langs) -> str:
    """The ``split`` files (train/dev/test) of each language, concatenated, one line each."""
    parts = []
    for lang in langs:
        path = Path(data_dir) / f"{split}.{lang}"
        if not path.is_file():
            raise FileNotFoundError(f"char_gpt.py: no data file {path} (see data/ende/README.md)")
        parts.append(path.read_text(encoding="utf-8"))
    return "".join(parts)


def get_batch(data: np.ndarray, batch_size: int, block_size: int, rng) -> tuple:
    """Random windows: inputs x (B, T) and targets y (B, T), y[:, t] = x[:, t + 1].

    The newline between sentences is an ordinary character, so the model also learns
    where sentences end, and sampling can stop there.
    """
    starts = rng.integers(0, len(data) - block_size - 1, size=batch_size)
    idx = starts[:, None] + np.arange(block_size + 1)     # (B, T+1)
    window = data[idx]
    return window[:, :-1], window[:, 1:]


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------

@dataclass
class GPTConfig:
    """Every hyper-parameter of the model (nanoGPT's GPTConfig at toy size)."""

    vocab_size: int = 100
    block_size: int = 64     # longest context, in characters
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"char_gpt.py: n_embd={self.n_embd} is not divisible by "
                             f"n_head={self.n_head}")


def causal_mask(t: int) -> np.ndarray:
    """(1, 1, T, T) bool, True on and below the diagonal: position i attends to j <= i."""
    return np.tril(np.ones((t, t), dtype=bool))[None, None]


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention in which no position can look ahead.

    One Linear makes queries, keys and values for all heads at once (B, T, 3C); the heads
    are split off, F.attention applies softmax(q k^T / sqrt(d) + causal mask) v, and the
    heads are joined again and projected back to C.
    """

    def __init__(self, cfg: GPTConfig):
        self.n_head = cfg.n_head
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.dropout = cfg.dropout
        self.resid_dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        b, t, c = x.shape
        h = self.n_head
        qkv = self.c_attn(x)                                          # (B, T, 3C)
        # (B, T, 3C) -> (3, B, h, T, C/h): one reshape and transpose for q, k and v.
        qkv = qkv.reshape(b, t, 3, h, c // h).permute(2, 0, 3, 1, 4)
        q, k, v = qkv[0], qkv[1], qkv[2]                              # (B, h, T, C/h)
        y = F.attention(q, k, v, mask=causal_mask(t), dropout=self.dropout,
                        training=self.training)                       # (B, h, T, C/h)
        y = y.permute(0, 2, 1, 3).reshape(b, t, c)                  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Position-wise feed-forward: Linear(C, 4C), ReLU, Linear(4C, C).

    GPT-2 uses GELU here; ReLU is a built-in op and trains as well at this size.
    docs/autograd.md adds GELU as a new op, and docs/extending.md swaps it in here.
    """

    def __init__(self, cfg: GPTConfig):
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: Tensor) -> Tensor:
        return self.dropout(self.c_proj(F.relu(self.c_fc(x))))       # (B, T, C)


class Block(nn.Module):
    """x + attn(ln_1(x)), then x + mlp(ln_2(x)): the pre-LayerNorm residual block.

    Normalising the input of each sub-layer (rather than the sum, as the 2017 Transformer
    does) keeps the residual stream an identity path, so training is stable without warmup.
    """

    def __init__(self, cfg: GPTConfig):
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.mlp = MLP(cfg)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """Token + position embeddings, ``n_layer`` Blocks, LayerNorm, tied output layer."""

    def __init__(self, cfg: GPTConfig):
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd, std=0.02)   # token embedding
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd, std=0.02)   # position embedding
        self.drop = nn.Dropout(cfg.dropout)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self._init_weights()

    def _init_weights(self) -> None:
        """GPT-2's initialisation, as in nanoGPT.

        N(0, 0.02) weights and zero biases; the two projections that write into the
        residual stream (``c_proj``) get std 0.02 / sqrt(2 n_layer), so the stream's
        variance does not grow with depth.
        """
        for name, p in self.named_parameters():
            if "ln_" in name or not name.startswith("blocks."):
                continue          # LayerNorms keep ones and zeros; wte, wpe are N(0, 0.02)
            if name.endswith(".bias"):
                nn.init.zeros_(p)
            elif name.endswith("c_proj.weight"):
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * self.cfg.n_layer))
            else:
                nn.init.normal_(p, std=0.02)

    def forward(self, idx: np.ndarray) -> Tensor:
        """Logits (B, T, V) of the next character at every position of ``idx`` (B, T)."""
        b, t = idx.shape
        if t > self.cfg.block_size:
            raise ValueError(f"char_gpt.py: sequence of {t} exceeds block_size="
                             f"{self.cfg.block_size}")
        tok = self.wte(idx)                                   # (B, T, C)
        pos = self.wpe(np.arange(t))                          # (T, C), broadcast over B
        x = self.drop(tok + pos)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        # Weight tying (Press & Wolf 2017): the output layer is the token embedding matrix,
        # so one Parameter receives gradient from both ends of the network.
        return F.linear(x, self.wte.weight)                   # (B, T, V)

    def loss(self, idx: np.ndarray, targets: np.ndarray) -> Tensor:
        """Mean cross-entropy (nats per character) of predicting ``targets`` (B, T)."""
        logits = self(idx)
        v = logits.shape[-1]
        return F.cross_entropy(logits.reshape(-1, v), targets.reshape(-1))

    @tinytf.no_grad()
    def generate(self, idx: np.ndarray, max_new_tokens: int, temperature: float = 1.0,
                 rng=None, stop_id: int | None = None) -> np.ndarray:
        """Extend each row of ``idx`` (B, T) by sampling one character at a time.

        Each step runs the model on the last ``block_size`` characters (no key/value cache:
        simple, and fast enough for a few lines) and samples from softmax(logits / temp).
        Stops early once every row has produced ``stop_id``.
        """
        rng = rng or np.random.default_rng()
        done = np.zeros(len(idx), dtype=bool)
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.cfg.block_size:]).data[:, -1, :]   # (B, V)
            weights = np.exp((logits - logits.max(axis=1, keepdims=True)) / temperature)
            # Inverse-CDF sampling from the unnormalised weights: the first index whose
            # cumulative weight exceeds u * total, u ~ U(0, 1).
            cdf = weights.cumsum(axis=1)
            u = rng.random((len(idx), 1)) * cdf[:, -1:]
            nxt = np.minimum((cdf < u).sum(axis=1), cdf.shape[1] - 1).astype(idx.dtype)
            idx = np.concatenate([idx, nxt[:, None]], axis=1)
            if stop_id is not None:
                done |= nxt == stop_id
                if done.all():
                    break
        return idx


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------

def lr_at(step: int, max_lr: float, warmup: int, total: int) -> float:
    """Linear warmup to ``max_lr`` over ``warmup`` steps, then cosine decay to max_lr / 10."""
    if step < warmup:
        return max_lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return max_lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


@tinytf.no_grad()
def estimate_loss(model: GPT, data: np.ndarray, batch_size: int, batches: int,
                  seed: int = 0) -> float:
    """Mean loss over ``batches`` fixed random windows of ``data`` (evaluation mode)."""
    model.eval()
    rng = np.random.default_rng(seed)   # the same windows every time: comparable numbers
    losses = [model.loss(*get_batch(data, batch_size, model.cfg.block_size, rng)).item()
              for _ in range(batches)]
    model.train()
    return float(np.mean(losses))


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; every default is the few-minute CPU run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR,
                   help="directory with train.LANG and dev.LANG")
    p.add_argument("--langs", default="en", help="comma-separated: en, de or en,de")
    p.add_argument("--steps", type=int, default=1000, help="optimizer updates")
    p.add_argument("--batch-size", type=int, default=32, help="sequences per update")
    p.add_argument("--block-size", type=int, default=64, help="characters of context")
    p.add_argument("--n-layer", type=int, default=2, help="Transformer blocks")
    p.add_argument("--n-head", type=int, default=4, help="attention heads per block")
    p.add_argument("--n-embd", type=int, default=128, help="model width")
    p.add_argument("--dropout", type=float, default=0.0, help="dropout rate")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (Adam)")
    p.add_argument("--warmup", type=int, default=100,
                   help="linear warm-up updates, then cosine decay to lr / 10")
    p.add_argument("--clip", type=float, default=1.0, help="max gradient norm")
    p.add_argument("--eval-interval", type=int, default=250,
                   help="updates between dev-loss evaluations")
    p.add_argument("--eval-batches", type=int, default=8, help="dev batches per evaluation")
    p.add_argument("--log-interval", type=int, default=50, help="updates between log lines")
    p.add_argument("--samples", type=int, default=4, help="lines to sample at the end")
    p.add_argument("--sample-length", type=int, default=200,
                   help="characters per sampled line, at most")
    p.add_argument("--temperature", type=float, default=0.8, help="sampling temperature")
    p.add_argument("--seed", type=int, default=1337, help="seed of weights, batches, samples")
    p.add_argument("--out", type=Path, default=None,
                   help="write the trained model here (.npz, see load_model)")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Train, report, sample. Returns {"train_loss", "dev_loss", "samples", "model", ...}."""
    args = parse_args(argv)
    tinytf.manual_seed(args.seed)                 # parameter init
    rng = np.random.default_rng(args.seed)        # batches and sampling
    langs = [s.strip() for s in args.langs.split(",") if s.strip()]

    train_text = read_text(args.data_dir, "train", langs)
    vocab = CharVocab.from_text(train_text)
    train_data = vocab.encode(train_text)
    dev_data = vocab.encode(read_text(args.data_dir, "dev", langs))
    cfg = GPTConfig(vocab_size=len(vocab), block_size=args.block_size, n_layer=args.n_layer,
                    n_head=args.n_head, n_embd=args.n_embd, dropout=args.dropout)
    model = GPT(cfg)
    # Plain Adam, as the brief of this example asks; nanoGPT uses AdamW (weight decay 0.1).
    opt = optim.Adam(model.named_parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-8)
    print(f"{len(train_data):,} training characters, vocabulary {len(vocab)}, "
          f"{model.num_parameters():,} parameters, {cfg}")
    print(f"a model that knew only character frequencies would score "
          f"{unigram_entropy(train_data, len(vocab)):.2f} nats/char")

    start = time.perf_counter()
    smoothed, dev_loss = None, None
    for step in range(args.steps):
        opt.lr = lr_at(step, args.lr, args.warmup, args.steps)
        x, y = get_batch(train_data, args.batch_size, cfg.block_size, rng)
        loss = model.loss(x, y)
        opt.zero_grad()
        loss.backward()
        optim.clip_grad_norm(model.named_parameters(), args.clip)
        opt.step()

        value = loss.item()
        smoothed = value if smoothed is None else 0.9 * smoothed + 0.1 * value
        last = step == args.steps - 1
        if step % args.log_interval == 0 or last:
            print(f"step {step:5d}  loss {value:.3f}  (smoothed {smoothed:.3f})  "
                  f"lr {opt.lr:.2e}  {time.perf_counter() - start:6.1f}s")
        if (step > 0 and step % args.eval_interval == 0) or last:
            dev_loss = estimate_loss(model, dev_data, args.batch_size, args.eval_batches)
            print(f"step {step:5d}  dev loss {dev_loss:.3f} nats/char "
                  f"({dev_loss / math.log(2):.2f} bits)")
    train_seconds = time.perf_counter() - start
    if args.out is not None:
        save_model(args.out, model, vocab)
        print(f"saved {args.out}")

    model.eval()
    newline = vocab.index["\n"]
    prompt = np.full((args.samples, 1), newline, dtype=np.int32)
    out = model.generate(prompt, args.sample_length, args.temperature, rng, stop_id=newline)
    samples = [vocab.decode(row[1:]).split("\n")[0] for row in out]
    print("samples:")
    for line in samples:
        print("  " + line)
    return {"train_loss": smoothed, "dev_loss": dev_loss, "samples": samples,
            "seconds": train_seconds, "parameters": model.num_parameters(),
            "model": model, "vocab": vocab}


def save_model(path: Path, model: GPT, vocab: CharVocab) -> None:
    """Parameters, config and characters in one tinytf checkpoint (an atomic .npz)."""
    checkpoint.save(path, model.state_dict(),
                    meta={"model_config": dataclasses.asdict(model.cfg), "chars": vocab.chars})


def load_model(path: Path) -> tuple[GPT, CharVocab]:
    """The model and vocabulary written by :func:`save_model`, in evaluation mode."""
    ckpt = checkpoint.load(path, with_optim=False)
    model = GPT(GPTConfig(**ckpt.meta["model_config"]))
    model.load_state_dict(ckpt.model)
    return model.eval(), CharVocab(ckpt.meta["chars"])


def unigram_entropy(data: np.ndarray, vocab_size: int) -> float:
    """Entropy (nats) of the character frequencies: the loss of the best context-free model."""
    p = np.bincount(data, minlength=vocab_size).astype(np.float64)
    p = p[p > 0] / p.sum()
    return float(-(p * np.log(p)).sum())


if __name__ == "__main__":
    main()
