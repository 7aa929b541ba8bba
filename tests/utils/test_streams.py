"""tinytf.utils.streams.write_all, and the commands that write through it: a write the file system
cuts short (here a file-size limit, as a full disk does) ends in an error, never in a
truncated output and exit status 0 (what CPython's buffered standard output gave)."""
import io
import os
import subprocess
import sys

import pytest

from tinytf.text import BPE
from tinytf.utils.streams import write_all

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DATA = os.path.join(ROOT, "data", "ende")
LIMIT = 3000    # bytes a process may write to any file


@pytest.fixture
def run_limited(file_size_limit):
    """``run(argv, stdout_path, stdin_path=None)``: Python with ``argv``, its standard output
    redirected to ``stdout_path``, no file past `LIMIT` bytes."""
    def run(argv, stdout_path, stdin_path=None):
        with open(stdout_path, "wb") as out, open(stdin_path or os.devnull, "rb") as inp:
            return subprocess.run([sys.executable, *argv], stdin=inp, stdout=out,
                                  stderr=subprocess.PIPE, cwd=ROOT, timeout=300,
                                  preexec_fn=file_size_limit(LIMIT))
    return run


def test_write_all_writes_everything_or_raises(tmp_path, run_limited):
    data = bytes(range(256)) * 40                       # 10,240 bytes, above the limit
    code = ("import sys\n"
            f"sys.path.insert(0, {ROOT!r})\n"
            "from tinytf.utils.streams import write_all\n"
            "try:\n"
            "    write_all(sys.stdout.buffer, bytes(range(256)) * 40)\n"
            "except OSError as e:\n"
            "    print(e.errno, file=sys.stderr); sys.exit(3)\n")
    result = run_limited(["-c", code], tmp_path / "out")
    assert result.returncode == 3, result.stderr
    assert (tmp_path / "out").read_bytes() == data[:LIMIT]
    buffer = io.BytesIO()                               # no descriptor: an ordinary write
    write_all(buffer, data)
    assert buffer.getvalue() == data
    small = tmp_path / "small"
    with open(small, "wb") as f:
        f.write(b"first ")                              # buffered: written first
        write_all(f, b"second")
    assert small.read_bytes() == b"first second"


@pytest.fixture(scope="module")
def bpe_model(tmp_path_factory):
    path = tmp_path_factory.mktemp("bpe") / "bpe.json"
    BPE.learn([os.path.join(DATA, "dev.en"), os.path.join(DATA, "dev.de")],
              vocab_size=400).save(str(path))
    return str(path)


@pytest.mark.parametrize("command", ["encode", "decode"])
def test_bpe_on_a_full_standard_output_is_an_error(bpe_model, tmp_path, run_limited, command):
    source = os.path.join(DATA, "dev.en")
    if command == "decode":
        pieces = tmp_path / "pieces"
        with open(pieces, "wb") as out, open(source, "rb") as inp:
            subprocess.run([sys.executable, "-m", "tinytf.commands.bpe", "encode", "--model",
                            bpe_model], stdin=inp, stdout=out, check=True, cwd=ROOT, timeout=120)
        source = str(pieces)
    result = run_limited(["-m", "tinytf.commands.bpe", command, "--model", bpe_model],
                         tmp_path / "out", source)
    err = result.stderr.decode()
    assert result.returncode == 2, err
    assert err == ("python -m tinytf.commands.bpe: error: the standard output: cannot write: "
                   "File too large\n")


def test_bpe_into_a_closed_pipe_ends_quietly(bpe_model):
    """| head: the reader goes away; exit 141 (128 + SIGPIPE) and nothing on stderr, as
    translate.py does (it printed "error: [Errno 32] Broken pipe", exit 1)."""
    with open(os.path.join(DATA, "train.en"), "rb") as inp:
        proc = subprocess.Popen([sys.executable, "-m", "tinytf.commands.bpe", "encode", "--model",
                                 bpe_model], stdin=inp, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, cwd=ROOT)
        assert proc.stdout.readline()
        proc.stdout.close()
        err = proc.stderr.read()
        assert proc.wait(timeout=120) == 141 and err == b"", err
