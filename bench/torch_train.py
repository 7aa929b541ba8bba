#!/usr/bin/env python
"""Train the same Transformer in PyTorch, as the reference for bench/quality.py.

The model is ``bench/torch_transformer.TorchTransformer``, initialised with tinytf's initial
weights (Xavier-uniform d x d blocks with zero biases, embeddings N(0, d^-0.5), the same
seed), trained on tinytf's token batches (``tinytf.data.batches.BatchIterator``: the same pairs, the
same order) with ``torch.optim.Adam(0.9, 0.98, 1e-9)`` (or ``RAdam``: ``--optimizer``),
label-smoothed cross-entropy per target token, a schedule from ``tinytf.optim.schedule`` (the
paper's by default) and dropout from ``--dropout-from-epoch`` on. Only the training
framework differs: the trained weights are copied back into a tinytf checkpoint and decoded
by tinytf (greedy and beam 4), so BLEU compares what each framework learnt, not two
decoders. Prints one JSON line like train.py's.

    python bench/torch_train.py --out runs/torch-ref --max-minutes 10
    python bench/torch_train.py --out runs/torch-ref --max-steps 300 --dropout 0 --log-losses

Not part of tinytf; needs torch.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from torch_transformer import TorchTransformer, label_smoothed_loss, load_tinytf_state  # noqa: E402

from tinytf.data.batches import BatchIterator, ParallelCorpus, read_parallel  # noqa: E402
from tinytf.decoding.translation import SearchOptions, Translator  # noqa: E402
from tinytf.engine import backend  # noqa: E402
from tinytf.models.transformer import Transformer, TransformerConfig  # noqa: E402
from tinytf.optim.adam import radam_rectifier  # noqa: E402
from tinytf.optim.schedule import Schedule  # noqa: E402
from tinytf.text import BPE  # noqa: E402
from tinytf.training.evaluate import bleu, greedy_translate  # noqa: E402
from tinytf.utils import checkpoint


def parse_args(argv=None):
    """The reference's options: the paper's recipe for ``tiny`` on a CPU budget by default."""
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", default="data/ende")
    p.add_argument("--src", default="en")
    p.add_argument("--tgt", default="de")
    p.add_argument("--out", required=True, help="run directory (bpe.json is reused if there)")
    p.add_argument("--config", default="tiny")
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--max-tokens", type=int, default=4096)
    p.add_argument("--lr-schedule", default="noam", choices=["noam", "inverse_sqrt", "linear"])
    p.add_argument("--lr-factor", type=float, default=1.0, help="noam's factor")
    p.add_argument("--lr", type=float, default=None, help="peak (inverse_sqrt, linear)")
    p.add_argument("--warmup", type=int, default=1000)
    p.add_argument("--max-minutes", type=float, default=None)
    p.add_argument("--max-steps", type=int, default=None)
    p.add_argument("--dropout", type=float, default=0.1,
                   help="P_drop of the sub-layers and embeddings (default: the paper's 0.1)")
    p.add_argument("--dropout-from-epoch", type=int, default=1,
                   help="train without dropout before this epoch (tinytf's late dropout; "
                        "default 1: dropout from the start, the paper's)")
    p.add_argument("--optimizer", default="adam", choices=["adam", "radam"],
                   help="adam: the paper's; radam: torch.optim.RAdam with the same betas and "
                        "eps, no step while tinytf's rectifier is 0 (tinytf's tiny default)")
    p.add_argument("--pre-norm", action="store_true", help="pre-LN (default: the paper's post-LN)")
    p.add_argument("--qk-norm", action="store_true",
                   help="LayerNorm of queries and keys (default: the paper's attention)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads")
    p.add_argument("--log-losses", action="store_true",
                   help="write every update's loss to OUT/losses.json (for parity checks)")
    p.add_argument("--no-test", action="store_true", help="skip dev/test decoding")
    args = p.parse_args(argv)
    if not args.max_minutes and not args.max_steps:
        args.max_minutes = 10.0
    return args


def build(args):
    """BPE, corpus, batches and the two models (tinytf's initial weights in both)."""
    os.makedirs(args.out, exist_ok=True)
    train_paths = [os.path.join(args.data, f"train.{lang}") for lang in (args.src, args.tgt)]
    bpe_path = os.path.join(args.out, "bpe.json")
    if not os.path.isfile(bpe_path):
        BPE.learn(train_paths, vocab_size=args.vocab_size).save(bpe_path)
    bpe = BPE.load(bpe_path)
    overrides = {"vocab_size": len(bpe), "pre_norm": args.pre_norm, "qk_norm": args.qk_norm,
                 "dropout": args.dropout}
    cfg = TransformerConfig.preset(args.config, **overrides)
    corpus = ParallelCorpus(*read_parallel(*train_paths), bpe, max_len=128)
    batches = BatchIterator(corpus, args.max_tokens, seed=args.seed)
    backend.manual_seed(args.seed)
    tt_model = Transformer(cfg)
    torch.manual_seed(args.seed)
    model = TorchTransformer(cfg)
    load_tinytf_state(model, tt_model.state_dict())
    return bpe, bpe_path, cfg, batches, tt_model, model


def train(args, cfg, batches, model) -> dict:
    """The loop: batch -> forward -> loss per target token -> backward -> Adam or RAdam (no
    clipping); dropout from epoch ``--dropout-from-epoch`` on."""
    if args.lr_schedule == "noam":
        schedule = Schedule("noam", args.warmup, factor=args.lr_factor, d_model=cfg.d_model)
    else:
        schedule = Schedule(args.lr_schedule, args.warmup, peak=args.lr)
    optimizer = torch.optim.RAdam if args.optimizer == "radam" else torch.optim.Adam
    betas = (0.9, 0.98)
    opt = optimizer(model.parameters(), lr=0.0, betas=betas, eps=1e-9)
    budget = args.max_minutes * 60 if args.max_minutes else float("inf")
    t0, step, tokens, losses = time.perf_counter(), 0, 0, []

    def batch_stream():
        while True:
            yield from batches

    for batch in batch_stream():
        model.train(batches.epoch >= args.dropout_from_epoch)   # eval mode: no dropout
        elapsed = time.perf_counter() - t0
        if (args.max_steps and step >= args.max_steps) or elapsed >= budget:
            break
        spent = max((step / args.max_steps) if args.max_steps else 0.0, elapsed / budget)
        lr = schedule(step + 1, min(spent, 1.0))
        if args.optimizer == "radam" and radam_rectifier(step + 1, betas[1]) == 0.0:
            lr = 0.0   # tinytf takes no step here; PyTorch's RAdam would take an SGD step
        for group in opt.param_groups:
            group["lr"] = lr
        src, tgt_in, tgt_out = (torch.from_numpy(np.asarray(a, dtype=np.int64))
                                for a in (batch.src, batch.tgt_in, batch.tgt_out))
        loss = label_smoothed_loss(model(src, tgt_in), tgt_out, cfg.label_smoothing)
        opt.zero_grad(set_to_none=True)
        (loss / batch.n_tgt_tokens).backward()
        opt.step()
        step += 1
        tokens += batch.n_tgt_tokens
        losses.append(float(loss.detach()) / batch.n_tgt_tokens)
        if step % 50 == 0:
            print(f"torch step {step} | loss {np.mean(losses[-50:]):.3f} | lr "
                  f"{opt.param_groups[0]['lr']:.2e} | tok/s {tokens / elapsed:,.0f} | elapsed "
                  f"{elapsed:.0f}s", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - t0
    return {"steps": step, "target_tokens": tokens, "train_seconds": round(seconds, 1),
            "target_tokens_per_s": round(tokens / seconds, 1), "losses": losses}


def evaluate(args, bpe, tt_model, model) -> dict:
    """Dev and test BLEU of the trained weights, decoded by tinytf (greedy and beam 4)."""
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    tt_model.load_state_dict({k: state[k] for k in tt_model.state_dict()})
    tt_model.eval()
    out = {}
    dev_src, dev_ref = read_parallel(*(os.path.join(args.data, f"dev.{x}")
                                       for x in (args.src, args.tgt)))
    out["dev_bleu"] = round(bleu(greedy_translate(tt_model, bpe, dev_src), dev_ref), 2)
    test_src, test_ref = read_parallel(*(os.path.join(args.data, f"test.{x}")
                                         for x in (args.src, args.tgt)))
    out["test_bleu_greedy"] = round(bleu(greedy_translate(tt_model, bpe, test_src), test_ref), 2)
    hyps = [n[0][0] for n in Translator(tt_model, bpe).translate_lines(test_src, SearchOptions())]
    out["test_bleu_beam"] = round(bleu(hyps, test_ref), 2)
    out["test_bleu"] = out["test_bleu_beam"]
    return out


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    bpe, bpe_path, cfg, batches, tt_model, model = build(args)
    result = train(args, cfg, batches, model)
    losses = result.pop("losses")
    if args.log_losses:
        with open(os.path.join(args.out, "losses.json"), "w") as f:
            json.dump(losses, f)
    if not args.no_test:
        result.update(evaluate(args, bpe, tt_model, model))
        path = os.path.join(args.out, "checkpoint_torch.npz")
        checkpoint.save(path, tt_model.state_dict(), meta={
            "step": result["steps"], "model_config": cfg.to_dict(),
            "bpe": {"file": "bpe.json", "sha256": checkpoint.sha256_file(bpe_path)}})
        result["checkpoint"] = path
    result.update(framework="torch", threads=torch.get_num_threads(), recipe=vars(args))
    print(json.dumps(result, sort_keys=True), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
