"""Shared by the MPI scripts and tests/distributed/test_distributed.py: tiny models, batches, steps.

The same ``train`` function runs under ``mpirun`` (each rank on its rows of every global
batch) and in the test process (one SingleCommunicator on all rows), so the comparison is
between two runs of one code path. Everything is float64, so that 1e-6 separates a real
difference from rounding.
"""
from __future__ import annotations

import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:  # scripts run as `python tests/mpi_scripts/x.py` from anywhere
    sys.path.insert(0, ROOT)

import tinytf  # noqa: E402
from tinytf import functional as F  # noqa: E402
from tinytf import nn, optim  # noqa: E402

VOCAB = 11
ROWS = 6          # rows of one global batch, split between the ranks
LR = 1e-2
MAX_NORM = 0.5    # small enough that clipping is active: it must see the global gradient


class TinyLM(nn.Module):
    """Embedding -> LayerNorm -> Linear -> ReLU -> Linear: next-token logits per position."""

    def __init__(self, vocab: int = VOCAB, d: int = 8):
        self.embed = nn.Embedding(vocab, d)
        self.norm = nn.LayerNorm(d)
        self.hidden = nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, vocab)

    def forward(self, ids):
        return self.out(F.relu(self.hidden(self.norm(self.embed(ids)))))


def build_model(kind: str, seed: int):
    """A float64 ``kind`` ("lm" or "transformer") model initialised from ``seed``."""
    tinytf.manual_seed(seed)
    if kind == "lm":
        model = TinyLM()
    elif kind == "transformer":
        from tinytf.models.transformer import Transformer, TransformerConfig  # noqa: PLC0415
        cfg = TransformerConfig.preset("tiny", vocab_size=VOCAB, d_model=16, n_heads=2,
                                       d_ff=32, n_encoder_layers=1, n_decoder_layers=1,
                                       dropout=0.0, max_len=32)
        model = Transformer(cfg)
    else:
        raise ValueError(f"unknown model kind {kind!r}")
    return model.astype(np.float64)


def _padded(rng, lengths):
    """Rows of random ids in [4, VOCAB) of the given lengths, right-padded with 0."""
    out = np.zeros((len(lengths), max(lengths)), dtype=np.int64)
    for i, n in enumerate(lengths):
        out[i, :n] = rng.integers(4, VOCAB, n)
    return out


def global_batch(step: int) -> dict:
    """Step ``step``'s batch of ROWS sentence pairs; later rows are longer, so the halves
    of the batch hold different numbers of target tokens (dividing by the number of ranks
    instead of the global token count would then give a different answer)."""
    rng = np.random.default_rng(100 + step)
    tgt_len = np.sort(rng.integers(2, 9, ROWS))
    src = _padded(rng, list(rng.integers(2, 9, ROWS)))
    tgt = _padded(rng, list(tgt_len))
    return {"src": src, "tgt": tgt}


def shard(batch: dict, rank: int, size: int) -> dict:
    """Rank ``rank``'s contiguous share of the rows."""
    return {k: np.array_split(v, size)[rank] for k, v in batch.items()}


def loss_sum(model, kind: str, batch: dict):
    """(summed token loss Tensor, number of target tokens) on ``batch``."""
    tgt = batch["tgt"]
    if kind == "lm":
        logits = model(tgt[:, :-1])
        target = tgt[:, 1:]
    else:
        from tinytf.models.transformer import label_smoothed_loss  # noqa: PLC0415
        bos = np.ones((tgt.shape[0], 1), dtype=tgt.dtype)
        return label_smoothed_loss(model(batch["src"], np.concatenate([bos, tgt[:, :-1]], 1)),
                                   tgt, eps=0.1)
    v = logits.shape[-1]
    loss = F.cross_entropy(logits.reshape(-1, v), target.reshape(-1), label_smoothing=0.1,
                           ignore_index=0, reduction="sum")
    return loss, int((target != 0).sum())


def train(model, kind: str, comm, steps: int, *, per_rank_mean: bool = False,
          on_grads=None, on_step=None) -> None:
    """``steps`` Adam steps, each rank on its share of ``global_batch(step)``.

    The recipe of train.py: summed loss, backward, all-reduce, scale by 1 / global token
    count, clip the (global) gradient norm, step. ``per_rank_mean`` is the wrong recipe
    (each rank divides by its own count, the sum is divided by the number of ranks) that
    the tests use as a negative control. ``on_grads(step)`` runs once the gradients are
    final (before clipping; Adam alone would hide a wrong global scale), ``on_step(step)``
    after every step.
    """
    opt = optim.Adam(model.named_parameters(), lr=LR)
    for step in range(1, steps + 1):
        batch = shard(global_batch(step), comm.rank, comm.size)
        opt.zero_grad()
        loss, tokens = loss_sum(model, kind, batch)
        loss.backward()
        if per_rank_mean:  # mean over my tokens, then mean over ranks
            for _, p in model.named_parameters():
                p.grad = p.grad / tokens
            comm.allreduce_grads(model, scale=1.0 / comm.size)
        else:
            total = comm.allreduce_scalars([tokens])[0]
            comm.allreduce_grads(model, scale=1.0 / total)
        if on_grads is not None:
            on_grads(step)
        optim.clip_grad_norm(model.named_parameters(), MAX_NORM)
        opt.step()
        if on_step is not None:
            on_step(step)


def grads(model) -> dict:
    """{name: copy of the gradient} (zeros where there is none)."""
    return {n: np.zeros(p.shape) if p.grad is None else np.array(p.grad)
            for n, p in model.named_parameters()}


def save_params(model, path: str) -> None:
    """The parameters as an npz of name -> array."""
    np.savez(path, **model.state_dict())
