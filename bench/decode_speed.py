"""Decoding speed: tinytf's batched beam search vs PyTorch with a key/value cache, and what the
cache saves over recomputing the whole prefix at every step.

    env -u OPENBLAS_CORETYPE -u OPENBLAS_L2_SIZE python bench/decode_speed.py [--model RUNDIR]

Without ``--model`` it first trains one: ``train.py --max-steps N`` (``--train-updates``,
default 1,000 updates of the default recipe, about 11 minutes on two cores) into
runs/decode-bench-N, reused by later runs. ``--random`` instead learns an 8k BPE on
data/ende/train.* and decodes with a randomly initialised model of the ``tiny`` preset (a
random model rarely says ``</s>``, so most sentences run to the maximum length, source + 50: a
worst case for the search). Both implementations get the same weights, the same length-sorted
batches and the same search rules (beam 4, alpha 0.6), so they take the same steps; the script
also reports how often their outputs agree. Figures go into docs/benchmarks.md ("Decoding
speed").
"""
from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a trained run directory or checkpoint")
    p.add_argument("--train-updates", type=int, default=1000,
                   help="without --model: train the default recipe for N updates first "
                        "(runs/decode-bench-N, reused when it exists)")
    p.add_argument("--random", action="store_true",
                   help="decode with a randomly initialised model instead")
    p.add_argument("--preset", default="tiny", help="model size with --random")
    p.add_argument("--vocab", type=int, default=8000, help="BPE size with --random")
    p.add_argument("--sentences", type=int, default=1000, help="first N lines of test.en")
    p.add_argument("--recompute-sentences", type=int, default=64,
                   help="sentences for the cache vs full-recomputation comparison")
    p.add_argument("--beam", type=int, default=4)
    p.add_argument("--alpha", type=float, default=0.6)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=2, help="BLAS / torch threads for both")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-torch", action="store_true", help="skip the PyTorch run")
    p.add_argument("--workers", type=int, default=0,
                   help="also time the whole set with tinytf's batches in N processes "
                        "(translate.py --workers N) against PyTorch's one process of --threads "
                        "threads, alternated twice (default: 0, not run)")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
ENVIRONMENT = dict(os.environ)  # before the thread settings below: train.py runs with it
if ARGS is not None:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(ARGS.threads)  # must precede the BLAS libraries' loading
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")  # as the commands set it

import numpy as np  # noqa: E402

sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "bench"))

import tinytf  # noqa: E402
import tinytf.fast.cpu.memory  # noqa: E402

tinytf.fast.cpu.memory.keep_by_default()   # as the commands do: freed memory kept
from tinytf.decoding.search import beam_search  # noqa: E402
from tinytf.decoding.translation import (  # noqa: E402
    PrefixState,
    SearchOptions,
    Translator,
    full_prefix_step,
    make_batches,
    pad_sources,
    read_text_lines,
)
from tinytf.models.transformer import Transformer, TransformerConfig  # noqa: E402
from tinytf.text import BPE  # noqa: E402

DATA = os.path.join(ROOT, "data", "ende")


def trained_model(updates: int) -> str:
    """The run directory of the default recipe trained for ``updates`` updates (trained now
    with train.py unless an earlier run of this benchmark left it)."""
    run = os.path.join(ROOT, "runs", f"decode-bench-{updates}")
    if not os.path.exists(os.path.join(run, "checkpoint_last.npz")):
        command = [sys.executable, os.path.join(ROOT, "train.py"), "--out", run,
                   "--max-steps", str(updates)]
        print("training the model to decode with:", " ".join(command), flush=True)
        subprocess.run(command, cwd=ROOT, check=True, env=ENVIRONMENT)
    return run


def build_translator(args) -> Translator:
    if not args.random:
        args.model = args.model or trained_model(args.train_updates)
        return Translator.load(args.model)
    bpe = BPE.learn([os.path.join(DATA, "train.en"), os.path.join(DATA, "train.de")],
                    vocab_size=args.vocab)
    tinytf.manual_seed(args.seed)
    config = TransformerConfig.preset(args.preset, vocab_size=len(bpe), dropout=0.0)
    return Translator(Transformer(config), bpe)


def decode_tinytf(translator, sources, options, step="cache"):
    """Best token lists for one batch: the Translator's own search (the cached decoder,
    as translate.py runs it), or the same search recomputing the whole prefix each step."""
    if step == "cache":
        results = translator.translate_batch(sources, options)
    else:
        model = translator.model
        src = pad_sources(sources)
        max_lens = translator.max_output_lens([len(s) for s in sources], options)
        with tinytf.no_grad():
            results = beam_search(full_prefix_step(model), PrefixState(model.encode(src), src),
                                  len(sources), max_lens, beam_size=options.beam_size,
                                  alpha=options.alpha, banned_ids=(0, 1, 3))
    return [list(nbest[0].tokens) for nbest in results]


def decode_torch(decoder, translator, sources, options):
    """The same batch with bench/torch_decode.py."""
    import torch
    from torch_decode import torch_beam_search

    src = torch.from_numpy(pad_sources(sources))
    max_lens = translator.max_output_lens([len(s) for s in sources], options)
    return torch_beam_search(decoder, src, max_lens, options.beam_size, options.alpha)


def count_rows(translator, torch_decoder=None) -> dict:
    """From now on, count the rows (hypotheses) that each decoder's step computes: tinytf's
    leaves out hypotheses that ended, the PyTorch reference keeps a sentence's whole beam.
    Returns the dict of counts, updated as the steps run (one addition per step)."""
    rows = {"tinytf": 0}
    steps = {"tinytf": (translator.model, "decode_step")}
    if torch_decoder is not None:
        rows["torch"] = 0
        steps["torch"] = (torch_decoder, "step")
    for name, (owner, method) in steps.items():
        def counted(tokens, state, name=name, step=getattr(owner, method)):
            rows[name] += len(tokens)
            return step(tokens, state)
        setattr(owner, method, counted)
    return rows


def race(contestants, sources, batches):
    """Run every contestant on every batch, alternating per batch so that both see the same
    machine load; returns {name: (outputs in input order, wall seconds, CPU seconds)}."""
    outputs = {name: [None] * len(sources) for name in contestants}
    wall = dict.fromkeys(contestants, 0.0)
    cpu = dict.fromkeys(contestants, 0.0)
    for batch in batches:
        for name, fn in contestants.items():
            w, c = time.perf_counter(), time.process_time()
            result = fn([sources[i] for i in batch])
            wall[name] += time.perf_counter() - w
            cpu[name] += time.process_time() - c
            for i, toks in zip(batch, result):
                outputs[name][i] = toks
    return {name: (outputs[name], wall[name], cpu[name]) for name in contestants}


def race_workers(contestants, translator, sources, batches, options, workers, expected,
                 batch_size, threads):
    """The whole set, twice, alternating: tinytf's batches in ``workers`` processes
    (:mod:`tinytf.decoding.workers`), then each other contestant's batches in turn, in one
    process; prints sentences/s and the ratio, and checks tinytf's outputs."""
    index = [list(b) for b in batches]
    runs = {"tinytf workers": lambda: [list(nbest[0].tokens) for nbest in translator.translate_ids(
        sources, options, batch_size=batch_size, workers=workers)]}
    for name, fn in contestants.items():
        if name != "tinytf":
            runs[name] = lambda fn=fn: [t for b in index for t in fn([sources[i] for i in b])]
    wall = dict.fromkeys(runs, 0.0)
    for _ in range(2):
        for name, fn in runs.items():
            start = time.perf_counter()
            out = fn()
            wall[name] += time.perf_counter() - start
            if name == "tinytf workers":
                assert out == expected, "worker processes changed the translations"
    n = 2 * len(sources)
    line = ", ".join(f"{name} {n / t:.2f} sentences/s" for name, t in wall.items())
    print(f"whole set, tinytf in {workers} processes: {line}", flush=True)
    if "torch" in wall:
        print(f"tinytf ({workers} processes) / torch ({threads} threads) speed: "
              f"{wall['torch'] / wall['tinytf workers']:.2f}x wall", flush=True)


def main(args):
    translator = build_translator(args)
    config = translator.model.config
    options = SearchOptions(beam_size=args.beam, alpha=args.alpha)
    lines = read_text_lines(os.path.join(DATA, "test.en"))[: args.sentences]
    sources = [s for s in translator.encode_lines(lines, "test.en") if s]
    batches = make_batches([len(s) for s in sources], batch_size=args.batch_size)
    print(f"model: {'trained ' + args.model if args.model else 'random ' + args.preset} "
          f"(d_model={config.d_model}, layers={config.n_encoder_layers}+{config.n_decoder_layers},"
          f" vocab={config.vocab_size}); {len(sources)} sentences, beam {args.beam}, "
          f"batch {args.batch_size}", flush=True)
    print(f"python {platform.python_version()}, numpy {np.__version__}, "
          f"OPENBLAS_CORETYPE={os.environ.get('OPENBLAS_CORETYPE', '(unset)')}, "
          f"{args.threads} threads, freed memory kept: {tinytf.fast.cpu.memory.kept()}", flush=True)

    contestants = {"tinytf": lambda b: decode_tinytf(translator, b, options)}
    decoder = None
    if not args.no_torch:
        import torch

        torch.set_num_threads(args.threads)
        from torch_decode import TorchIncrementalDecoder
        from torch_transformer import TorchTransformer, load_tinytf_state

        tmodel = TorchTransformer(config)
        load_tinytf_state(tmodel, translator.model.state_dict())
        decoder = TorchIncrementalDecoder(tmodel)
        contestants["torch"] = lambda b: decode_torch(decoder, translator, b, options)
        print(f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)
    race(contestants, sources[:8], [np.arange(8)])  # warm-up
    rows = count_rows(translator, decoder)
    res = race(contestants, sources, batches)
    print("rows the decoder computed: " + ", ".join(f"{name} {n:,}" for name, n in rows.items()))
    ours, t_ours, c_ours = res["tinytf"]
    print(f"tinytf, cache: {len(sources) / t_ours:7.2f} sentences/s ({t_ours:.1f} s wall, "
          f"{c_ours:.1f} s CPU; mean output {np.mean([len(t) for t in ours]):.1f} tokens)")
    if "torch" in res:
        theirs, t_torch, c_torch = res["torch"]
        agree = np.mean([a == b for a, b in zip(ours, theirs)])
        print(f"torch,  cache: {len(sources) / t_torch:7.2f} sentences/s ({t_torch:.1f} s wall, "
              f"{c_torch:.1f} s CPU)")
        print(f"tinytf / torch speed: {t_torch / t_ours:.2f}x wall, {c_torch / c_ours:.2f}x CPU;"
              f" identical outputs: {agree:.1%}", flush=True)

    if args.workers > 0:
        race_workers(contestants, translator, sources, batches, options, args.workers, ours,
                     args.batch_size, args.threads)
    if args.recompute_sentences <= 0:
        return
    sub = sources[: args.recompute_sentences]
    sub_batches = make_batches([len(s) for s in sub], batch_size=args.batch_size)
    res = race({"cache": lambda b: decode_tinytf(translator, b, options),
                "full": lambda b: decode_tinytf(translator, b, options, step="full")},
               sub, sub_batches)
    (cached, t_cache, c_cache), (full, t_full, c_full) = res["cache"], res["full"]
    print(f"first {len(sub)} sentences: cache {t_cache:.1f} s, full recomputation {t_full:.1f} s"
          f" wall -> cache speed-up {t_full / t_cache:.1f}x wall, {c_full / c_cache:.1f}x CPU; "
          f"identical outputs: {np.mean([a == b for a, b in zip(cached, full)]):.1%}", flush=True)


if __name__ == "__main__":
    main(ARGS)
