"""Shared test set-up: Hypothesis profiles, the ``data_dir`` fixture of the training tests,
``cupy_without_a_gpu`` for the commands' ``--device gpu`` on a machine that cannot use one, and
``file_size_limit`` for a subprocess whose writes a file system refuses, as a full disk does.
A session that runs past `SESSION_SECONDS` (a test that hangs), or that has reported its
results but does not exit within `EXIT_SECONDS` (a thread or process that the interpreter's
exit waits on), prints every thread's stack and exits 1: a failure that says where it
stopped, rather than a CI job that runs until its time limit.

Profiles: "ci" (default) keeps the suite fast on 2 cores; "dev" searches harder. Select one
with HYPOTHESIS_PROFILE=dev. "ci" keeps no example database, so every run starts
fresh; a failure prints the falsifying example and a reproduction blob.
"""
import contextlib
import faulthandler
import os
import resource
import signal
import types

import pytest
from hypothesis import HealthCheck, settings

SHIPPED = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "data",
                       "ende")

settings.register_profile(
    "ci", max_examples=30, deadline=None, database=None, print_blob=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])
settings.register_profile("dev", max_examples=300, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "ci"))

NO_DRIVER = RuntimeError("cudaErrorInsufficientDriver: CUDA driver version is insufficient "
                         "for CUDA runtime version")
"""What CuPy 14's ``cuda.runtime.getDeviceCount()`` raises (a ``CUDARuntimeError``, which is
a RuntimeError) on a machine whose driver is missing or older than the wheel's CUDA."""


def _head(src, dst, n):
    with open(src, encoding="utf-8") as f:
        lines = [next(f) for _ in range(n)]
    with open(dst, "w", encoding="utf-8") as f:
        f.writelines(lines)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    """The first 120 training and 6 dev pairs of the shipped corpus (training tests)."""
    d = tmp_path_factory.mktemp("data")
    for lang in ("en", "de"):
        _head(os.path.join(SHIPPED, f"train.{lang}"), d / f"train.{lang}", 120)
        _head(os.path.join(SHIPPED, f"dev.{lang}"), d / f"dev.{lang}", 6)
    return str(d)


@pytest.fixture
def cupy_without_a_gpu(monkeypatch):
    """``install(device_count=None)``: for this test tinytf sees an installed CuPy whose
    ``cuda.runtime.getDeviceCount()`` raises `NO_DRIVER` (None) or returns ``device_count``
    (0: no GPU). Returns the words a command's error should give after "--device gpu"."""
    from tinytf.engine import backend  # noqa: PLC0415 (tinytf is imported by the tests, not here)

    def install(device_count=None):
        def get_device_count():
            if device_count is None:
                raise NO_DRIVER
            return device_count
        runtime = types.SimpleNamespace(getDeviceCount=get_device_count)
        monkeypatch.setattr(backend, "_cupy", types.SimpleNamespace(
            cuda=types.SimpleNamespace(runtime=runtime), ndarray=type("ndarray", (), {})))
        return (f"finds no usable GPU ({NO_DRIVER})" if device_count is None
                else "finds no GPU (CUDA counts none)")
    return install


def _file_size_limit(limit: int):
    """A ``preexec_fn`` for ``subprocess``: the child may write no file past ``limit`` bytes,
    and a write that would gets EFBIG (SIGXFSZ ignored, which would kill it): the short write,
    then the refusal, that a full disk gives."""
    def apply():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    return apply


@pytest.fixture
def file_size_limit():
    """``file_size_limit(limit)``: a ``preexec_fn`` (see `_file_size_limit`)."""
    return _file_size_limit


SESSION_SECONDS = 3600       # (the suite takes about 7 minutes on 2 cores)
EXIT_SECONDS = 120


_real_stderr = None
"""A descriptor of the session's own stderr (pytest captures descriptor 2 while it runs)."""


def pytest_configure(config):
    """From the start: a session that runs past SESSION_SECONDS is a failure with stacks."""
    global _real_stderr
    capture = config.pluginmanager.getplugin("capturemanager")
    with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
        _real_stderr = os.dup(2)
    faulthandler.dump_traceback_later(SESSION_SECONDS, exit=True, file=_real_stderr)


def pytest_unconfigure(config):
    """The session has reported: from here, a hang at the interpreter's exit is a failure
    with the stacks that say what it waits on, not a CI job that never ends."""
    faulthandler.dump_traceback_later(EXIT_SECONDS, exit=True, file=_real_stderr or 2)
