"""A character-level GRU language model of English, on tinytf's recurrent layers.

    python examples/gru_lm.py                # about 20 seconds on a CPU

It reads ``data/ende/train.en`` as one stream of characters (sentences joined by newlines),
trains on random windows of ``--block-size`` characters to predict each next character, and
reports the dev loss (``dev.en``) in nats per character against the entropy of the character
frequencies (what a model without context scores, 3.10):

    embed (B, T, E) -> GRU(E, H, num_layers, batch_first) (B, T, H) -> Linear -> logits (B, T, V)

trained with ``optim.Adam``, a linear warm-up then cosine decay (``lr_scheduler.LambdaLR``)
and gradient clipping (``optim.clip_grad_norm_``); the loss is ``F.cross_entropy`` over the
(B, T) positions. At the end it samples a few lines, carrying the GRU's state from character
to character (``nn.GRU`` with ``h0``).
"""
from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import numpy as np

import tinytf
from tinytf import functional as F
from tinytf import nn, optim
from tinytf.engine.tensor import Tensor
from tinytf.optim.lr_scheduler import LambdaLR

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "ende"


def read_stream(path: Path, vocab: dict | None = None) -> tuple[np.ndarray, dict]:
    """The file's characters as ids (unseen characters are dropped) and the vocabulary
    (built from this file when None; "\\n" ends each sentence)."""
    if not Path(path).is_file():
        raise FileNotFoundError(f"gru_lm.py: no data file {path} (see data/ende/README.md)")
    text = Path(path).read_text(encoding="utf-8")
    if vocab is None:
        vocab = {ch: i for i, ch in enumerate(sorted(set(text)))}
    return np.array([vocab[ch] for ch in text if ch in vocab], dtype=np.int64), vocab


def unigram_entropy(ids: np.ndarray, size: int) -> float:
    """The entropy of the character frequencies, in nats: a context-free model's loss."""
    p = np.bincount(ids, minlength=size) / len(ids)
    p = p[p > 0]
    return float(-(p * np.log(p)).sum())


class CharGRU(nn.Module):
    """Embedding -> stacked GRU -> linear layer to the next character's logits."""

    def __init__(self, vocab_size: int, embed: int, hidden: int, layers: int):
        self.embed = nn.Embedding(vocab_size, embed, std=0.3)
        self.gru = nn.GRU(embed, hidden, num_layers=layers, batch_first=True)
        self.out = nn.Linear(hidden, vocab_size)

    def forward(self, ids: np.ndarray, h0: Tensor | None = None) -> tuple:
        """(logits (B, T, V), final state (layers, B, H)) for ids (B, T)."""
        states, h_n = self.gru(self.embed(ids), h0)
        return self.out(states), h_n


def windows(stream: np.ndarray, rng, batch: int, block: int) -> tuple:
    """``batch`` random windows (B, block) and the characters that follow each position."""
    starts = rng.integers(0, len(stream) - block - 1, size=batch)
    idx = starts[:, None] + np.arange(block)
    return stream[idx], stream[idx + 1]


@tinytf.no_grad()
def evaluate(model: CharGRU, stream: np.ndarray, block: int, batches: int, seed: int) -> float:
    """Mean dev loss (nats per character) over ``batches`` fixed random windows of 64."""
    model.eval()
    rng = np.random.default_rng(seed)
    losses = [F.cross_entropy(model(x)[0], y).item()
              for x, y in (windows(stream, rng, 64, block) for _ in range(batches))]
    model.train()
    return float(np.mean(losses))


@tinytf.no_grad()
def sample(model: CharGRU, vocab: dict, n: int, length: int, seed: int) -> list:
    """``n`` lines drawn character by character, each starting after a newline."""
    model.eval()
    chars = {i: ch for ch, i in vocab.items()}
    rng = np.random.default_rng(seed)
    ids, h, out = np.full((n, 1), vocab["\n"]), None, [[] for _ in range(n)]
    for _ in range(length):
        logits, h = model(ids, h)
        p = F.softmax(logits[:, -1]).numpy().astype(np.float64)
        ids = np.array([[rng.choice(len(row), p=row / row.sum())] for row in p])
        for line, i in zip(out, ids[:, 0]):
            line.append(chars[int(i)])
    model.train()
    return ["".join(line).split("\n")[0] for line in out]


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; the defaults are the 20-second CPU run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR,
                   help="directory with train.en and dev.en")
    p.add_argument("--embed", type=int, default=32, help="character embedding size")
    p.add_argument("--hidden", type=int, default=192, help="GRU state size")
    p.add_argument("--layers", type=int, default=1, help="stacked GRU layers")
    p.add_argument("--block-size", type=int, default=32, help="characters per window")
    p.add_argument("--batch-size", type=int, default=32, help="windows per update")
    p.add_argument("--steps", type=int, default=600, help="optimizer updates")
    p.add_argument("--lr", type=float, default=5e-3, help="peak learning rate (Adam)")
    p.add_argument("--warmup", type=int, default=30, help="linear warm-up updates")
    p.add_argument("--clip-norm", type=float, default=1.0, help="gradient norm clip")
    p.add_argument("--eval-batches", type=int, default=8, help="dev batches of 64 windows")
    p.add_argument("--log-interval", type=int, default=100, help="updates between log lines")
    p.add_argument("--samples", type=int, default=3, help="lines sampled at the end")
    p.add_argument("--sample-length", type=int, default=80, help="characters per sampled line")
    p.add_argument("--seed", type=int, default=1234, help="seed of weights and batches")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Train, evaluate and sample. Returns {"dev_loss", "unigram_entropy", "train_loss",
    "samples", "seconds", "parameters"}."""
    args = parse_args(argv)
    tinytf.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    train, vocab = read_stream(args.data_dir / "train.en")
    dev, _ = read_stream(args.data_dir / "dev.en", vocab)
    baseline = unigram_entropy(train, len(vocab))
    model = CharGRU(len(vocab), args.embed, args.hidden, args.layers)
    opt = optim.Adam(model.named_parameters(), lr=args.lr, betas=(0.9, 0.99), eps=1e-8)

    def warmup_cosine(t):
        if t < args.warmup:
            return (t + 1) / args.warmup
        return 0.5 * (1 + math.cos(math.pi * (t - args.warmup) / max(1, args.steps - args.warmup)))

    schedule = LambdaLR(opt, warmup_cosine)
    print(f"{len(train):,} training characters, {len(vocab)} distinct; "
          f"{model.num_parameters():,} parameters; a model without context scores "
          f"{baseline:.2f} nats/char")
    smoothed = None
    for step in range(args.steps):
        x, y = windows(train, rng, args.batch_size, args.block_size)
        loss = F.cross_entropy(model(x)[0], y)
        opt.zero_grad()
        loss.backward()
        optim.clip_grad_norm_(model.parameters(), args.clip_norm)
        opt.step()
        schedule.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % args.log_interval == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {smoothed:.3f}  lr {schedule.get_last_lr()[0]:.2e}  "
                  f"{time.perf_counter() - start:5.1f}s")
    dev_loss = evaluate(model, dev, args.block_size, args.eval_batches, args.seed)
    print(f"dev loss {dev_loss:.3f} nats/char ({dev_loss / math.log(2):.2f} bits), "
          f"context-free {baseline:.2f}")
    lines = sample(model, vocab, args.samples, args.sample_length, args.seed)
    for line in lines:
        print(f"  {line}")
    seconds = time.perf_counter() - start
    print(f"{seconds:.1f}s in all")
    return {"dev_loss": dev_loss, "unigram_entropy": baseline, "train_loss": smoothed,
            "samples": lines, "seconds": seconds, "parameters": model.num_parameters()}


if __name__ == "__main__":
    main()
