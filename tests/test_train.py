"""train.py and tinytf.training.trainer: exact resume, CLI smoke run, clear errors, non-finite
steps."""
import dataclasses
import importlib.util
import io
import json
import math
import os
import pathlib
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest

from tinytf.training import evaluate, loop, pipelined, run_dir, trainer
from tinytf.training.recipes import tiny
from tinytf.training.progress import Progress, budget_seconds_spent
from tinytf.training.config import TrainConfig, TrainError, apply_overrides
from tinytf.utils import checkpoint
from tinytf.utils.log import count_of

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# A model small enough that a step takes milliseconds; dropout on from the start (not the
# tiny preset's late dropout), so resuming must also reproduce the dropout masks; and Adam,
# whose every update moves the weights (RAdam, the tiny preset's, takes no step in its
# first 5, which would leave the comparisons of these short runs empty; its own test below).
TINY = ["d_model=16", "n_heads=2", "d_ff=32", "n_encoder_layers=1", "n_decoder_layers=1",
        "dropout=0.1", "dropout_from_epoch=1", "max_len=64", "train_max_len=40",
        "valid_bleu_sentences=4", "optimizer=adam"]


def _config(data_dir, out, **kw):
    kw = {"save_interval": 1000, "warmup": 4, "lr_factor": 1.0, "max_tokens": 200, **kw}
    cfg = TrainConfig(data=data_dir, out=str(out), vocab_size=300, log_interval=2, seed=3,
                      **kw)
    return apply_overrides(cfg, TINY)


def _run(cfg):
    return trainer.Trainer(cfg, log_stream=open(os.devnull, "w")).train()


def test_resume_is_bitwise_exact(data_dir, tmp_path):
    """N steps + resume + N steps == 2N straight steps, parameters and Adam moments bitwise,
    across an epoch boundary and with gradient accumulation and dropout."""
    n = 5
    straight = _run(_config(data_dir, tmp_path / "straight", max_steps=2 * n, update_freq=2))
    assert straight["steps"] == 2 * n and straight["epoch"] >= 2  # crossed an epoch
    _run(_config(data_dir, tmp_path / "split", max_steps=n, update_freq=2))
    resumed = _run(_config(data_dir, tmp_path / "split", max_steps=2 * n, update_freq=2,
                           resume=True))
    assert resumed["steps"] == 2 * n

    a = checkpoint.load(tmp_path / "straight" / checkpoint.LAST)
    b = checkpoint.load(tmp_path / "split" / checkpoint.LAST)
    assert a.step == b.step == 2 * n
    assert a.meta["data_state"] == b.meta["data_state"]
    assert sorted(a.model) == sorted(b.model)
    for name in a.model:
        assert a.model[name].tobytes() == b.model[name].tobytes(), name
    arrays = [k for k, v in a.optim.items() if isinstance(v, np.ndarray)]
    assert arrays and a.optim["step"] == b.optim["step"] == 2 * n
    for key in arrays:
        assert a.optim[key].tobytes() == b.optim[key].tobytes(), key
    # The split run kept its first checkpoint; the straight one never had one at step n.
    assert os.path.isfile(tmp_path / "split" / f"checkpoint_{n}.npz")


def _train_py(*args, timeout=120):
    """train.py in a subprocess, as a user runs it."""
    return subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def _train_main(capsys, *args):
    """train.py's main() in this process (no interpreter start-up): (status, stdout, stderr)."""
    spec = importlib.util.spec_from_file_location("train_cli", os.path.join(ROOT, "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    code = module.main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def _train_tiny(capsys, data_dir, out, *args):
    """train.py's main() on the test model (TINY, a 300-piece BPE, no test decoding) with
    ``args`` on top: (status, stdout, stderr)."""
    sets = [a for s in TINY for a in ("--set", s)]
    return _train_main(capsys, "--data", data_dir, "--out", str(out), "--vocab-size", "300",
                       "--set", "test_bleu=false", *sets, *args)


def test_cli_smoke_run_prints_json_summary(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    sets = [a for s in TINY for a in ("--set", s)]
    result = _train_py("--data", data_dir, "--out", str(out), "--max-steps", "4",
                       "--vocab-size", "300", "--max-tokens", "200", "--log-interval", "2",
                       "--save-interval", "2", "--keep-last", "1", "--warmup", "2", *sets)
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1  # stdout is only the summary; logs go to stderr
    summary = json.loads(lines[0])
    for key in ("steps", "train_seconds", "target_tokens", "target_tokens_per_s", "dev_loss",
                "dev_bleu"):
        assert key in summary
    assert summary["steps"] == 4 and summary["target_tokens"] > 0
    assert np.isfinite(summary["dev_loss"])
    log = result.stderr
    for word in ("step 2 |", "epoch", "loss", "ppl", "lr", "gnorm", "tok/s", "elapsed", "eta",
                 "dev BLEU"):
        assert word in log, word

    names = sorted(os.listdir(out))
    assert {"bpe.json", "checkpoint_last.npz", "checkpoint_best.npz", "checkpoint_4.npz",
            "train.log", "log.jsonl", "training.svg"} <= set(names)
    assert "checkpoint_2.npz" not in names  # --keep-last 1
    with np.load(out / "checkpoint_last.npz", allow_pickle=False) as npz:
        assert any(k.startswith("model/") for k in npz.files)
        assert any(k.startswith("optim/") for k in npz.files)
        meta = {k[5:]: json.loads(str(npz[k][()])) for k in npz.files
                if k.startswith("meta/")}
    assert meta["step"] == 4
    assert meta["bpe"]["sha256"] == checkpoint.sha256_file(out / "bpe.json")
    assert meta["model_config"]["d_model"] == 16 and meta["train_config"]["max_steps"] == 4
    # The run directory tells its story: options and command line, timestamped log lines.
    config = json.loads((out / "config.json").read_text())
    assert config["options"]["max_steps"] == 4 and config["ranks"] == 1
    assert "--max-steps" in config["command"] and config["tinytf"]
    first = (out / "train.log").read_text().splitlines()[0]
    assert first[:4].isdigit() and " | " in first
    (out / "training.svg").unlink()
    drawn = subprocess.run([sys.executable, "-m", "tinytf.utils.plot", str(out)], cwd=ROOT,
                           capture_output=True, text=True, timeout=60)
    assert drawn.returncode == 0 and (out / "training.svg").read_text().startswith("<svg")
    for where, problem in ((tmp_path / "none", "no such run directory"),
                           (tmp_path, "no log.jsonl (not a run directory)")):
        drawn = subprocess.run([sys.executable, "-m", "tinytf.utils.plot", str(where)], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        assert drawn.returncode == 2 and f"{where}: {problem}" in drawn.stderr, drawn.stderr
    assert {"epoch", "index"} <= set(meta["data_state"]) and "numpy" in meta["rng_state"]
    svg = ET.parse(out / "training.svg").getroot()
    assert svg.tag.endswith("svg") and svg.iter("{http://www.w3.org/2000/svg}polyline")

    # Running again into the same directory without --resume must not overwrite the run.
    code, _, err = _train_main(capsys, "--data", data_dir, "--out", str(out), "--max-steps",
                               "4", *sets)
    assert code == 2 and "already holds a training run" in err and "--resume" in err


def test_bad_data_files_are_named(data_dir, tmp_path, capsys):
    bad = tmp_path / "bad"
    bad.mkdir()
    for name in os.listdir(data_dir):
        (bad / name).write_bytes(open(os.path.join(data_dir, name), "rb").read())
    lines = (bad / "train.de").read_bytes().split(b"\n")
    (bad / "train.de").write_bytes(b"\n".join(lines[:50]) + b"\n")
    result = _train_py("--data", str(bad), "--out", str(tmp_path / "r1"), "--max-steps", "1")
    assert result.returncode == 2
    assert "train.en" in result.stderr and "line 51" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr

    (bad / "train.de").write_bytes(b"\n".join(lines[:9] + [b"Gr\xfc\xdfe"] + lines[10:]))
    code, _, err = _train_main(capsys, "--data", str(bad), "--out", str(tmp_path / "r2"),
                               "--max-steps", "1")
    assert code == 2 and "train.de" in err and "line 10" in err and "UTF-8" in err, err

    (bad / "dev.de").write_bytes(b"")
    (bad / "train.de").write_bytes(b"\n".join(lines))
    code, _, err = _train_main(capsys, "--data", str(bad), "--out", str(tmp_path / "r3"),
                               "--max-steps", "1")
    assert code == 2 and "dev.de" in err and "empty" in err, err

    os.unlink(bad / "dev.en")
    code, _, err = _train_main(capsys, "--data", str(bad), "--out", str(tmp_path / "r4"),
                               "--max-steps", "1")
    assert code == 2 and "dev.en" in err and "no such file" in err, err
    (bad / "dev.en").mkdir()
    code, _, err = _train_main(capsys, "--data", str(bad), "--out", str(tmp_path / "r5"),
                               "--max-steps", "1")
    assert code == 2 and "dev.en: a directory, not a file" in err, err


def test_device_gpu_without_cupy_is_a_usage_error(data_dir, tmp_path):
    """--device gpu where CuPy is not installed: one line that says what to install, exit 2,
    before any work (no run directory, no BPE learnt, no corpus encoded)."""
    if importlib.util.find_spec("cupy") is not None:
        pytest.skip("CuPy is installed here")
    result = _train_py("--data", data_dir, "--out", str(tmp_path / "gpu"), "--device", "gpu",
                       "--max-steps", "1")
    assert result.returncode == 2 and "--device gpu needs CuPy: pip install 'tinytf[gpu]'" \
        in result.stderr, result.stderr
    assert "Traceback" not in result.stderr and not (tmp_path / "gpu").exists()


@pytest.mark.parametrize("device_count", [None, 0])
def test_device_gpu_without_a_usable_gpu_is_a_usage_error(data_dir, tmp_path, capsys,
                                                          cupy_without_a_gpu, device_count):
    """--device gpu where CuPy is installed but CUDA cannot count a GPU (no driver, or one
    older than the wheel's CUDA runtime) or counts none: one line that says so, exit 2,
    before any work (no run directory); the library's Trainer says the same."""
    words = "--device gpu " + cupy_without_a_gpu(device_count)
    out = tmp_path / "gpu"
    code, _, err = _train_main(capsys, "--data", data_dir, "--out", str(out), "--device",
                               "gpu", "--max-steps", "1")
    assert code == 2 and err.strip().endswith(f": error: {words}"), err
    assert len(err.strip().splitlines()) == 1 and not out.exists()
    with pytest.raises(TrainError, match=re.escape(words)):
        trainer.Trainer(_config(data_dir, out, max_steps=1, device="gpu"))
    assert not out.exists()


def test_device_defaults_to_tinytf_device(monkeypatch, capsys):
    """--device defaults to $TINYTF_DEVICE (README: ``--device gpu`` or ``TINYTF_DEVICE=gpu``),
    in train.py as in translate.py; another value than cpu or gpu is a usage error."""
    from tinytf.commands import train as train_command
    from tinytf.commands import translate as translate_command
    for command in (train_command, translate_command):
        monkeypatch.delenv("TINYTF_DEVICE", raising=False)
        assert command.build_parser().get_default("device") == "cpu"
        monkeypatch.setenv("TINYTF_DEVICE", "gpu")
        assert command.build_parser().get_default("device") == "gpu"
        monkeypatch.setenv("TINYTF_DEVICE", "tpu")
        with pytest.raises(SystemExit) as stop:
            command.build_parser()
        assert stop.value.code == 2
        assert "TINYTF_DEVICE must be 'cpu' or 'gpu', got 'tpu'" in capsys.readouterr().err


def test_a_log_that_cannot_be_written_never_stops_the_training(data_dir, tmp_path):
    """train.py 2>&1 | head (or a tee whose reader ended, a closed terminal): its stderr
    pipe closes after a few lines and the run goes on to its end, the lines in train.log
    after a note of the closed stream (it died with exit 1 at the next line). And a log
    file the disk refuses is warned of once, the training going on."""
    out = tmp_path / "run"
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--data", data_dir, "--out",
            str(out), "--max-steps", "3", "--log-interval", "1",
            *[a for kv in TINY for a in ("--set", kv)]]
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    assert proc.stderr.readline()
    proc.stderr.close()
    assert proc.wait(timeout=120) == 0
    log = (out / "train.log").read_text(encoding="utf-8")
    assert "the log's stream stopped taking lines ([Errno 32] Broken pipe)" in log
    assert "stopped (max_steps) at step 3" in log
    assert json.loads((out / "summary.json").read_text())["steps"] == 3

    from tinytf.utils.log import Logger
    stream = io.StringIO()
    logger = Logger(str(tmp_path / "no_such_dir"), stream=stream)
    for i in range(3):
        logger.info(f"line {i}")
        logger.record(step=i)
    lines = stream.getvalue().splitlines()
    assert lines[1].startswith("warning: cannot write ") and "train.log" in lines[1]
    assert sum("cannot write" in line for line in lines) == 2      # once per file
    assert [line for line in lines if line.startswith("line")] == ["line 0", "line 1", "line 2"]


def test_unknown_set_key_is_an_error(tmp_path, capsys):
    code, _, err = _train_main(capsys, "--out", str(tmp_path / "r"), "--set", "d_modle=64")
    assert code == 2 and "d_modle" in err and "d_model" in err
    assert not (tmp_path / "r").exists()
    with pytest.raises(TrainError, match="expected an integer"):
        apply_overrides(TrainConfig(), ["d_model=big"])
    with pytest.raises(TrainError, match="key=value"):
        apply_overrides(TrainConfig(), ["dropout"])
    cfg = apply_overrides(TrainConfig(), ["pre_norm=true", "dropout=0.3", "train_max_len=50"])
    assert cfg.model_overrides == {"pre_norm": True, "dropout": 0.3}
    assert cfg.train_max_len == 50
    assert TrainConfig().resolved().max_minutes == 10.0  # never unbounded by default


def test_non_finite_steps_are_skipped_then_stop(data_dir, tmp_path):
    cfg = _config(data_dir, tmp_path / "nan", max_steps=20)
    cfg.max_bad_steps = 3
    t = trainer.Trainer(cfg, log_stream=open(os.devnull, "w"))
    t.train_step([next(iter(t.batches))])  # one good update
    weight = t.model.embed.weight
    weight.data[5, 0] = np.nan  # a corrupted parameter: every loss is now NaN
    before = t.model.state_dict()
    with pytest.raises(TrainError, match="3 updates in a row had a non-finite"):
        t.train()
    assert t.step == 1 and t.skipped == 3
    after = t.model.state_dict()
    for name in before:  # nothing was updated by the skipped steps
        np.testing.assert_array_equal(after[name], before[name])


def test_resume_refuses_a_different_model(data_dir, tmp_path):
    _run(_config(data_dir, tmp_path / "r", max_steps=1))
    cfg = _config(data_dir, tmp_path / "r", max_steps=2, resume=True)
    cfg.model_overrides["d_ff"] = 64
    with pytest.raises(TrainError, match="d_ff"):
        trainer.Trainer(cfg, log_stream=open(os.devnull, "w"))
    with pytest.raises(TrainError, match="nothing to resume"):
        trainer.Trainer(_config(data_dir, tmp_path / "empty", resume=True))


def test_resume_of_a_checkpoint_older_than_a_model_option(data_dir, tmp_path):
    """A checkpoint written before ``qk_norm`` existed (no such key in its model config)
    resumes as the model it trained (without QK-norm), although the tiny preset now has it;
    asking for it with --set is still a conflict."""
    cfg = _config(data_dir, tmp_path / "r", max_steps=1)
    cfg.model_overrides["qk_norm"] = False
    _run(cfg)
    last = tmp_path / "r" / checkpoint.LAST
    old = checkpoint.load(last)
    meta = dict(old.meta, model_config={k: v for k, v in old.meta["model_config"].items()
                                        if k != "qk_norm"})
    checkpoint.save(last, old.model, optim_state=old.optim, meta=meta)
    assert TrainConfig().resolved().config == "tiny"
    resumed = _config(data_dir, tmp_path / "r", max_steps=2, resume=True)
    assert "qk_norm" not in resumed.model_overrides
    t = trainer.Trainer(resumed, log_stream=open(os.devnull, "w"))
    assert t.model_cfg.qk_norm is False and not any("q_norm" in n for n in t.model.state_dict())
    assert t.train()["steps"] == 2
    asked = _config(data_dir, tmp_path / "r", max_steps=3, resume=True)
    asked.model_overrides["qk_norm"] = True
    with pytest.raises(TrainError, match="qk_norm"):
        trainer.Trainer(asked, log_stream=open(os.devnull, "w"))


STOP_ARGS = ["--max-steps", "40", "--vocab-size", "300", "--max-tokens", "200",
             "--log-interval", "1", "--save-interval", "1000", "--update-freq", "2",
             "--lr-schedule", "inverse_sqrt", "--lr", "2e-3", "--warmup", "5", "--seed", "4",
             *[a for s in TINY for a in ("--set", s)]]


def _with_shipped(data_dir, tmp_path, split):
    """A copy of ``data_dir`` with the shipped corpus's whole ``split`` (both sides)."""
    data = tmp_path / "data"
    data.mkdir()
    for name in os.listdir(data_dir):
        (data / name).write_bytes((pathlib.Path(data_dir) / name).read_bytes())
    for lang in ("en", "de"):
        shipped = pathlib.Path(ROOT, "data", "ende", f"{split}.{lang}")
        (data / f"{split}.{lang}").write_bytes(shipped.read_bytes())
    return data


def _train_cli(*args, **kw):
    return subprocess.Popen([sys.executable, os.path.join(ROOT, "train.py"), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            **kw)


@pytest.mark.parametrize("signum, twice", [(signal.SIGINT, False), (signal.SIGTERM, True),
                                           (signal.SIGUSR1, False)])
def test_a_signal_stops_with_a_checkpoint_first_and_the_run_resumes_exactly(
        data_dir, tmp_path, signum, twice):
    """A stop signal (a second one 50 ms later changes nothing): the run stops after the
    update in progress, writes its checkpoint at once (no validation, no test after the
    signal) and exits 128 + the signal's number. ``--out RUNDIR --resume`` alone then
    continues with the run's own options and ends bitwise where a straight run ends."""
    out = tmp_path / "split"
    proc = _train_cli("--data", data_dir, "--out", str(out), *STOP_ARGS)
    try:
        for line in proc.stderr:
            if line.startswith("step 3 |"):
                proc.send_signal(signum)
                if twice:
                    time.sleep(0.05)
                    proc.send_signal(signum)
                break
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stopped"] == "signal" and summary["signal"] == signum
    assert 3 <= summary["steps"] < 40
    after = stderr[stderr.index("received signal"):]
    assert "valid step" not in after and "test BLEU" not in after
    assert checkpoint.load(out / checkpoint.LAST).step == summary["steps"]

    resumed = _train_cli("--out", str(out), "--resume")     # nothing else: the run's options
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == 40
    straight = _train_cli("--data", data_dir, "--out", str(tmp_path / "straight"), *STOP_ARGS)
    _, stderr = straight.communicate(timeout=300)
    assert straight.returncode == 0, stderr
    a = checkpoint.load(tmp_path / "straight" / checkpoint.LAST)
    b = checkpoint.load(out / checkpoint.LAST)
    assert a.step == b.step == 40
    for name in a.model:
        assert a.model[name].tobytes() == b.model[name].tobytes(), name


@pytest.mark.parametrize("signum, marker", [(signal.SIGTERM, "stopped (max_steps)"),
                                            (signal.SIGINT, "test BLEU")])
def test_a_signal_in_the_final_phase_stops_it_and_the_run_finishes_it_on_resume(
        data_dir, tmp_path, signum, marker):
    """A stop signal after the last update, in the final validation or the test decoding
    (twice, to the whole process group, as a terminal's Ctrl-C or a scheduler sends it):
    the run stops there, with the last update's checkpoint written whole, no traceback,
    not even from the decoding workers, and exit status 128 + N. ``--resume`` then runs the
    final validation and test and writes checkpoint_best.npz."""
    data = _with_shipped(data_dir, tmp_path, "test")   # decoding it takes a second or two
    out = tmp_path / "run"
    proc = _train_cli("--data", str(data), "--out", str(out), *STOP_ARGS,
                      start_new_session=True)
    try:
        for line in proc.stderr:
            if line.startswith(marker):
                os.killpg(proc.pid, signum)
                time.sleep(0.05)
                os.killpg(proc.pid, signum)
                break
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signum, stderr
    assert "Traceback" not in stderr, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stopped"] == "signal" and summary["signal"] == signum
    assert summary["steps"] == 40 and "test_bleu" not in summary
    assert checkpoint.load(out / checkpoint.LAST).step == 40

    resumed = _train_cli("--out", str(out), "--resume")
    stdout, stderr = resumed.communicate(timeout=300)
    assert resumed.returncode == 0, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stopped"] == "max_steps" and summary["steps"] == 40
    assert "test_bleu_beam" in summary
    best = checkpoint.load(out / checkpoint.BEST, with_optim=False)
    assert best.step == 40 and "dev_loss" in best.meta["metrics"]


def test_a_signal_in_a_periodic_validation_ends_it_with_the_checkpoint(data_dir, tmp_path):
    """A stop signal while the run validates (every 20 updates, greedy BLEU of the 500
    shipped dev sentences): the validation ends at once, unfinished, the update's
    checkpoint is written and the run exits 128 + N."""
    data = _with_shipped(data_dir, tmp_path, "dev")
    out = tmp_path / "run"
    proc = _train_cli("--data", str(data), "--out", str(out), *STOP_ARGS,
                      "--valid-interval", "20", "--set", "valid_bleu_sentences=0")
    try:
        for line in proc.stderr:
            if line.startswith("step 20 |"):
                time.sleep(0.15)        # into the validation (about 1 s on 2 cores)
                proc.send_signal(signal.SIGUSR1)
                break
        stdout, stderr = proc.communicate(timeout=300)
    finally:
        proc.kill()
    assert proc.returncode == 128 + signal.SIGUSR1, stderr
    assert "valid step 20" not in stderr and "Traceback" not in stderr, stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["stopped"] == "signal" and summary["steps"] == 20
    assert checkpoint.load(out / checkpoint.LAST).step == 20


@pytest.mark.parametrize("when", ["interval", "final"])
def test_a_failed_validation_costs_no_training(data_dir, tmp_path, monkeypatch, when):
    """A validation that raises (here sacrebleu's scoring, at a periodic validation or the
    final one) writes the update's checkpoint before the error propagates: the run resumes
    from it and ends bitwise where a straight run ends."""
    def failing_bleu(hypotheses, references):
        raise MemoryError("out of memory while scoring")

    steps, valid_interval = 6, (4 if when == "interval" else 100)
    fail_at = 4 if when == "interval" else steps
    cfg = _config(data_dir, tmp_path / "split", max_steps=steps,
                  valid_interval=valid_interval, save_interval=100)
    with monkeypatch.context() as patch:
        patch.setattr(evaluate, "bleu", failing_bleu)
        with pytest.raises(MemoryError):
            _run(cfg)
    assert checkpoint.load(tmp_path / "split" / checkpoint.LAST).step == fail_at
    resumed = _run(dataclasses.replace(cfg, resume=True))
    straight = _run(_config(data_dir, tmp_path / "straight", max_steps=steps,
                            valid_interval=valid_interval, save_interval=100))
    assert resumed["steps"] == straight["steps"] == steps
    a = checkpoint.load(tmp_path / "straight" / checkpoint.LAST)
    b = checkpoint.load(tmp_path / "split" / checkpoint.LAST)
    for name in a.model:
        assert a.model[name].tobytes() == b.model[name].tobytes(), name


def test_a_run_without_sacrebleu_stops_before_training(data_dir, tmp_path, monkeypatch):
    """sacrebleu missing is an error at the start, not after the training."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sacrebleu" else find_spec(name, *a))
    with pytest.raises(TrainError, match="sacrebleu is not installed"):
        _run(_config(data_dir, tmp_path / "nobleu", max_steps=2))
    assert not os.path.exists(tmp_path / "nobleu")


def test_resume_auto_starts_then_continues(data_dir, tmp_path):
    """--resume auto: a new run when RUNDIR has no checkpoint, the run continued when it has
    one (the same command for the first job and every requeue)."""
    out = str(tmp_path / "auto")
    args = ["--data", data_dir, "--out", out, "--resume", "auto", *STOP_ARGS[2:]]
    first = _train_cli(*args, "--max-steps", "3")
    stdout, stderr = first.communicate(timeout=300)
    assert first.returncode == 0, stderr
    assert json.loads(stdout.strip().splitlines()[-1])["steps"] == 3
    again = _train_cli(*args, "--max-steps", "5")
    stdout, stderr = again.communicate(timeout=300)
    assert again.returncode == 0, stderr
    assert "resuming at step 3" in stderr
    summary = json.loads(stdout.strip().splitlines()[-1])
    assert summary["steps"] == 5 and "dev_loss" in summary
    with open(os.path.join(out, "summary.json"), encoding="utf-8") as f:
        assert json.load(f) == summary
    # A requeue of the finished run: nothing to do, the same summary, nothing rewritten.
    log_size = os.path.getsize(os.path.join(out, "log.jsonl"))
    last_written = os.stat(os.path.join(out, "checkpoint_5.npz")).st_mtime_ns
    done = _train_cli(*args, "--max-steps", "5")
    stdout, stderr = done.communicate(timeout=300)
    assert done.returncode == 0, stderr
    assert "already finished at step 5; nothing to do" in stderr and "valid step" not in stderr
    assert json.loads(stdout.strip().splitlines()[-1]) == summary
    assert os.path.getsize(os.path.join(out, "log.jsonl")) == log_size
    assert os.stat(os.path.join(out, "checkpoint_5.npz")).st_mtime_ns == last_written


def test_a_second_training_on_one_run_directory_is_refused(data_dir, tmp_path):
    """RUNDIR is locked while a run trains: another train.py on it stops at once with a
    message naming the holder's PID, and the first run is unharmed."""
    out = str(tmp_path / "locked")
    first = _train_cli("--data", data_dir, "--out", out, *STOP_ARGS[2:], "--max-steps",
                       "100000")
    try:
        for line in first.stderr:
            if line.startswith("step 2 |"):
                break
        second = _train_cli("--data", data_dir, "--out", out, "--resume", "auto",
                            *STOP_ARGS[2:])
        _, err = second.communicate(timeout=120)
        assert second.returncode == 2 and f"PID {first.pid}" in err, err
        first.send_signal(signal.SIGTERM)
        _, stderr = first.communicate(timeout=120)
    finally:
        first.kill()
    assert first.returncode == 143, stderr


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_fp16_training_skips_overflows_and_resumes_with_the_loss_scale(data_dir, tmp_path):
    """--precision fp16 (float16 on NumPy): the first steps overflow at the initial scale
    2^16 and are skipped with the scale halved, without counting as bad steps; the scale
    is saved in the checkpoint and a resumed run starts from it. The expected overflows
    raise no NumPy warning (here an error), and the log warns of the CPU's float16 speed
    before anything else is timed."""
    cfg = _config(data_dir, tmp_path / "fp16", max_steps=4, precision="fp16")
    log = io.StringIO()
    t = trainer.Trainer(cfg, log_stream=log)
    assert "warning: --precision fp16 on the CPU computes in NumPy's float16" in log.getvalue()
    summary = t.train()
    assert summary["steps"] == 4 and summary["precision"] == "fp16"
    scale = t.scaler.scale
    assert scale < 2.0 ** 16 and t.scaler.skipped_steps == summary["skipped_steps"] >= 1
    assert all(p.dtype == np.float32 for _, p in t.model.named_parameters())
    saved = checkpoint.load(tmp_path / "fp16" / checkpoint.LAST).meta["loss_scaler"]
    assert saved["scale"] == scale and saved["enabled"]
    resumed = trainer.Trainer(_config(data_dir, tmp_path / "fp16", max_steps=6,
                                      precision="fp16", resume=True),
                              log_stream=open(os.devnull, "w"))
    assert resumed.scaler.scale == scale
    assert resumed.train()["steps"] == 6


def test_bf16_emulated_training_tracks_float32(data_dir, tmp_path):
    """--precision bf16 on the CPU rounds the products' inputs to bfloat16 (emulated): the
    run differs from float32 in its low bits only, and the master weights stay float32."""
    runs = {}
    for precision in ("float32", "bf16"):
        cfg = _config(data_dir, tmp_path / precision, max_steps=3, precision=precision)
        t = trainer.Trainer(cfg, log_stream=open(os.devnull, "w"))
        runs[precision] = (t.train(), t)
    (s32, t32), (s16, t16) = runs["float32"], runs["bf16"]
    assert s16["precision"] == "bf16" and s16["skipped_steps"] == 0
    assert s16["dev_loss"] == pytest.approx(s32["dev_loss"], rel=2e-2)
    pairs = list(zip(t32.model.named_parameters(), t16.model.named_parameters()))
    assert all(b.dtype == np.float32 for _, (_, b) in pairs)
    assert any(not np.array_equal(a.data, b.data) for (_, a), (_, b) in pairs)


def test_unknown_precision_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _train_main(capsys, "--out", str(tmp_path / "x"), "--precision", "fp8")
    assert e.value.code == 2 and "--precision" in capsys.readouterr().err
    with pytest.raises(TrainError, match="--precision"):
        TrainConfig(precision="fp8").resolved()


def _same_state(a, b):
    """Parameters, Adam's moments and step, and the counters of two trainers, bitwise."""
    sa, sb = a.model.state_dict(), b.model.state_dict()
    for name in sa:
        np.testing.assert_array_equal(sa[name], sb[name], err_msg=name)
    oa, ob = a.optimizer.state_dict(), b.optimizer.state_dict()
    assert oa.keys() == ob.keys() and oa["step"] == ob["step"] == a.step
    for key in oa:
        if key.startswith("exp_avg"):
            np.testing.assert_array_equal(oa[key], ob[key], err_msg=key)
    assert (a.step, a.skipped, a.launched) == (b.step, b.skipped, b.launched)
    assert a.scaler.state_dict() == b.scaler.state_dict()


@pytest.mark.filterwarnings("ignore::RuntimeWarning")  # float16 overflow is the point
@pytest.mark.parametrize("precision", ["float32", "fp16"])
def test_the_loop_keeps_one_update_in_flight_and_equals_train_step(data_dir, tmp_path,
                                                                   precision):
    """PipelinedTrainer.train() reads update k's outcome after launching update k + 1's
    forward and backward (except where the step count decides something: here the
    checkpoint at step 3 and the end at 7), and ends bitwise where train_step called seven
    times ends, and where the plain loop ends. fp16 overflows and skips its first updates,
    decided on the device before the host knows."""
    kw = dict(max_steps=7, save_interval=3, valid_interval=1000, precision=precision,
              clip_norm=0.5)
    piped = pipelined.PipelinedTrainer(_config(data_dir, tmp_path / "piped", **kw),
                                       log_stream=open(os.devnull, "w"))
    events, fb, settle = [], piped.run_batches, piped.settle

    def forward_backward(batches, seed):
        events.append(f"fb{piped.launched}")
        return fb(batches, seed)

    def settle_update(update):
        result = settle(update)
        events.append("skip" if result["skipped"] else f"step{piped.step}")
        return result
    piped.run_batches, piped.settle = forward_backward, settle_update
    summary = piped.train()
    assert summary["steps"] == 7

    synced = trainer.Trainer(_config(data_dir, tmp_path / "synced", **kw),
                             log_stream=open(os.devnull, "w"))
    stream = loop.forever(synced.batches)
    while synced.step < 7:
        synced.train_step([next(stream)])
    _same_state(piped, synced)
    plain = trainer.Trainer(_config(data_dir, tmp_path / "plain", **kw),
                            log_stream=open(os.devnull, "w"))
    assert plain.train()["steps"] == 7
    _same_state(piped, plain)

    skips = events.count("skip")
    assert (skips >= 1) == (precision == "fp16") and piped.skipped == skips
    # Each outcome is read after the next forward-backward was launched, unless the step
    # it may reach is 3, 6 (checkpoints) or 7 (the end): those are read first.
    steps = [e for e in events if e != "skip"]
    assert steps[-1] == "step7" and len(steps) == 7 + 7 + skips
    for i, e in enumerate(events):
        if e.startswith("step") and int(e[4:]) not in (3, 6, 7):
            assert events[i - 1].startswith("fb"), events
    for k in (3, 6):   # the checkpoint saw step k's parameters, nothing launched after
        ckpt = checkpoint.load(tmp_path / "piped" / f"checkpoint_{k}.npz")
        assert ckpt.step == k and ckpt.meta["skipped_steps"] <= skips
        assert events[events.index(f"step{k}") + 1] == f"fb{k + 1 + ckpt.meta['skipped_steps']}"


def test_a_non_finite_loss_skips_the_update_on_the_device(data_dir, tmp_path):
    """A loss that is not finite with finite gradients (float16 logits of -inf do that)
    still skips the update: 0 * loss poisons one gradient entry, so the norm, which the
    device tests, is NaN. Adam's step count takes the skipped update back."""
    t = trainer.Trainer(_config(data_dir, tmp_path / "poison", max_steps=3),
                        log_stream=open(os.devnull, "w"))
    t.train_step([next(iter(t.batches))])
    before = t.model.state_dict()
    run_batches, grads = t.run_batches, []

    def infinite_loss(batches, seed):       # finite gradients, a loss of inf
        _, tokens = run_batches(batches, seed)
        grads.extend(p.grad.copy() for _, p in t.params)
        return np.full((), np.inf, np.float32), tokens
    t.run_batches = infinite_loss
    update = t.launch_step([next(iter(t.batches))])
    assert grads and all(np.isfinite(g).all() for g in grads)
    assert np.isnan(update.norm) and isinstance(update.norm, np.ndarray)  # not read yet
    result = t.settle(update)
    assert result["skipped"] and not result["overflow"] and t.bad_in_a_row == 1
    assert (t.step, t.skipped, t.launched, t.optimizer.step_count) == (1, 1, 2, 1)
    for name, value in t.model.state_dict().items():
        np.testing.assert_array_equal(value, before[name])
    t.run_batches = run_batches
    assert t.train_step([next(iter(t.batches))])["skipped"] is False and t.step == 2


def test_linear_schedule_decays_to_the_step_budget_and_resumes_bitwise(data_dir, tmp_path):
    """The budget-aware schedule by --max-steps: the last update's rate is the formula's at
    (steps - 1) / steps spent, and a run stopped half-way (as by a signal) and resumed with
    the same budget equals a straight one bitwise."""
    n, kw = 4, dict(lr_schedule="linear", lr=1e-3, lr_factor=None, warmup=2, max_steps=8)
    run = trainer.Trainer(_config(data_dir, tmp_path / "straight", **kw),
                          log_stream=open(os.devnull, "w"))
    run.train()
    assert run.optimizer.lr == pytest.approx(run.schedule(2 * n, (2 * n - 1) / (2 * n)))
    spent = (2 * n - 1) / (2 * n)   # the warm-up ended at 2 * spent / (2 * n) of the budget
    assert run.optimizer.lr == pytest.approx(1e-3 * (1 - spent) / (1 - 2 * spent / (2 * n)))

    class StopHalfWay(trainer.Trainer):
        def _account(self, result, progress):
            super()._account(result, progress)
            self.signals.requested = self.signals.requested or self.step == n

    stopped = StopHalfWay(_config(data_dir, tmp_path / "split", **kw),
                          log_stream=open(os.devnull, "w")).train()
    assert stopped["stopped"] == "signal" and n <= stopped["steps"] < 2 * n  # one in flight
    _run(_config(data_dir, tmp_path / "split", resume=True, **kw))
    a = checkpoint.load(tmp_path / "straight" / checkpoint.LAST)
    b = checkpoint.load(tmp_path / "split" / checkpoint.LAST)
    assert a.step == b.step == 2 * n
    for name in a.model:
        assert a.model[name].tobytes() == b.model[name].tobytes(), name
    assert a.meta["budget_progress"] == b.meta["budget_progress"] == 1.0


def test_schedule_flags_on_the_command_line(data_dir, tmp_path, capsys):
    """--lr and --lr-factor together are a usage error; the log's first lines name the
    schedule and its peak, and warn when the peak is far from the preset's."""
    code, _, err = _train_main(capsys, "--out", str(tmp_path / "r"), "--lr", "1e-3",
                               "--lr-factor", "1")
    assert code == 2 and "exclude each other" in err and not (tmp_path / "r").exists()
    code, out, err = _train_tiny(capsys, data_dir, tmp_path / "w", "--max-steps", "1",
                                 "--max-tokens", "200", "--lr-factor", "0.05", "--warmup",
                                 "4000")
    assert code == 0, err
    assert "schedule: noam: lr = 0.05 * 16^-0.5" in err
    assert "warning: peak learning rate" in err and "tuned for" in err


def test_radam_trains_resumes_bitwise_and_older_checkpoints_keep_adam(
        data_dir, tmp_path, capsys):
    """--optimizer radam: the log names it, the first 5 updates change no weight (the
    rectifier is 0 there), a stopped and resumed run equals a straight one bitwise (the
    rectifier follows the restored step), and a checkpoint written before the option existed
    resumes with Adam, whatever the preset's default."""
    with pytest.raises(SystemExit) as usage:
        _train_main(capsys, "--optimizer", "sgd")
    assert usage.value.code == 2 and "invalid choice: 'sgd'" in capsys.readouterr().err
    with pytest.raises(TrainError, match="--optimizer 'sgd'"):
        TrainConfig(optimizer="sgd").resolved()
    code, _, err = _train_tiny(capsys, data_dir, tmp_path / "log", "--max-steps", "1",
                               "--max-tokens", "200", "--set", "optimizer=radam")
    assert code == 0, err
    assert "RAdam: Adam(0.9, 0.98, 1e-9) with its rectifier" in err

    def radam(out, **kw):    # the tiny preset's optimizer, over TINY's Adam
        return apply_overrides(_config(data_dir, out, **kw), ["optimizer=radam"])

    first = trainer.Trainer(radam(tmp_path / "five", max_steps=5),
                            log_stream=open(os.devnull, "w"))
    initial = {n: p.data.copy() for n, p in first.params}
    first.train()
    assert first.optimizer.rectify and first.optimizer.step_count == 5
    assert all(np.array_equal(p.data, initial[n]) for n, p in first.params)
    _run(radam(tmp_path / "straight", max_steps=8))
    _run(radam(tmp_path / "split", max_steps=6))
    _run(radam(tmp_path / "split", resume=True, max_steps=8))
    a = checkpoint.load(tmp_path / "straight" / checkpoint.LAST)
    b = checkpoint.load(tmp_path / "split" / checkpoint.LAST)
    assert a.step == b.step == 8 and a.meta["train_config"]["optimizer"] == "radam"
    for name in a.model:
        assert a.model[name].tobytes() == b.model[name].tobytes(), name
    assert not all(np.array_equal(a.model[n], initial[n]) for n in a.model)

    cfg = _config(data_dir, tmp_path / "old", max_steps=1)
    _run(cfg)
    last = tmp_path / "old" / checkpoint.LAST
    old = checkpoint.load(last)
    options = {k: v for k, v in old.meta["train_config"].items() if k != "optimizer"}
    checkpoint.save(last, old.model, optim_state=old.optim, meta=dict(old.meta,
                                                                      train_config=options))
    resumed = run_dir.resumed_config(dataclasses.replace(cfg, resume=True, max_steps=2),
                                     given={"max_steps"}).resolved()
    assert resumed.optimizer == "adam" and resumed.max_steps == 2


def test_time_budget_progress_continues_from_a_resumed_fraction(data_dir, tmp_path):
    """--max-minutes: the budget spent is the run's training time, earlier invocations'
    included, over the run's budget; the larger of step and time wins."""
    run = trainer.Trainer(_config(data_dir, tmp_path / "r", max_minutes=1.0),
                          log_stream=open(os.devnull, "w"))
    # 50 s spent before this invocation, 50 s left of 100; 25 s into it: 0.75.
    run.progress = Progress(start_step=0, budget=50.0, spent_before=50.0,
                             t_start=time.perf_counter() - 25.0)
    assert run.budget_progress(1) == pytest.approx(0.75, abs=1e-3)
    assert run.progress.budget_seconds_spent() == pytest.approx(75.0, abs=0.1)
    run.progress.t_start -= 1000.0
    assert run.budget_progress(1) == 1.0        # never past the end
    run.cfg.max_steps = 10
    run.progress = None
    assert run.budget_progress(6) == pytest.approx(0.5)
    run.close()
    assert Progress(start_step=0, budget=math.inf, spent_before=50.0).time_spent() == 0.0
    # A checkpoint of older code kept only the fraction: that much of the budget.
    cfg = _config(data_dir, tmp_path / "r", max_minutes=2.0)
    assert budget_seconds_spent({"budget_progress": 0.5}, cfg) == 60.0
    assert budget_seconds_spent({"budget_progress": 0.5, "budget_seconds_spent": 7.5},
                                       cfg) == 7.5


def test_a_resumed_time_budget_is_what_the_run_had_left(data_dir, tmp_path):
    """--max-minutes counts the whole run, resumes included: a run resumed with its time
    budget spent trains no more (a requeue of a finished job: its kept summary); with
    budget left, the first log lines say how much."""
    out = tmp_path / "t"
    first = _run(_config(data_dir, out, max_steps=3))
    last = out / checkpoint.LAST
    ckpt = checkpoint.load(last)
    assert 0 < ckpt.meta["budget_seconds_spent"] < 60
    checkpoint.save(last, ckpt.model, optim_state=ckpt.optim,
                    meta=dict(ckpt.meta, budget_seconds_spent=60.0))
    again = _run(_config(data_dir, out, max_steps=6, max_minutes=1.0, resume=True))
    assert again == first and again["steps"] == 3
    log = (out / "train.log").read_text(encoding="utf-8")
    assert "stop after 6 steps or 1 minute in all (0s of them left)" in log
    assert "already finished at step 3" in log
    checkpoint.save(last, ckpt.model, optim_state=ckpt.optim,
                    meta=dict(ckpt.meta, budget_seconds_spent=30.0))
    more = _run(_config(data_dir, out, max_steps=6, max_minutes=1.0, resume=True))
    assert more["steps"] == 6 and more["stopped"] == "max_steps"
    assert more["run_train_seconds"] == pytest.approx(30.0 + more["train_seconds"], abs=0.01)
    log = (out / "train.log").read_text(encoding="utf-8")
    assert "1 minute in all (30s of them left)" in log


def test_a_budget_given_on_resume_replaces_the_run_s_budget(data_dir, tmp_path):
    """--resume --max-steps N after a time-budgeted run whose minutes are spent (the main
    job's 10) trains on to update N, the stored time budget replaced, not kept beside it;
    --max-minutes or --max-epochs likewise replaces a stored budget; a budget not given is
    kept. Under the linear schedule the new budget gets a warning (the learning rate
    follows it)."""
    from tinytf.training.run_dir import resume_warnings, resumed_config
    out = tmp_path / "t"
    _run(_config(data_dir, out, max_steps=3))
    last = out / checkpoint.LAST
    ckpt = checkpoint.load(last)
    timed = dict(ckpt.meta["train_config"], max_steps=None, max_minutes=1.0)
    checkpoint.save(last, ckpt.model, optim_state=ckpt.optim,
                    meta=dict(ckpt.meta, train_config=timed, budget_seconds_spent=60.0))
    kept = resumed_config(TrainConfig(data=data_dir, out=str(out), resume=True),
                          given=set()).resolved()
    assert (kept.max_steps, kept.max_minutes) == (None, 1.0)
    more = resumed_config(TrainConfig(data=data_dir, out=str(out), resume=True, max_steps=5),
                          given={"max_steps"}).resolved()
    assert (more.max_steps, more.max_minutes) == (5, None)
    summary = _run(more)
    assert summary["steps"] == 5 and summary["stopped"] == "max_steps"
    minutes = resumed_config(TrainConfig(data=data_dir, out=str(out), resume=True,
                                         max_minutes=2.0), given={"max_minutes"}).resolved()
    assert (minutes.max_steps, minutes.max_minutes) == (None, 2.0)
    epochs = resumed_config(TrainConfig(data=data_dir, out=str(out), resume=True,
                                        max_epochs=20), given={"max_epochs"}).resolved()
    assert (epochs.max_steps, epochs.max_minutes, epochs.max_epochs) == (None, None, 20)
    # A new run: --max-epochs bounds it (no 10 minutes added); nothing at all: 10 minutes.
    assert TrainConfig(data=data_dir, max_epochs=3).resolved().max_minutes is None
    assert TrainConfig(data=data_dir).resolved().max_minutes == 10.0

    linear = dataclasses.replace(more, lr_schedule="linear")
    warnings = resume_warnings(dict(timed, lr_schedule="linear"), linear)
    assert len(warnings) == 1 and "max_steps (None -> 5), max_minutes (1.0 -> None)" in \
        warnings[0] and "linear schedule follows it" in warnings[0]
    assert resume_warnings(dict(timed, lr_schedule="linear"), dataclasses.replace(
        linear, max_steps=None, max_minutes=1.0)) == []


def test_the_first_lines_say_whether_a_test_set_will_be_scored(data_dir, tmp_path):
    """The data line counts the test pairs the run will score at its end, or says why none:
    no test.* files in --data, or test_bleu off."""
    import io
    import shutil
    with_test = tmp_path / "with_test"
    shutil.copytree(data_dir, with_test)
    for lang in ("en", "de"):
        shutil.copy(with_test / f"dev.{lang}", with_test / f"test.{lang}")
    cases = [(data_dir, {}, "dev pairs, no test BLEU (no test.en, test.de); "),
             (str(with_test), {"test_bleu": False}, "dev pairs, no test BLEU (test_bleu off); "),
             (str(with_test), {}, "dev pairs, 6 test pairs; ")]
    for i, (data, kw, expected) in enumerate(cases):
        log = io.StringIO()
        t = trainer.Trainer(_config(data, tmp_path / f"run{i}", **kw), log_stream=log)
        t.start_clock()
        t.close()
        assert expected in log.getvalue(), log.getvalue()


def test_warns_when_the_time_budget_allows_few_updates():
    """After 20 updates, a --max-minutes budget that at this pace ends before 800 updates
    gets one warning; a budget of thousands, or the user's own shorter --max-steps, none."""
    progress = Progress(start_step=0, budget=60.0,
                        t_start=time.perf_counter() - 10.0)  # 0.5 s an update
    assert progress.pace_warning(19) is None                  # too early to tell
    warning = progress.pace_warning(20)
    assert "warning: at 0.50 s per update the 1-minute budget" in warning
    assert "ends after about 120 updates" in warning
    assert progress.pace_warning(20) is None                  # once
    resumed = Progress(start_step=100, budget=20.0, spent_before=40.0,   # a resumed run:
                       t_start=time.perf_counter() - 10.0)  # its whole budget and updates
    warning = resumed.pace_warning(120)
    assert "the 1-minute budget ends after about 140 updates" in warning
    for max_steps, per_update in [(0, 0.01), (100, 0.5)]:
        progress = Progress(start_step=0, budget=60.0, max_steps=max_steps,
                            t_start=time.perf_counter() - 20 * per_update)
        assert progress.pace_warning(20) is None


def test_progress_window_and_remaining_time():
    """The log window sums applied updates and reopens when taken; validation pauses count
    against tokens/s, not the budget; the time left is the nearer of the two budgets."""
    progress = Progress(start_step=10, budget=100.0, max_steps=40,
                        t_start=time.perf_counter() - 20.0)
    for loss, tokens in [(2.0, 100), (4.0, 300)]:
        progress.add({"loss": loss, "tokens": tokens, "gnorm": 1.5})
    t_open = progress.window["t"]
    progress.pause(3.0)
    assert progress.valid_seconds == 3.0 and progress.window["t"] == t_open + 3.0
    window = progress.take_window()
    assert window["loss"] == 2.0 * 100 + 4.0 * 300 and window["tokens"] == 400
    assert window["steps"] == 2 and window["gnorm"] == 3.0
    assert progress.window["steps"] == 0
    # 20 s for 10 updates: 2 s each, so 20 more updates need 40 s, before the 80 s left.
    assert progress.remaining(20) == pytest.approx(40.0, abs=0.1)
    assert Progress(start_step=0, budget=10.0, t_start=time.perf_counter() - 20.0
                    ).remaining(5) == 0.0


def test_resume_takes_the_newest_checkpoint_that_loads(data_dir, tmp_path):
    """A truncated checkpoint_last.npz with intact numbered checkpoints resumes from the
    newest of those, saying so; a numbered checkpoint newer than the last one wins."""
    out = tmp_path / "r"
    _run(_config(data_dir, out, max_steps=4, save_interval=2, keep_last=0))
    last = out / checkpoint.LAST
    torn = last.read_bytes()[:1000]
    last.unlink()                     # (the last is a hard link to checkpoint_4.npz)
    last.write_bytes(torn)            # a torn copy
    log = tmp_path / "log.txt"
    t = trainer.Trainer(_config(data_dir, out, max_steps=6, save_interval=2, keep_last=0,
                                resume=True), log_stream=open(log, "w"))
    assert t.step == 4
    text = log.read_text()
    assert "checkpoint_last.npz: unreadable checkpoint" in text
    assert "resuming from" in text and "checkpoint_4.npz (step 4)" in text
    t.train()
    # Now the last is step 6; put a newer numbered checkpoint beside an older last.
    older = checkpoint.load(out / "checkpoint_4.npz")
    last.unlink()
    checkpoint.save(last, older.model, optim_state=older.optim, meta=older.meta)
    t = trainer.Trainer(_config(data_dir, out, max_steps=7, save_interval=2, keep_last=0,
                                resume=True), log_stream=open(os.devnull, "w"))
    assert t.step == 6
    t.close()


def test_patience_and_max_epochs_stop_the_run(data_dir, tmp_path):
    """--patience N stops after N validations without a better --best-metric (here the
    greedy BLEU of a model that barely moves, so it never improves after the first), and
    --max-epochs after that many passes over the data."""
    sets = [a for s in TINY for a in ("--set", s)]
    common = ["--data", data_dir, "--vocab-size", "300", "--max-tokens", "200", *sets]
    result = _train_py(*common, "--out", str(tmp_path / "p"), "--max-steps", "50",
                       "--lr-schedule", "inverse_sqrt", "--lr", "1e-12", "--warmup", "1",
                       "--valid-interval", "1", "--save-interval", "1", "--patience", "2",
                       "--best-metric", "bleu")
    assert result.returncode == 0, result.stderr
    summary = json.loads(result.stdout.strip().splitlines()[-1])
    assert summary["stopped"] == "patience" and summary["steps"] == 3, summary
    best = checkpoint.load(tmp_path / "p" / checkpoint.BEST)
    assert best.step == 1 and "dev_bleu" in best.meta["metrics"]

    t = trainer.Trainer(_config(data_dir, tmp_path / "e", max_epochs=1, max_steps=10_000),
                        log_stream=open(os.devnull, "w"))
    assert t.step_budget() == len(t.batches)
    summary = t.train()
    assert summary["stopped"] == "max_epochs" and summary["steps"] == len(t.batches)


def test_the_linear_schedule_ends_with_the_epochs_of_max_epochs(data_dir, tmp_path):
    """--max-epochs is an update budget too: the linear schedule decays to zero at its last
    update (here 2 epochs at --update-freq 2, the 10-minute time budget far off), and the
    run's clock takes it as its update budget (the time left, the pace warning)."""
    t = trainer.Trainer(_config(data_dir, tmp_path / "e", max_epochs=2, update_freq=2,
                                lr_schedule="linear", lr=1e-3, lr_factor=None, warmup=2,
                                max_minutes=10.0), log_stream=open(os.devnull, "w"))
    steps = -(-2 * len(t.batches) // 2)
    assert t.step_budget() == steps
    lrs = []
    original = t.optimizer.step
    t.optimizer.step = lambda *a, **kw: (lrs.append(t.optimizer.lr), original(*a, **kw))[1]
    summary = t.train()
    assert summary["stopped"] == "max_epochs" and summary["steps"] == steps
    assert t.progress.max_steps == steps
    assert t.lr(steps + 1) == 0.0 and 0 < t.lr(steps) < t.lr(steps - 1)
    assert max(lrs) == pytest.approx(1e-3, rel=0.2) and lrs[-1] == pytest.approx(t.lr(steps))


def test_init_from_starts_a_new_run_from_another_runs_weights(data_dir, tmp_path):
    """--init-from: a new run directory, the source's BPE copied in, its weights loaded
    (fresh optimizer, step 0); another model shape is a clear error."""
    _run(_config(data_dir, tmp_path / "a", max_steps=3))
    source = checkpoint.load(tmp_path / "a" / checkpoint.LAST)
    t = trainer.Trainer(_config(data_dir, tmp_path / "b", max_steps=2,
                                init_from=str(tmp_path / "a")),
                        log_stream=open(os.devnull, "w"))
    assert t.step == 0 and t.optimizer.step_count == 0
    for name, value in t.model.state_dict().items():
        np.testing.assert_array_equal(value, source.model[name])
    assert (tmp_path / "b" / "bpe.json").read_bytes() == (tmp_path / "a" / "bpe.json").read_bytes()
    assert t.train()["steps"] == 2
    cfg = _config(data_dir, tmp_path / "c", max_steps=2, init_from=str(tmp_path / "a"))
    cfg.model_overrides["d_ff"] = 48
    with pytest.raises(TrainError, match="--init-from .* the model differs"):
        trainer.Trainer(cfg, log_stream=open(os.devnull, "w"))


def _start(cfg):
    """Start a run (closed again at once); its log lines."""
    log = io.StringIO()
    trainer.Trainer(cfg, log_stream=log).close()
    return log.getvalue()


def test_a_failed_start_keeps_its_bpe_which_a_changed_text_learns_again(data_dir, tmp_path):
    """A corpus that yields no training pair (CR-only line ends: one huge line per side)
    fails the start after the BPE is learnt; the BPE model is kept, and the next start on
    the same text reuses it. Once the text is mended, the next start learns it again (the
    BPE that a fresh directory learns from that text). A bpe.json learnt, or prepared, for
    another --vocab-size is refused; one that the directory did not learn is reused."""
    text = tmp_path / "text"
    text.mkdir()
    for name in os.listdir(data_dir):
        content = (pathlib.Path(data_dir) / name).read_text(encoding="utf-8")
        (text / name).write_text(content.replace("\n", "\r") if name.startswith("train")
                                 else content, encoding="utf-8")
    run = tmp_path / "run"
    for attempt in range(2):
        log = io.StringIO()
        with pytest.raises(TrainError, match="0 batches"):
            trainer.Trainer(_config(str(text), run, max_steps=1), log_stream=log)
        assert ("learning a joint BPE" in log.getvalue()) == (attempt == 0), log.getvalue()
        assert (run / "bpe.json").is_file() and (run / run_dir.BPE_SOURCE_FILE).is_file()

    for name in ("train.en", "train.de"):                      # the text mended
        (text / name).write_bytes((pathlib.Path(data_dir) / name).read_bytes())
    log = _start(_config(str(text), run, max_steps=1))
    assert f"{run / 'bpe.json'} was learnt from other training text ({text / 'train.en'}: " \
        "its content differs): learning it again" in log, log
    _start(_config(data_dir, tmp_path / "fresh", max_steps=1))
    assert (run / "bpe.json").read_bytes() == (tmp_path / "fresh" / "bpe.json").read_bytes()
    assert "learning a joint BPE" not in _start(_config(str(text), run, max_steps=1))
    swapped = dataclasses.replace(_config(str(text), run, max_steps=1), src="de", tgt="en")
    assert "learning a joint BPE" not in _start(swapped)   # the same joint BPE either way

    (run / "config.json").unlink()           # the BPE's own record says its --vocab-size
    with pytest.raises(TrainError, match="learnt for --vocab-size 300, this run asks for 280"):
        trainer.Trainer(dataclasses.replace(_config(str(text), run, max_steps=1),
                                            vocab_size=280), log_stream=open(os.devnull, "w"))

    # A bpe.json put there by hand (not the one the record names) is the run's, as it is.
    (run / "bpe.json").write_bytes((run / "bpe.json").read_bytes().replace(b"\n", b"\r\n"))
    (text / "train.en").write_text("Another text.\n", encoding="utf-8")
    (text / "train.de").write_text("Ein anderer Text.\n", encoding="utf-8")
    log = _start(_config(str(text), run, max_steps=1))
    assert "learning a joint BPE" not in log and f"BPE: {run / 'bpe.json'}" in log, log


def test_fitted_batch_halves_to_the_floor_while_the_budget_holds_too_few_updates():
    """--min-updates: the batch is halved while the time budget at the measured pace holds
    fewer updates than asked, down to 1,024 tokens; a step budget that ends the run first
    leaves it alone."""
    from tinytf.training.recipes.tiny import MIN_FITTED_TOKENS, fitted_max_tokens
    # 1.2 s per 2,048-token update: 500 in 10 minutes; 1,024 tokens give about 1,000.
    assert fitted_max_tokens(2048, 1.2, 600.0, 1500) == 1024 == MIN_FITTED_TOKENS
    assert fitted_max_tokens(2048, 0.3, 600.0, 1500) == 2048     # 2,000 updates: enough
    assert fitted_max_tokens(8192, 2.4, 600.0, 1000) == 2048     # 250 -> 500 -> 1,000
    assert fitted_max_tokens(8192, 2.4, 600.0, 10**9) == 1024    # never below the floor
    assert fitted_max_tokens(2048, 1.2, 600.0, 1500, max_steps=400) == 2048  # steps end first
    assert fitted_max_tokens(4096, 2.4, 600.0, 1500, max_steps=400) == 2048  # 250 -> 500
    assert fitted_max_tokens(512, 10.0, 60.0, 1500) == 512       # already below the floor


def test_the_tiny_preset_fits_its_batch_whoever_chose_it():
    """min_updates resolves to the tiny preset's 1,500 whether --max-tokens is the preset's or
    the user's (it is the largest batch the fit keeps), to 0 for the paper's presets; a
    user's value is kept, and 0 keeps --max-tokens as given."""
    assert TrainConfig().resolved().min_updates == 1500
    assert tiny.fits_batch(TrainConfig().resolved())                 # the 10-minute default
    assert TrainConfig(max_tokens=8192).resolved().min_updates == 1500
    assert tiny.fits_batch(TrainConfig(max_tokens=8192).resolved())
    assert TrainConfig(max_tokens=4096, min_updates=800).resolved().min_updates == 800
    assert not tiny.fits_batch(TrainConfig(max_tokens=4096, min_updates=0).resolved())
    assert not tiny.fits_batch(TrainConfig(max_tokens=1024).resolved())  # cannot halve: not timed
    assert TrainConfig(config="base").resolved().min_updates == 0
    assert not tiny.fits_batch(TrainConfig(max_steps=100).resolved())  # no time budget
    with pytest.raises(TrainError, match="--min-updates must not be negative"):
        TrainConfig(min_updates=-1).resolved()


def test_a_fitted_batch_trains_as_if_the_user_had_chosen_it(data_dir, tmp_path):
    """A run whose budget is too short for its --max-tokens (here the user's) starts with the
    halved batch, logs why and how to keep it, and its first update equals, bitwise, that of
    a run given that batch: timing the batches changes no weight and no random state."""
    import io
    log = io.StringIO()
    fitted = trainer.Trainer(_config(data_dir, tmp_path / "fitted", max_tokens=2048,
                                     min_updates=10**9, max_minutes=1.0), log_stream=log)
    assert fitted.cfg.max_tokens == 1024 and fitted.batches.max_tokens == 1024
    assert "batch: 1,024 tokens, fitted to the budget: an update of 2,048 tokens takes" in \
        log.getvalue()
    assert "--min-updates 0 keeps 2,048" in log.getvalue()
    given = trainer.Trainer(_config(data_dir, tmp_path / "given", max_tokens=1024,
                                    min_updates=0, max_minutes=1.0),
                            log_stream=open(os.devnull, "w"))
    for run in (fitted, given):
        run.train_step([next(iter(run.batches))])
    for (name, a), (_, b) in zip(fitted.params, given.params):
        assert a.data.tobytes() == b.data.tobytes(), name
    fitted.close(), given.close()


def test_option_messages_name_the_flag_or_set():
    """A bad value is named as the user sets it: train.py's flag for an option that has one
    (every flag in train_config.FLAGS is train.py's), else ``--set key``."""
    from tinytf.commands.train import build_parser
    from tinytf.training.config import FLAGS, option_of
    flags = {s for action in build_parser()._actions for s in action.option_strings}
    assert {option_of(key) for key in FLAGS} <= flags
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert FLAGS <= fields and {f"--{k.replace('_', '-')}" for k in fields - FLAGS} \
        .isdisjoint(flags)
    for key, value, message in (("max_tokens", 0, "--max-tokens must be at least 1, got 0"),
                                ("train_max_len", 0, "--set train_max_len must be at least 1"),
                                ("clip_norm", -1.0, "--clip-norm must not be negative"),
                                ("lr_factor", 0.0, "--lr-factor must be positive")):
        with pytest.raises(TrainError, match=message):
            dataclasses.replace(TrainConfig().resolved(), **{key: value}).check()


def test_min_updates_on_the_command_line(data_dir, tmp_path, capsys):
    """--min-updates reaches the config (and is checked); with --max-tokens and a budget
    that holds enough updates the batch is the user's, and the summary reports it."""
    code, _, err = _train_main(capsys, "--out", str(tmp_path / "bad"), "--min-updates", "-1")
    assert code == 2 and "error: --min-updates must not be negative, got -1" in err, err
    code, out, err = _train_tiny(capsys, data_dir, tmp_path / "r", "--max-minutes", "0.2",
                                 "--max-steps", "2", "--min-updates", "3", "--max-tokens",
                                 "2048")
    assert code == 0, err
    assert "batch: 2,048 tokens: an update of 2,048 tokens takes about" in err  # steps end first
    assert json.loads(out.strip().splitlines()[-1])["max_tokens"] == 2048


def test_a_job_requeued_with_its_first_command_keeps_its_fitted_batch(data_dir, tmp_path,
                                                                      capsys):
    """A --max-tokens fitted to the budget is stored with the batch it came from: the same
    command with --resume auto (a requeued job) continues with the fitted batch, as the
    run trained, instead of refusing the batch iterator's position."""
    args = ("--max-minutes", "0.03", "--min-updates", "1000000000", "--max-tokens", "2048",
            "--resume", "auto")
    code, out, err = _train_tiny(capsys, data_dir, tmp_path / "r", *args)
    assert code == 0, err
    first = json.loads(out.strip().splitlines()[-1])
    assert first["max_tokens"] == 1024 and "fitted to the budget" in err
    # As if the job had been preempted before it spent its budget (its checkpoint's time
    # spent set back to none; a finished one is not trained again).
    last = tmp_path / "r" / checkpoint.LAST
    ckpt = checkpoint.load(last)
    checkpoint.save(last, ckpt.model, optim_state=ckpt.optim,
                    meta=dict(ckpt.meta, budget_seconds_spent=0.0))
    code, out, err = _train_tiny(capsys, data_dir, tmp_path / "r", *args)
    assert code == 0, err
    again = json.loads(out.strip().splitlines()[-1])
    assert again["max_tokens"] == 1024 and again["steps"] > first["steps"]
    assert "resuming with changed" not in err and "fitted to the budget" not in err


def test_late_dropout_resolves_per_preset_and_is_checked():
    """The tiny preset's dropout acts from epoch 5, the paper's presets' from the start; a
    user's value is kept, and a value below 1 is an error."""
    assert TrainConfig().resolved().dropout_from_epoch == 5
    assert TrainConfig(config="base").resolved().dropout_from_epoch == 1
    assert apply_overrides(TrainConfig(), ["dropout_from_epoch=1"]).resolved() \
        .dropout_from_epoch == 1
    with pytest.raises(TrainError, match="dropout_from_epoch must be at least 1"):
        TrainConfig(dropout_from_epoch=0).resolved()


def test_the_help_lists_each_presets_defaults_as_a_command_line_that_gives_them():
    """``train.py --help`` ends with each preset's training defaults; read back as a
    command line, each line is accepted (keys without an option of their own as ``--set``)
    and resolves to exactly those defaults."""
    import shlex

    from tinytf.commands.train import build_parser, config_from_args
    parser = build_parser()
    lines = [line for line in parser.epilog.splitlines() if line.startswith("  ")]
    assert len(lines) == len(TrainConfig.PRESET_DEFAULTS)
    assert "--set dropout_from_epoch=5" in lines[0] and "--dropout-from-epoch" not in lines[0]
    for line, (name, defaults) in zip(lines, TrainConfig.PRESET_DEFAULTS.items()):
        argv = shlex.split(line.split(":", 1)[1].split("(peak lr")[0])
        config = "tiny" if name == "tiny" else "base"
        cfg = config_from_args(parser.parse_args(argv + ["--config", config])).resolved()
        assert {k: getattr(cfg, k) for k in defaults} == defaults


def test_late_dropout_trains_without_dropout_until_its_epoch_and_resumes_bitwise(
        data_dir, tmp_path):
    """With dropout_from_epoch=2 the updates of epoch 1 equal, bitwise, those of a model
    without dropout; from epoch 2 on the masks act (the weights part), the log says when,
    and a run stopped in epoch 1 and resumed past the switch equals a straight run."""
    import io

    def late(out, **kw):
        return apply_overrides(_config(data_dir, out, **kw), ["dropout_from_epoch=2"])

    def no_dropout(out, **kw):
        return apply_overrides(_config(data_dir, out, **kw), ["dropout=0"])
    probe = trainer.Trainer(late(tmp_path / "probe"), log_stream=open(os.devnull, "w"))
    per_epoch = len(probe.batches)
    probe.close()
    assert per_epoch >= 2
    weights = {}
    for name, make in (("late", late), ("none", no_dropout)):
        for steps in (per_epoch, per_epoch + 2):
            log = io.StringIO()
            t = trainer.Trainer(make(tmp_path / f"{name}{steps}", max_steps=steps),
                                log_stream=log)
            t.train()
            weights[name, steps] = [p.data.copy() for _, p in t.params]
            if name == "late":
                assert ("dropout: none in epochs 1-1, 0.1 from epoch 2 on" in log.getvalue())
                assert ("epoch 2: dropout 0.1 from here on" in log.getvalue()) == \
                    (steps > per_epoch)
            t.close()
    for a, b in zip(weights["late", per_epoch], weights["none", per_epoch]):
        assert a.tobytes() == b.tobytes()                   # epoch 1: no dropout
    assert any(a.tobytes() != b.tobytes() for a, b in
               zip(weights["late", per_epoch + 2], weights["none", per_epoch + 2]))
    _run(late(tmp_path / "split", max_steps=per_epoch - 1))
    _run(late(tmp_path / "split", max_steps=per_epoch + 2, resume=True))
    resumed = checkpoint.load(tmp_path / "split" / checkpoint.LAST)
    straight = checkpoint.load(tmp_path / f"late{per_epoch + 2}" / checkpoint.LAST)
    for name in straight.model:
        assert straight.model[name].tobytes() == resumed.model[name].tobytes(), name


def test_budget_epochs():
    """Passes over the data in a budget: updates x update_freq / batches, capped by
    max_epochs; None when nothing bounds them."""
    from tinytf.training.recipes.tiny import budget_epochs
    assert budget_epochs(2680, 1, 98) == pytest.approx(27.35, abs=0.01)
    assert budget_epochs(100, 2, 50) == 4.0
    assert budget_epochs(100, 2, 50, max_epochs=3) == 3
    assert budget_epochs(None, 1, 50, max_epochs=3) == 3
    assert budget_epochs(None, 1, 50) is None


def _preset_dropout_trainer(data_dir, tmp_path, out, *overrides, **kw):
    """A Trainer with the tiny preset's own dropout options (TINY without its dropout and
    dropout_from_epoch) and ``overrides`` on top, and the StringIO its log goes to."""
    import io
    preset = [x for x in TINY if not x.startswith(("dropout_from_epoch", "dropout="))]
    cfg = apply_overrides(TrainConfig(data=data_dir, out=str(tmp_path / out), seed=3,
                                      vocab_size=300, max_tokens=200, save_interval=1000, **kw),
                          [*preset, *overrides])
    log = io.StringIO()
    return trainer.Trainer(cfg, log_stream=log), log


def test_late_dropout_gives_way_to_a_long_budget(data_dir, tmp_path):
    """The tiny preset's late dropout (from epoch 5) starts at epoch 3 instead
    (long_dropout_from_epoch) where the budget holds full_dropout_epochs (8) epochs or more:
    a step budget decides before the first update; a user's dropout_from_epoch is kept
    whatever the budget, and a resumed run keeps what its start chose. (A time budget:
    the next test.)"""
    import io

    def start(out, *overrides, **kw):
        t, log = _preset_dropout_trainer(data_dir, tmp_path, out, *overrides, **kw)
        return t, log.getvalue()

    probe, _ = start("probe", max_steps=1)
    per_epoch = len(probe.batches)
    epochs = TrainConfig().resolved().full_dropout_epochs
    assert epochs == 8 and probe.cfg.dropout_from_epoch == 5
    assert probe.cfg.long_dropout_from_epoch == 3
    assert probe.cfg.full_dropout_epochs == 0       # decided: late dropout, whatever comes
    probe.close()
    for out, kw, first in (("long", dict(max_steps=epochs * per_epoch), 3),
                           ("short", dict(max_steps=epochs * per_epoch - 1), 5)):
        t, log = start(out, **kw)
        assert t.cfg.dropout_from_epoch == first, out
        assert ("dropout: from epoch 3" in log) == (first == 3)
        t.close()
    t, log = start("from-1", "long_dropout_from_epoch=1", max_steps=epochs * per_epoch)
    assert t.cfg.dropout_from_epoch == 1 and "dropout: from the first epoch: the budget" in log
    t.close()
    kept, _ = start("kept", "dropout_from_epoch=5", max_steps=epochs * per_epoch)
    assert kept.cfg.dropout_from_epoch == 5 and kept.cfg.full_dropout_epochs == 0
    kept.close()
    # Resumed as train.py resumes (the checkpoint's options): its choice stands, though the
    # new budget would choose otherwise.
    from tinytf.training.run_dir import resumed_config
    t, _ = start("resumed", max_steps=epochs * per_epoch)
    t.cfg = dataclasses.replace(t.cfg, max_steps=2)
    t.train()
    cfg = resumed_config(TrainConfig(data=data_dir, out=str(tmp_path / "resumed"), resume=True,
                                     max_steps=4), given={"max_steps"}).resolved()
    log = io.StringIO()
    again = trainer.Trainer(cfg, log_stream=log)
    assert again.cfg.dropout_from_epoch == 3 and again.step == 2
    assert "dropout: from epoch 3" not in log.getvalue()
    assert "resuming with changed" not in log.getvalue()
    again.close()


def test_the_dropout_log_never_rounds_a_count_onto_its_threshold(tmp_path):
    """A count just under full_dropout_epochs prints below it, one just over at or above
    it: the figures are rounded down, never up to 8.0 for a budget of 7.97 epochs."""
    import io

    from tinytf.training.recipes.tiny import dropout_for_budget, epochs_text
    from tinytf.utils.log import Logger

    assert [epochs_text(e) for e in (7.97, 7.999999, 8.0, 8.04, 15.0)] == \
        ["7.9", "7.9", "8.0", "8.0", "15.0"]
    assert epochs_text(8.7, 0) == "8"
    tiny = TrainConfig(max_minutes=10).resolved()
    assert tiny.full_dropout_epochs == 8
    for epochs, want in ((7.97, "late dropout): the budget holds about 7.9 epochs"),
                         (8.04, "from epoch 3: the budget holds about 8.0 epochs")):
        stream = io.StringIO()
        dropout_for_budget(tiny, 0.1, epochs, Logger(tmp_path, stream=stream),
                           pace=" at the pace of epochs 1-2")
        lines = stream.getvalue().splitlines()
        assert len(lines) == 1 and want in lines[0], lines


def test_a_time_budget_decides_dropout_at_the_pace_of_its_first_epochs(data_dir, tmp_path):
    """With --max-minutes the choice waits for the first update of epoch 3: the passes
    the budget holds are counted at the pace of epochs 1-2 (here capped by --max-epochs,
    so that the count is exact), the log, config.json and the checkpoints state it, and a
    run stopped before epoch 3 decides when its resumed part gets there."""
    import io

    from tinytf.training.run_dir import resumed_config

    def run(out, max_epochs, **kw):
        t, log = _preset_dropout_trainer(data_dir, tmp_path, out, max_minutes=10_000,
                                         min_updates=0, max_epochs=max_epochs, **kw)
        assert t.cfg.dropout_from_epoch == 5 and t.recipe.decided_at == 3
        assert t.model_cfg.dropout == 0.1
        return t.train(), log.getvalue()

    summary, log = run("long", 8)
    assert ("dropout: none in epochs 1-2; then, at the pace of those epochs, from epoch 3 "
            "(at 0.1, 0.02 more for each epoch past 10, at most 0.3) if the budget holds "
            "full_dropout_epochs 8 epochs or more, else 0.1 from epoch 5" in log)
    assert "dropout: none in epochs 1-4" not in log
    assert "dropout: from epoch 3: the budget holds about 8.0 epochs at the pace of " \
           "epochs 1-2 (" in log
    assert log.index("dropout: from epoch 3:") < log.index("epoch 3: dropout 0.1 from here on")
    assert summary["dropout_from_epoch"] == 3 and summary["epoch"] == 8
    saved = checkpoint.load(tmp_path / "long" / checkpoint.LAST).meta["train_config"]
    assert saved["dropout_from_epoch"] == 3
    config = json.loads((tmp_path / "long" / "config.json").read_text())
    assert config["options"]["dropout_from_epoch"] == 3

    summary, log = run("short", 7)
    assert ("dropout: 0.1 from epoch 5 (late dropout): the budget holds about 7.0 epochs "
            "at the pace of epochs 1-2 (" in log)
    assert "epoch 5: dropout 0.1 from here on" in log and "epoch 3: dropout" not in log
    saved = checkpoint.load(tmp_path / "short" / checkpoint.LAST).meta["train_config"]
    assert (saved["dropout_from_epoch"], saved["full_dropout_epochs"]) == (5, 0)

    # Stopped in epoch 2 (as by a signal), resumed with its first command: the resumed
    # part decides.
    class StopInEpoch2(trainer.Trainer):
        def _account(self, result, progress):
            super()._account(result, progress)
            self.signals.requested = self.signals.requested or self.batches.epoch == 2

    t, _ = _preset_dropout_trainer(data_dir, tmp_path, "resumed", max_minutes=10_000,
                                   min_updates=0, max_epochs=8)
    t.close()
    t = StopInEpoch2(t.cfg, log_stream=io.StringIO())
    stopped = t.train()
    assert stopped["stopped"] == "signal" and stopped["epoch"] == 2
    cfg = resumed_config(TrainConfig(data=data_dir, out=str(tmp_path / "resumed"),
                                     resume=True, max_minutes=10_000, max_epochs=8),
                         given={"max_minutes", "max_epochs"}).resolved()
    log = io.StringIO()
    again = trainer.Trainer(cfg, log_stream=log)
    assert again.recipe.decided_at == 3 and again.cfg.dropout_from_epoch == 5
    assert again.train()["dropout_from_epoch"] == 3
    assert "dropout: from epoch 3: the budget holds about" in log.getvalue()


def test_a_long_budget_raises_the_dropout_rate(data_dir, tmp_path):
    """Where the budget starts dropout at epoch 3, the tiny preset's P_drop grows with the
    epochs: the model's 0.1 up to 10, then dropout_per_epoch (0.02) more for each, up to
    0.3. The model trains at that rate, the log says so, a user's ``--set dropout`` is kept,
    and a resumed run keeps the rate its start chose."""
    import io

    from tinytf.models.transformer import SublayerConnection
    from tinytf.training.recipes.tiny import MAX_BUDGET_DROPOUT, budget_dropout
    assert budget_dropout(0.1, 0.02, 10, 9.8) == 0.1      # never below the model's
    assert budget_dropout(0.1, 0.02, 10, 10) == 0.1
    assert budget_dropout(0.1, 0.02, 10, 15) == 0.2
    assert budget_dropout(0.1, 0.02, 10, 17.4) == 0.25
    assert budget_dropout(0.1, 0.02, 10, 80) == MAX_BUDGET_DROPOUT == 0.3
    assert budget_dropout(0.4, 0.02, 10, 80) == 0.4       # nor lowering a higher one
    assert budget_dropout(0.1, 0.0, 0, 80) == 0.1         # the paper's presets: off
    tiny, base = TrainConfig().resolved(), TrainConfig(config="base").resolved()
    assert (tiny.dropout_per_epoch, tiny.dropout_rises_after) == (0.02, 10)
    assert (base.dropout_per_epoch, base.dropout_rises_after) == (0.0, 0)

    def start(out, *overrides, **kw):
        return _preset_dropout_trainer(data_dir, tmp_path, out, *overrides, **kw)

    probe, _ = start("probe", max_steps=1)
    per_epoch = len(probe.batches)
    probe.close()
    t, stream = start("fifteen", max_steps=15 * per_epoch)
    log = stream.getvalue()
    assert t.cfg.dropout_from_epoch == 3 and t.cfg.model_overrides["dropout"] == 0.2
    assert t.model_cfg.dropout == t.model.config.dropout == 0.2
    layers = [m for _, m in t.model.named_modules() if isinstance(m, SublayerConnection)]
    assert layers and all(m.dropout.p == 0.2 for m in layers)
    assert t.model.pos.dropout.p == 0.2
    assert ("dropout: from epoch 3 at 0.2: the budget holds about 15 epochs, at least "
            "full_dropout_epochs 8, and 0.02 more for each past 10, at most 0.3" in log)
    assert "--set dropout=0.1 keeps the model's rate" in log
    t.cfg = dataclasses.replace(t.cfg, max_steps=2)
    summary = t.train()
    assert summary["dropout"] == 0.2 and summary["dropout_from_epoch"] == 3
    assert "dropout: none in epochs 1-2, 0.2 from epoch 3 on" in stream.getvalue()
    from tinytf.training.run_dir import resumed_config
    cfg = resumed_config(TrainConfig(data=data_dir, out=str(tmp_path / "fifteen"), resume=True,
                                     max_steps=4), given={"max_steps"}).resolved()
    again = trainer.Trainer(cfg, log_stream=io.StringIO())
    assert again.model_cfg.dropout == again.model.pos.dropout.p == 0.2 and again.step == 2
    again.close()
    user, stream = start("user", "dropout=0.1", max_steps=15 * per_epoch)
    log = stream.getvalue()
    assert user.cfg.dropout_from_epoch == 3 and user.model_cfg.dropout == 0.1
    assert " at 0.1" not in log and "dropout: from epoch 3: the budget" in log
    user.close()


def test_count_of_is_singular_only_for_one():
    """The log's limits and paces: "1 minute", not "1 minutes"; thousands grouped."""
    assert count_of(1, "minute") == "1 minute"
    assert count_of(1.0, "minute") == "1 minute"
    assert count_of(2.5, "minute") == "2.5 minutes"
    assert count_of(10.0, "minute") == "10 minutes"
    assert count_of(100000, "step") == "100,000 steps"
    assert count_of(1, "epoch") == "1 epoch"


def test_ctrl_c_before_the_first_update_is_one_line_and_exit_130(
        data_dir, tmp_path, monkeypatch, capsys):
    """Ctrl-C while the run starts (learning the BPE, preparing the corpus), before the
    stop signals are the run's: no traceback, one line, 128 + SIGINT."""
    from tinytf.commands import train as train_command

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(train_command, "train", interrupted)
    status = train_command.main(["--data", data_dir, "--out", str(tmp_path / "run"),
                                 "--max-steps", "1"])
    assert status == 128 + signal.SIGINT
    assert capsys.readouterr().err.strip().endswith("interrupted; no update to save")


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGUSR1, signal.SIGINT])
def test_a_stop_signal_while_the_run_starts_is_one_line(data_dir, tmp_path, monkeypatch,
                                                        capsys, sig):
    """A scheduler's SIGTERM (or SIGUSR1, or a Ctrl-C) while the run starts, here while its
    corpus is encoded: the start stops at once, with one line and 128 + N (before, SIGTERM
    and SIGUSR1 killed the process by their default action, without a word); the BPE
    model learnt is kept for the requeue."""
    from tinytf.commands import train as train_command

    def signalled(*args, **kwargs):
        os.kill(os.getpid(), sig)
        time.sleep(30)                  # the handler raises here
        raise AssertionError("the signal did not stop the start")

    monkeypatch.setattr(trainer, "prepared_corpus", signalled)
    sets = [a for s in TINY for a in ("--set", s)]
    out = tmp_path / "run"
    status = train_command.main(["--data", data_dir, "--out", str(out), "--vocab-size", "300",
                                 "--max-steps", "1", *sets])
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert status == 128 + sig, last
    if sig == signal.SIGINT:
        assert last.endswith("interrupted; no update to save"), last
    else:
        assert last == f"{os.path.basename(sys.argv[0]) or 'train.py'}: stopped by signal " \
            f"{int(sig)} ({sig.name}) before the first update; no update to save", last
    assert (out / "bpe.json").is_file()
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL     # the handlers given back


def test_run_files_that_cannot_be_written_are_one_line_or_a_warning(
        data_dir, tmp_path, capsys, file_size_limit):
    """Files that the disk refuses at the start (a file-size limit, as a full disk refuses)
    end it with one line naming the file: the BPE model (590 bytes here), the encoded corpus
    (its 4 KiB of ids: a short last write that NumPy's tofile left unreported had the
    start crash at the memory map) and config.json. A summary.json that cannot be written
    at the end is a warning: the run's work is in its checkpoint."""
    sets = [a for s in TINY for a in ("--set", s)]
    refused = {400: "bpe.json: cannot write the BPE model: File too large (it needs about ",
               2_000: "corpus: cannot write the encoded corpus: File too large"}
    for limit, what in refused.items():
        out = tmp_path / f"full{limit}"
        proc = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), "--data",
                               data_dir, "--out", str(out), "--vocab-size", "300",
                               "--max-steps", "1", *sets], cwd=ROOT, capture_output=True,
                              text=True, timeout=120, preexec_fn=file_size_limit(limit))
        assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].startswith(
            f"train.py: error: {out}/{what}"), proc.stderr
        assert "Traceback" not in proc.stderr and not (out / "corpus").exists()

    (tmp_path / "r" / "config.json").mkdir(parents=True)   # a path that takes no file
    code, _, err = _train_tiny(capsys, data_dir, tmp_path / "r", "--max-steps", "1")
    assert code == 2 and f"{tmp_path / 'r' / 'config.json'}: cannot write the run's " \
        "options: Is a directory" in err, err
    (tmp_path / "r" / "config.json").rmdir()
    (tmp_path / "r" / "summary.json").mkdir()
    code, out_line, err = _train_tiny(capsys, data_dir, tmp_path / "r", "--max-steps", "1")
    assert code == 0 and json.loads(out_line)["steps"] == 1, err
    assert f"warning: {tmp_path / 'r' / 'summary.json'}: cannot write the run's summary: " \
        "Is a directory; a --resume of this run validates and tests it again" in err, err
