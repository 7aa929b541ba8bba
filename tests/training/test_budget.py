"""The budget: the learning rate over it, the time a resumed run has left, progress and its
warnings."""
import dataclasses
import math
import os
import time

import numpy as np
import pytest
from train_support import (
    _config,
    _run,
    _train_main,
    _train_tiny,
)

from tinytf.training import run_dir, trainer
from tinytf.training.config import TrainConfig, TrainError, apply_overrides
from tinytf.training.progress import Progress, budget_seconds_spent
from tinytf.utils import checkpoint
from tinytf.utils.log import count_of


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


def test_count_of_is_singular_only_for_one():
    """The log's limits and paces: "1 minute", not "1 minutes"; thousands grouped."""
    assert count_of(1, "minute") == "1 minute"
    assert count_of(1.0, "minute") == "1 minute"
    assert count_of(2.5, "minute") == "2.5 minutes"
    assert count_of(10.0, "minute") == "10 minutes"
    assert count_of(100000, "step") == "100,000 steps"
    assert count_of(1, "epoch") == "1 epoch"
