"""tinytf.engine.backend: which device a command can use, said before any work."""
import types

import pytest

from tinytf.engine import backend


def test_gpu_unusable_says_why_or_nothing(monkeypatch, cupy_without_a_gpu):
    """None where CUDA counts a GPU; otherwise the words that follow "--device gpu" in the
    commands' one-line error: CuPy missing, failing to import, CUDA failing to count the
    GPUs (no driver, or one older than the wheel's runtime), or counting none."""
    words = cupy_without_a_gpu(None)
    assert backend.gpu_unusable() == words
    assert words.startswith("finds no usable GPU (cudaErrorInsufficientDriver")
    words = cupy_without_a_gpu(0)
    assert backend.gpu_unusable() == words == "finds no GPU (CUDA counts none)"
    runtime = types.SimpleNamespace(getDeviceCount=lambda: 2)
    monkeypatch.setattr(backend, "_cupy", types.SimpleNamespace(
        cuda=types.SimpleNamespace(runtime=runtime)))
    assert backend.gpu_unusable() is None

    def missing():
        raise RuntimeError("the GPU device needs CuPy")

    def broken():
        raise OSError("libcudart.so.12: cannot open shared object file")

    monkeypatch.setattr(backend, "_import_cupy", missing)
    assert backend.gpu_unusable().startswith("needs CuPy: pip install 'tinytf[gpu]'")
    monkeypatch.setattr(backend, "_import_cupy", broken)
    assert backend.gpu_unusable() == ("cannot import CuPy (OSError: libcudart.so.12: cannot "
                                      "open shared object file)")


@pytest.mark.skipif(backend.gpu_unusable() is None, reason="this machine has a GPU")
def test_this_machine_s_answer_names_the_problem():
    """Here (no usable GPU), whatever is installed: a reason, never an exception."""
    assert isinstance(backend.gpu_unusable(), str)
