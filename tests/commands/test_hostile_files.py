"""Hostile and broken files through the commands: one line naming the file and what is
wrong, exit 2, no traceback, nothing allocated from a file's claims before they are checked,
and no output clobbered by a failure (docs/checkpoints.md, "Untrusted files")."""
import io
import json
import os
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest

import tinytf
from tinytf.models.transformer import Transformer, TransformerConfig
from tinytf.text import BPE
from tinytf.utils import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "data", "ende")
LIMIT = "import resource; resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30)); "


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A small run directory: its BPE and one checkpoint of an untrained model."""
    run = tmp_path_factory.mktemp("run")
    lines = open(os.path.join(DATA, "train.en"), encoding="utf-8").read().splitlines()[:200]
    bpe = BPE.learn(lines, vocab_size=300)
    bpe.save(str(run / "bpe.json"))
    tinytf.manual_seed(1)
    config = TransformerConfig(vocab_size=len(bpe), d_model=16, n_heads=2, d_ff=32,
                               n_encoder_layers=1, n_decoder_layers=1, max_len=64)
    meta = {"model_config": config.to_dict(),
            "bpe": {"file": "bpe.json", "sha256": checkpoint.sha256_file(run / "bpe.json")}}
    checkpoint.CheckpointManager(str(run)).save(1, Transformer(config).state_dict(), None, meta)
    return run


def _copy(run_dir, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(run_dir, run)
    return run


def _translate(*args, stdin=subprocess.DEVNULL, limit=True):
    """translate.py in a fresh process under a 3 GiB address-space limit: a claim that
    allocates is a MemoryError traceback, not a machine brought to its knees."""
    code = (LIMIT if limit else "") + \
        "import sys; from tinytf.commands.translate import main; sys.exit(main(sys.argv[1:]))"
    return subprocess.run([sys.executable, "-c", code, *args], cwd=ROOT, stdin=stdin,
                          capture_output=True, text=True, timeout=300)


def _one_line_exit_2(result, *words):
    err = result.stderr.strip()
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in err and len(err.splitlines()) == 1, err
    for word in words:
        assert word in err, err
    return err


def _rewrite(path, member, data: bytes):
    """The checkpoint at ``path`` with ``member`` replaced by ``data``."""
    with zipfile.ZipFile(path) as z:
        members = {i.filename: z.read(i) for i in z.infolist()}
    members[member] = data
    with zipfile.ZipFile(path, "w") as z:
        for name, value in members.items():
            z.writestr(name, value)


def _forge_terabyte_header(path):
    """``path`` with its embedding's .npy header claiming shape (10^12,) over 64 bytes."""
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False,
                                                  "shape": (10 ** 12,)})
    _rewrite(path, "model/embed.weight.npy", header.getvalue() + b"\0" * 64)
    return path


def _run_with_a_link(tmp_path, name):
    """(run directory, outside file): the run's ``name`` is a symbolic link to the file,
    which holds "keep"."""
    outside = tmp_path / "outside.txt"
    outside.write_text("keep\n")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / name)
    return run, outside


def _npy(array) -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array(out, array, allow_pickle=False)
    return out.getvalue()


def test_an_array_header_that_claims_a_terabyte_is_refused_before_loading(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path)
    path = _forge_terabyte_header(run / checkpoint.LAST)
    err = _one_line_exit_2(_translate("--model", str(run)), str(path), "embed.weight",
                           "claims shape (1000000000000,)")
    assert "MemoryError" not in err
    with pytest.raises(checkpoint.CheckpointError, match="claims shape"):
        checkpoint.load(path)


def test_an_object_array_member_is_refused(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path)
    path = run / checkpoint.LAST
    out = io.BytesIO()
    np.lib.format.write_array(out, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    _rewrite(path, "model/embed.weight.npy", out.getvalue())
    _one_line_exit_2(_translate("--model", str(run)), str(path), "object array")


@pytest.mark.parametrize("key, value, words", [
    ("d_model", 65536, ["d_model 65536", "embed.weight"]),
    ("d_ff", 10 ** 9, ["d_ff 1000000000"]),
    ("vocab_size", 10 ** 9, ["vocab_size 1000000000"]),
    ("n_encoder_layers", 10 ** 6, ["1000000 encoder layers"]),
    ("max_len", 10 ** 9, ["max_len 1000000000"]),
    ("n_heads", 3, ["n_heads=3"]),
])
def test_a_model_config_that_claims_more_than_the_arrays_builds_nothing(
        run_dir, tmp_path, key, value, words):
    run = _copy(run_dir, tmp_path)
    path = run / checkpoint.LAST
    with np.load(path) as z:
        config = json.loads(str(z["meta/model_config"][()]))
    config[key] = value
    _rewrite(path, "meta/model_config.npy", _npy(np.array(json.dumps(config))))
    _one_line_exit_2(_translate("--model", str(run)), str(path), *words)


def test_a_model_that_fails_to_load_leaves_the_output_as_it_was(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path)
    path = run / checkpoint.LAST
    data = open(path, "rb").read()
    open(path, "wb").write(data[:len(data) // 2])      # truncated
    output = tmp_path / "o.txt"
    output.write_text("keep\n")
    _one_line_exit_2(_translate("--model", str(path), "--input", os.path.join(DATA, "dev.en"),
                                "--output", str(output)), str(path))
    assert output.read_text() == "keep\n"


def test_a_closed_standard_input_is_one_line(run_dir):
    code = ("import os, sys; os.close(0); sys.stdin = None; "
            "from tinytf.commands.translate import main; sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "--model", str(run_dir)], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    _one_line_exit_2(result, "standard input is closed")


@pytest.mark.parametrize("text, words", [
    ('{"format": ' + "1" * 5000 + "}", ["a number of over 4,300 digits"]),
    ("[" * 200_000 + "]" * 200_000, ["nested too deeply"]),
], ids=["5000-digit-number", "deep-nesting"])
def test_a_bpe_file_with_a_huge_number_or_deep_nesting_is_one_line(tmp_path, text, words):
    model = tmp_path / "bpe.json"
    model.write_text(text)
    result = subprocess.run([sys.executable, "-m", "tinytf.commands.bpe", "encode", "--model",
                             str(model)], cwd=ROOT, input="a b\n", capture_output=True,
                            text=True, timeout=300)
    err = _one_line_exit_2(result, str(model), *words)
    assert "RecursionError" not in err


def test_a_directory_named_like_a_temporary_checkpoint_is_left_alone(tmp_path):
    """A stray temporary file of a killed writer is removed when a run starts; a directory
    of that name is not (it is not a checkpoint's), and starts no longer crash on it."""
    (tmp_path / ".checkpoint_x.tmp").mkdir()
    (tmp_path / ".checkpoint_y.tmp").write_bytes(b"half a checkpoint")
    manager = checkpoint.CheckpointManager(str(tmp_path))
    assert (tmp_path / ".checkpoint_x.tmp").is_dir()
    assert not (tmp_path / ".checkpoint_y.tmp").exists()
    manager.save(1, {"w": np.ones(2, np.float32)}, None, {})
    assert checkpoint.load(tmp_path / checkpoint.LAST).step == 1


def test_a_lock_that_is_a_link_out_of_the_run_directory_is_refused(data_dir, tmp_path, capsys):
    """train.lock replaced by a symbolic link: the run refuses it in one line and the
    link's target is not truncated nor written (it used to receive the PID)."""
    from train_support import _train_tiny
    run, outside = _run_with_a_link(tmp_path, "train.lock")
    code, _, err = _train_tiny(capsys, data_dir, run, "--max-steps", "1")
    assert code == 2 and "train.lock" in err and "symbolic link" in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert outside.read_text() == "keep\n"


def test_a_log_that_is_a_link_out_of_the_run_directory_is_not_written(
        data_dir, tmp_path, capsys):
    """train.log replaced by a symbolic link: the run trains on, says once that it cannot
    write the log there, and writes nothing outside the run directory."""
    from train_support import _train_tiny
    run, outside = _run_with_a_link(tmp_path, "train.log")
    code, out, err = _train_tiny(capsys, data_dir, run, "--max-steps", "2")
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["steps"] == 2
    assert err.count("cannot write") == 1 and "symbolic link" in err
    assert outside.read_text() == "keep\n"


def test_a_bpe_model_smaller_than_the_models_vocabulary_is_refused(run_dir, tmp_path):
    """A checkpoint that does not record its BPE's SHA-256, beside a smaller bpe.json: one
    line before decoding (it used to crash there: "id 826 is outside the vocabulary")."""
    run = _copy(run_dir, tmp_path)
    ckpt = checkpoint.load(run / checkpoint.LAST)
    for name in os.listdir(run):
        if name.startswith("checkpoint"):
            os.remove(run / name)
    meta = {"model_config": ckpt.meta["model_config"]}          # no "bpe" entry
    checkpoint.CheckpointManager(str(run)).save(1, ckpt.model, None, meta)
    lines = open(os.path.join(DATA, "train.en"), encoding="utf-8").read().splitlines()[:200]
    BPE.learn(lines, vocab_size=280).save(str(run / "bpe.json"))
    _one_line_exit_2(_translate("--model", str(run)), "bpe.json", "280 pieces",
                     "has 300")


def _broken_data(data_dir, tmp_path, name, content: bytes | None):
    """A copy of ``data_dir`` with ``name`` replaced by ``content`` (None: a link to
    /dev/null)."""
    data = tmp_path / "data"
    shutil.copytree(data_dir, data)
    os.remove(data / name)
    if content is None:
        os.symlink(os.devnull, data / name)
    else:
        (data / name).write_bytes(content)
    return data


def _nul_at_line(text: bytes, n: int) -> bytes:
    """``text`` with a NUL byte at the start of its line ``n`` (from 1)."""
    lines = text.split(b"\n")
    lines[n - 1] = b"\0" + lines[n - 1]
    return b"\n".join(lines)


def _train_lines(data_dir, lang="en"):
    return open(os.path.join(data_dir, f"train.{lang}"), "rb").read()


@pytest.mark.parametrize("case, name, words", [
    ("cr-only", "train.en", ["carriage returns (CR) only"]),
    ("utf-16", "train.de", ["UTF-16 text", "iconv"]),
    ("nul", "train.en", ["line 5: a NUL byte"]),
    ("dev-nul", "dev.de", ["line 2: a NUL byte"]),
    ("device", "train.en", ["not a regular file"]),
])
def test_data_that_is_not_text_is_named_before_anything_is_learnt(data_dir, tmp_path, capsys,
                                                                  case, name, words):
    """CR-only line ends, UTF-16, NUL bytes and a link to a device are each one line naming
    the file (and line), exit 2, and the run directory gets no BPE and no corpus (CR-only
    used to learn a BPE from one 139 KB "line"; UTF-16 was "no partner line"; the device
    "no such file")."""
    from train_support import _train_tiny
    text = _train_lines(data_dir, name.split(".")[1]) if name.startswith("train") else \
        open(os.path.join(data_dir, name), "rb").read()
    content = {"cr-only": text.replace(b"\n", b"\r"),
               "utf-16": text.decode("utf-8").encode("utf-16"),
               "nul": _nul_at_line(text, 5),
               "dev-nul": text.replace(b"\n", b"\nx\0", 1),
               "device": None}[case]
    data = _broken_data(data_dir, tmp_path, name, content)
    run = tmp_path / "run"
    code, _, err = _train_tiny(capsys, str(data), run, "--max-steps", "1")
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert name in err, err
    for word in words:
        assert word in err, err
    assert not (run / "bpe.json").exists() and not (run / "corpus").exists()


def test_a_stale_corpus_that_was_a_link_is_replaced_and_its_target_left_alone(tmp_path):
    """RUNDIR/corpus as a symbolic link to a directory elsewhere: the new corpus replaces
    the link, nothing is left behind as corpus.old-PID (it used to stay for ever), and the
    directory the link pointed to is untouched."""
    import numpy as np

    from tinytf.data import corpus_file
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    (outside / "keep.txt").write_text("keep\n")
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / "corpus")
    with corpus_file.CorpusWriter(str(run / "corpus"), vocab_size=100) as w:
        w.add(np.array([5, 6]), np.array([2]), np.array([7]), np.array([1]), np.array([0]))
        w.finish({"bpe_sha256": "x", "max_len": 16, "sources": [], "lines": 1,
                  "skipped_long": 0, "skipped_empty": 0})
    assert sorted(os.listdir(run)) == ["corpus"] and not os.path.islink(run / "corpus")
    assert (outside / "keep.txt").read_text() == "keep\n"
    assert len(corpus_file.open_corpus(str(run / "corpus"))) == 1


def test_tinytf_average_refuses_a_forged_array_header_in_one_line(run_dir, tmp_path):
    run = _copy(run_dir, tmp_path)
    path = _forge_terabyte_header(run / checkpoint.LAST)
    code = (LIMIT + "import sys; from tinytf.commands.average import main; "
            "sys.exit(main(sys.argv[1:]))")
    result = subprocess.run([sys.executable, "-c", code, "--inputs", str(path), str(path),
                             "--output", str(tmp_path / "avg.npz")], cwd=ROOT,
                            capture_output=True, text=True, timeout=300)
    _one_line_exit_2(result, str(path), "claims shape")
    assert not (tmp_path / "avg.npz").exists()


def test_tinytf_prepare_names_utf16_data_in_one_line(data_dir, tmp_path):
    text = _train_lines(data_dir, "de").decode("utf-8").encode("utf-16")
    data = _broken_data(data_dir, tmp_path, "train.de", text)
    result = subprocess.run([sys.executable, "-m", "tinytf.commands.prepare", "--data",
                             str(data), "--out", str(tmp_path / "run"), "--vocab-size", "300",
                             "--workers", "1"], cwd=ROOT, capture_output=True, text=True,
                            timeout=300)
    _one_line_exit_2(result, "train.de", "UTF-16 text")
    assert not (tmp_path / "run" / "bpe.json").exists()


def test_a_resume_from_a_forged_model_config_builds_nothing(data_dir, tmp_path, capsys):
    """train.py --resume of a checkpoint whose model_config claims d_model 65536: one line
    before the model is built."""
    from train_support import _train_tiny
    run = tmp_path / "run"
    code, _, err = _train_tiny(capsys, data_dir, run, "--max-steps", "1")
    assert code == 0, err
    path = run / checkpoint.LAST
    with np.load(path) as z:
        config = json.loads(str(z["meta/model_config"][()]))
    config["d_model"] = 65536
    _rewrite(path, "meta/model_config.npy", _npy(np.array(json.dumps(config))))
    code, _, err = _train_tiny(capsys, data_dir, run, "--max-steps", "2", "--resume")
    last = err.strip().splitlines()[-1]     # after the run's progress lines
    assert code == 2 and "error:" in last and "d_model 65536" in last, err
    assert "Traceback" not in err


def test_run_files_nested_too_deeply_read_as_unreadable(tmp_path):
    """The run directory's own JSON (a corpus header, summary.json) nested 200,000 deep is
    unreadable, as a damaged one is (the corpus is encoded again, the summary ignored),
    not a RecursionError traceback."""
    from tinytf.data import corpus_file
    from tinytf.training import run_dir
    deep = "[" * 200_000 + "]" * 200_000
    (tmp_path / corpus_file.HEADER).write_text(deep)
    assert corpus_file.read_header(str(tmp_path)) is None
    assert corpus_file.stale_reason(str(tmp_path), "x", [], 16) == "no readable header"
    (tmp_path / run_dir.SUMMARY_FILE).write_text(deep)
    assert run_dir.finished_summary(str(tmp_path), 1) is None
