"""The prepared corpus (tinytf.data.prepare, tinytf.data.corpus_file): encoded once, streamed
in chunks by worker processes, memory-mapped, checked against its sources; and train.py's use
of it."""
import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from tinytf.data.batches import BatchIterator, DataError, ParallelCorpus, read_parallel
from tinytf.data.corpus_file import CorpusWriter, open_corpus, read_header, stale_reason
from tinytf.data.prepare import prepare_corpus
from tinytf.text import BPE
from tinytf.utils.checkpoint import sha256_file

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "data", "ende")
PAIR = (os.path.join(DATA, "train.en"), os.path.join(DATA, "train.de"))


@pytest.fixture(scope="module")
def bpe_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "bpe.json"
    BPE.learn(list(PAIR), vocab_size=1000).save(str(path))
    return str(path)


def _arrays(corpus):
    return {name: np.asarray(getattr(corpus, name)) for name in
            ("_src", "_src_off", "_tgt", "_tgt_off", "kept", "src_lengths", "tgt_lengths")}


def _write_pair(tmp_path, src: bytes, tgt: bytes):
    (tmp_path / "a.en").write_bytes(src)
    (tmp_path / "a.de").write_bytes(tgt)
    return str(tmp_path / "a.en"), str(tmp_path / "a.de")


@pytest.mark.parametrize("workers", [1, 2])
def test_prepared_corpus_equals_the_corpus_encoded_in_memory(bpe_path, tmp_path, workers):
    """Many small chunks, in order, by one or two processes: the same ids, offsets, kept
    lines and skip counts as ParallelCorpus over the lines; the arrays are read-only maps."""
    out = str(tmp_path / "corpus")
    header = prepare_corpus(*PAIR, bpe_path, out, max_len=40, workers=workers,
                            chunk_bytes=20000)
    mapped = open_corpus(out)
    ref = ParallelCorpus(*read_parallel(*PAIR), BPE.load(bpe_path), max_len=40)
    assert ref.n_skipped_long > 0  # the filter is exercised
    for name, array in _arrays(ref).items():
        np.testing.assert_array_equal(_arrays(mapped)[name], array, err_msg=name)
    assert (mapped.n_lines, mapped.n_skipped_long, mapped.n_skipped_empty) == (
        ref.n_lines, ref.n_skipped_long, ref.n_skipped_empty)
    assert header["pairs"] == len(ref) and header["bpe_sha256"] == sha256_file(bpe_path)
    assert isinstance(mapped._src, np.memmap) and not mapped._src.flags.writeable
    assert mapped._src.dtype == np.uint16
    a, b = BatchIterator(mapped, 1000, seed=3), BatchIterator(ref, 1000, seed=3)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.src, y.src)
        np.testing.assert_array_equal(x.tgt_out, y.tgt_out)
    assert stale_reason(out, sha256_file(bpe_path), PAIR, 40) is None


def test_odd_files_prepare_as_they_read(bpe_path, tmp_path):
    """A byte-order mark, CRLF ends, empty sides and no final newline: as read_parallel."""
    src = "\ufeffHello there.\r\n\r\nA third line.\nno newline".encode()
    tgt = "Hallo.\r\nLeer.\nDritte Zeile.\nkein Zeilenende".encode()
    pair = _write_pair(tmp_path, src, tgt)
    out = str(tmp_path / "c")
    prepare_corpus(*pair, bpe_path, out, max_len=100, workers=1, chunk_bytes=5)
    ref = ParallelCorpus(*read_parallel(*pair), BPE.load(bpe_path), max_len=100)
    got = open_corpus(out)
    assert got.kept.tolist() == ref.kept.tolist() == [0, 2, 3] and got.n_skipped_empty == 1
    for name, array in _arrays(ref).items():
        np.testing.assert_array_equal(_arrays(got)[name], array, err_msg=name)


@pytest.mark.parametrize("workers", [1, 2])
def test_bad_files_are_named_and_leave_nothing(bpe_path, tmp_path, workers):
    out = tmp_path / "c"
    good = "".join(f"line {i}\n" for i in range(3000)).encode()
    # Invalid UTF-8 far into the file: the error names the file's line and byte, not the
    # chunk's.
    pair = _write_pair(tmp_path, good, good[:20000] + b"Gr\xfc\xdfe\n" + good[20000:])
    line = good[:20000].count(b"\n") + 1
    with pytest.raises(DataError, match=rf"a\.de: line {line}: invalid UTF-8 at byte offset "
                                        rf"20002 of the file"):
        prepare_corpus(*pair, bpe_path, str(out), 100, workers=workers, chunk_bytes=4000)
    assert sorted(os.listdir(tmp_path)) == ["a.de", "a.en"]
    for src, tgt, message in [
            (good, good + b"extra\n", r"a\.de: line 3001: no partner line in .*a\.en "
                                      r"\(.*a\.en has 3000 lines, .*a\.de has 3001\)"),
            (good + b"x\ny\n", good, r"a\.en: line 3001: no partner line in .*a\.de"),
            (b"", b"", r"a\.en: empty file")]:
        pair = _write_pair(tmp_path, src, tgt)
        with pytest.raises(DataError, match=message):
            prepare_corpus(*pair, bpe_path, str(out), 100, workers=workers, chunk_bytes=4000)
        assert not out.exists()


def test_a_failed_preparation_keeps_the_previous_corpus(bpe_path, tmp_path):
    out = str(tmp_path / "c")
    prepare_corpus(*PAIR, bpe_path, out, 128, workers=1)
    before = read_header(out)
    with pytest.raises(RuntimeError):
        with CorpusWriter(out, 1000) as writer:
            writer.add(np.arange(3), [3], np.arange(2), [2], [0])
            raise RuntimeError("stopped half-way")
    assert read_header(out) == before and len(open_corpus(out)) == before["pairs"]
    assert sorted(os.listdir(tmp_path)) == ["c"]


def test_a_full_disk_is_one_error_naming_the_corpus(bpe_path, tmp_path, file_size_limit):
    """A write that the file system refuses (here a file-size limit, as a full disk refuses:
    NumPy's short write says only "N requested and M written") is one DataError naming the
    corpus, what was written and the free space; the unfinished corpus is removed and a
    previous one stays."""
    out = str(tmp_path / "c")
    prepare_corpus(*PAIR, bpe_path, out, 128, workers=1)
    before = read_header(out)
    code = f"""
import sys
sys.path.insert(0, {ROOT!r})
from tinytf.data.batches import DataError
from tinytf.data.prepare import prepare_corpus
try:
    prepare_corpus({PAIR[0]!r}, {PAIR[1]!r}, {bpe_path!r}, {out!r}, 128, workers=1)
except DataError as e:
    print(e)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=120, preexec_fn=file_size_limit(100_000))
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert message.startswith(f"{os.path.abspath(out)}: cannot write the encoded corpus: ")
    assert "MiB written so far" in message and "MiB free there" in message, message
    assert read_header(out) == before and sorted(os.listdir(tmp_path)) == ["c"]


def test_a_killed_writer_s_leftovers_go_at_the_next_preparation(bpe_path, tmp_path):
    """A writer killed half-way (SIGKILL: no clean-up runs) leaves ``c.tmp-PID``; the next
    preparation removes it once that process is gone, and leaves a running one's alone."""
    out = str(tmp_path / "c")
    code = ("import time, numpy as np\nfrom tinytf.data.corpus_file import CorpusWriter\n"
            f"w = CorpusWriter({out!r}, 1000)\n"
            "w.add(np.arange(3), [3], np.arange(2), [2], [0])\n"
            "print('half-way', flush=True)\ntime.sleep(120)\n")
    writer = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert writer.stdout.readline().strip() == "half-way"
        leftover = f"{out}.tmp-{writer.pid}"
        assert os.path.isdir(leftover)
        prepare_corpus(*PAIR, bpe_path, out, 128, workers=1)
        assert os.path.isdir(leftover)              # its writer still runs
    finally:
        writer.kill()
        writer.wait()
    prepare_corpus(*PAIR, bpe_path, out, 128, workers=1)
    assert sorted(os.listdir(tmp_path)) == ["c"]
    assert read_header(out)["pairs"] == len(open_corpus(out))


def test_stale_and_foreign_corpora_are_recognised(bpe_path, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    pair = tuple(str(data / os.path.basename(p)) for p in PAIR)
    for p, q in zip(PAIR, pair):
        shutil.copy(p, q)
    out = str(tmp_path / "c")
    sha = sha256_file(bpe_path)
    assert stale_reason(out, sha, pair, 128) == "not prepared yet"
    prepare_corpus(*pair, bpe_path, out, 128, workers=1)
    assert stale_reason(out, sha, pair, 128) is None
    # Touched, not changed (another node's copy): stale by mtime, the same by content.
    os.utime(pair[0], ns=(0, os.stat(pair[0]).st_mtime_ns + 10**9))
    assert "train.en changed" in stale_reason(out, sha, pair, 128)
    assert stale_reason(out, sha, pair, 128, check_mtime=False) is None
    prepare_corpus(*pair, bpe_path, out, 128, workers=1)
    assert stale_reason(out, "0" * 64, pair, 128) == "encoded with another BPE model"
    assert "max_len 128" in stale_reason(out, sha, pair, 64)
    # The same size, one letter changed in the middle: the modification time tells.
    text = bytearray(open(pair[1], "rb").read())
    text[len(text) // 2] = ord("x") if text[len(text) // 2] != ord("x") else ord("y")
    os.utime(pair[1], ns=(0, os.stat(pair[1]).st_mtime_ns))
    open(pair[1], "wb").write(bytes(text))
    assert "train.de changed since it was prepared" in stale_reason(out, sha, pair, 128)
    prepare_corpus(*pair, bpe_path, out, 128, workers=1)
    with open(os.path.join(out, "tgt.bin"), "r+b") as f:   # a truncated file
        f.truncate(100)
    assert "tgt.bin is missing or not" in stale_reason(out, sha, pair, 128)
    with open(os.path.join(out, "header.json"), "w") as f:
        f.write("{not json")
    assert stale_reason(out, sha, pair, 128) == "no readable header"
    with open(os.path.join(out, "header.json"), "w") as f:
        json.dump({"format": "tinytf-corpus", "version": 99}, f)
    assert "version 99" in stale_reason(out, sha, pair, 128)


def _train(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)


TINY = ["--vocab-size", "300", "--max-tokens", "200", *[a for s in (
    "d_model=16", "n_heads=2", "d_ff=32", "n_encoder_layers=1", "n_decoder_layers=1",
    "test_bleu=false", "valid_bleu_sentences=4", "optimizer=adam") for a in ("--set", s)]]


def test_train_prepares_once_maps_on_resume_and_rebuilds_when_stale(data_dir, tmp_path):
    data_dir = shutil.copytree(data_dir, tmp_path / "data")   # changed below
    out = str(tmp_path / "run")
    first = _train("--data", data_dir, "--out", out, "--max-steps", "2", *TINY)
    assert first.returncode == 0, first.stderr
    assert "into " + os.path.join(out, "corpus") + " (not prepared yet)" in first.stderr
    again = _train("--out", out, "--resume", "--max-steps", "3")
    assert again.returncode == 0, again.stderr
    assert "encoding" not in again.stderr
    with open(os.path.join(data_dir, "train.en"), "ab") as f, \
            open(os.path.join(data_dir, "train.de"), "ab") as g:
        f.write(b"One more line.\n")
        g.write(b"Noch eine Zeile.\n")
    stale = _train("--out", out, "--resume", "--max-steps", "4")
    assert "train.en changed since it was prepared" in stale.stderr, stale.stderr


def test_a_bpe_that_runs_out_of_pairs_says_so(data_dir, tmp_path):
    """A --vocab-size beyond what the training text holds: the BPE stops where no pair of
    pieces occurs twice more, and the log line says how many pieces of how many asked."""
    from tinytf.distributed.communicator import SingleCommunicator
    from tinytf.training.config import TrainConfig
    from tinytf.training.run_dir import run_bpe
    lines = []

    class Log:
        info = staticmethod(lines.append)

    cfg = TrainConfig(data=data_dir, out=str(tmp_path), vocab_size=100_000, workers=1)
    pair = (os.path.join(data_dir, "train.en"), os.path.join(data_dir, "train.de"))
    bpe, _, learnt = run_bpe(cfg, SingleCommunicator(), Log, pair)
    assert learnt and len(bpe) < 100_000
    assert f"({len(bpe):,} pieces, not the 100,000 asked: no further pair of pieces occurs " \
        "twice in the training text;" in lines[-1], lines


def test_prepare_command_readies_a_run_directory(data_dir, tmp_path):
    out = str(tmp_path / "run")
    prep = subprocess.run([sys.executable, "-m", "tinytf.commands.prepare", "--data", data_dir,
                           "--out", out, "--vocab-size", "300", "--workers", "2"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert prep.returncode == 0, prep.stderr
    assert sorted(os.listdir(out)) == ["bpe.json", "bpe.source.json", "config.json",
                                       "corpus", "train.lock"]
    other = _train("--data", data_dir, "--out", out, "--max-steps", "1", *TINY,
                   "--vocab-size", "400")
    assert other.returncode == 2 and "was learnt for --vocab-size 300, this run asks for " \
        "400" in other.stderr, other.stderr
    run = _train("--data", data_dir, "--out", out, "--max-steps", "1", *TINY)
    assert run.returncode == 0, run.stderr
    assert "learning a joint BPE" not in run.stderr and "encoding" not in run.stderr
    assert f"BPE: {os.path.join(out, 'bpe.json')} (300 pieces)" in run.stderr
    # A changed text: a run's BPE stays (its checkpoints use it); the corpus is encoded again.
    model = pathlib.Path(out, "bpe.json").read_bytes()
    for lang, line in (("en", "One more line.\n"), ("de", "Noch eine Zeile.\n")):
        with open(os.path.join(data_dir, f"train.{lang}"), "a", encoding="utf-8") as f:
            f.write(line)
    again = subprocess.run([sys.executable, "-m", "tinytf.commands.prepare", "--data", data_dir,
                            "--out", out, "--vocab-size", "300"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0 and "learning" not in again.stderr and \
        "changed since it was prepared" in again.stderr, again.stderr
    assert pathlib.Path(out, "bpe.json").read_bytes() == model
    bad = subprocess.run([sys.executable, "-m", "tinytf.commands.prepare", "--data",
                          str(tmp_path / "none"), "--out", out], cwd=ROOT, capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "no such file" in bad.stderr
    a_file = tmp_path / "a_file"
    a_file.write_text("not a directory\n")
    for command in ([sys.executable, "-m", "tinytf.commands.prepare"],
                    [sys.executable, os.path.join(ROOT, "train.py"), *TINY]):
        proc = subprocess.run([*command, "--data", data_dir, "--out", str(a_file)], cwd=ROOT,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 2 and f"--out {a_file}: a file, not a run directory" in \
            proc.stderr, proc.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_stops_the_prepare_command_with_one_line(data_dir, tmp_path, monkeypatch,
                                                               capsys, sig):
    """A scheduler's SIGTERM (or SIGUSR1, or a Ctrl-C) while tinytf-prepare encodes the
    corpus: it stops at once, with one line and 128 + N (SIGTERM and SIGUSR1 used to kill
    it by their default action, without a word); the BPE model learnt is kept, and the
    handlers are given back."""
    from tinytf.commands import prepare as prepare_command

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), sig)
        time.sleep(30)                  # the handler raises here
        raise AssertionError("the signal did not stop the preparation")

    monkeypatch.setattr(prepare_command, "prepared_corpus", signalled)
    out = tmp_path / "run"
    status = prepare_command.main(["--data", data_dir, "--out", str(out), "--vocab-size",
                                   "300", "--workers", "2"])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 128 + sig, last
    assert last == ("tinytf-prepare: interrupted" if sig == signal.SIGINT else
                    f"tinytf-prepare: stopped by signal {int(sig)} ({sig.name})"), last
    assert (out / "bpe.json").is_file() and not (out / "corpus").exists()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
