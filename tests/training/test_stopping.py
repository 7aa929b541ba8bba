"""Stopping a run on a signal: the checkpoint first, then an exact resume; validation failures
cost no training."""
import dataclasses
import json
import os
import signal
import time

import pytest
from train_support import (
    STOP_ARGS,
    _config,
    _run,
    _train_cli,
    _with_shipped,
)

from tinytf.training import evaluate
from tinytf.utils import checkpoint


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
                      "--validate-interval-updates", "20", "--set", "valid_bleu_sentences=0")
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
