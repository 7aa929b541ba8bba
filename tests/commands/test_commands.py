"""The installed commands: ``pip install .`` (a wheel, not an editable install) puts
tinytf-train, tinytf-translate, tinytf-average, tinytf-prepare and tinytf-bpe on the PATH, and
they work from any directory, with no checkout on ``sys.path``."""
import os
import shutil
import subprocess
import sys
import venv

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = ["d_model=16", "n_heads=2", "d_ff=32", "n_encoder_layers=1", "n_decoder_layers=1",
        "max_len=64", "train_max_len=40", "valid_bleu_sentences=4", "test_bleu=false",
        "optimizer=adam"]   # (RAdam, the tiny preset's, takes no step in its first 5 updates)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A virtual environment (seeing this Python's packages) with tinytf installed from a
    wheel built from a copy of the tracked files."""
    base = tmp_path_factory.mktemp("install")
    files = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True)
    if files.returncode != 0:
        pytest.skip("not a git checkout")
    src = base / "src"
    for name in files.stdout.splitlines():
        if name.startswith(("tinytf/", "pyproject.toml", "README.md", "LICENSE")):
            (src / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(os.path.join(ROOT, name), src / name)
    wheel = subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps",
                            "--no-build-isolation", "-w", str(base / "wheel"), str(src)],
                           capture_output=True, text=True)
    if wheel.returncode != 0:
        pytest.skip(f"cannot build a wheel here: {wheel.stderr.strip()[-200:]}")
    env_dir = base / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    bin_dir = env_dir / ("Scripts" if os.name == "nt" else "bin")
    whl = next((base / "wheel").iterdir())
    subprocess.run([str(bin_dir / "python"), "-m", "pip", "install", "-q", "--no-deps",
                    str(whl)], check=True, capture_output=True)
    return bin_dir


def _run(bin_dir, cwd, name, *args, timeout=300):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(bin_dir / name), *map(str, args)], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_the_installed_commands_train_translate_and_average_from_another_directory(
        installed, tmp_path):
    where = _run(installed, tmp_path, "python", "-c", "import tinytf; print(tinytf.__file__)")
    assert str(installed.parent) in where.stdout, where.stdout     # the wheel, not the checkout
    for name in ("tinytf-train", "tinytf-translate", "tinytf-average", "tinytf-prepare",
                 "tinytf-bpe"):
        assert _run(installed, tmp_path, name, "--help").returncode == 0, name
    bare = _run(installed, tmp_path, "tinytf-train", "--max-steps", "1")
    assert bare.returncode == 2 and len(bare.stderr.strip().splitlines()) == 1, bare.stderr
    assert "no data/ende here" in bare.stderr and "--train SRC TGT --valid SRC TGT" in bare.stderr
    data = os.path.join(ROOT, "data", "ende")
    run = tmp_path / "run"
    sets = [a for s in TINY for a in ("--set", s)]
    prepare = _run(installed, tmp_path, "tinytf-prepare", "--data", data, "--out", run,
                   "--vocab-size", "300", "--set", "train_max_len=40")
    assert prepare.returncode == 0 and (run / "corpus" / "header.json").is_file(), prepare.stderr
    train = _run(installed, tmp_path, "tinytf-train", "--data", data, "--out", run,
                 "--max-steps", "4", "--save-interval-updates", "2", "--vocab-size", "300",
                 "--max-tokens", "200", *sets)
    assert train.returncode == 0, train.stderr
    assert "encoding" not in train.stderr     # the prepared corpus is used as it is
    average = _run(installed, tmp_path, "tinytf-average", "--inputs", run, "--num", "2",
                   "--output", run / "averaged.npz")
    assert average.returncode == 0, average.stderr
    (tmp_path / "in.txt").write_text("A house.\n\nThe dog sleeps.\n", encoding="utf-8")
    out = _run(installed, tmp_path, "tinytf-translate", "--model", run / "averaged.npz",
               "--input", "in.txt", "--max-len-b", "3", "--quiet")
    assert out.returncode == 0, out.stderr
    assert out.stdout.count("\n") == 3
    bpe = subprocess.run([str(installed / "tinytf-bpe"), "encode", "--model",
                          str(run / "bpe.json")], input="A house.\n", capture_output=True,
                         text=True, cwd=tmp_path)
    assert bpe.returncode == 0 and bpe.stdout.strip(), bpe.stderr
