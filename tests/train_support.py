"""Helpers shared by the training tests: a tiny model's config, runs in-process and through
train.py."""
import importlib.util
import io
import os
import pathlib
import subprocess
import sys

import numpy as np

from tinytf.training import recipes, trainer
from tinytf.training.config import TrainConfig, apply_overrides

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
    recipe = {k: kw.pop(k) for k in list(kw) if k in recipes.LEGACY_KEYS}  # (the tiny recipe's)
    cfg = TrainConfig(data=data_dir, out=str(out), vocab_size=300, log_interval=2, seed=3,
                      recipe_options=recipe, **kw)
    return apply_overrides(cfg, TINY)


def _run(cfg):
    return trainer.Trainer(cfg, log_stream=open(os.devnull, "w")).train()


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


STOP_ARGS = ["--max-steps", "40", "--vocab-size", "300", "--max-tokens", "200",
             "--log-interval", "1", "--save-interval-updates", "1000", "--update-freq", "2",
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


def _start(cfg):
    """Start a run (closed again at once); its log lines."""
    log = io.StringIO()
    trainer.Trainer(cfg, log_stream=log).close()
    return log.getvalue()


def _preset_dropout_trainer(data_dir, tmp_path, out, *overrides, **kw):
    """A Trainer with the tiny preset's own dropout options (TINY without its dropout and
    dropout_from_epoch) and ``overrides`` on top, and the StringIO its log goes to."""
    import io
    preset = [x for x in TINY if not x.startswith(("dropout_from_epoch", "dropout="))]
    recipe = {k: kw.pop(k) for k in list(kw) if k in recipes.LEGACY_KEYS}
    cfg = apply_overrides(TrainConfig(data=data_dir, out=str(tmp_path / out), seed=3,
                                      vocab_size=300, max_tokens=200, save_interval=1000,
                                      recipe_options=recipe, **kw),
                          [*preset, *overrides])
    log = io.StringIO()
    return trainer.Trainer(cfg, log_stream=log), log
