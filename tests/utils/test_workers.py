"""tinytf.utils.workers: ordered_map's worker processes end with their parent, however it ends."""
import os
import signal
import subprocess
import sys
import time

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PARENT = f"""
import os, sys, time
sys.path.insert(0, {ROOT!r})
from tinytf.training.run_dir import RunLock
from tinytf.utils.workers import ordered_map

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
    from tinytf.training.config import TrainError
    from tinytf.training.run_dir import RunLock
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
        while True:     # free again (a worker that took no item, if any, may end later)
            try:
                RunLock(str(tmp_path)).release()
                break
            except TrainError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        parent.kill()
        parent.wait()


def _nap_unless_first(i):
    """Item 0 at once; the others take 30 s (work in progress when the caller stops)."""
    if i:
        time.sleep(30)
    return os.getpid()


def _big_late_unless_first(i):
    """Item 0: this worker's PID, at once. The others: 64 MiB, after 0.3 s; the worker is
    then half-way through writing it into its pipe until the caller asks for it."""
    if i == 0:
        return os.getpid()
    time.sleep(0.3)
    return bytes(64 << 20)


def _run(code: str, timeout: float = 60):
    """Python ``code`` in a child process (with tinytf and this module importable), timed; a
    hang is a failure, not a hung test session."""
    prelude = f"""
import multiprocessing, os, signal, sys, time
sys.path.insert(0, {ROOT!r})
sys.path.insert(0, {os.path.dirname(os.path.abspath(__file__))!r})
from test_workers import _big_late_unless_first, _nap_unless_first
from tinytf.utils.workers import WorkerError, ordered_map
"""
    t0 = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-c", prelude + code], capture_output=True,
                              text=True, timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        pytest.fail(f"hung for {timeout} s: {exc.stderr!r}")
    return proc, time.monotonic() - t0


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="reads /proc")
def test_a_caller_that_stops_early_does_not_wait_for_the_pieces_in_progress():
    """An exception in the caller (an error, a Ctrl-C's KeyboardInterrupt) while workers are
    busy: the workers end at once, and the process exits without waiting for their pieces
    (the interpreter's exit would join them)."""
    proc, seconds = _run("""
for pid in ordered_map(_nap_unless_first, range(6), 2):
    time.sleep(0.5)                                  # the other worker is in its nap
    raise KeyboardInterrupt
""")
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr, \
        proc.stderr
    assert seconds < 15, "the exit waited for the workers' pieces"


def test_a_caller_that_stops_while_a_worker_writes_its_answer_exits():
    """The caller stops while a worker is half-way through writing a large answer (the
    parent reads an answer only when it waits for one): the workers are killed there, and
    the process exits at once."""
    proc, seconds = _run("""
it = ordered_map(_big_late_unless_first, range(2), 2)
next(it)
time.sleep(1.0)                        # the other worker writes 64 MiB that no one reads
raise KeyboardInterrupt
""")
    assert proc.returncode == -signal.SIGINT and "KeyboardInterrupt" in proc.stderr, \
        proc.stderr
    assert seconds < 15


def test_a_worker_killed_half_way_through_its_answer_is_an_error_not_a_hang():
    """A worker killed (the OOM killer, a SIGKILL to it alone) half-way through writing its
    answer: the caller gets a WorkerError that says how it ended, at once. (With
    concurrent.futures' pool, whose workers share one result pipe, the pool's reader thread
    waited for ever on the half-written answer, and so did the interpreter's exit, which
    joins that thread: a test session that had printed its results never ended.)"""
    proc, seconds = _run("""
it = ordered_map(_big_late_unless_first, range(2), 2)
first = next(it)
time.sleep(1.0)                        # the other worker writes 64 MiB that no one reads
other, = [p.pid for p in multiprocessing.active_children() if p.pid != first]
os.kill(other, signal.SIGKILL)
try:
    next(it)
except WorkerError as exc:
    print(exc)
""")
    assert proc.returncode == 0 and "ended with signal 9 (SIGKILL) before it finished its " \
        "pieces" in proc.stdout, proc.stderr
    assert seconds < 15


def test_a_map_left_unfinished_does_not_hold_the_exit():
    """A map that the caller neither finishes nor closes (its generator kept to the end):
    the interpreter's exit ends its workers, which ignore SIGTERM, rather than wait on them."""
    proc, seconds = _run("""
it = ordered_map(_nap_unless_first, range(6), 2)
next(it)
""")
    assert proc.returncode == 0, proc.stderr
    assert seconds < 15


class _Refused(Exception):
    pass


def _refuse_odd(i):
    if i % 2:
        raise _Refused(f"item {i}")
    return i * i


def _unpicklable(i):
    return lambda: i


def _fail_to_start():
    raise _Refused("no start")


def test_results_come_in_order_and_errors_at_their_turn():
    """Results in input order over workers that take turns unevenly; an exception raised by
    ``fn`` in a worker is raised at its item's turn, with the worker's traceback as a note;
    an answer that cannot be sent, or an initializer that fails, is an error too, and the
    map can be run again after each."""
    from tinytf.utils.workers import WorkerError, ordered_map
    items = [0, 2, 4, 6, 8, 10, 12, 14, 16]
    assert list(ordered_map(_refuse_odd, items, 3)) == [i * i for i in items]
    got = []
    with pytest.raises(_Refused, match="item 5") as info:
        for value in ordered_map(_refuse_odd, [0, 2, 4, 5, 6], 2):
            got.append(value)
    assert got == [0, 4, 16]
    assert any("_refuse_odd" in note for note in getattr(info.value, "__notes__", []))
    with pytest.raises(WorkerError, match="cannot be sent"):
        list(ordered_map(_unpicklable, [1, 2], 2))
    with pytest.raises(_Refused, match="no start"):
        list(ordered_map(_refuse_odd, [0, 2], 2, initializer=_fail_to_start))
    assert list(ordered_map(_refuse_odd, range(0, 40, 2), 2)) == [i * i for i in
                                                                  range(0, 40, 2)]


def _killed(*args):
    """A worker's piece that ends its process as the OOM killer would."""
    os.kill(os.getpid(), signal.SIGKILL)


def _one_line_exit_1(status, err, prog):
    lines = err.strip().splitlines()
    assert status == 1 and "Traceback" not in err, err
    assert lines[-1].startswith(prog) and ": error: worker process " in lines[-1] and \
        "ended with signal 9 (SIGKILL) before it finished its pieces (out of memory?" in \
        lines[-1], err


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="POSIX signals")
def test_a_killed_worker_is_one_line_and_exit_1_in_each_command(
        data_dir, tmp_path, monkeypatch, capsys):
    """A worker killed (by the OOM killer) while train.py learns its BPE, tinytf-prepare
    encodes the corpus or ``tinytf-bpe encode --workers 2`` encodes its input: one line
    that says so, exit 1, no traceback."""
    import io

    from tinytf.commands import bpe as cli
    from tinytf.commands import prepare as prepare_command
    from tinytf.commands import train as train_command
    from tinytf.data import prepare
    from tinytf.text import learn

    with monkeypatch.context() as patch:
        patch.setattr(learn, "_count_range", _killed)
        status = train_command.main(["--data", data_dir, "--out", str(tmp_path / "t"),
                                     "--vocab-size", "300", "--workers", "2",
                                     "--max-steps", "1"])
        _one_line_exit_1(status, capsys.readouterr().err, os.path.basename(sys.argv[0]))

    with monkeypatch.context() as patch:
        patch.setattr(prepare, "_encode_in_worker", _killed)
        status = prepare_command.main(["--data", data_dir, "--out", str(tmp_path / "p"),
                                       "--vocab-size", "300", "--workers", "2"])
        _one_line_exit_1(status, capsys.readouterr().err, "tinytf-prepare")

    with monkeypatch.context() as patch:
        patch.setattr(cli, "_encode_block", _killed)
        patch.setattr("sys.stdin", io.TextIOWrapper(io.BytesIO(b"a house\n" * 50)))
        status = cli.main(["encode", "--model", str(tmp_path / "p" / "bpe.json"),
                           "--workers", "2"])
        _one_line_exit_1(status, capsys.readouterr().err, "python -m tinytf.commands.bpe")


def _pid(_):
    return os.getpid()


def test_workers_start_as_the_pieces_need_them():
    """A map of fewer pieces than workers (a small input to ``tinytf-bpe encode --workers 4``)
    forks no worker that would stay idle."""
    import multiprocessing

    from tinytf.utils.workers import ordered_map
    pieces = ordered_map(_pid, [0], 4)
    pid = next(pieces)
    assert [p.pid for p in multiprocessing.active_children()] == [pid]
    assert list(pieces) == []
    assert len(set(ordered_map(_pid, range(8), 2))) == 2
