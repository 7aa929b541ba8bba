"""Stop signals: SIGINT, SIGTERM and SIGUSR1 ask a training run to stop after the update in
progress, with a checkpoint first (docs/checkpoints.md, "Stopping, preemption, requeueing")."""
from __future__ import annotations

import contextlib
import signal
import threading

from tinytf.utils.workers import STOP_SIGNALS


class StopRequested(BaseException):
    """Raised where the program is when a stop signal arrives inside
    :meth:`StopSignals.interrupting` (a BaseException, like KeyboardInterrupt, so that no
    ``except Exception`` swallows it)."""


class StopSignals:
    """Records the first stop signal while :meth:`catching`; ``requested`` and ``number``
    say whether one came and which. Further signals are noted and change nothing, so that
    the checkpoint that follows is written whole before the process exits. With
    ``hold_after_stop`` (the command line, whose process ends with the run) the stop signals
    are ignored after a stop, so that one between the checkpoint and the exit cannot turn the
    exit status 128 + N into a death by signal; otherwise the previous handlers come back.

    Between updates the first signal is only recorded: the loop stops at the next update's
    boundary. Work with no such boundary (the final validation and test decoding) runs
    inside :meth:`interrupting`, where the first signal also raises :class:`StopRequested`
    at once, except inside :meth:`deferred`, which a checkpoint's writing holds."""

    def __init__(self, log, hold_after_stop: bool = False):
        self.log = log
        self.hold_after_stop = hold_after_stop
        self.requested = False
        self.number = None
        self._interrupts = False

    def _handler(self, signum, frame):
        if self.requested:
            self.log.info(f"received signal {signum} again: already stopping, the checkpoint "
                          "comes first")
            return
        self.requested, self.number = True, signum
        if self._interrupts:
            self.log.info(f"received signal {signum}: stopping now")
            raise StopRequested(signum)
        self.log.info(f"received signal {signum}: stopping after this update with a "
                      "checkpoint")

    @contextlib.contextmanager
    def catching(self):
        """Handle the stop signals inside the block (main thread only), then restore the
        previous handlers."""
        if threading.current_thread() is not threading.main_thread():
            yield self
            return
        self.requested, self.number = False, None
        previous = {sig: signal.signal(sig, self._handler) for sig in STOP_SIGNALS}
        try:
            yield self
        finally:
            for sig, old in previous.items():
                # SIG_IGN, unlike a Python handler, survives the interpreter's shutdown.
                held = self.requested and self.hold_after_stop
                signal.signal(sig, signal.SIG_IGN if held else old)

    @contextlib.contextmanager
    def interrupting(self):
        """Inside :meth:`catching`: the first stop signal raises :class:`StopRequested`
        where the block is, and so does entering it after a signal was recorded."""
        if self.requested:
            raise StopRequested(self.number)
        with self._interrupting(True):
            yield self

    @contextlib.contextmanager
    def deferred(self):
        """Inside :meth:`interrupting`: a stop signal is only recorded (what the block
        writes is written whole); the caller reads ``requested`` after it."""
        with self._interrupting(False):
            yield self

    @contextlib.contextmanager
    def _interrupting(self, on: bool):
        before, self._interrupts = self._interrupts, on
        try:
            yield
        finally:
            self._interrupts = before
