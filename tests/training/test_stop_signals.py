"""tinytf.training.signals: what a stop signal does inside catching, interrupting and deferred."""
import os
import signal

import pytest

from tinytf.training.signals import StopRequested, StopSignals


class _Log:
    def __init__(self):
        self.lines = []

    def info(self, line):
        self.lines.append(line)


def _signal_self(signum=signal.SIGUSR1):
    os.kill(os.getpid(), signum)
    # The handler runs in the main thread at the next bytecode boundary; a call makes one.
    sum(range(10))


def test_between_updates_the_first_signal_is_recorded_and_the_others_change_nothing():
    log = _Log()
    stops = StopSignals(log)
    before = signal.getsignal(signal.SIGUSR1)
    with stops.catching():
        _signal_self()
        _signal_self(signal.SIGTERM)
        assert stops.requested and stops.number == signal.SIGUSR1
    assert len(log.lines) == 2 and "again" in log.lines[1]
    assert signal.getsignal(signal.SIGUSR1) is before       # the handlers come back


def test_interrupting_raises_at_once_but_never_inside_deferred():
    stops = StopSignals(_Log())
    with stops.catching():
        with pytest.raises(StopRequested):
            with stops.interrupting():
                _signal_self()
                pytest.fail("the signal did not stop the block")
        assert stops.number == signal.SIGUSR1
        with pytest.raises(StopRequested):      # entering it after a stop raises too
            with stops.interrupting():
                pass

    stops = StopSignals(_Log())
    with stops.catching():
        with stops.interrupting():
            with stops.deferred():
                _signal_self()
                written = True                  # a checkpoint's writing goes on
            assert written and stops.requested
            _signal_self()                      # a second signal: noted, no raise

    stops = StopSignals(_Log())
    with stops.catching():
        with stops.interrupting():
            pass
        _signal_self()                          # outside it again: recorded only
        assert stops.requested


def test_after_a_stop_the_command_line_ignores_the_signals_until_it_exits():
    stops = StopSignals(_Log(), hold_after_stop=True)
    before = signal.getsignal(signal.SIGTERM)
    try:
        with stops.catching():
            _signal_self(signal.SIGTERM)
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, before)
