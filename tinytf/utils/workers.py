"""Worker processes for work in independent pieces: word counts, encoding a corpus.

:func:`ordered_map` is ``map(fn, items)`` over ``workers`` processes with the results in input
order and at most two pieces per worker in flight, so reading, computing and writing overlap
and memory stays bounded by the pieces, whatever the input's size. Workers are forked where the
platform can (as fairseq-preprocess's are): a spawned worker would import the user's main
script again. They must touch no MPI or GPU state.
"""
from __future__ import annotations

import atexit
import collections
import contextlib
import multiprocessing
import multiprocessing.connection
import multiprocessing.util  # noqa: F401 (its exit handler is registered before ours)
import os
import pickle
import queue
import signal
import threading
import traceback

# What OpenBLAS's thread-count setter is called in the builds that NumPy ships (scipy-openblas,
# 64-bit integers) and in a distribution's own library.
_OPENBLAS_SETTERS = ("scipy_openblas_set_num_threads64_", "openblas_set_num_threads64_",
                     "scipy_openblas_set_num_threads", "openblas_set_num_threads")


def available_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. under mpirun's binding)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        return max(1, os.cpu_count() or 1)


def thread_budget() -> int:
    """The cores this process is meant to use: ``TINYTF_THREADS``, else ``OMP_NUM_THREADS``,
    else ``OPENBLAS_NUM_THREADS`` (the knobs that already size the BLAS), else the CPUs it
    may run on. Row threads and decode workers share it."""
    for var in ("TINYTF_THREADS", "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        value = os.environ.get(var, "").strip()
        if value.isdigit() and int(value) > 0:
            return int(value)
    return available_cpus()


def set_blas_threads(n: int) -> bool:
    """Size the thread pools of the BLAS libraries loaded in this process (OpenBLAS, MKL,
    BLIS) to ``n`` threads, at run time (``OPENBLAS_NUM_THREADS`` is read only when NumPy
    loads its BLAS), through threadpoolctl. Returns False where no BLAS pool was found."""
    from threadpoolctl import threadpool_limits   # noqa: PLC0415 - loads only when used
    limits = threadpool_limits(limits=int(n), user_api="blas")
    return bool(limits.get_original_num_threads().get("blas"))


def blas_threads() -> int | None:
    """The thread count of the first BLAS library loaded in this process (None: unknown)."""
    from threadpoolctl import threadpool_info     # noqa: PLC0415
    pools = [p for p in threadpool_info() if p.get("user_api") == "blas"]
    return int(pools[0]["num_threads"]) if pools else None


def can_fork() -> bool:
    """Whether this platform starts worker processes by forking (they inherit the parent's
    memory, such as a loaded model)."""
    return "fork" in multiprocessing.get_all_start_methods()


STOP_SIGNALS = tuple(getattr(signal, name) for name in ("SIGINT", "SIGTERM", "SIGUSR1")
                     if hasattr(signal, name))
"""The signals that stop a command or a training run (the run's handling of them:
:mod:`tinytf.training.signals`). SIGUSR1 is the one Open MPI's ``mpirun`` forwards to its ranks
(it handles SIGTERM itself)."""


@contextlib.contextmanager
def stop_signals_held():
    """The stop signals held back (pending, not lost) while the block runs, and delivered
    when it ends: work that a stop must not cut in two (a block of output written and
    counted). :func:`ordered_map` holds them while it forks workers: in the parent, a
    handler that ran inside fork's at-fork hooks would have its exception ignored, and a
    worker must not run the parent's handler before :func:`_worker_main` ignores them."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, before)


PARENT_CHECK_SECONDS = 1.0
"""How often a worker looks whether its parent is still there (one that dies closes its
pipes' ends, which the worker sees at once; this catches the rest)."""


class WorkerError(RuntimeError):
    """A worker process of :func:`ordered_map` ended before it answered for its pieces (the
    OOM killer, a SIGKILL sent to it alone)."""


def signal_words(number: int) -> str:
    """A signal in a message: "signal 15 (SIGTERM)" (its number alone where it has no name)."""
    try:
        return f"signal {number} ({signal.Signals(number).name})"
    except ValueError:
        return f"signal {number}"


def _describe_exit(code) -> str:
    """A process's end, in words: "exit status 1", "signal 9 (SIGKILL)"."""
    return f"exit status {code}" if code is None or code >= 0 else signal_words(-code)


def _receive_tasks(tasks, inbox, parent: int) -> None:
    """A worker's thread that reads its pieces from the pipe ``tasks`` as they come, into
    ``inbox``, so that the parent never waits on a busy worker to send it the next one (and
    the worker never waits on the parent, which might be sending, to take its result). It
    ends the worker at once (SIGKILL: no clean-up, the parent's state is not its own) when
    process ``parent`` is gone, looking every :data:`PARENT_CHECK_SECONDS`, however the
    parent ended (SIGKILL and the OOM killer included): an orphaned worker would hold its
    memory (hundreds of MB of word counts at WMT size) and the files it inherited, a run
    directory's lock among them, so that a requeued run would be refused."""
    while os.getppid() == parent:
        try:
            if not tasks.poll(PARENT_CHECK_SECONDS):
                continue
            task = tasks.recv()
        except (EOFError, OSError):     # the parent's end closed: the parent is gone
            break
        except Exception as exc:        # read whole, but it does not unpickle here
            task = (None, exc)
        inbox.put(task)
        if task == _DONE:
            return
    os.kill(os.getpid(), getattr(signal, "SIGKILL", signal.SIGTERM))   # (Windows: no SIGKILL)


_DONE = ()
"""What the parent sends a worker when it has no more pieces for it (a piece comes as the
1-tuple ``(piece,)``; one that the worker cannot read becomes ``(None, the error)``)."""


def _worker_main(tasks, results, fn, initializer, initargs, parent: int, inherited) -> None:
    """A worker process: ``initializer(*initargs)``, then ``fn(piece)`` for each piece that
    comes on the pipe ``tasks``, in order, each answered on the pipe ``results`` by
    ``(True, value, None)`` or ``(False, exception, its traceback in words)``.

    It closes the ``inherited`` connections (its forked copies of its elder siblings'
    pipes, so that each pipe's ends are held by its parent and its worker alone, and an end
    closed by either is seen by the other) and ignores the stop signals (a terminal's Ctrl-C
    and a scheduler's SIGTERM reach the whole process group): the parent decides, and ends
    its workers. No pipe is shared between workers, so a worker killed at any instant, even
    half-way through writing a result, leaves its siblings and its parent a clean state."""
    for connection in inherited:
        connection.close()
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):      # held back by the fork (`stop_signals_held`)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, STOP_SIGNALS)
    inbox = queue.SimpleQueue()
    threading.Thread(target=_receive_tasks, args=(tasks, inbox, parent),
                     name="tinytf-tasks", daemon=True).start()
    failed = None
    if initializer is not None:
        try:
            initializer(*initargs)
        except Exception as exc:            # every piece answers with it
            failed = (False, exc, traceback.format_exc())
    while (task := inbox.get()) != _DONE:
        answer = failed
        if len(task) == 2:
            answer = (False, WorkerError(f"a piece cannot be read in a worker: {task[1]!r}"),
                      None)
        if answer is None:
            try:
                answer = (True, fn(task[0]), None)
            except Exception as exc:
                answer = (False, exc, traceback.format_exc())
        try:
            results.send(answer)
        except (pickle.PicklingError, TypeError, AttributeError) as exc:   # nothing written yet
            results.send((False, WorkerError(f"a worker's answer cannot be sent to its "
                                             f"parent: {exc}"), traceback.format_exc()))
        except OSError:             # EPIPE: the parent is gone (and so is this worker, soon)
            return


PIPE_BYTES = 1 << 20
"""The buffer asked for each worker's pipes (Linux's default is 64 KiB)."""


def _widen(connection) -> None:
    """Give the pipe under ``connection`` a buffer of :data:`PIPE_BYTES` (Linux; 64 KiB
    otherwise): a piece of megabytes then crosses in a few reads, not hundreds, each of
    which a busy worker's reader thread waits for the interpreter's lock to make."""
    try:
        import fcntl  # noqa: PLC0415 - POSIX only; imported where it is used
    except ImportError:
        return
    if hasattr(fcntl, "F_SETPIPE_SZ"):
        with contextlib.suppress(OSError):      # above /proc/sys/fs/pipe-max-size
            fcntl.fcntl(connection.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)


class _Worker:
    """One worker process, its two pipes and the answers it owes (see :func:`_worker_main`)."""

    def __init__(self, context, fn, initializer, initargs, siblings):
        tasks_read, self.tasks = context.Pipe(duplex=False)
        self.results, results_write = context.Pipe(duplex=False)
        for end in (self.tasks, self.results):
            _widen(end)
        inherited = []                  # what a fork copies of the parent's ends
        if context.get_start_method() == "fork":
            inherited = [c for w in [self, *siblings] for c in (w.tasks, w.results)]
        self.process = context.Process(
            target=_worker_main, name="tinytf-worker", daemon=True,
            args=(tasks_read, results_write, fn, initializer, initargs, os.getpid(),
                  inherited))
        with stop_signals_held():   # no handler of the parent's runs in the fork
            self.process.start()
        tasks_read.close()          # the worker's ends are its own
        results_write.close()
        self.parent = os.getpid()
        self.owed = 0               # answers not yet yielded: received, or to come
        self.answers = collections.deque()

    def busy(self) -> int:
        """The pieces it has not answered yet (as far as this process has read)."""
        return self.owed - len(self.answers)

    def send(self, piece) -> None:
        """Give the worker ``piece`` (its reader thread takes it at once)."""
        try:
            self.tasks.send((piece,))
        except OSError as exc:      # EPIPE: it died
            raise self.died() from exc
        self.owed += 1

    def receive(self) -> None:
        """Take the next answer from the pipe (one is ready) into :attr:`answers`."""
        try:
            self.answers.append(self.results.recv())
        except (EOFError, OSError) as exc:     # killed, maybe half-way through an answer
            raise self.died() from exc
        except Exception as exc:               # read whole, but it does not unpickle here
            self.answers.append((False, WorkerError(f"an answer of worker process "
                                                    f"{self.process.pid} cannot be read: "
                                                    f"{exc!r}"), None))

    def died(self) -> WorkerError:
        """The error to raise for a worker found dead (its pipe closed)."""
        self.process.join(1.0)
        code = self.process.exitcode
        hint = " (out of memory? the kernel's OOM killer sends SIGKILL)" \
            if code == -getattr(signal, "SIGKILL", 9) else ""
        return WorkerError(f"worker process {self.process.pid} ended with "
                           f"{_describe_exit(code)} before it finished its pieces{hint}")

    def end(self, kill: bool) -> None:
        """Stop the worker: told it has no more pieces, or (``kill``) at once, SIGKILL."""
        if kill:
            self.process.kill()
        else:
            with contextlib.suppress(OSError):
                self.tasks.send(_DONE)
        self.process.join()
        self.tasks.close()
        self.results.close()


_LIVE = set()
"""The workers of every :func:`ordered_map` in progress: the interpreter's exit kills those
of a map left unfinished (multiprocessing's own exit would wait for them, and they ignore
SIGTERM)."""


@atexit.register
def _kill_live_workers() -> None:      # registered after multiprocessing's: runs before it
    for worker in list(_LIVE):
        if worker.parent == os.getpid():    # (not in a fork that exits through here)
            worker.process.kill()


def _answer(worker: _Worker, pool: list):
    """``worker``'s next answer, ``value`` or the exception raised: reads the other workers'
    answers that come in the meantime, so that none waits on its pipe while the parent waits."""
    while not worker.answers:
        busy = [w for w in pool if w.busy()]
        ready = multiprocessing.connection.wait([w.results for w in busy])
        for w in busy:
            if w.results in ready:
                w.receive()
    worker.owed -= 1
    ok, value, trace = worker.answers.popleft()
    if ok:
        return value
    if trace and hasattr(value, "add_note"):
        value.add_note(f"in worker process {worker.process.pid}:\n{trace.rstrip()}")
    raise value


def ordered_map(fn, items, workers: int, initializer=None, initargs=()):
    """Yield ``fn(item)`` for each item, in order: in this process for one worker (after
    ``initializer(*initargs)``), else in ``workers`` processes, each initialised once.

    An exception raised by ``fn`` in a worker is raised here, at its item's turn. The map
    stops early when the caller does (an error, Ctrl-C, a consumer that stops reading): the
    workers are killed at once, not waited for (their pieces in progress take seconds each at
    WMT size). A worker that dies is a :class:`WorkerError`."""
    if workers <= 1:
        if initializer is not None:
            initializer(*initargs)
        yield from map(fn, items)
        return
    context = multiprocessing.get_context("fork" if can_fork() else "spawn")
    pool = []
    finished = False
    try:
        turns = collections.deque()         # the worker of each piece not yet yielded
        for item in items:
            if len(pool) < workers and all(w.busy() for w in pool):   # started as needed
                pool.append(_Worker(context, fn, initializer, initargs, pool))
                _LIVE.add(pool[-1])
            worker = min(pool, key=_Worker.busy)     # the least busy, the first of equals
            worker.send(item)
            turns.append(worker)
            if len(turns) >= 2 * workers:
                yield _answer(turns.popleft(), pool)
        while turns:
            yield _answer(turns.popleft(), pool)
        finished = True
    finally:
        for worker in pool:
            worker.end(kill=not finished)
            _LIVE.discard(worker)
