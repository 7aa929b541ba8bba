"""Tests for tinytf.decoding.translation and translate.py on a tiny randomly initialised model.

The module fixture builds a real run directory: a small BPE learned on a few hundred lines of
data/ende/train.*, a 2+2-layer model saved as three numbered checkpoints (different weights, for
``--average``) with its config and BPE file in the metadata, as train.py writes them.
"""

import contextlib
import dataclasses
import json
import os
import re
import select
import signal
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import numpy as np
import pytest

import tinytf
from tinytf.decoding.search import beam_search, greedy_search
from tinytf.decoding.translation import (
    DecodeProgress,
    PrefixState,
    SearchOptions,
    TranslationError,
    Translator,
    full_prefix_step,
    make_batches,
    one_line,
    pad_sources,
    read_text_lines,
)
from tinytf.fast.cpu import threads as row_threads
from tinytf.models.transformer import Transformer, TransformerConfig
from tinytf.text import BPE, EOS_ID
from tinytf.utils import checkpoint
from tinytf.utils.workers import blas_threads, set_blas_threads, thread_budget

ROOT = Path(__file__).resolve().parent.parent.parent
DATA = ROOT / "data" / "ende"
MAX_LEN = 128  # model positions: a source of more than 127 tokens is truncated
OPTIONS = SearchOptions(beam_size=4, alpha=0.6, max_len_a=0.25, max_len_b=4)


def first_lines(path, n):
    return read_text_lines(str(path))[:n]


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    bpe = BPE.learn(first_lines(DATA / "train.en", 300) + first_lines(DATA / "train.de", 300),
                    vocab_size=400)
    bpe.save(str(run / "bpe.json"))
    tinytf.manual_seed(1234)
    config = TransformerConfig(vocab_size=len(bpe), d_model=32, n_heads=4, d_ff=64,
                               n_encoder_layers=2, n_decoder_layers=2, dropout=0.0,
                               max_len=MAX_LEN)
    model = Transformer(config)
    manager = checkpoint.CheckpointManager(str(run), keep_last=5)
    meta = {"model_config": config.to_dict(),
            "bpe": {"file": "bpe.json", "sha256": checkpoint.sha256_file(run / "bpe.json")}}
    rng = np.random.default_rng(0)
    for step in (100, 200, 300):
        state = {k: v + rng.standard_normal(v.shape).astype(np.float32) * 0.05
                 for k, v in model.state_dict().items()}
        manager.save(step, state, None, meta)
    return run


@pytest.fixture(scope="module")
def translator(run_dir):
    return Translator.load(str(run_dir))


@pytest.fixture(scope="module")
def test_lines():
    return first_lines(DATA / "test.en", 16)


def run_cli(*args, stdin=None):
    return subprocess.run([sys.executable, str(ROOT / "translate.py"), *map(str, args)],
                          input=stdin, capture_output=True, cwd=ROOT, timeout=300)


# ------------------------------------------------------------------ incremental decoding


def test_incremental_log_probs_equal_full_prefix(translator, test_lines):
    """decode_step with the caches == decode over the whole prefix, including after select."""
    model = translator.model
    sources = translator.encode_lines(test_lines[:5])
    src = pad_sources(sources)  # different lengths: real padding in the batch
    rng = np.random.default_rng(0)
    with tinytf.no_grad():
        memory = model.encode(src)
        cached = model.start_decoding(memory, src)
        full = PrefixState(memory, src)
        full_step = full_prefix_step(model)
        tokens = np.full(len(src), 1)
        for t in range(8):
            a = model.decode_step(tokens, cached)
            b = full_step(tokens, full)
            np.testing.assert_allclose(a, b, atol=1e-5, rtol=0)
            assert a.dtype == np.float32
            rows = rng.integers(0, len(src), size=len(src))  # reorder and repeat, as the beam does
            cached, full = cached.select(rows), full.select(rows)
            tokens = rng.integers(4, model.config.vocab_size, size=len(src))


def encoded_batch(translator, lines):
    """(model, padded source ids, max output lengths, encoder output) of ``lines``."""
    sources = translator.encode_lines(lines)
    src = pad_sources(sources)
    with tinytf.no_grad():
        memory = translator.model.encode(src)
    max_lens = translator.max_output_lens([len(s) for s in sources], OPTIONS)
    return translator.model, src, max_lens, memory


def test_beam_search_with_cache_equals_without(translator, test_lines):
    model, src, max_lens, memory = encoded_batch(translator, test_lines[:6])
    with tinytf.no_grad():
        cached = beam_search(model.decode_step, model.start_decoding(memory, src), len(src),
                             max_lens, beam_size=4, nbest=2)
        full = beam_search(full_prefix_step(model), PrefixState(memory, src), len(src),
                           max_lens, beam_size=4, nbest=2)
    assert [[h.tokens for h in n] for n in cached] == [[h.tokens for h in n] for n in full]
    for a, b in zip(cached, full):
        np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-4)


# ------------------------------------------------------------------ search on the real model


def test_beam_one_equals_greedy_on_model(translator, test_lines):
    model, src, max_lens, memory = encoded_batch(translator, test_lines[:8])
    with tinytf.no_grad():
        greedy = greedy_search(model.decode_step, model.start_decoding(memory, src), len(src),
                               max_lens, banned_ids=(0, 1, 3))
        beam = beam_search(model.decode_step, model.start_decoding(memory, src), len(src),
                           max_lens, beam_size=1, alpha=0.6, banned_ids=(0, 1, 3))
    assert [g.tokens for g in greedy] == [b[0].tokens for b in beam]
    assert [g.log_prob for g in greedy] == [b[0].log_prob for b in beam]


def test_output_does_not_depend_on_batch_or_position(translator, test_lines):
    """Batch sizes 1, 3, 64 and a token budget, in order and shuffled: identical translations."""
    lines = test_lines + [""] + test_lines[:3]  # repeats sit in other batches and positions
    expected = [n[0][0] for n in translator.translate_lines(lines, OPTIONS, batch_size=1)]
    assert expected[-3:] == expected[:3]
    for kwargs in (dict(batch_size=3), dict(batch_size=64), dict(max_tokens=50)):
        got = [n[0][0] for n in translator.translate_lines(lines, OPTIONS, **kwargs)]
        assert got == expected, kwargs
    order = np.random.default_rng(1).permutation(len(lines))
    shuffled = translator.translate_lines([lines[i] for i in order], OPTIONS, batch_size=64)
    assert [shuffled[j][0][0] for j in np.argsort(order)] == expected


@contextlib.contextmanager
def threads_of_one_worker(workers: int):
    """This process with the BLAS and row threads that each of ``workers`` forked decoders
    gets: a BLAS may sum a product in another order with more threads (OpenBLAS's AVX2
    kernels do), so a result is reproducible only at the same thread count."""
    before = blas_threads()
    n = max(1, thread_budget() // workers)
    set_blas_threads(n)
    row_threads.set_threads(n)
    try:
        yield
    finally:
        if before is not None:
            set_blas_threads(before)
        row_threads.set_threads(None)


def test_worker_processes_give_the_same_nbest_lists(translator, test_lines):
    """Batches decoded in 2 and 3 forked processes: the n-best lists (texts and scores) of one
    process with each worker's threads, in input order."""
    lines = test_lines + [""] + test_lines[:5]
    options = dataclasses.replace(OPTIONS, nbest=2)
    for workers in (2, 3):
        with threads_of_one_worker(workers):
            expected = translator.translate_lines(lines, options, batch_size=3)
        assert translator.translate_lines(lines, options, batch_size=3,
                                          workers=workers) == expected


def test_test_scores_in_worker_processes(translator):
    """The training run's final test BLEU: the same scores and logged samples with the beam
    search in 2 processes as in one."""
    from tinytf.training.evaluate import test_scores  # noqa: PLC0415

    class Log:
        def __init__(self):
            self.lines = []

        def info(self, line):
            self.lines.append(re.sub(r"\d+s\)", "Ns)", line))  # drop the timings

    lines = (first_lines(DATA / "test.en", 70), first_lines(DATA / "test.de", 70))  # 2 batches
    logs, scores = [], []
    for workers in (1, 2):
        log = Log()
        with threads_of_one_worker(2) if workers == 1 else contextlib.nullcontext():
            scores.append(test_scores(translator.model, translator.bpe, lines, log,
                                      workers=workers))
        logs.append(log.lines)
    assert scores[0] == scores[1] and logs[0] == logs[1]
    assert set(scores[0]) == {"test_bleu", "test_bleu_beam", "test_bleu_greedy"}


def test_max_output_length(translator):
    opts = SearchOptions(max_len_a=1.0, max_len_b=50)
    assert translator.max_output_lens([0, 3, 100], opts).tolist() == [50, 53, 127]  # 127: cap
    opts = SearchOptions(max_len_a=0.5, max_len_b=2)
    assert translator.max_output_lens([0, 3, 10], opts).tolist() == [2, 3, 7]
    nbest = translator.translate_ids([[300, 301, 302]], SearchOptions(beam_size=2, max_len_a=0,
                                                                      max_len_b=3))
    assert len(nbest[0][0].tokens) <= 3


# ------------------------------------------------------------------ text handling


def test_read_text_lines_splits_only_at_newline(tmp_path):
    path = tmp_path / "in.txt"
    path.write_bytes("\ufeffa\u2028b\r\n\x0cc\x85\n\n  \nlast".encode())
    assert read_text_lines(str(path)) == ["a\u2028b", "\x0cc\x85", "", "  ", "last"]
    path.write_bytes(b"one\n")
    assert read_text_lines(str(path)) == ["one"]
    path.write_bytes(b"")
    assert read_text_lines(str(path)) == []


def test_read_text_lines_invalid_utf8(tmp_path):
    path = tmp_path / "bad.txt"
    path.write_bytes(b"fine\nalso fine\nbad \xff byte\n")
    with pytest.raises(TranslationError, match=r"bad\.txt: line 3: invalid UTF-8"):
        read_text_lines(str(path))
    assert read_text_lines(str(path), errors="replace")[2] == "bad \ufffd byte"


def test_one_line():
    assert one_line("a\nb\rc\u2028d\x85e\x0bf\x0cg") == "a b c d e f g"
    assert one_line("x\ud800y") == "x\ufffdy"
    assert one_line("tab\tstays") == "tab\tstays"


def test_make_batches():
    lengths = [5, 1, 9, 3, 3, 7]
    batches = make_batches(lengths, batch_size=2)
    assert [b.tolist() for b in batches] == [[1, 3], [4, 0], [5, 2]]
    batches = make_batches(lengths, max_tokens=10)
    assert all(len(b) * max(lengths[i] for i in b) <= 10 or len(b) == 1 for b in batches)
    assert sorted(np.concatenate(batches).tolist()) == list(range(6))
    assert make_batches([], batch_size=4) == []


def test_long_line_is_truncated_with_warning(translator):
    warnings = []
    translator.warn = warnings.append
    try:
        sources = translator.encode_lines(["short", "word " * 300], name="f.txt")
    finally:
        translator.warn = lambda m: print(m, file=sys.stderr)
    assert len(sources[1]) == MAX_LEN - 1
    assert len(warnings) == 1 and "f.txt: line 2" in warnings[0]


# ------------------------------------------------------------------ the command line


AWKWARD = [
    "A normal sentence about the weather.",
    "",
    "   \t  ",
    "word " * 300,                               # longer than the model's positions
    "control \x01\x02\x07\x1b[31m characters \x7f",
    "tabs\tin\tthe\tmiddle",
    "emoji 😀🎉👍🏽 and a flag 🇩🇪",
    "mixed scripts: Привет мир, こんにちは世界, مرحبا, नमस्ते, ελληνικά",
    "line\u2028separator, form\x0cfeed, next\x85line, \u202eright-to-left\u202c",
    "combining \u0301 mark first, zero\u200bwidth, nul \x00 byte",
    "A normal sentence about the weather.",
    "",
]


def test_cli_awkward_inputs_keep_line_count_and_order(run_dir, translator, tmp_path):
    src = tmp_path / "awkward.txt"
    src.write_bytes("\n".join(AWKWARD).encode() + b"\n")
    out = tmp_path / "out.txt"
    proc = run_cli("--model", run_dir, "--input", src, "--output", out, "--beam", 3,
                   "--max-len-a", 0.25, "--max-len-b", 4, "--batch-size", 5)
    assert proc.returncode == 0, proc.stderr.decode()
    got = out.read_bytes().decode("utf-8").split("\n")
    assert got[-1] == "" and len(got) - 1 == len(AWKWARD)
    got = got[:-1]
    assert got[1] == got[2] == got[11] == ""
    assert got[0] == got[10]
    stderr = proc.stderr.decode()
    assert "awkward.txt: line 4:" in stderr and "truncated" in stderr
    assert "sentences/s" in stderr
    # Order: every line equals its translation decoded alone.
    opts = SearchOptions(beam_size=3, alpha=0.6, max_len_a=0.25, max_len_b=4)
    for line, text in zip(AWKWARD, got):
        alone = translator.translate_lines([line], opts, batch_size=1)[0][0][0]
        assert text == alone


def test_cli_stdin_stdout_and_batch_sizes(run_dir, test_lines):
    data = ("\n".join(test_lines[:10]) + "\n").encode()
    outs = []
    for size in ("1", "3", "64"):
        proc = run_cli("--model", run_dir, "--batch-size", size, "--max-len-b", 4, "--quiet",
                       stdin=data)
        assert proc.returncode == 0, proc.stderr.decode()
        assert b"sentences" not in proc.stderr  # --quiet: no progress, no summary
        outs.append(proc.stdout)
    assert outs[0] == outs[1] == outs[2]
    assert outs[0].count(b"\n") == 10
    for workers in ("1", "2"):
        proc = run_cli("--model", run_dir, "--batch-size", 3, "--workers", workers,
                       "--max-len-b", 4, "--quiet", stdin=data)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stdout == outs[0], workers


def test_cli_fp16_on_the_cpu_warns_of_its_speed(run_dir, test_lines):
    """--precision fp16 on the CPU runs NumPy's float16 (no BLAS): one warning line on
    stderr, and the translations all the same; float32 and bf16 say nothing of speed."""
    data = ("\n".join(test_lines[:2]) + "\n").encode()
    for precision in ("fp16", "bf16", "float32"):
        proc = run_cli("--model", run_dir, "--precision", precision, "--max-len-b", 4,
                       "--quiet", "--workers", 1, stdin=data)
        assert proc.returncode == 0, proc.stderr.decode()
        assert proc.stdout.count(b"\n") == 2
        warned = b"warning: --precision fp16 on the CPU" in proc.stderr
        assert warned == (precision == "fp16"), proc.stderr.decode()


@pytest.mark.parametrize("device_count", [None, 0])
def test_cli_device_gpu_without_a_usable_gpu_writes_nothing(run_dir, tmp_path, capsys,
                                                            cupy_without_a_gpu, device_count):
    """--device gpu where CuPy is installed but CUDA cannot use a GPU: one line, exit 2,
    before any file is opened (the --output is not created)."""
    from tinytf.commands import translate as command  # noqa: PLC0415
    words = "--device gpu " + cupy_without_a_gpu(device_count)
    out = tmp_path / "out.de"
    code = command.main(["--model", str(run_dir), "--input", str(DATA / "test.en"),
                         "--output", str(out), "--device", "gpu"])
    err = capsys.readouterr().err
    assert code == 2 and err.strip().endswith(f": error: {words}"), err
    assert len(err.strip().splitlines()) == 1 and not out.exists()


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_cli_a_killed_decoding_worker_is_one_line_and_exit_1(run_dir, tmp_path, monkeypatch,
                                                             capsys):
    """A decoding worker killed (by the OOM killer): one line that says so and how many
    lines are written, exit 1, no traceback."""
    from tinytf.commands import translate as command  # noqa: PLC0415
    from tinytf.decoding import workers as decode_workers  # noqa: PLC0415
    monkeypatch.setattr(decode_workers, "_translate_job",
                        lambda job: os.kill(os.getpid(), signal.SIGKILL))
    code = command.main(["--model", str(run_dir), "--input", str(DATA / "test.en"),
                         "--output", str(tmp_path / "out.de"), "--workers", "2", "--quiet"])
    err = capsys.readouterr().err
    assert code == 1 and len(err.strip().splitlines()) == 1, err
    assert ": error: worker process " in err and "ended with signal 9 (SIGKILL)" in err and \
        err.strip().endswith("; the first 0 lines are written"), err


@pytest.mark.parametrize("to_stdout", [False, True])
def test_cli_a_full_disk_is_one_line_naming_the_output(run_dir, test_lines, tmp_path,
                                                       file_size_limit, to_stdout):
    """A write the file system refuses (here a file-size limit, as a full disk refuses):
    one line naming the output and the lines that are whole in it, exit 2, no traceback
    (the close after the failed write raised again, from ``finally``); through a redirected
    standard output too, where CPython's buffered writer dropped the rest of the block
    without an error and the command exited 0 (tinytf.utils.streams)."""
    src = tmp_path / "in.en"
    src.write_text("\n".join(test_lines) * 8 + "\n", encoding="utf-8")
    out = tmp_path / "out.de"

    argv = [sys.executable, str(ROOT / "translate.py"), "--model", str(run_dir), "--input",
            str(src), "--max-len-b", "4", "--buffer-size", "64", "--quiet"]
    with open(out if to_stdout else os.devnull, "wb") as stdout:
        proc = subprocess.run(argv + ([] if to_stdout else ["--output", str(out)]),
                              stdout=stdout, stderr=subprocess.PIPE, cwd=ROOT, timeout=300,
                              preexec_fn=file_size_limit(200))
    err = proc.stderr.decode()
    where = "the standard output" if to_stdout else str(out)
    assert proc.returncode == 2 and "Traceback" not in err, err
    assert err.startswith(f"translate.py: error: {where}: cannot write the output: File too "
                          "large (the first "), err
    whole = int(err.split("(the first ")[1].split()[0])
    assert whole % 64 == 0 and out.read_bytes().count(b"\n") >= whole


def test_cli_a_closed_stderr_stops_nothing(run_dir, test_lines, tmp_path):
    """``translate.py --output F 2>&1 | tee`` whose reader ended: the progress and summary
    lines find no reader, and the translation still ends whole, exit 0 (the summary line's
    BrokenPipeError was taken for a closed output: exit 141)."""
    src = tmp_path / "in.en"
    src.write_text("\n".join(test_lines) + "\n", encoding="utf-8")
    out = tmp_path / "out.de"
    proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--model",
                             str(run_dir), "--input", str(src), "--output", str(out),
                             "--max-len-b", "4"], cwd=ROOT, stderr=subprocess.PIPE)
    proc.stderr.close()
    assert proc.wait(timeout=300) == 0
    assert out.read_bytes().count(b"\n") == len(test_lines)


def test_cli_invalid_utf8(run_dir, tmp_path):
    src = tmp_path / "bad.txt"
    src.write_bytes(b"good line\n\xc3\x28 broken\nanother\n")
    proc = run_cli("--model", run_dir, "--input", src, "--max-len-b", 3)
    assert proc.returncode == 2
    assert "bad.txt: line 2: invalid UTF-8" in proc.stderr.decode()
    assert proc.stdout == b""
    proc = run_cli("--model", run_dir, "--input", src, "--max-len-b", 3, "--errors", "replace")
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.count(b"\n") == 3


def test_cli_reference_nbest_average_and_attention(run_dir, test_lines, tmp_path):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(test_lines[:4] + [""]) + "\n", encoding="utf-8")
    ref.write_text("\n".join(first_lines(DATA / "test.de", 4) + [""]) + "\n", encoding="utf-8")
    out = tmp_path / "out.txt"
    svg_dir = tmp_path / "svg"
    proc = run_cli("--model", run_dir, "--input", src, "--output", out, "--max-len-b", 4,
                   "--reference", ref, "--average", 3, "--print-attention", svg_dir)
    assert proc.returncode == 0, proc.stderr.decode()
    assert "BLEU|nrefs:1|case:mixed|eff:no|tok:13a|smooth:exp|version:" in proc.stdout.decode()
    assert out.read_text(encoding="utf-8").count("\n") == 5
    svgs = sorted(os.listdir(svg_dir))
    assert svgs == ["line_1.svg", "line_2.svg", "line_3.svg", "line_4.svg"]
    root = ET.parse(svg_dir / "line_1.svg").getroot()
    assert root.tag.endswith("svg")

    proc = run_cli("--model", run_dir, "--input", src, "--max-len-b", 4, "--nbest", 3,
                   "--beam", 3, "--quiet")
    assert proc.returncode == 0, proc.stderr.decode()
    rows = [r.split(" ||| ") for r in proc.stdout.decode().strip("\n").split("\n")]
    assert [int(r[0]) for r in rows] == [0, 0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]
    scores = [float(r[3]) for r in rows[:3]]
    assert scores == sorted(scores, reverse=True)
    assert all(r[2].startswith("LogProb=") and " Len=" in r[2] for r in rows)

    for bad_args, message in [(("--average", 4), "needs 4 numbered checkpoints"),
                              (("--reference", src.parent / "nope"), "cannot read"),
                              (("--model", tmp_path / "none"), "no such checkpoint"),
                              (("--print-attention", out), "a file, not a directory")]:
        args = ["--model", run_dir, "--input", src, *bad_args]
        proc = run_cli(*args)
        assert proc.returncode == 2 and message in proc.stderr.decode(), proc.stderr.decode()


def test_average_is_the_mean_of_the_checkpoints(run_dir):
    averaged = Translator.load(str(run_dir), average=3).model.state_dict()
    paths = checkpoint.list_checkpoints(str(run_dir))
    states = [checkpoint.load(p).model for p in paths]
    for name, value in averaged.items():
        np.testing.assert_allclose(value, np.mean([s[name] for s in states], axis=0), atol=1e-6)


def test_attention_weights_are_distributions(translator):
    from tinytf.decoding.attention_svg import cross_attention_weights

    src = translator.bpe.encode("A small test.") + [EOS_ID]
    weights = cross_attention_weights(translator.model, src, [300, 301, 302])
    assert weights.shape == (2, 4, 4, len(src)) and weights.dtype == np.float32
    np.testing.assert_allclose(weights.sum(axis=-1), 1.0, atol=1e-5)


# ------------------------------------------------------------------ streaming

def test_cli_output_is_independent_of_the_buffer_size(run_dir, test_lines, tmp_path):
    """Blocks of 1, 3 and 1000 lines give the same output, line for line, n-best too."""
    src = tmp_path / "src.txt"
    src.write_text("\n".join(test_lines[:7] + [""] + test_lines[7:9]) + "\n", encoding="utf-8")
    for extra in ([], ["--nbest", 2, "--beam", 2]):
        outs = [run_cli("--model", run_dir, "--input", src, "--max-len-b", 4, "--quiet",
                        "--buffer-size", n, *extra) for n in (1, 3, 1000)]
        for proc in outs:
            assert proc.returncode == 0, proc.stderr.decode()
        # The same lines and texts; scores to float32 rounding (the batches differ).
        rows = [[r.split(" ||| ") for r in p.stdout.decode().splitlines()] for p in outs]
        assert len(rows[0]) == len(rows[1]) == len(rows[2])
        for a, b, c in zip(*rows):
            assert a[:2] == b[:2] == c[:2]
            numbers = [re.findall(r"-?\d+\.\d+", " ".join(r[2:])) for r in (a, b, c)]
            for x, y, z in zip(*numbers):
                assert float(x) == pytest.approx(float(y), abs=2e-3) == pytest.approx(
                    float(z), abs=2e-3)
    assert outs[0].stdout.decode().splitlines()[-1].startswith("9 ||| ")


def test_cli_answers_a_line_before_the_input_ends(run_dir, test_lines):
    """A line written to a pipe that stays open is translated and written at once (the
    default --buffer-size of 1000 does not wait for 999 more)."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--model",
                             str(run_dir), "--max-len-b", "4", "--quiet"], cwd=ROOT,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    try:
        for line in test_lines[:2]:
            proc.stdin.write(line.encode() + b"\n")
            proc.stdin.flush()
            ready = select.select([proc.stdout], [], [], 120)[0]
            assert ready, "no translation before EOF"
            assert proc.stdout.readline().endswith(b"\n")
        proc.stdin.close()
        assert proc.stdout.read() == b"" and proc.wait(timeout=60) == 0
    finally:
        proc.kill()


def test_cli_a_closed_output_pipe_ends_quietly(run_dir, test_lines, tmp_path):
    """The reader of stdout goes away (as ``| head -1`` does): exit 141, no traceback."""
    src = tmp_path / "src.txt"
    src.write_text("\n".join(test_lines * 4) + "\n", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--model",
                             str(run_dir), "--input", str(src), "--max-len-b", "2",
                             "--buffer-size", "1", "--quiet"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.readline()
    proc.stdout.close()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 141 and b"Traceback" not in stderr, stderr.decode()


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
def test_cli_ctrl_c_ends_with_the_blocks_written_and_no_traceback(run_dir, test_lines, tmp_path,
                                                                  sig):
    """SIGINT to the whole process group, as a terminal's Ctrl-C sends it (or a scheduler's
    SIGTERM or SIGUSR1), while two decoding workers run: exit 128 + N, one line on stderr
    that counts the lines written, every block written so far whole, no traceback from the
    command or its workers."""
    src = tmp_path / "src.txt"
    src.write_text("\n".join(test_lines * 40) + "\n", encoding="utf-8")
    proc = subprocess.Popen([sys.executable, str(ROOT / "translate.py"), "--model",
                             str(run_dir), "--input", str(src), "--buffer-size", "8",
                             "--batch-size", "2", "--workers", "2", "--quiet"], cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            start_new_session=True,
                            # SIGINT as a terminal leaves it (a shell's background job, as
                            # a CI runner may start this, inherits it ignored)
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        first = proc.stdout.readline()
        os.killpg(proc.pid, sig)
        rest = proc.stdout.read()       # through the reader's buffer: the block's other lines
        stderr = proc.stderr.read()
        proc.wait(timeout=120)
    finally:
        proc.kill()
    stderr = stderr.decode()
    assert proc.returncode == 128 + sig, stderr
    written = (first + rest).decode().splitlines()
    said = "interrupted" if sig == signal.SIGINT else f"stopped by signal {int(sig)} " \
        f"({sig.name})"
    assert "Traceback" not in stderr and stderr.strip().endswith(
        f"{said} after {len(written):,} lines"), stderr
    assert 0 < len(written) < 16 * 40 and len(written) % 8 == 0


def test_cli_an_unwritable_output_fails_before_decoding(run_dir, tmp_path):
    proc = run_cli("--model", run_dir, "--output", tmp_path / "no" / "such" / "dir.txt",
                   stdin=b"a line\n")
    assert proc.returncode == 2 and "cannot write" in proc.stderr.decode()


def test_score_ids_is_the_search_s_own_log_prob(translator, test_lines):
    """Forced decoding of the beam's hypotheses gives back their log_prob (to float32
    rounding): the same model, the same probabilities, no search."""
    sources = translator.encode_lines(test_lines[:6])
    results = translator.translate_ids(sources, SearchOptions(beam_size=3, nbest=3,
                                                              max_len_b=5))
    pairs = [(s, h) for s, nbest in zip(sources, results) for h in nbest]
    scores = translator.score_ids([s for s, _ in pairs], [list(h.tokens) for _, h in pairs],
                                  batch_size=4)
    for (_, h), value in zip(pairs, scores):
        assert value == pytest.approx(h.log_prob, rel=1e-4, abs=1e-3)


def test_cli_score_reference(run_dir, test_lines, tmp_path):
    """--score-reference: one log-probability per input line, of its reference line; a
    reference file of another length is an error naming it."""
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(test_lines[:4]) + "\n", encoding="utf-8")
    ref.write_text("\n".join(first_lines(DATA / "test.de", 4)) + "\n", encoding="utf-8")
    scored = run_cli("--model", run_dir, "--input", src, "--score-reference", ref)
    assert scored.returncode == 0, scored.stderr.decode()
    values = [float(x) for x in scored.stdout.decode().split()]
    assert len(values) == 4 and all(v < 0 for v in values)
    short = tmp_path / "short.txt"
    short.write_text("eine Zeile\n", encoding="utf-8")
    bad = run_cli("--model", run_dir, "--input", src, "--score-reference", short)
    assert bad.returncode == 2 and "1 lines for 4 input lines" in bad.stderr.decode()


def test_cli_bleu_and_chrf_as_json(run_dir, test_lines, tmp_path):
    src, ref = tmp_path / "src.txt", tmp_path / "ref.txt"
    src.write_text("\n".join(test_lines[:3]) + "\n", encoding="utf-8")
    ref.write_text("\n".join(first_lines(DATA / "test.de", 3)) + "\n", encoding="utf-8")
    proc = run_cli("--model", run_dir, "--input", src, "--output", tmp_path / "o.txt",
                   "--max-len-b", 3, "--reference", ref, "--bleu-format", "json", "--quiet")
    assert proc.returncode == 0, proc.stderr.decode()
    doc = json.loads(proc.stdout.decode())
    assert {"bleu", "chrf", "bleu_signature", "chrf_signature"} <= set(doc)
    assert doc["sentences"] == 3
    assert "chrF2" in doc["chrf_signature"] or "nc:6" in doc["chrf_signature"]


def test_progress_lines_give_the_rate_the_time_spent_and_the_time_to_go():
    """translate.py's progress: done/total, sentences/s, seconds elapsed and, with a known
    total, the seconds to go at that rate; the closing line counts in the singular too."""
    import io
    out = io.StringIO()
    progress = DecodeProgress(every=0.0, stream=out)
    progress.start -= 10.0                            # 10 s ago
    progress(250, 1000)
    progress(1000, 1000)                              # done: no line
    progress(250, None)                               # a stream of unknown length
    lines = out.getvalue().splitlines()
    assert len(lines) == 2 and re.fullmatch(
        r"translated 250/1,000 sentences, 2\d\.\d sentences/s, 10 s elapsed, about 3\d s to go",
        lines[0]), lines
    assert lines[1].startswith("translated 250 sentences, ") and "to go" not in lines[1]
    assert DecodeProgress().summary(1).startswith("translated 1 sentence in ")
    assert DecodeProgress().summary(1234).startswith("translated 1,234 sentences in ")


def test_output_onto_the_input_or_the_reference_is_refused(run_dir, tmp_path):
    """--output naming the --input or --reference file (by another path too) would empty it
    before it is read: refused with exit 2, the file left as it was."""
    src = tmp_path / "in.txt"
    src.write_bytes(b"Hello.\nGood morning.\n")
    ref = tmp_path / "ref.txt"
    ref.write_bytes(b"Hallo.\nGuten Morgen.\n")
    for output, option in ((tmp_path / "." / "in.txt", "--input"), (ref, "--reference")):
        proc = run_cli("--model", run_dir, "--input", src, "--reference", ref,
                       "--output", output)
        assert proc.returncode == 2, proc.stderr.decode()
        assert f"is the {option} file: writing would erase it" in proc.stderr.decode()
    proc = run_cli("--model", run_dir, "--input", src, "--score-reference", ref, "--output", ref)
    assert proc.returncode == 2 and b"is the --score-reference file" in proc.stderr
    assert src.read_bytes() == b"Hello.\nGood morning.\n"
    assert ref.read_bytes() == b"Hallo.\nGuten Morgen.\n"
