"""``import tinytf`` changes nothing in the process and loads nothing heavy; the op table
fills itself at the first op; the commands set up their own process."""
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

IMPORT_ONLY = r"""
import json, os, sys
before = dict(os.environ)
import tinytf
loaded = "numpy" in sys.modules
import numpy as np
x = tinytf.Tensor(np.ones((2, 3), np.float32), requires_grad=True)
(x * 2.0).sum().backward()
from tinytf.engine.dispatch import impl
from tinytf.fast.cpu import memory
print(json.dumps({"numpy_at_import": loaded, "environ_same": dict(os.environ) == before,
                  "kept": memory.kept(), "grad": x.grad.tolist(),
                  "linear": impl.Linear.cpu.__name__, "gpu_linear": impl.Linear.gpu.__name__,
                  "replaced": sorted(impl.installed("cpu"))}))
"""


def _run(code, **env):
    environ = {k: v for k, v in os.environ.items()
               if k not in ("OPENBLAS_THREAD_TIMEOUT", "TINYTF_FAST")}
    out = subprocess.run([sys.executable, "-c", code], env=dict(environ, **env), cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip().splitlines()[-1]


def test_importing_tinytf_changes_nothing_in_the_process():
    """No environment variable, no allocator setting, no NumPy at ``import tinytf``; the
    first op fills the op table, fast variants included (references with TINYTF_FAST=0)."""
    import json
    got = json.loads(_run(IMPORT_ONLY))
    assert got["numpy_at_import"] is False and got["environ_same"] and not got["kept"]
    assert got["grad"] == [[2.0] * 3] * 2
    assert got["linear"] == "RowParallelLinear" and got["gpu_linear"] == "FusedLinear"
    assert "LayerNorm" in got["replaced"]
    got = json.loads(_run(IMPORT_ONLY, TINYTF_FAST="0"))
    assert got["linear"] == got["gpu_linear"] == "Linear" and got["replaced"] == []


def test_a_command_sets_up_its_process():
    """Importing the commands sets OpenBLAS's thread timeout before NumPy loads (never over
    the user's); a command's start keeps freed memory."""
    code = ("import os, sys\nimport tinytf.commands as c\nc.start_process()\n"
            "from tinytf.fast.cpu import memory\n"
            "print(os.environ.get('OPENBLAS_THREAD_TIMEOUT'), memory.kept())")
    timeout, kept = _run(code).split()
    assert timeout == "16" and (kept == "True" or not sys.platform.startswith("linux"))
    assert _run(code, OPENBLAS_THREAD_TIMEOUT="4").split()[0] == "4"
    assert _run(code, TINYTF_KEEP_MEMORY="0").split()[1] == "False"


def test_the_chain_of_an_op_names_each_class_down_to_the_reference():
    from tinytf.engine.dispatch import impl
    from tinytf.fast.cpu.ops import RowParallelLayerNorm
    from tinytf.fast.cuda.ops import FusedLayerNorm
    from tinytf.ops.norm import LayerNorm
    assert impl.chain("LayerNorm", "cpu") == [RowParallelLayerNorm, LayerNorm]
    assert impl.chain("LayerNorm", "gpu") == [FusedLayerNorm, LayerNorm]   # no CPU class
    assert impl.chain("Softmax", "cpu") == [impl.reference("Softmax")]
    text = impl.describe("LayerNorm").splitlines()
    assert text[0].startswith("LayerNorm") and len(text) == 3
    assert text[1] == ("  cpu: RowParallelLayerNorm (tinytf.fast.cpu.ops) -> "
                       "LayerNorm (tinytf.ops.norm)")
    assert text[2] == "  gpu: FusedLayerNorm (tinytf.fast.cuda.ops) -> LayerNorm (tinytf.ops.norm)"
    with pytest.raises(KeyError):
        impl.chain("NoSuchOp")
