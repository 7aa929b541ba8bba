"""What a user of fairseq, Marian or Sockeye expects of train.py (issue 61), through the
command line: their own file names (--train/--valid/--test), --preset and --config FILE
(JSON or TOML with the keys of a run's config.json, a run's own config.json starting an
equal run), a --max-tokens that is never replaced, and renamed flags that say so."""
import json
import os
import shutil

import numpy as np
import pytest
from train_support import TINY, _train_main

from tinytf.utils import checkpoint

FAST = ["--vocab-size", "300", "--max-tokens", "200", "--max-steps", "2", "--log-interval", "1",
        "--set", "valid_bleu_sentences=2", "--set", "test_beam=1",
        *[a for s in TINY for a in ("--set", s)]]


@pytest.fixture
def own_files(data_dir, tmp_path):
    """The test corpus under names of the user's choosing, none of them train.SRC (its dev
    pair serves as the test pair too)."""
    names = {}
    for split, new in (("train", "corpus"), ("dev", "held-out"), ("dev", "final")):
        for lang, side in (("en", "source"), ("de", "target")):
            path = tmp_path / "mine" / f"{new}.{side}.txt"
            path.parent.mkdir(exist_ok=True)
            shutil.copy(os.path.join(data_dir, f"{split}.{lang}"), path)
            names["test" if new == "final" else split, side] = str(path)
    return names


def _weights(run_dir):
    ckpt = checkpoint.load(os.path.join(run_dir, checkpoint.LAST))
    return {k: v for k, v in ckpt.model.items()}


def test_own_files_train_translate_and_score(own_files, tmp_path, capsys):
    f = own_files
    code, out, err = _train_main(capsys, "--train", f["train", "source"], f["train", "target"],
                                 "--valid", f["dev", "source"], f["dev", "target"],
                                 "--test", f["test", "source"], f["test", "target"],
                                 "--out", str(tmp_path / "run"), *FAST)
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["steps"] == 2 and "test_bleu" in summary, summary
    assert "test pairs" in err and "no test BLEU" not in err


def test_own_files_errors_are_one_line(own_files, tmp_path, capsys):
    f = own_files
    code, _, err = _train_main(capsys, "--train", f["train", "source"], f["train", "target"],
                               "--out", str(tmp_path / "a"), *FAST)
    assert code == 2 and "--train and --valid go together" in err
    code, _, err = _train_main(capsys, "--train", f["train", "source"], str(tmp_path / "nope"),
                               "--valid", f["dev", "source"], f["dev", "target"],
                               "--out", str(tmp_path / "b"), *FAST)
    assert code == 2 and f"{tmp_path / 'nope'}: no such file (--train SOURCE_FILE" in err, err
    code, _, err = _train_main(capsys, "--data", "data/ende", "--train", f["train", "source"],
                               f["train", "target"], "--valid", f["dev", "source"],
                               f["dev", "target"], *FAST)
    assert code == 2 and "--data DIR or --train/--valid files, not both" in err
    assert all(len(e.strip().splitlines()) == 1 for e in [err])


def test_a_runs_config_json_starts_an_equal_run_and_flags_override_it(data_dir, tmp_path,
                                                                       capsys):
    code, _, err = _train_main(capsys, "--data", data_dir, "--out", str(tmp_path / "first"),
                               "--seed", "7", "--lr", "3e-3", *FAST)
    assert code == 0, err
    config = tmp_path / "first" / "config.json"
    code, out, err = _train_main(capsys, "--config", str(config), "--out", str(tmp_path / "again"))
    assert code == 0, err
    first, again = _weights(tmp_path / "first"), _weights(tmp_path / "again")
    assert first.keys() == again.keys()
    assert all(np.array_equal(first[k], again[k]) for k in first)          # bitwise
    code, out, err = _train_main(capsys, "--config", str(config), "--out", str(tmp_path / "third"),
                                 "--seed", "8", "--max-steps", "1")
    assert code == 0, err
    options = json.loads((tmp_path / "third" / "config.json").read_text())["options"]
    assert options["seed"] == 8 and options["max_steps"] == 1 and options["lr"] == 3e-3


def test_a_toml_config_file(data_dir, tmp_path, capsys):
    path = tmp_path / "run.toml"
    path.write_text(f'data = "{data_dir}"\nvocab_size = 300\nmax_tokens = 200\nmax_steps = 1\n'
                    'valid_bleu_sentences = 2\ntest_bleu = false\nseed = 5\noptimizer = "adam"\n'
                    'train_max_len = 40\ndropout_from_epoch = 1\n'
                    '[model_overrides]\nd_model = 16\nn_heads = 2\nd_ff = 32\n'
                    'n_encoder_layers = 1\nn_decoder_layers = 1\nmax_len = 64\n')
    code, out, err = _train_main(capsys, "--config", str(path), "--out", str(tmp_path / "t"))
    assert code == 0, err
    options = json.loads((tmp_path / "t" / "config.json").read_text())["options"]
    assert options["seed"] == 5 and options["max_tokens"] == 200
    assert options["recipe_options"]["fit_batch"] is False


@pytest.mark.parametrize("content, message", [
    ('{"max_tokens": 200, "typo_key": 1}', "unknown option 'typo_key'"),
    ('{"max_tokens": "many"}', "option 'max_tokens' has the wrong type"),
    ('{"max_tokens": 200,', "line 1: Expecting property name"),
    ('[1, 2]', "expected an object of options"),
    ('{"model_overrides": {"dropuot": 0.1}}', "unknown model key 'dropuot'"),
    ('{"recipe_options": {"min_updates": 1.5}}', "recipe_options: min_updates must be int"),
    ('{"recipe_options": {"min_updatez": 1}}', "min_updatez is not an option of the tiny"),
    ('{"min_updates": -3}', "recipe_options: min_updates must not be negative, got -3"),
    ("[" * 100000 + "]" * 100000, "nested too deeply"),
])
def test_bad_config_files_are_one_line_and_exit_2(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    code, _, err = _train_main(capsys, "--config", str(path), "--out", str(tmp_path / "r"))
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "r").exists()


def test_a_gigantic_config_file_is_refused_before_it_is_read(tmp_path, capsys):
    path = tmp_path / "big.json"
    with open(path, "wb") as f:
        f.truncate(3 << 30)                  # 3 GiB of holes: never read
    code, _, err = _train_main(capsys, "--config", str(path), "--out", str(tmp_path / "r"))
    assert code == 2 and "a --config file holds at most 1,048,576" in err, err


def test_a_preset_name_given_to_config_still_works_with_a_notice(data_dir, tmp_path, capsys):
    code, out, err = _train_main(capsys, "--config", "tiny", "--data", data_dir,
                                 "--out", str(tmp_path / "r"), "--max-steps", "1",
                                 *FAST[:4], "--set", "test_bleu=false",
                                 *[a for s in TINY for a in ("--set", s)])
    assert code == 0, err
    assert "--config tiny: a preset name; --preset tiny is its flag" in err


@pytest.mark.parametrize("old, new", [("--min-updates", "--budget-min-updates"),
                                      ("--save-interval", "--save-interval-updates"),
                                      ("--valid-interval", "--validate-interval-updates")])
def test_flags_that_meant_something_else_were_renamed_and_say_so(capsys, old, new):
    with pytest.raises(SystemExit) as stop:
        _train_main(capsys, old, "5")
    err = capsys.readouterr().err
    assert stop.value.code == 2 and f"{old} is now {new}" in err


def test_a_users_max_tokens_is_what_runs(data_dir, tmp_path, capsys):
    """The tiny preset would halve a batch that leaves the budget too few updates; the
    user's --max-tokens is kept and the first lines say what the preset would have done."""
    code, out, err = _train_main(capsys, "--data", data_dir, "--out", str(tmp_path / "r"),
                                 "--max-tokens", "2048", "--max-minutes", "0.05",
                                 "--budget-min-updates", "1000000", "--max-steps", "1",
                                 "--vocab-size", "300", "--set", "test_bleu=false",
                                 *[a for s in TINY for a in ("--set", s)])
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["max_tokens"] == 2048
    assert "warning: batch 2,048 tokens (--max-tokens, kept as given)" in err
    assert "fitted to the budget" not in err


@pytest.mark.parametrize("command", ["train", "translate"])
def test_help_is_short_and_every_option_has_text(command, monkeypatch):
    """At 80 columns each option takes at most three lines: the option and two of text (or
    one line with both); the long explanations live in docs/."""
    import importlib
    import re
    monkeypatch.setenv("COLUMNS", "80")
    text = importlib.import_module(f"tinytf.commands.{command}").build_parser().format_help()
    entries = re.split(r"\n(?=  -)", text.split("options:")[1].split("Without --max-steps")[0])
    for entry in entries[1:]:
        body = [line for line in entry.splitlines() if line.startswith(" ")]
        assert len(body) <= 3, body
        assert len(body) > 1 or len(body[0].split("  ")) > 1 or "--help" in body[0], body


def test_the_same_command_twice_starts_a_fresh_run_directory_and_says_so(data_dir, tmp_path,
                                                                          capsys, monkeypatch):
    """The README's main job run a second time: the default run directory holds a finished
    run, so the new one goes to RUNDIR-2 (a named --out still refuses to start over a run)."""
    monkeypatch.chdir(tmp_path)
    args = ["--data", data_dir, *FAST, "--set", "test_bleu=false"]
    code, out, err = _train_main(capsys, *args)
    assert code == 0, err
    first = os.path.join("runs", f"{os.path.basename(data_dir)}-tiny")
    assert os.path.isfile(os.path.join(first, "summary.json"))
    code, out, err = _train_main(capsys, *args)
    assert code == 0, err
    assert f"{first} holds a finished run (its result: {first}/summary.json); this new run " \
           f"goes to {first}-2" in err
    assert os.path.isfile(os.path.join(f"{first}-2", "summary.json"))
    code, _, err = _train_main(capsys, *args, "--out", first)
    assert code == 2 and "already holds a training run" in err


def test_prepare_takes_own_files_and_a_config_file(own_files, tmp_path):
    """tinytf-prepare has train.py's data options: --train/--valid, and --config FILE."""
    import subprocess
    import sys
    f = own_files
    config = tmp_path / "data.json"
    config.write_text(json.dumps({"train_files": [f["train", "source"], f["train", "target"]],
                                  "valid_files": [f["dev", "source"], f["dev", "target"]],
                                  "vocab_size": 300, "seed": 3}))
    proc = subprocess.run([sys.executable, "-m", "tinytf.commands.prepare", "--config",
                           str(config), "--out", str(tmp_path / "p")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    options = json.loads((tmp_path / "p" / "config.json").read_text())["options"]
    assert options["vocab_size"] == 300 and options["train_files"][0] == f["train", "source"]
