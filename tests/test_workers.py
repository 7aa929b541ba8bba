"""tinytf.workers: ordered_map's worker processes end with their parent, however it ends."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

PARENT = f"""
import os, sys, time
sys.path.insert(0, {ROOT!r})
from tinytf.run_dir import RunLock
from tinytf.workers import ordered_map

lock = RunLock(sys.argv[1])      # forked workers share its file, and so the lock

def work(i):
    if i < 2:
        return os.getpid()
    time.sleep(120)         # the parent is killed while its workers are busy

for pid in ordered_map(work, range(6), 2):
    print(pid, flush=True)
"""


def _alive(pid: int) -> bool:
    """Whether process ``pid`` exists and is not a zombie."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_workers_end_with_a_killed_parent(sig, tmp_path):
    """A parent killed by SIGTERM (its default action) or SIGKILL while its workers are busy
    (a training run preempted while it learns its BPE): the workers end within a few
    seconds, not blocked for ever on their result pipe, and with them the run directory's
    lock, which they inherited: the requeued run can start."""
    from tinytf.run_dir import RunLock
    from tinytf.train_config import TrainError
    parent = subprocess.Popen([sys.executable, "-c", PARENT, str(tmp_path)],
                              stdout=subprocess.PIPE, text=True)
    try:
        workers = {int(parent.stdout.readline()) for _ in range(2)}
        assert len(workers) <= 2 and parent.pid not in workers
        time.sleep(0.5)                                # the workers are in their long items
        assert all(map(_alive, workers))
        with pytest.raises(TrainError, match="in use by another training run"):
            RunLock(str(tmp_path))
        parent.send_signal(sig)
        parent.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_alive, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(map(_alive, workers)), f"orphaned workers {workers} still run"
        RunLock(str(tmp_path)).release()               # free again
    finally:
        parent.kill()
        parent.wait()


def _nap_unless_first(i):
    """Item 0 at once; the others take 30 s (work in progress when the caller stops)."""
    if i:
        time.sleep(30)
    return os.getpid()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_caller_that_stops_early_does_not_wait_for_the_pieces_in_progress():
    """An exception in the caller (an error, a Ctrl-C's KeyboardInterrupt) while workers are
    busy: the workers end at once, and the process exits without waiting for their pieces
    (the interpreter's exit joins the pool)."""
    from tinytf.workers import ordered_map
    code = f"""
import sys, time
sys.path.insert(0, {ROOT!r})
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from test_workers import _nap_unless_first
from tinytf.workers import ordered_map
for pid in ordered_map(_nap_unless_first, range(6), 2):
    time.sleep(0.5)                                  # the other worker is in its nap
    raise KeyboardInterrupt
"""
    t0 = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr, \
        proc.stderr
    assert time.monotonic() - t0 < 15, "the exit waited for the workers' pieces"
    assert list(ordered_map(_nap_unless_first, [0, 0], 2))   # the module's pool still works
