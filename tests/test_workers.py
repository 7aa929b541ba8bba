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
