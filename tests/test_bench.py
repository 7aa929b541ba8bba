"""The benchmarks' own logic that runs without PyTorch: bench/quality.py's mirror of a tinytf
run's recipe for the PyTorch reference (docs/benchmarks.md, "The same recipe in both")."""
import importlib
import json
import os
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(ROOT, "bench")


def _bench_module(name):
    sys.path.insert(0, BENCH)
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(BENCH)


def _options(argv) -> dict:
    """{"--flag": value or True} of an argv of flags, each followed by its value if any."""
    out, i = {}, 0
    while i < len(argv):
        if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
            out[argv[i]], i = argv[i + 1], i + 2
        else:
            out[argv[i]], i = True, i + 1
    return out


@pytest.fixture(scope="module")
def finished_run(data_dir, tmp_path_factory):
    """A finished two-update run of the tiny preset (its own model, a small batch and BPE)."""
    out = tmp_path_factory.mktemp("quality") / "tinytf"
    argv = [sys.executable, os.path.join(ROOT, "train.py"), "--data", data_dir, "--out",
            str(out), "--max-steps", "2", "--max-tokens", "200", "--vocab-size", "300",
            "--warmup", "7", "--set", "dropout_from_epoch=2", "--set", "valid_bleu_sentences=2"]
    subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL,
                   stderr=subprocess.DEVNULL, timeout=300)
    return out


def test_the_pytorch_reference_is_given_the_recipe_that_the_tinytf_run_resolved(finished_run):
    quality = _bench_module("quality")
    args = quality.mirrored_torch_args(finished_run)
    options = _options(args)
    summary = json.loads((finished_run / "summary.json").read_text())
    assert options == {
        "--config": "tiny", "--vocab-size": "300", "--max-tokens": str(summary["max_tokens"]),
        "--lr-schedule": "linear", "--lr": "0.002", "--warmup": "7", "--optimizer": "radam",
        "--dropout": str(summary["dropout"]), "--dropout-from-epoch": "2",
        "--pre-norm": True, "--qk-norm": True}   # the tiny preset's defaults, resolved
    assert summary["max_tokens"] == 200 and summary["dropout"] == 0.1
    if importlib.util.find_spec("torch") is not None:   # and torch_train.py takes them
        parsed = _bench_module("torch_train").parse_args(["--out", "x", *args])
        assert (parsed.optimizer, parsed.dropout_from_epoch, parsed.max_tokens, parsed.lr,
                parsed.pre_norm, parsed.qk_norm) == ("radam", 2, 200, 0.002, True, True)


def test_a_run_that_the_reference_cannot_train_is_refused(finished_run, tmp_path):
    """Model keys of --set other than pre_norm, qk_norm and dropout, several batches per
    update or clipping: torch_train.py has no option for them, so no mirror is made."""
    quality = _bench_module("quality")
    config = json.loads((finished_run / "config.json").read_text())
    for key, value in (("model_overrides", {"d_model": 16}), ("update_freq", 2),
                       ("clip_norm", 1.0)):
        run = tmp_path / key
        run.mkdir()
        shutil.copy(finished_run / "summary.json", run / "summary.json")
        changed = json.loads(json.dumps(config))
        changed["options"][key] = value
        (run / "config.json").write_text(json.dumps(changed))
        with pytest.raises(SystemExit, match="cannot mirror the run in"):
            quality.mirrored_torch_args(run)
