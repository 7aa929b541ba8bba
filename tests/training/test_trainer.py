"""Trainer: the step, the loop, exact resume, non-finite updates, precision, the run directory."""
import dataclasses
import importlib.util
import io
import json
import os
import pathlib
import signal
import subprocess
import sys

import numpy as np
import pytest
from train_support import (
    ROOT,
    STOP_ARGS,
    TINY,
    _config,
    _run,
    _same_state,
    _start,
    _train_cli,
    _train_py,
)

from tinytf.training import loop, pipelined, run_dir, trainer
from tinytf.training.config import TrainConfig, TrainError
from tinytf.utils import checkpoint


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
                       "--validate-interval-updates", "1", "--save-interval-updates", "1",
                       "--patience", "2",
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


def test_a_failed_start_keeps_its_bpe_which_a_changed_text_learns_again(data_dir, tmp_path):
    """A corpus that yields no training pair (every line longer than train_max_len) fails
    the start after the BPE is learnt; the BPE model is kept, and the next start on
    the same text reuses it. Once the text is mended, the next start learns it again (the
    BPE that a fresh directory learns from that text). A bpe.json learnt, or prepared, for
    another --vocab-size is refused; one that the directory did not learn is reused."""
    text = tmp_path / "text"
    text.mkdir()
    for name in os.listdir(data_dir):
        content = (pathlib.Path(data_dir) / name).read_text(encoding="utf-8")
        long_lines = "".join(" ".join([line] * 30) + "\n" for line in content.splitlines())
        (text / name).write_text(long_lines if name.startswith("train") else content,
                                 encoding="utf-8")
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
        "its size differs): learning it again" in log, log
    _start(_config(data_dir, tmp_path / "fresh", max_steps=1))
    assert (run / "bpe.json").read_bytes() == (tmp_path / "fresh" / "bpe.json").read_bytes()
    assert "learning a joint BPE" not in _start(_config(str(text), run, max_steps=1))
    swapped = dataclasses.replace(_config(str(text), run, max_steps=1), src="de", tgt="en")
    assert "learning a joint BPE" not in _start(swapped)   # the same joint BPE either way
    data = (text / "train.en").read_bytes()                 # the same size, one letter other
    (text / "train.en").write_bytes(data.replace(b"a", b"e", 1))
    assert f"{run / 'bpe.json'} was learnt from other training text ({text / 'train.en'}: " \
        "its content differs): learning it again" in _start(_config(str(text), run,
                                                                    max_steps=1))

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


def test_a_run_without_sacrebleu_stops_before_training(data_dir, tmp_path, monkeypatch):
    """sacrebleu missing is an error at the start, not after the training."""
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "sacrebleu" else find_spec(name, *a))
    with pytest.raises(TrainError, match="sacrebleu is not installed"):
        _run(_config(data_dir, tmp_path / "nobleu", max_steps=2))
    assert not os.path.exists(tmp_path / "nobleu")
