"""tinytf.optim.schedule and how TrainConfig chooses a schedule from the user's flags."""
import math

import numpy as np
import pytest

from tinytf.optim import schedule
from tinytf.optim.schedule import Schedule
from tinytf.training.config import TrainConfig, TrainError


def test_inverse_sqrt_is_fairseqs_formula():
    peak, warmup = 5e-4, 400
    s = Schedule("inverse_sqrt", warmup, peak=peak)
    for step in (1, 2, 200, 399, 400, 401, 1600, 40000):
        expected = peak * step / warmup if step <= warmup else peak * math.sqrt(warmup / step)
        assert s(step) == pytest.approx(expected, rel=1e-12)
    assert s.peak_lr == peak and max(s(k) for k in range(1, 2000)) == pytest.approx(peak)


def test_inverse_sqrt_equals_noam_with_the_same_peak():
    """The same curve: only how the peak is given differs."""
    noam = Schedule("noam", 1000, factor=0.7, d_model=256)
    inv = Schedule("inverse_sqrt", 1000, peak=noam.peak_lr)
    for step in (1, 10, 999, 1000, 1001, 5000):
        assert inv(step) == pytest.approx(noam(step), rel=1e-12)


def test_noam_peak_moves_with_warmup_but_a_given_peak_does_not():
    assert Schedule("noam", 1000, factor=0.2, d_model=256).peak_lr == pytest.approx(
        Schedule("noam", 100, factor=0.2, d_model=256).peak_lr / math.sqrt(10))
    for kind in ("inverse_sqrt", "linear"):
        assert Schedule(kind, 1000, peak=2e-3).peak_lr == Schedule(kind, 100, peak=2e-3).peak_lr


def test_linear_warms_up_then_decays_to_zero_at_the_end_of_the_budget():
    s = Schedule("linear", 100, peak=2e-3)
    steps = np.arange(1, 1001)
    lrs = np.array([s(int(k), k / 1000) for k in steps])   # a step budget of 1000
    assert lrs.max() == pytest.approx(2e-3) and lrs.argmax() + 1 == 100
    assert np.all(np.diff(lrs[:100]) > 0)                  # warm-up: 100 updates
    assert np.all(np.diff(lrs[99:]) < 0)                   # then linear decay from the peak
    assert np.allclose(lrs[99:], 2e-3 * (1 - steps[99:] / 1000) / (1 - 0.1))
    assert lrs[-1] == 0.0 and s(1001, 1.0) == 0.0
    assert s(5, 1.5) == 0.0  # never negative past the budget


def test_linear_on_a_time_budget_decays_from_where_the_warmup_ended():
    """With --max-minutes, progress is time: the decay starts at the budget fraction that the
    warm-up took at the run's pace, so the curve stays continuous at its peak."""
    s = Schedule("linear", 100, peak=1e-3)
    pace = 0.0008                                          # budget fraction per update
    assert s(100, 100 * pace) == pytest.approx(1e-3)
    assert s(600, 600 * pace) == pytest.approx(1e-3 * (1 - 0.48) / (1 - 0.08))
    lrs = [s(k, k * pace) for k in range(1, 1251)]
    assert max(abs(b - a) for a, b in zip(lrs, lrs[1:])) < 2e-5   # no jump


def test_linear_warmup_ends_by_30_percent_of_the_budget():
    """A warm-up longer than the run (the paper's 4000 in a few hundred updates) is cut at 30 %
    of the budget, so the run still reaches its peak."""
    assert schedule.LINEAR_WARMUP_CAP == 0.3
    s = Schedule("linear", 4000, peak=1e-3)
    assert s(30, 0.15) == pytest.approx(0.5e-3)
    assert s(60, 0.3) == pytest.approx(1e-3)
    assert s(90, 0.65) == pytest.approx(0.5e-3)
    assert s(100, 0.001) == pytest.approx(1e-3 * 100 / 4000)  # long runs: the warmup's pace


def test_a_schedule_needs_its_settings():
    with pytest.raises(ValueError, match="peak"):
        Schedule("linear", 10)
    with pytest.raises(ValueError, match="factor"):
        Schedule("noam", 10, peak=1e-3)
    with pytest.raises(ValueError, match="unknown schedule"):
        Schedule("cosine", 10, peak=1e-3)


def test_describe_names_the_formula_and_the_peak():
    assert "peak 6.99e-04" in Schedule("noam", 4000, factor=1.0, d_model=512).describe()
    assert "zero at the end" in Schedule("linear", 100, peak=2e-3).describe()


# ---- TrainConfig: which schedule the flags mean -------------------------------------------

def test_presets_state_their_peak_and_warmup_does_not_move_it():
    tiny = TrainConfig().resolved()
    assert tiny.lr_schedule == TrainConfig.PRESET_DEFAULTS["tiny"]["lr_schedule"]
    assert tiny.schedule().peak_lr == pytest.approx(tiny.tuned_peak())
    moved = TrainConfig(warmup=1000, max_tokens=4096).resolved()
    assert moved.schedule().peak_lr == tiny.schedule().peak_lr
    assert moved.schedule_warning() is None


def test_base_keeps_the_papers_schedule():
    base = TrainConfig(config="base").resolved()
    assert (base.lr_schedule, base.lr_factor, base.warmup) == ("noam", 1.0, 4000)
    assert base.schedule().peak_lr == pytest.approx((512 * 4000) ** -0.5)


def test_lr_factor_alone_means_noam_and_warns_when_the_peak_moves_far():
    cfg = TrainConfig(lr_factor=0.2, warmup=4000).resolved()
    assert cfg.lr_schedule == "noam"
    assert cfg.schedule().peak_lr == pytest.approx(0.2 * (256 * 4000) ** -0.5)
    assert "tuned for" in cfg.schedule_warning()
    base = TrainConfig(config="base", warmup=100).resolved()  # peak 6.3x the paper's
    assert "ties its peak to --warmup" in base.schedule_warning()


def test_lr_alone_on_a_noam_preset_means_inverse_sqrt():
    cfg = TrainConfig(config="base", lr=5e-4).resolved()
    assert cfg.lr_schedule == "inverse_sqrt" and cfg.schedule().peak_lr == 5e-4


def test_contradictory_schedule_flags_are_errors():
    with pytest.raises(TrainError, match="exclude each other"):
        TrainConfig(lr=1e-3, lr_factor=1.0).resolved()
    with pytest.raises(TrainError, match="takes --lr-factor"):
        TrainConfig(lr_schedule="noam", lr=1e-3).resolved()
    with pytest.raises(TrainError, match="takes its peak as --lr"):
        TrainConfig(lr_schedule="linear", lr_factor=1.0).resolved()
    with pytest.raises(TrainError, match="choose from"):
        TrainConfig(lr_schedule="cosine").resolved()
    with pytest.raises(TrainError, match="lr must be positive"):
        TrainConfig(lr=-1.0).resolved()


def test_resolving_twice_changes_nothing():
    for cfg in (TrainConfig(), TrainConfig(config="base"), TrainConfig(lr_factor=0.5),
                TrainConfig(config="big", lr=3e-4)):
        once = cfg.resolved()
        assert once.resolved() == once


def test_a_warm_up_far_shorter_than_the_tuned_one_warns_with_the_budget_known():
    """With Adam the linear schedule's warm-up, set shorter than the preset's, ending before
    15 % of the budget's updates warns, with or without QK-norm; RAdam (the tiny preset's
    optimizer), the preset's own warm-up (at its cap, 30 %, or 4,000 in a long run), a long
    enough one, no known budget or another schedule do not."""
    tiny = TrainConfig().resolved()
    assert tiny.warmup_warning(1000) is None          # 4000, capped at 300 of 1000
    assert tiny.warmup_warning(100_000) is None       # the preset's 4000 in a long run
    assert TrainConfig(warmup=100).resolved().warmup_warning(1900) is None   # RAdam
    short = TrainConfig(warmup=100, optimizer="adam").resolved()   # QK-norm, the preset's
    warning = short.warmup_warning(1900)
    assert "ends after 100 of the budget's about 1900 updates (5%)" in warning
    assert "2.00e-03 was tuned with the warm-up at 30% of the budget" in warning
    assert "--optimizer radam, a longer --warmup, or a lower --lr" in warning
    assert "qk_norm" not in warning
    no_qk = TrainConfig(warmup=100, optimizer="adam",
                        model_overrides={"qk_norm": False}).resolved()
    assert "--set qk_norm=true" in no_qk.warmup_warning(1900)
    assert short.warmup_warning(600) is None           # 100 of 600: 17 %
    assert short.warmup_warning(None) is None
    assert TrainConfig(config="base", warmup=100).resolved().warmup_warning(1900) is None


def test_expected_updates_is_the_step_or_the_time_budget_whichever_ends_first():
    import time

    from tinytf.training.progress import Progress
    assert Progress(start_step=0, budget=math.inf).expected_updates(20) is None
    assert Progress(start_step=0, budget=math.inf, max_steps=900).expected_updates(20) == 900
    timed = Progress(start_step=0, budget=60.0, t_start=time.perf_counter() - 10.0)
    assert timed.expected_updates(20) == pytest.approx(120, abs=2)   # 0.5 s an update
    timed.max_steps = 50
    assert timed.expected_updates(20) == 50
