"""Language identification with tinytf: is a sentence English or German?

    python examples/classifier.py              # well under a minute on a CPU

The shipped corpus gives 12,098 training sentences in each language (``data/ende/train.*``)
and 500 in each for development (``dev.*``). Each sentence becomes a bag of its character
n-grams (n = 1, 2, 3, with the sentence padded by spaces so word beginnings and endings
count), each n-gram hashed into one of ``--buckets`` rows of an embedding table (the
"hashing trick": no vocabulary to build, unseen n-grams still get a row). The model averages
the rows of a sentence's n-grams and classifies the average with a one-hidden-layer MLP:

    p(language | sentence) = softmax(W_2 relu(W_1 mean_i E[hash(ngram_i)] + b_1) + b_2)

This is fastText's classifier (Joulin et al. 2017) with a hidden layer. It is built from
``nn.Embedding``, ``nn.Linear``, ``F.relu``, ``F.cross_entropy`` and ``optim.Adam``; the
mean over a ragged batch is a product with a weight matrix (1/length at real n-grams,
0 at padding) followed by a sum, so padding never needs a special op.
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

DATA_DIR = Path(__file__).resolve().parent.parent / "data" / "ende"
LANGS = ("en", "de")                  # class 0, class 1
# Odd multipliers for a polynomial hash of the n characters (any distinct odd numbers do).
_MULTIPLIERS = np.array([1_000_003, 998_244_353, 1_234_567_891], dtype=np.int64)


# --------------------------------------------------------------------------------------
# Features: hashed character n-grams
# --------------------------------------------------------------------------------------

def ngram_ids(sentence: str, buckets: int, orders=(1, 2, 3)) -> np.ndarray:
    """Ids in [1, buckets) of the sentence's character n-grams; id 0 is kept for padding.

    The hash is a fixed polynomial of the code points (not Python's ``hash``, which changes
    from one process to the next), with the order n mixed in so that "e" and "e " differ.
    """
    codes = np.frombuffer(f" {sentence} ".encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    ids = []
    for n in orders:
        if len(codes) < n:
            continue
        h = np.full(len(codes) - n + 1, n, dtype=np.int64)
        for j in range(n):
            h = h * _MULTIPLIERS[j] + codes[j:len(codes) - n + 1 + j]
            h %= 2_147_483_647        # keep the products inside int64
        ids.append(h % (buckets - 1) + 1)
    return np.concatenate(ids)


def load_split(data_dir: Path, split: str, buckets: int) -> tuple[list, np.ndarray, list]:
    """(n-gram id arrays, labels (N,), sentences) of ``split`` in both languages."""
    features, labels, sentences = [], [], []
    for label, lang in enumerate(LANGS):
        path = Path(data_dir) / f"{split}.{lang}"
        if not path.is_file():
            raise FileNotFoundError(f"classifier.py: no data file {path} "
                                    "(see data/ende/README.md)")
        for line in path.read_text(encoding="utf-8").splitlines():
            features.append(ngram_ids(line, buckets))
            labels.append(label)
            sentences.append(line)
    return features, np.array(labels, dtype=np.int64), sentences


def pad_batch(features: list) -> tuple[np.ndarray, np.ndarray]:
    """Ids (B, L) padded with 0, and mean-pooling weights (B, L): 1/length, 0 at padding."""
    longest = max(len(f) for f in features)
    ids = np.zeros((len(features), longest), dtype=np.int64)
    weights = np.zeros((len(features), longest), dtype=np.float32)
    for i, f in enumerate(features):
        ids[i, :len(f)] = f
        weights[i, :len(f)] = 1.0 / len(f)
    return ids, weights


# --------------------------------------------------------------------------------------
# The model
# --------------------------------------------------------------------------------------

class BagOfNgrams(nn.Module):
    """Mean of hashed n-gram embeddings -> Linear -> ReLU -> Linear -> class logits."""

    def __init__(self, buckets: int, dim: int, hidden: int, n_classes: int):
        self.embed = nn.Embedding(buckets, dim, std=0.1)
        self.hidden = nn.Linear(dim, hidden)
        self.out = nn.Linear(hidden, n_classes)

    def forward(self, ids: np.ndarray, weights: np.ndarray) -> Tensor:
        """Logits (B, n_classes) for padded ids (B, L) with pooling weights (B, L)."""
        e = self.embed(ids)                                     # (B, L, D)
        pooled = (e * weights[:, :, None]).sum(axis=1)          # (B, D): the mean
        return self.out(F.relu(self.hidden(pooled)))            # (B, n_classes)


@tinytf.no_grad()
def predict(model: BagOfNgrams, features: list, batch_size: int = 500) -> np.ndarray:
    """Predicted class of every sentence (evaluation mode, no graph)."""
    model.eval()
    preds = [model(*pad_batch(features[i:i + batch_size])).data.argmax(axis=1)
             for i in range(0, len(features), batch_size)]
    model.train()
    return np.concatenate(preds)


# --------------------------------------------------------------------------------------
# Training
# --------------------------------------------------------------------------------------

def parse_args(argv=None) -> argparse.Namespace:
    """Command-line flags; the defaults are the under-a-minute CPU run."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--data-dir", type=Path, default=DATA_DIR,
                   help="directory with train.en, train.de, dev.en and dev.de")
    p.add_argument("--buckets", type=int, default=2 ** 14, help="rows of the hash table")
    p.add_argument("--dim", type=int, default=32, help="n-gram embedding size")
    p.add_argument("--hidden", type=int, default=64, help="width of the hidden layer")
    p.add_argument("--steps", type=int, default=300, help="optimizer updates")
    p.add_argument("--batch-size", type=int, default=64, help="sentences per update")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate (Adam)")
    p.add_argument("--train-limit", type=int, default=0,
                   help="use only this many training sentences per language (0 = all)")
    p.add_argument("--log-interval", type=int, default=50, help="updates between log lines")
    p.add_argument("--seed", type=int, default=1234, help="seed of weights and batches")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    """Train and evaluate. Returns {"dev_accuracy", "train_loss", "seconds", ...}."""
    args = parse_args(argv)
    tinytf.manual_seed(args.seed)
    rng = np.random.default_rng(args.seed)

    start = time.perf_counter()
    train_x, train_y, _ = load_split(args.data_dir, "train", args.buckets)
    if args.train_limit:
        keep = np.concatenate([np.flatnonzero(train_y == c)[:args.train_limit]
                               for c in range(len(LANGS))])
        train_x, train_y = [train_x[i] for i in keep], train_y[keep]
    dev_x, dev_y, dev_sentences = load_split(args.data_dir, "dev", args.buckets)
    print(f"{len(train_x)} training and {len(dev_x)} dev sentences, "
          f"featurised in {time.perf_counter() - start:.1f}s")

    model = BagOfNgrams(args.buckets, args.dim, args.hidden, len(LANGS))
    opt = optim.Adam(model.named_parameters(), lr=args.lr, betas=(0.9, 0.999), eps=1e-8)
    print(f"{model.num_parameters():,} parameters")

    order, pos, smoothed = rng.permutation(len(train_x)), 0, None
    for step in range(args.steps):
        if pos + args.batch_size > len(order):     # a new epoch: reshuffle
            order, pos = rng.permutation(len(train_x)), 0
        batch = order[pos:pos + args.batch_size]
        pos += args.batch_size
        logits = model(*pad_batch([train_x[i] for i in batch]))
        loss = F.cross_entropy(logits, train_y[batch])
        opt.zero_grad()
        loss.backward()
        opt.step()
        smoothed = loss.item() if smoothed is None else 0.95 * smoothed + 0.05 * loss.item()
        if step % args.log_interval == 0 or step == args.steps - 1:
            print(f"step {step:4d}  loss {smoothed:.4f}  {time.perf_counter() - start:5.1f}s")

    pred = predict(model, dev_x)
    accuracy = float((pred == dev_y).mean())
    seconds = time.perf_counter() - start
    print(f"dev accuracy {accuracy:.4f} ({int((pred == dev_y).sum())}/{len(dev_y)}), "
          f"chance 0.5, {seconds:.1f}s in all")
    wrong = np.flatnonzero(pred != dev_y)
    for i in wrong[:5]:
        print(f"  wrong: {LANGS[dev_y[i]]} taken for {LANGS[pred[i]]}: {dev_sentences[i]}")
    return {"dev_accuracy": accuracy, "train_loss": smoothed, "seconds": seconds,
            "parameters": model.num_parameters()}


if __name__ == "__main__":
    main()
