"""Benchmark: tinytf's BPE against subword-nmt and sentencepiece (learn, encode, compression).

    python bench/bpe.py                 # shipped corpus and a >= 5 MB corpus built on the fly
    python bench/bpe.py --quick         # shipped corpus only
    python bench/bpe.py --vocab-size 8000 --repeats 3
    python bench/bpe.py --synthetic-mb 100   # and a synthetic corpus of about 100 MB

For each corpus, with the same input file for both tools:

1. ``BPE.learn`` with ``--vocab-size`` pieces; its number of merges M is then given to
   ``subword_nmt.learn_bpe.learn_bpe`` (the code behind ``subword-nmt learn-bpe -s M``), so both
   learn the same number of merges (min_frequency 2 for both);
2. each model encodes the whole corpus, freshly loaded (cold caches): ``BPE.encode_batch`` against
   ``subword_nmt.apply_bpe.BPE.process_line`` (the code behind ``subword-nmt apply-bpe``);
3. compression = pieces per sentence (subword-nmt: space-separated ``@@`` pieces).

Every measurement runs in a fresh Python process, so its peak resident memory (ru_maxrss) is
its own; "peak" is the process's peak, "+work" is the peak minus the size after imports and
reading the input lines. Times are CPU seconds of that process (user + system), which a busy
shared machine inflates less than wall time; wall seconds are printed too. Each encode runs
--repeats times (default 3) and each learn --learn-repeats times (default 1), for both tools
alike, and the fastest run counts.

The >= 5 MB corpus is every file of data/ende (train, dev, test, phrases; both languages) plus a
lower-cased copy of each line, written to a temporary directory (never to the repository).
Needs ``pip install subword-nmt`` (a benchmark dependency, not a tinytf one); with
``pip install sentencepiece`` its C++ BPE trainer and encoder run too (one thread, as many
pieces as tinytf's alphabet and merges), a second reference.
"""
import argparse
import importlib.util
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
DATA = os.path.join(ROOT, "data", "ende")


# ---------------------------------------------------------------- workers (one per process)

def _peak_mb():
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0  # Linux: KiB


def _read_lines(path):
    with open(path, encoding="utf-8") as f:
        return [line.rstrip("\n") for line in f]


def _timed(fn):
    cpu, wall = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def worker(task, args):
    """Run one measurement in this process and return a JSON-able dict."""
    sys.path.insert(0, ROOT)
    if task.endswith("-tinytf"):
        from tinytf.text import BPE
    if task == "learn-tinytf":
        base = _peak_mb()
        bpe, cpu, wall = _timed(lambda: BPE.learn([args["input"]], vocab_size=args["vocab_size"]))
        bpe.save(args["output"])
        return dict(cpu=cpu, wall=wall, peak=_peak_mb(), base=base, merges=len(bpe.merges),
                    vocab=len(bpe), alphabet=len(bpe.alphabet))
    if task == "learn-subword-nmt":
        from subword_nmt.learn_bpe import learn_bpe
        base = _peak_mb()
        with open(args["input"], encoding="utf-8") as inp, \
                open(args["output"], "w", encoding="utf-8") as out:
            _, cpu, wall = _timed(lambda: learn_bpe(inp, out, args["merges"], min_frequency=2))
        with open(args["output"], encoding="utf-8") as f:
            merges = sum(1 for line in f if not line.startswith("#version"))
        return dict(cpu=cpu, wall=wall, peak=_peak_mb(), base=base, merges=merges)
    if task == "encode-tinytf":
        bpe = BPE.load(args["model"])
        lines = _read_lines(args["input"])
        base = _peak_mb()
        ids, cpu, wall = _timed(lambda: bpe.encode_batch(lines))
        ok = all(bpe.decode(i) == line for i, line in zip(ids, lines))
        return dict(cpu=cpu, wall=wall, peak=_peak_mb(), base=base, lines=len(lines),
                    pieces=sum(map(len, ids)), roundtrip=ok)
    if task == "encode-subword-nmt":
        from subword_nmt.apply_bpe import BPE as SubwordNMT
        with open(args["model"], encoding="utf-8") as f:
            bpe = SubwordNMT(f)
        lines = _read_lines(args["input"])
        base = _peak_mb()
        out, cpu, wall = _timed(lambda: [bpe.process_line(line) for line in lines])
        return dict(cpu=cpu, wall=wall, peak=_peak_mb(), base=base, lines=len(lines),
                    pieces=sum(len(o.split()) for o in out))
    if task == "learn-sentencepiece":
        import sentencepiece as spm
        base = _peak_mb()
        _, cpu, wall = _timed(lambda: spm.SentencePieceTrainer.train(
            input=args["input"], model_prefix=args["output"], vocab_size=args["vocab_size"],
            model_type="bpe", character_coverage=1.0, num_threads=1, input_sentence_size=0,
            max_sentence_length=1 << 16, minloglevel=2))
        return dict(cpu=cpu, wall=wall, peak=_peak_mb(), base=base)
    if task == "encode-sentencepiece":
        import sentencepiece as spm  # noqa: F811 (each task imports what it runs)
        sp = spm.SentencePieceProcessor(model_file=args["model"] + ".model")
        lines = _read_lines(args["input"])
        base = _peak_mb()
        ids, cpu, wall = _timed(lambda: sp.encode(lines, num_threads=1))
        return dict(cpu=cpu, wall=wall, peak=_peak_mb(), base=base, lines=len(lines),
                    pieces=sum(map(len, ids)))
    raise ValueError(f"unknown task {task!r}")


def run_worker(task, repeats=1, **args):
    """The fastest of `repeats` runs of `task`, each in a fresh process."""
    best = None
    env = dict(os.environ, TQDM_DISABLE="1")  # subword-nmt's progress bar
    for _ in range(repeats):
        proc = subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", task,
                               json.dumps(args)], capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            sys.exit(f"{task} failed:\n{proc.stderr}")
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        if best is None or result["cpu"] < best["cpu"]:
            best = result
    return best


# ---------------------------------------------------------------- corpora

def concat(paths, out, transforms=(lambda s: s,)):
    """Write the lines of `paths` to `out`, once per transform; returns (lines, bytes)."""
    n = 0
    with open(out, "w", encoding="utf-8") as f:
        for transform in transforms:
            for path in paths:
                for line in _read_lines(path):
                    f.write(transform(line) + "\n")
                    n += 1
    return n, os.path.getsize(out)


def build_synthetic(tmp, megabytes):
    """A file of about `megabytes` MB: both sides of `bench/data_scale.py`'s synthetic pairs
    (each line 1 to 4 shipped sentences, three in ten after a made-up name)."""
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from data_scale import build_corpus
    pairs = int(megabytes * 1e6 / 254)  # a pair is about 254 bytes, both sides
    build_corpus(pairs, os.path.join(tmp, "synthetic"))
    out = os.path.join(tmp, f"synthetic-{megabytes:g}mb.txt")
    concat([os.path.join(tmp, "synthetic", f"train.{lang}") for lang in ("en", "de")], out)
    shutil.rmtree(os.path.join(tmp, "synthetic"))
    return out


def build_corpora(tmp, quick, synthetic_mb=None):
    """[(name, learn file, encode file)] for the shipped corpus, the >= 5 MB one and, with
    `synthetic_mb`, a synthetic one of that size."""
    sentences = [os.path.join(DATA, f"{split}.{lang}") for split in ("train", "dev", "test")
                 for lang in ("en", "de")]
    for path in sentences:
        if not os.path.exists(path):
            sys.exit(f"{path}: missing; the benchmark needs the shipped corpus data/ende/")
    corpora = []
    learn = os.path.join(tmp, "shipped-train.txt")
    concat([os.path.join(DATA, f"train.{lang}") for lang in ("en", "de")], learn)
    encode = os.path.join(tmp, "shipped-all.txt")
    concat(sentences, encode)
    corpora.append(("shipped: learn train.{en,de}, encode train/dev/test.{en,de}", learn, encode))
    if not quick:
        files = sentences + [os.path.join(DATA, f"phrases.{lang}") for lang in ("en", "de")
                             if os.path.exists(os.path.join(DATA, f"phrases.{lang}"))]
        big = os.path.join(tmp, "large.txt")
        _, size = concat(files, big, (lambda s: s, str.lower))
        if size < 5 * 1000 * 1000:
            sys.exit(f"{big}: only {size} bytes, the large corpus must be >= 5 MB")
        corpora.append(("large: all data/ende files + lower-cased copy, learn and encode it",
                        big, big))
    if synthetic_mb:
        path = build_synthetic(tmp, synthetic_mb)
        corpora.append((f"synthetic {synthetic_mb:g} MB: bench/data_scale.py's pairs, both "
                        "sides, learn and encode it", path, path))
    return corpora


# ---------------------------------------------------------------- report

def describe(path):
    n, size = 0, os.path.getsize(path)
    with open(path, "rb") as f:
        for _ in f:
            n += 1
    return f"{n:,} lines, {size / 1e6:.1f} MB"


def bench(name, learn_file, encode_file, vocab_size, repeats, learn_repeats, tmp):
    tag = name.split(":")[0]
    model, codes = os.path.join(tmp, f"{tag}.json"), os.path.join(tmp, f"{tag}.codes")
    ours = run_worker("learn-tinytf", learn_repeats, input=learn_file, vocab_size=vocab_size,
                      output=model)
    theirs = run_worker("learn-subword-nmt", learn_repeats, input=learn_file,
                        merges=ours["merges"], output=codes)
    enc_ours = run_worker("encode-tinytf", repeats, model=model, input=encode_file)
    enc_theirs = run_worker("encode-subword-nmt", repeats, model=codes, input=encode_file)
    spm = None
    if importlib.util.find_spec("sentencepiece") is not None:
        # As many pieces as tinytf's merges and alphabet (sentencepiece counts its own
        # characters and 3 specials among them, and has no byte pieces).
        spm_model = os.path.join(tmp, f"{tag}-spm")
        spm = (run_worker("learn-sentencepiece", learn_repeats, input=learn_file,
                          vocab_size=ours["merges"] + ours["alphabet"] + 3, output=spm_model),
               run_worker("encode-sentencepiece", repeats, model=spm_model, input=encode_file))
    pps_ours = enc_ours["pieces"] / enc_ours["lines"]
    pps_theirs = enc_theirs["pieces"] / enc_theirs["lines"]
    rows = [
        ("learn", ours, theirs),
        ("encode", enc_ours, enc_theirs),
    ]
    print(f"\n### {name}")
    print(f"learn: {describe(learn_file)}; encode: {describe(encode_file)}; "
          f"vocab {ours['vocab']} pieces = {ours['merges']} merges "
          f"(subword-nmt learned {theirs['merges']})\n")
    print("| step | tinytf CPU s (wall) | subword-nmt CPU s (wall) | speed-up | "
          "tinytf peak MB (+work) | subword-nmt peak MB (+work) |")
    print("|---|---:|---:|---:|---:|---:|")
    ratios = {}
    for step, a, b in rows:
        ratios[step] = b["cpu"] / a["cpu"]
        print(f"| {step} | {a['cpu']:.2f} ({a['wall']:.2f}) | {b['cpu']:.2f} ({b['wall']:.2f}) | "
              f"**{ratios[step]:.1f}x** | {a['peak']:.0f} (+{a['peak'] - a['base']:.0f}) | "
              f"{b['peak']:.0f} (+{b['peak'] - b['base']:.0f}) |")
    if spm is not None:
        print("\n| step | sentencepiece CPU s (wall) | tinytf / sentencepiece speed | "
              "sentencepiece peak MB (+work) |")
        print("|---|---:|---:|---:|")
        for step, a, b in (("learn", ours, spm[0]), ("encode", enc_ours, spm[1])):
            ratios[f"{step}-spm"] = b["cpu"] / a["cpu"]
            print(f"| {step} | {b['cpu']:.2f} ({b['wall']:.2f}) | **{b['cpu'] / a['cpu']:.2f}x** "
                  f"| {b['peak']:.0f} (+{b['peak'] - b['base']:.0f}) |")
        print(f"sentencepiece pieces per sentence: {spm[1]['pieces'] / spm[1]['lines']:.3f}")
    else:
        print("\n(sentencepiece not installed: pip install sentencepiece for its columns)")
    diff = 100.0 * (pps_ours / pps_theirs - 1.0)
    print(f"\npieces per sentence: tinytf {pps_ours:.3f}, subword-nmt {pps_theirs:.3f} "
          f"({diff:+.2f}%); tinytf decode(encode(line)) == line for every line: "
          f"{enc_ours['roundtrip']}")
    ok = ratios["learn"] >= 10 and ratios["encode"] >= 3 and diff <= 2 and enc_ours["roundtrip"]
    targets = (f"learn {ratios['learn']:.1f}x subword-nmt (target >= 10x), encode "
               f"{ratios['encode']:.1f}x (target >= 3x), compression {diff:+.2f}% (target <= +2%)")
    if spm is not None:
        ok = ok and ratios["learn-spm"] >= 0.5 and ratios["encode-spm"] >= 1.0
        targets += (f", learn {ratios['learn-spm']:.2f}x sentencepiece (target >= 0.5x), "
                    f"encode {ratios['encode-spm']:.2f}x (target >= 1x)")
    print(f"ratios: {targets}: {'all targets met' if ok else 'TARGET MISSED'}")
    return ok


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--vocab-size", type=int, default=8000)
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs per encode measurement; the fastest counts (default 3)")
    parser.add_argument("--learn-repeats", type=int, default=1,
                        help="runs per learn measurement (default 1: subword-nmt is slow)")
    parser.add_argument("--quick", action="store_true", help="shipped corpus only")
    parser.add_argument("--synthetic-mb", type=float, metavar="MB",
                        help="also a synthetic corpus of about MB megabytes (bench/data_scale.py's "
                        "pairs: shipped sentences joined, made-up names)")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker[0], json.loads(args.worker[1]))))
        return
    if importlib.util.find_spec("subword_nmt") is None:
        sys.exit("subword-nmt is not installed: pip install subword-nmt")
    print(f"tinytf BPE vs subword-nmt; python {sys.version.split()[0]}, "
          f"{os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} at start")
    with tempfile.TemporaryDirectory(prefix="bench-bpe-") as tmp:
        ok = all([bench(name, learn, encode, args.vocab_size, args.repeats, args.learn_repeats,
                        tmp)
                  for name, learn, encode in build_corpora(tmp, args.quick,
                                                           args.synthetic_mb)])
    print(f"\nload average {os.getloadavg()[0]:.1f} at the end")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
