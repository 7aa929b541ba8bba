"""Corpora of WMT size: BPE learning, preparation, start-up time and memory at N pairs.

    python bench/data_scale.py --pairs 1000000 4500000 [--workers 1 2] [--vocab-size 8000]

For each N it builds (once, cached under --workdir) a synthetic parallel corpus of N pairs
from the shipped one: each line joins 1 to 4 random shipped sentences (the same ones on both
sides), and three lines in ten start with a made-up name (the same on both sides), so lines
are long (about 120 bytes a side, 1.1 GB at 4.5M pairs), all distinct, and the vocabulary keeps
growing with N as a real corpus's does. Then, each step a whole process as a user runs it:

1. ``tinytf-bpe learn`` of the joint BPE (``--workers`` processes counting words);
2. ``tinytf-prepare`` with the BPE given, once per ``--workers`` value (the encoding);
3. ``train.py --max-steps 1`` on the prepared run directory, and again with ``--resume``:
   the seconds from the process's start to its first update's log line;
4. in one process, the corpus's private memory (RssAnon, /proc/self/status) after opening
   the prepared corpus, building the batches and collating a whole epoch's first 100
   batches, against the goal of 2 bytes per token (the mapped files are page cache, shared by
   every rank on a node);
5. ``mpirun -n 2 train.py --max-steps 1`` on a fresh run directory holding only the BPE
   (one preparation by rank 0, two maps), when mpirun is present.

Peak memory is the largest resident set of the step's processes (``wait4``'s ``ru_maxrss``:
the process and its workers). The figures go to stdout as a table; docs/benchmarks.md holds
the latest.
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

DATA = os.path.join(ROOT, "data", "ende")


def build_corpus(n: int, out_dir: str, seed: int = 0) -> None:
    """N synthetic pairs in out_dir/train.{en,de} (and the shipped dev/test beside them)."""
    if os.path.isfile(os.path.join(out_dir, "done")):
        return
    os.makedirs(out_dir, exist_ok=True)
    en = open(os.path.join(DATA, "train.en"), encoding="utf-8").read().splitlines()
    de = open(os.path.join(DATA, "train.de"), encoding="utf-8").read().splitlines()
    rng = np.random.default_rng(seed)
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    block = 100_000
    with open(os.path.join(out_dir, "train.en"), "w", encoding="utf-8") as fe, \
            open(os.path.join(out_dir, "train.de"), "w", encoding="utf-8") as fd:
        for start in range(0, n, block):
            m = min(block, n - start)
            k = rng.integers(1, 5, m)
            picks = rng.integers(0, len(en), (m, 4))
            named = rng.random(m) < 0.3
            name_len = rng.integers(5, 10, m)
            chars = letters[rng.integers(0, 26, (m, 9))]
            lines_en, lines_de = [], []
            for i in range(m):
                idx = picks[i, :k[i]]
                e = " ".join(en[j] for j in idx)
                d = " ".join(de[j] for j in idx)
                if named[i]:
                    name = "".join(chars[i, :name_len[i]]).capitalize()
                    e, d = f"{name}: {e}", f"{name}: {d}"
                lines_en.append(e)
                lines_de.append(d)
            fe.write("\n".join(lines_en) + "\n")
            fd.write("\n".join(lines_de) + "\n")
    for split in ("dev", "test"):
        for lang in ("en", "de"):
            shutil.copy(os.path.join(DATA, f"{split}.{lang}"), out_dir)
    open(os.path.join(out_dir, "done"), "w").close()


def run(cmd, env=None, first_line=None):
    """Run ``cmd``; returns (seconds, peak RSS in MB, seconds to the first stderr line that
    starts with ``first_line`` or None, stderr)."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, env=env)
    first, lines = None, []
    for line in proc.stderr:
        lines.append(line)
        if first is None and first_line and line.startswith(first_line):
            first = time.perf_counter() - t0
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{''.join(lines[-20:])}")
    return seconds, usage.ru_maxrss / 1024, first, "".join(lines)


def corpus_memory(run_dir: str, max_tokens: int) -> dict:
    """Private memory of opening the prepared corpus and batching it, in a fresh process."""
    code = f"""
import json, sys
sys.path.insert(0, {ROOT!r})
from tinytf.data.corpus_file import open_corpus
from tinytf.data.batches import BatchIterator
def anon():
    for line in open("/proc/self/status"):
        if line.startswith("RssAnon:"):
            return int(line.split()[1]) * 1024
before = anon()
corpus = open_corpus({os.path.join(run_dir, "corpus")!r})
batches = BatchIterator(corpus, {max_tokens}, seed=1)
opened = anon()
it = iter(batches)
for _ in range(100):
    next(it)
print(json.dumps({{"pairs": len(corpus), "tokens": int(corpus.src_lengths.sum() +
                  corpus.tgt_lengths.sum()), "opened": opened - before,
                  "batching": anon() - before, "batches": batches.n_batches}}))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    return json.loads(out.stdout)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pairs", type=int, nargs="+", default=[1_000_000, 4_500_000])
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    p.add_argument("--vocab-size", type=int, default=8000)
    p.add_argument("--workdir", default="/tmp/tinytf-data-scale")
    p.add_argument("--skip-mpi", action="store_true")
    args = p.parse_args()
    py = sys.executable
    rows = []
    for n in args.pairs:
        data = os.path.join(args.workdir, f"corpus-{n}")
        t0 = time.perf_counter()
        build_corpus(n, data)
        size = sum(os.path.getsize(os.path.join(data, f"train.{x}")) for x in ("en", "de"))
        print(f"N={n:,}: corpus {size / 1e6:,.0f} MB ({time.perf_counter() - t0:.0f}s to "
              "build or find)", flush=True)
        row = {"pairs": n, "MB": size / 1e6}
        bpe = os.path.join(args.workdir, f"bpe-{n}-{args.vocab_size}.json")
        w = max(args.workers)
        s, peak, _, _ = run([py, "-m", "tinytf.commands.bpe", "learn", "--input",
                             os.path.join(data, "train.en"), os.path.join(data, "train.de"),
                             "--vocab-size", str(args.vocab_size), "--workers", str(w),
                             "--output", bpe])
        row["learn"] = (w, s, peak)
        print(f"  learn BPE {args.vocab_size}: {s:.1f}s, peak {peak:,.0f} MB ({w} workers)",
              flush=True)
        run_dir = os.path.join(args.workdir, f"run-{n}")
        for workers in args.workers:
            shutil.rmtree(run_dir, ignore_errors=True)
            os.makedirs(run_dir)
            shutil.copy(bpe, os.path.join(run_dir, "bpe.json"))
            s, peak, _, _ = run([py, "-m", "tinytf.commands.prepare", "--data", data,
                                 "--out", run_dir, "--vocab-size", str(args.vocab_size),
                                 "--workers", str(workers)])
            row[f"prepare{workers}"] = (s, peak)
            print(f"  prepare, {workers} worker(s): {s:.1f}s, peak {peak:,.0f} MB", flush=True)
        common = ["--data", data, "--vocab-size", str(args.vocab_size),
                  "--log-interval", "1", "--set", "test_bleu=false", "--set",
                  "valid_bleu_sentences=1", "--max-tokens", "4096"]
        s, peak, first, _ = run([py, "train.py", *common, "--out", run_dir, "--max-steps", "1"],
                                first_line="step 1 |")
        row["first_update"] = (first, peak)
        s2, peak2, first2, _ = run([py, "train.py", "--out", run_dir, "--resume",
                                    "--max-steps", "2"], first_line="step 2 |")
        row["resume_update"] = (first2, peak2)
        print(f"  train.py: first update after {first:.1f}s (peak {peak:,.0f} MB); "
              f"--resume: next update after {first2:.1f}s (peak {peak2:,.0f} MB)", flush=True)
        mem = corpus_memory(run_dir, 4096)
        row["memory"] = mem
        print(f"  corpus memory: {mem['pairs']:,} pairs, {mem['tokens']:,} tokens; private "
              f"{mem['opened'] / 1e6:,.0f} MB opened, {mem['batching'] / 1e6:,.0f} MB after "
              f"100 batches = {mem['batching'] / mem['tokens']:.2f} bytes/token (goal <= 2)",
              flush=True)
        if not args.skip_mpi and shutil.which("mpirun"):
            mpi_dir = os.path.join(args.workdir, f"run-{n}-mpi")
            shutil.rmtree(mpi_dir, ignore_errors=True)
            os.makedirs(mpi_dir)
            shutil.copy(bpe, os.path.join(mpi_dir, "bpe.json"))
            mpi = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-n", "2"]
            s, peak, first, err = run([*mpi, py, "train.py", *common, "--out", mpi_dir,
                                       "--max-steps", "1", "--workers", "2"],
                                      first_line="step 1 |")
            preparations = sum(line.startswith("prepared ") for line in err.splitlines())
            row["mpi"] = (s, first, peak, preparations)
            print(f"  mpirun -n 2: first update after {first:.1f}s, {preparations} "
                  f"preparation(s), peak {peak:,.0f} MB", flush=True)
        rows.append(row)
    print(json.dumps(rows))


if __name__ == "__main__":
    main()
