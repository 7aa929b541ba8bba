"""Checkpoints: pickle-free npz layout, exact round trip, atomic writes, keep-last, averaging."""
import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time
import zipfile

import numpy as np
import pytest

from tinytf import nn, optim
from tinytf.utils import checkpoint
from tinytf.utils.checkpoint import CheckpointError, CheckpointManager

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model_state(seed=0, scale=1.0):
    rng = np.random.default_rng(seed)
    return {"embed.weight": (scale * rng.standard_normal((7, 4))).astype(np.float32),
            "decoder.layers.0.ff.w1.bias": rng.standard_normal(3).astype(np.float32)}


def _trained_adam():
    """A real Adam state after two steps on a small Linear layer."""
    layer = nn.Linear(4, 3)
    adam = optim.Adam(layer.named_parameters(), lr=0.01)
    rng = np.random.default_rng(1)
    for _ in range(2):
        for _, p in layer.named_parameters():
            p.grad = rng.standard_normal(p.shape).astype(np.float32)
        adam.step()
    return adam


def test_round_trip_is_exact_and_pickle_free(tmp_path):
    path = tmp_path / "c.npz"
    model = _model_state()
    adam = _trained_adam()
    state = adam.state_dict()
    state["nested"] = {"scalar": np.float32(0.5), "list": [1, np.arange(3)], "none": None}
    meta = {"step": 7, "data_state": {"epoch": 2, "index": 3}, "rng_state": {"seed": 1},
            "bpe": {"file": "bpe.json", "sha256": "ab" * 32}}
    checkpoint.save(path, model, optim_state=state, meta=meta)

    # Every entry loads without pickle, and metadata are 0-d unicode arrays of JSON.
    with np.load(path, allow_pickle=False) as npz:
        for key in npz.files:
            assert npz[key].dtype != object
        assert npz["meta/step"].shape == () and npz["meta/step"].dtype.kind == "U"
        np.testing.assert_array_equal(npz["model/embed.weight"], model["embed.weight"])

    ckpt = checkpoint.load(path)
    assert ckpt.step == 7 and ckpt.meta["data_state"] == {"epoch": 2, "index": 3}
    assert ckpt.meta["bpe"]["sha256"] == "ab" * 32
    for name, value in model.items():
        assert ckpt.model[name].dtype == np.float32
        np.testing.assert_array_equal(ckpt.model[name], value)
    assert set(ckpt.optim) == set(state)
    for key, value in state.items():
        if isinstance(value, np.ndarray):
            assert ckpt.optim[key].dtype == value.dtype
            np.testing.assert_array_equal(ckpt.optim[key], value)
    assert ckpt.optim["nested"]["scalar"] == np.float32(0.5)
    assert isinstance(ckpt.optim["nested"]["scalar"], np.float32)
    np.testing.assert_array_equal(ckpt.optim["nested"]["list"][1], np.arange(3))
    assert ckpt.optim["nested"]["none"] is None and ckpt.optim["step"] == 2

    # The loaded state drives a fresh optimizer to the same next step.
    fresh = optim.Adam(nn.Linear(4, 3).named_parameters(), lr=0.01)
    del ckpt.optim["nested"]
    fresh.load_state_dict(ckpt.optim)
    assert fresh.step_count == 2


def test_interrupted_write_leaves_previous_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "c.npz"
    checkpoint.save(path, _model_state(0), meta={"step": 1})

    def crash(src, dst):
        raise OSError("simulated crash before the rename")
    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(checkpoint.CheckpointError, match="simulated crash"):
        checkpoint.save(path, _model_state(1), meta={"step": 2})
    monkeypatch.undo()

    ckpt = checkpoint.load(path)
    assert ckpt.step == 1
    np.testing.assert_array_equal(ckpt.model["embed.weight"], _model_state(0)["embed.weight"])
    assert os.listdir(tmp_path) == ["c.npz"]  # no temporary file left behind


def test_killed_writer_never_leaves_a_broken_file(tmp_path):
    """SIGKILL a process that rewrites a ~16 MB checkpoint in a loop: the file always loads."""
    path = tmp_path / "c.npz"
    script = textwrap.dedent(f"""
        import sys, numpy as np
        sys.path.insert(0, {ROOT!r})
        from tinytf.utils import checkpoint
        big = np.zeros((1024, 4096), np.float32)
        step = 0
        while True:
            step += 1
            big[0, 0] = step
            checkpoint.save({str(path)!r}, {{"w": big}}, meta={{"step": step}})
            print(step, flush=True)
    """)
    for delay in (0.4, 0.7):
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
        proc.stdout.readline()  # the first checkpoint is complete
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        ckpt = checkpoint.load(path)
        assert ckpt.model["w"][0, 0] == ckpt.step >= 1
        assert ckpt.model["w"].shape == (1024, 4096)


def test_bad_files_give_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match="no such checkpoint"):
        checkpoint.load(tmp_path / "missing.npz")
    good = tmp_path / "good.npz"
    checkpoint.save(good, _model_state(), meta={"step": 1})
    data = good.read_bytes()
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated.npz: unreadable checkpoint: the .npz "
                       "archive is truncated or damaged"):
        checkpoint.load(truncated)
    for name, content in (("text.npz", b"not a checkpoint\n"), ("empty.npz", b""),
                          ("array.npy", b"\x93NUMPY")):
        (tmp_path / name).write_bytes(content)
        with pytest.raises(CheckpointError, match=f"{name}: not a checkpoint \\(not a NumPy "
                           ".npz archive\\)"):
            checkpoint.load(tmp_path / name)
    foreign = tmp_path / "foreign.npz"
    np.savez(foreign, w=np.zeros(3))
    with pytest.raises(CheckpointError, match="not a tinytf checkpoint"):
        checkpoint.load(foreign)
    # An object array would need pickle to load: refused, never executed.
    pickled = tmp_path / "pickled.npz"
    np.savez(pickled, **{"meta/format": np.array(checkpoint.FORMAT),
                         "model/w": np.array([{"evil": 1}], dtype=object)})
    with pytest.raises(CheckpointError, match="pickled.npz"):
        checkpoint.load(pickled)
    with pytest.raises(CheckpointError, match="cannot store"):
        checkpoint.save(tmp_path / "x.npz", {}, optim_state={"f": object()})


def test_manager_keeps_last_k_and_best(tmp_path):
    manager = CheckpointManager(tmp_path, keep_last=2)
    losses = {1: 5.0, 2: 4.0, 3: 4.5, 4: None}
    for step, loss in losses.items():
        manager.save(step, _model_state(step), None, {"note": step}, score=loss)
    assert [os.path.basename(p) for p in checkpoint.list_checkpoints(tmp_path)] == \
        ["checkpoint_3.npz", "checkpoint_4.npz"]
    assert checkpoint.load(tmp_path / checkpoint.LAST).step == 4
    best = checkpoint.load(tmp_path / checkpoint.BEST)
    assert best.step == 2 and best.meta["metrics"]["dev_loss"] == 4.0
    np.testing.assert_array_equal(best.model["embed.weight"], _model_state(2)["embed.weight"])
    assert checkpoint.resolve(str(tmp_path)) == str(tmp_path / checkpoint.LAST)
    # A new manager on the same directory remembers the best loss.
    again = CheckpointManager(tmp_path, keep_last=2)
    again.save(5, _model_state(5), None, {}, score=4.2)
    assert checkpoint.load(tmp_path / checkpoint.BEST).step == 2
    again.save(6, _model_state(6), None, {}, score=3.9)
    assert checkpoint.load(tmp_path / checkpoint.BEST).step == 6
    # Numbered checkpoints sort by step, not by name.
    again.keep_last = 0
    again.save(10, _model_state(10), None, {})
    assert checkpoint.list_checkpoints(tmp_path)[-1].endswith("checkpoint_10.npz")


def test_average(tmp_path):
    states = [_model_state(seed) for seed in range(3)]
    paths = []
    for step, state in enumerate(states, 1):
        paths.append(str(tmp_path / f"checkpoint_{step}.npz"))
        checkpoint.save(paths[-1], state, optim_state={"step": step},
                        meta={"step": step, "model_config": {"d_model": 4}})
    avg = checkpoint.average(paths)
    for name in states[0]:
        expected = (states[0][name].astype(np.float64) + states[1][name] + states[2][name]) / 3
        assert avg.model[name].dtype == np.float32
        np.testing.assert_allclose(avg.model[name], expected.astype(np.float32), rtol=1e-7)
    assert avg.meta["model_config"] == {"d_model": 4} and avg.optim is None
    assert avg.meta["averaged_from"] == [f"checkpoint_{i}.npz" for i in (1, 2, 3)]

    bad = str(tmp_path / "bad.npz")
    checkpoint.save(bad, {"embed.weight": np.zeros((2, 2), np.float32),
                          "decoder.layers.0.ff.w1.bias": np.zeros(3, np.float32)})
    with pytest.raises(CheckpointError, match="shape"):
        checkpoint.average([paths[0], bad])
    # Same shapes, another vocabulary: refused, naming both files.
    vocab = [str(tmp_path / f"vocab_{i}.npz") for i in range(2)]
    for path, sha in zip(vocab, ("a" * 64, "b" * 64)):
        checkpoint.save(path, states[0], meta={"bpe": {"file": "bpe.json", "sha256": sha}})
    with pytest.raises(CheckpointError, match="another BPE model than .*vocab_0.npz"):
        checkpoint.average(vocab)
    assert checkpoint.average([vocab[0], vocab[0], paths[1]]).model.keys() == states[0].keys()

    # The command-line script: the last 2 of the run directory.
    out = tmp_path / "avg" / "averaged.npz"
    out.parent.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "tinytf.commands.average",
         "--inputs", str(tmp_path), "--num", "2", "--output", str(out)],
        capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    ckpt = checkpoint.load(out)
    expected = ((states[1]["embed.weight"].astype(np.float64) + states[2]["embed.weight"]) / 2)
    np.testing.assert_allclose(ckpt.model["embed.weight"], expected.astype(np.float32))
    assert ckpt.meta["averaged_from"] == ["checkpoint_2.npz", "checkpoint_3.npz"]
    assert zipfile.is_zipfile(out)

    # An average (no optimizer state) never replaces a checkpoint it averages, nor takes
    # the name of a run's own checkpoints, which --resume and translate.py read.
    before = {p: pathlib.Path(p).read_bytes() for p in paths}
    for inputs, output, words in [
            ([str(tmp_path), "--num", "2"], tmp_path / checkpoint.LAST, "the name of a run's"),
            ([str(tmp_path), "--num", "2"], tmp_path / "avg" / checkpoint.BEST, "the name of"),
            ([str(tmp_path), "--num", "2"], tmp_path / "avg" / "checkpoint_9.npz", "the name"),
            ([paths[0], str(out)], out, "is one of the checkpoints averaged"),
            ([str(tmp_path), "--num", "0"], tmp_path / "avg" / "zero.npz", "--num must be")]:
        result = subprocess.run(
            [sys.executable, "-m", "tinytf.commands.average", "--inputs", *inputs,
             "--output", str(output)], capture_output=True, text=True, timeout=60)
        assert result.returncode == 2 and words in result.stderr, result.stderr
        assert "tinytf-average: error: " in result.stderr
    assert {p: pathlib.Path(p).read_bytes() for p in paths} == before
    assert not (tmp_path / checkpoint.LAST).exists() and checkpoint.load(out).meta[
        "averaged_from"] == ["checkpoint_2.npz", "checkpoint_3.npz"]


def test_a_failed_write_names_the_file_and_keeps_the_old_checkpoint(tmp_path,
                                                                    file_size_limit):
    """A write the file system refuses (here: a file-size limit, as a full disk refuses)
    is one CheckpointError naming the file and the size, and the previous checkpoint at
    that path stays whole."""
    path = tmp_path / "c.npz"
    code = f"""
import sys
import numpy as np
sys.path.insert(0, {ROOT!r})
from tinytf.utils import checkpoint
checkpoint.save({str(path)!r}, {{"w": np.ones(10, np.float32)}})
try:
    checkpoint.save({str(path)!r}, {{"w": np.ones(1_000_000, np.float32)}})
except checkpoint.CheckpointError as e:
    print(e)
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            timeout=60, preexec_fn=file_size_limit(200_000))
    assert result.returncode == 0, result.stderr
    message = result.stdout.strip()
    assert message.startswith(f"{path}: cannot write the checkpoint: File too large")
    assert "needs about 3.8 MiB" in message and "intact" in message
    np.testing.assert_array_equal(checkpoint.load(path).model["w"], np.ones(10, np.float32))
    assert [p.name for p in tmp_path.iterdir()] == ["c.npz"]          # no temporary left
