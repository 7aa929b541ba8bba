"""train.py on the command line: the JSON summary, one-line errors with exit 2, --help, flags."""
import dataclasses
import importlib.util
import json
import os
import re
import signal
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import numpy as np
import pytest
from train_support import (
    ROOT,
    TINY,
    _config,
    _train_main,
    _train_py,
    _train_tiny,
)

from tinytf.training import trainer
from tinytf.training.config import TrainConfig, TrainError, apply_overrides
from tinytf.utils import checkpoint


def test_cli_smoke_run_prints_json_summary(data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    sets = [a for s in TINY for a in ("--set", s)]
    result = _train_py("--data", data_dir, "--out", str(out), "--max-steps", "4",
                       "--vocab-size", "300", "--max-tokens", "200", "--log-interval", "2",
                       "--save-interval-updates", "2", "--keep-last", "1", "--warmup", "2", *sets)
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


def test_unknown_precision_is_a_clear_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        _train_main(capsys, "--out", str(tmp_path / "x"), "--precision", "fp8")
    assert e.value.code == 2 and "--precision" in capsys.readouterr().err
    with pytest.raises(TrainError, match="--precision"):
        TrainConfig(precision="fp8").resolved()


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
    """--budget-min-updates reaches the config (and is checked); with --max-tokens and a budget
    that holds enough updates the batch is the user's, and the summary reports it."""
    code, _, err = _train_main(capsys, "--out", str(tmp_path / "bad"), "--budget-min-updates", "-1")
    assert code == 2 and "error: --budget-min-updates must not be negative, got -1" in err, err
    code, out, err = _train_tiny(capsys, data_dir, tmp_path / "r", "--max-minutes", "0.2",
                                 "--max-steps", "2", "--budget-min-updates", "3", "--max-tokens",
                                 "2048")
    assert code == 0, err
    assert "batch: 2,048 tokens (--max-tokens): about" in err   # the user's, timed
    assert "fitted" not in err
    assert json.loads(out.strip().splitlines()[-1])["max_tokens"] == 2048


def test_the_help_lists_each_presets_defaults_as_a_command_line_that_gives_them():
    """``train.py --help`` ends with each preset's training defaults; read back as a
    command line, each line is accepted (keys without an option of their own as ``--set``)
    and resolves to exactly those defaults."""
    import shlex

    from tinytf.commands.train import build_parser, config_from_args
    parser = build_parser()
    block = parser.epilog.split("Per-preset defaults:\n")[1].split("See docs")[0]
    lines = [" ".join(entry.split()) for entry in re.split(r"\n(?=  \S)", block.strip("\n"))]
    assert len(lines) == len(TrainConfig.PRESET_DEFAULTS)
    assert "--set dropout_from_epoch=5" in lines[0] and "--dropout-from-epoch" not in lines[0]
    for line, (name, defaults) in zip(lines, TrainConfig.PRESET_DEFAULTS.items()):
        argv = shlex.split(line.split(":", 1)[1].split("(peak lr")[0])
        config = "tiny" if name == "tiny" else "base"
        cfg = config_from_args(parser.parse_args(argv + ["--preset", config])).resolved()
        recipe = defaults.get("recipe", {})
        assert {k: getattr(cfg, k) for k in defaults if k != "recipe"} == \
            {k: v for k, v in defaults.items() if k != "recipe"}
        assert {k: cfg.recipe_options[k] for k in recipe} == recipe


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
