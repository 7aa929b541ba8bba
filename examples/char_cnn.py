"""A character CNN that tells English from German, on tinytf's convolution and pooling.

    python examples/char_cnn.py              # under ten seconds on a CPU

Each sentence of ``data/ende/{train,dev}.{en,de}`` becomes its first ``--length``
characters (ids from the training text's characters; 0 pads, 1 is an unseen character). The
model is a small convolutional text classifier (Kim 2014; Zhang et al. 2015 at toy size):

    embed (B, L, E) -> transpose (B, E, L) -> Conv1d(E, C, 5) -> ReLU -> MaxPool1d(2)
                    -> Conv1d(C, C, 3) -> ReLU -> max over positions (B, C) -> Linear -> 2 logits

trained with ``optim.AdamW`` under a ``lr_scheduler.CosineAnnealingLR``. Built only from the
public API: ``nn.Embedding``, ``nn.Conv1d``, ``nn.MaxPool1d``, ``nn.Linear``, ``F.relu``,
``Tensor.amax`` and ``F.cross_entropy``.
"""
from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

import tinytf
from tinytf import functional as F
from tinytf import nn, optim
from tinytf.engine.tensor import Tensor
from tinytf.optim.lr_scheduler import CosineAnnealingLR

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "ende"
LANGS = ("en", "de")                  # class 0, class 1
PAD, UNK = 0, 1


def read(data_dir: Path, split: str) -> tuple[list, np.ndarray]:
    """(sentences, labels) of ``split`` in both languages."""
    sentences, labels = [], []
    for label, lang in enumerate(LANGS):
        path = Path(data_dir) / f"{split}.{lang}"
        if not path.is_file():
            raise FileNotFoundError(f"char_cnn.py: no data file {path} (see data/ende/README.md)")
        lines = path.read_text(encoding="utf-8").splitlines()
        sentences += lines
        labels += [label] * len(lines)
    return sentences, np.array(labels, dtype=np.int64)


def char_ids(sentences: list, vocab: dict, length: int) -> np.ndarray:
    """(N, length) character ids, cut or padded with 0."""
    ids = np.zeros((len(sentences), length), dtype=np.int64)
    for i, s in enumerate(sentences):
        row = [vocab.get(ch, UNK) for ch in s[:length]]
        ids[i, :len(row)] = row
    return ids


class CharCNN(nn.Module):
    """Character embeddings, two convolutions, max over positions, a linear classifier."""

    def __init__(self, vocab_size: int, embed: int, channels: int, n_classes: int):
        self.embed = nn.Embedding(vocab_size, embed, std=0.3)
        self.conv1 = nn.Conv1d(embed, channels, 5, padding=2)
        self.pool = nn.MaxPool1d(2)
        self.conv2 = nn.Conv1d(channels, channels, 3, padding=1)
        self.out = nn.Linear(channels, n_classes)

    def forward(self, ids: np.ndarray) -> Tensor:
        """Logits (B, n_classes) for character ids (B, L)."""
        x = self.embed(ids).transpose(1, 2)                    # (B, E, L): channels first
        x = self.pool(F.relu(self.conv1(x)))                   # (B, C, L/2)
        x = F.relu(self.conv2(x)).amax(2)                      # (B, C): the strongest match
        return self.out(x)


@tinytf.no_grad()
def predict(model: CharCNN, ids: np.ndarray, batch_size: int = 500) -> np.ndarray:
    """Predicted class of every row (evaluation mode, no graph)."""
    model.eval()
    preds = [model(ids[i:i + batch_size]).argmax(1).numpy()
             for i in range(0, len(ids), batch_size)]
    model.train()
    return np.concatenate(preds)


def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; the defaults are the few-second CPU run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR,
                   help="directory with train.en, train.de, dev.en and dev.de")
    p.add_argument("--length", type=int, default=48, help="characters read per sentence")
    p.add_argument("--embed", type=int, default=16, help="character embedding size")
    p.add_argument("--channels", type=int, default=64, help="convolution channels")
    p.add_argument("--steps", type=int, default=400, help="optimizer updates")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per update")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--weight-decay", type=float, default=0.01, help="AdamW's decoupled decay")
    p.add_argument("--log-interval", type=int, default=100, help="updates between log lines")
    p.add_argument("--seed", type=int, default=1234, help="seed of weights and batches")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Train and evaluate. Returns {"dev_accuracy", "train_loss", "seconds", "parameters"}."""
    args = parse_args(argv)
    tinytf.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    train_s, train_y = read(args.data_dir, "train")
    dev_s, dev_y = read(args.data_dir, "dev")
    chars = sorted({ch for s in train_s for ch in s})
    vocab = {ch: i + 2 for i, ch in enumerate(chars)}
    train_x = char_ids(train_s, vocab, args.length)
    dev_x = char_ids(dev_s, vocab, args.length)

    model = CharCNN(len(vocab) + 2, args.embed, args.channels, len(LANGS))
    opt = optim.AdamW(model.named_parameters(), lr=args.lr, weight_decay=args.weight_decay)
    schedule = CosineAnnealingLR(opt, T_max=args.steps)
    print(f"{len(train_x)} training and {len(dev_x)} dev sentences, {len(vocab)} characters; "
          f"{model.num_parameters():,} parameters")

    order, pos, smoothed = rng.permutation(len(train_x)), 0, None
    for step in range(args.steps):
        if pos + args.batch_size > len(order):
            order, pos = rng.permutation(len(train_x)), 0
        batch = order[pos:pos + args.batch_size]
        pos += args.batch_size
        loss = F.cross_entropy(model(train_x[batch]), train_y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        schedule.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % args.log_interval == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {smoothed:.4f}  lr {schedule.get_last_lr()[0]:.2e}  "
                  f"{time.perf_counter() - start:5.1f}s")

    pred = predict(model, dev_x)
    accuracy = float((pred == dev_y).mean())
    seconds = time.perf_counter() - start
    print(f"dev accuracy {accuracy:.4f} ({int((pred == dev_y).sum())}/{len(dev_y)}), "
          f"chance 0.5, {seconds:.1f}s in all")
    return {"dev_accuracy": accuracy, "train_loss": smoothed, "seconds": seconds,
            "parameters": model.num_parameters()}


if __name__ == "__main__":
    main()
