"""Where a search's time goes: the shares of docs/decoding.md, "Where the time goes".

    python bench/decode_profile.py --model RUN [--threads 1] [--sentences N]

Runs, each once to warm up, once timed and once under ``cProfile``: the beam search of
``translate.py`` (``Translator.translate_lines``, beam 4, batches of 64) and the same with
one slot (beam 1) over the shipped test sentences, and validation's greedy search
(``evaluate.greedy_translate``, batches of 100) over the dev sentences. Each function's own
time goes to the part of the search whose code it is (the table ``PARTS``); NumPy's calls
count for the function that made them. What belongs to none of them is the Python of the
search, the engine and the layers.
"""
from __future__ import annotations

import argparse
import cProfile
import inspect
import os
import pstats
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a trained run directory or checkpoint")
    p.add_argument("--threads", type=int, default=1, help="BLAS and row threads")
    p.add_argument("--sentences", type=int, default=1000, help="first N test sentences")
    return p.parse_args(argv)


ARGS = parse_args() if __name__ == "__main__" else None
if ARGS is not None:
    for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "TINYTF_THREADS"):
        os.environ[var] = str(ARGS.threads)  # must precede the BLAS libraries' loading

sys.path.insert(0, ROOT)

from tinytf.decoding import search
from tinytf.decoding.translation import SearchOptions, Translator, read_text_lines  # noqa: E402
from tinytf.fast.cpu import ops as cpu  # noqa: E402
from tinytf.fast.cuda.kernels import gemm  # noqa: E402
from tinytf.models import decoder_state  # noqa: E402
from tinytf.ops import attention, matmul, norm, softmax  # noqa: E402
from tinytf.training.evaluate import greedy_translate  # noqa: E402

PARTS = [  # (part, code objects): the first that holds a function's line takes it
    ("linear layers' products", [cpu.RowParallelLinear.product, matmul.Linear.product]),
    ("bias and ReLU passes", [cpu.RowParallelLinear, matmul.Linear.add_bias]),
    ("attention: products, masked softmax", [attention, cpu.RowParallelAttention, gemm]),
    ("layer norm", [norm, cpu.RowParallelLayerNorm, cpu.affine_grouped_]),
    ("log-softmax over the vocabulary", [softmax]),
    ("top-k of the beam's candidates", [search.top_k, search.top_k_by_bound]),
    ("decoder state: caches and their reordering", [decoder_state]),
]
REST = "the rest: Python of the search, the engine, the layers"


def _spans():
    spans = []
    for part, objects in PARTS:
        for obj in objects:
            lines, first = inspect.getsourcelines(obj)
            path = os.path.realpath(inspect.getsourcefile(obj))
            spans.append((path, first or 1, (first or 1) + len(lines), part))
    return spans


SPANS = _spans()


def part_of(file: str, line: int) -> str | None:
    """The part whose code holds ``file``'s ``line``, None for a builtin, else REST."""
    if file == "~":
        return None
    file = os.path.realpath(file)
    for path, first, end, part in SPANS:
        if first <= line < end and path == file:
            return part
    return REST


def shares(run) -> tuple[float, dict]:
    """Seconds of ``run()`` without the profiler, and {part: profiled seconds}."""
    run()
    start = time.perf_counter()
    run()
    plain = time.perf_counter() - start
    profile = cProfile.Profile()
    profile.enable()
    run()
    profile.disable()
    parts: dict = {}
    for (file, line, _), (_, _, own, _, callers) in pstats.Stats(profile).stats.items():
        part = part_of(file, line)
        if part is not None:
            parts[part] = parts.get(part, 0.0) + own
            continue
        for (c_file, c_line, _), edge in callers.items():   # a builtin: its callers' parts
            caller = part_of(c_file, c_line) or REST
            parts[caller] = parts.get(caller, 0.0) + edge[2]
    return plain, parts


def main(args):
    translator = Translator.load(args.model)
    test = read_text_lines(os.path.join(ROOT, "data", "ende", "test.en"))[:args.sentences]
    dev = read_text_lines(os.path.join(ROOT, "data", "ende", "dev.en"))
    runs = {
        "beam 4": lambda: translator.translate_lines(test, SearchOptions(beam_size=4)),
        "beam 1": lambda: translator.translate_lines(test, SearchOptions(beam_size=1)),
        "validation (greedy)": lambda: greedy_translate(translator.model, translator.bpe, dev),
    }
    print(f"model {args.model}; {len(test)} test sentences, {len(dev)} dev sentences; "
          f"{args.threads} thread(s)")
    results = {name: shares(run) for name, run in runs.items()}
    print("| share of the time | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for part in [p for p, _ in PARTS] + [REST]:
        cells = []
        for plain, parts in results.values():
            cells.append(f"{100 * parts.get(part, 0.0) / sum(parts.values()):.0f} %")
        print(f"| {part} | " + " | ".join(cells) + " |")
    print("| seconds without the profiler | "
          + " | ".join(f"{plain:.2f}" for plain, _ in results.values()) + " |")


if __name__ == "__main__":
    main(ARGS)
