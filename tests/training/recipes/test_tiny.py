"""The tiny recipe's budget rules: the batch fitted to the pace, late dropout and its rate."""
import dataclasses
import json
import os

import pytest
from train_support import (
    _config,
    _preset_dropout_trainer,
    _run,
    _train_tiny,
)

from tinytf.training import trainer
from tinytf.training.config import TrainConfig, TrainError, apply_overrides
from tinytf.training.recipes import tiny
from tinytf.utils import checkpoint


def test_fitted_batch_halves_to_the_floor_while_the_budget_holds_too_few_updates():
    """--budget-min-updates: the batch is halved while the time budget at the measured pace holds
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


def test_only_the_presets_batch_is_fitted_a_users_max_tokens_is_kept():
    """min_updates resolves to the tiny preset's 1,500, to 0 for the paper's presets; the
    batch is fitted only where --max-tokens is the preset's (fit_batch), and a user's
    --max-tokens is timed instead, to warn (checks_user_batch)."""
    assert TrainConfig().resolved().recipe_options["min_updates"] == 1500
    assert TrainConfig().resolved().recipe_options["fit_batch"]
    assert tiny.fits_batch(TrainConfig().resolved())                 # the 10-minute default
    users = TrainConfig(max_tokens=8192).resolved()
    assert users.recipe_options["min_updates"] == 1500 and not users.recipe_options["fit_batch"]
    assert not tiny.fits_batch(users) and tiny.checks_user_batch(users)
    assert TrainConfig(max_tokens=4096, recipe_options={"min_updates": 800}).resolved() \
        .recipe_options["min_updates"] == 800
    assert not tiny.checks_user_batch(TrainConfig(max_tokens=4096,
                                                  recipe_options={"min_updates": 0}).resolved())
    assert not tiny.fits_batch(TrainConfig(max_tokens=1024,
                                          recipe_options={"fit_batch": True}).resolved())
    assert TrainConfig(config="base").resolved().recipe_options["min_updates"] == 0
    assert not tiny.fits_batch(TrainConfig(max_steps=100).resolved())  # no time budget
    with pytest.raises(TrainError, match="--budget-min-updates must not be negative"):
        TrainConfig(recipe_options={"min_updates": -1}).resolved()


def test_the_recipes_options_are_its_own_the_config_knows_them_as_a_dict(tmp_path):
    """TrainConfig has no field of the tiny recipe's: its options live in ``recipe_options``,
    filled in from the preset, set by ``--set`` like any option, checked by the recipe, and
    read from the top level of an older run's config.json or checkpoint."""
    from tinytf.training import recipes
    from tinytf.training.config import read_config_file
    fields = {f.name for f in dataclasses.fields(TrainConfig)}
    assert not fields & recipes.LEGACY_KEYS and "recipe_options" in fields
    cfg = apply_overrides(TrainConfig(), ["full_dropout_epochs=0", "dropout_per_epoch=0.05"])
    assert cfg.recipe_options == {"full_dropout_epochs": 0, "dropout_per_epoch": 0.05}
    resolved = cfg.resolved().recipe_options
    assert resolved["full_dropout_epochs"] == 0 and resolved["min_updates"] == 1500
    assert cfg.resolved().resolved().recipe_options == resolved        # resolving is stable
    with pytest.raises(TrainError, match="--set full_dropout_epochs=x: expected an integer"):
        apply_overrides(TrainConfig(), ["full_dropout_epochs=x"])
    with pytest.raises(TrainError, match="--set long_dropout_from_epoch must be at least 1"):
        apply_overrides(TrainConfig(), ["long_dropout_from_epoch=0"]).resolved()
    old = tmp_path / "config.json"         # a run's config.json from before recipe_options
    old.write_text(json.dumps({"command": ["train.py"], "options": {
        "max_tokens": 1024, "min_updates": 800, "fitted_from": 2048, "fit_batch": True,
        "full_dropout_epochs": 0, "long_dropout_from_epoch": 3}}))
    options = read_config_file(str(old))
    assert options["recipe_options"] == {"min_updates": 800, "fit_batch": True,
                                         "full_dropout_epochs": 0,
                                         "long_dropout_from_epoch": 3}   # no fitted_from
    assert TrainConfig(**options).resolved().recipe_options["min_updates"] == 800


def test_a_run_stored_before_recipe_options_resumes_with_its_recipe(data_dir, tmp_path):
    """A checkpoint whose training options hold the recipe's at the top level (older runs)
    resumes with them in ``recipe_options``: its fitted batch and decided dropout kept."""
    from tinytf.training.run_dir import resumed_config
    cfg = _config(data_dir, tmp_path / "old", max_steps=1)
    _run(cfg)
    last = tmp_path / "old" / checkpoint.LAST
    ckpt = checkpoint.load(last)
    stored = {k: v for k, v in ckpt.meta["train_config"].items() if k != "recipe_options"}
    stored.update(min_updates=7, fitted_from=400, fit_batch=True, full_dropout_epochs=0)
    checkpoint.save(last, ckpt.model, optim_state=ckpt.optim,
                    meta=dict(ckpt.meta, train_config=stored))
    again = resumed_config(TrainConfig(data=data_dir, out=str(tmp_path / "old"), resume=True,
                                       max_tokens=400), {"max_tokens"}).resolved()
    assert again.recipe_options["min_updates"] == 7
    assert again.recipe_options["fitted_from"] == 400 and again.recipe_options["fit_batch"]
    assert again.recipe_options["full_dropout_epochs"] == 0


def test_a_users_max_tokens_under_a_short_budget_is_kept_and_the_log_says_so(data_dir,
                                                                            tmp_path):
    """--max-tokens 2048 with a budget that holds too few updates: the run keeps 2,048, and
    its first lines say how many updates the budget holds and what the preset would do."""
    import io
    log = io.StringIO()
    t = trainer.Trainer(_config(data_dir, tmp_path / "kept", max_tokens=2048,
                                min_updates=10**9, max_minutes=1.0), log_stream=log)
    assert t.cfg.max_tokens == 2048 and t.batches.max_tokens == 2048
    assert not t.cfg.recipe_options["fitted_from"]
    text = log.getvalue()
    assert "warning: batch 2,048 tokens (--max-tokens, kept as given)" in text, text
    assert "the tiny preset would train with 1,024-token batches here" in text
    assert "fitted to the budget" not in text
    t.close()


def test_a_fitted_batch_trains_as_if_the_user_had_chosen_it(data_dir, tmp_path):
    """A run whose budget is too short for the preset's batch (fit_batch; here 2,048 tokens)
    starts with the halved batch, logs why and how to keep it, and its first update equals,
    bitwise, that of a run given that batch: timing the batches changes no weight and no
    random state."""
    import io
    log = io.StringIO()
    fitted = trainer.Trainer(_config(data_dir, tmp_path / "fitted", max_tokens=2048,
                                     fit_batch=True, min_updates=10**9, max_minutes=1.0),
                             log_stream=log)
    assert fitted.cfg.max_tokens == 1024 and fitted.batches.max_tokens == 1024
    assert "batch: 1,024 tokens, fitted to the budget: an update of 2,048 tokens takes" in \
        log.getvalue()
    assert "--max-tokens 2,048 keeps it" in log.getvalue()
    given = trainer.Trainer(_config(data_dir, tmp_path / "given", max_tokens=1024,
                                    min_updates=0, max_minutes=1.0),
                            log_stream=open(os.devnull, "w"))
    for run in (fitted, given):
        run.train_step([next(iter(run.batches))])
    for (name, a), (_, b) in zip(fitted.params, given.params):
        assert a.data.tobytes() == b.data.tobytes(), name
    fitted.close(), given.close()


def test_a_job_requeued_with_its_first_command_keeps_its_fitted_batch(data_dir, tmp_path,
                                                                      capsys):
    """The preset's batch fitted to the budget is stored with the batch it came from: the
    same command with --resume auto (a requeued job) continues with the fitted batch, as the
    run trained, instead of refusing the batch iterator's position."""
    args = ("--max-minutes", "0.03", "--budget-min-updates", "1000000000", "--resume", "auto")
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
    epochs = TrainConfig().resolved().recipe_options["full_dropout_epochs"]
    assert epochs == 8 and probe.cfg.dropout_from_epoch == 5
    assert probe.cfg.recipe_options["long_dropout_from_epoch"] == 3
    assert probe.cfg.recipe_options["full_dropout_epochs"] == 0   # decided: late, whatever comes
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
    assert kept.cfg.dropout_from_epoch == 5 and kept.cfg.recipe_options["full_dropout_epochs"] == 0
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
    assert tiny.recipe_options["full_dropout_epochs"] == 8
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
    assert (saved["dropout_from_epoch"], saved["recipe_options"]["full_dropout_epochs"]) == (5, 0)

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
    assert tiny.recipe_options["dropout_per_epoch"] == 0.02
    assert tiny.recipe_options["dropout_rises_after"] == 10
    assert base.recipe_options["dropout_per_epoch"] == 0.0
    assert base.recipe_options["dropout_rises_after"] == 0

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
