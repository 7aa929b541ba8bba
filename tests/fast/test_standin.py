"""tinytf's GPU code paths, run on the CPU through a stand-in for CuPy (tests/standin/).

No GPU is needed: the stand-in's arrays are NumPy memory that tinytf takes for CuPy's, the
fused kernels run through the g++ build of their CUDA source, cuBLAS products through a
Python version of the GEMM interface, and every device-to-host read is counted. So these
tests run what only a GPU machine ran before: train.py and translate.py with --device gpu
(fused kernels, the cuBLAS plans, pinned staging, bf16 storage, the CUDA-graph fallback),
and they check that a training step launches its work without waiting for the device.
They prove wiring, not CUDA semantics or speed (tests/fast/test_gpu.py and bench/gpu_check.sh
do that on a GPU). Each runs in a subprocess, so the stand-in never meets the other tests'
NumPy arrays.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi_support import SCRIPTS, requires_mpi, run_mpi

from tinytf.fast.cuda.kernels import host
from tinytf.utils import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STANDIN = os.path.join(ROOT, "tests", "standin")
TINY = ["d_model=16", "n_heads=2", "d_ff=32", "n_encoder_layers=1", "n_decoder_layers=1",
        "max_len=40", "train_max_len=30", "valid_bleu_sentences=2", "dropout=0.0",
        "optimizer=adam"]   # (RAdam, the tiny preset's, takes no step in its first 5 updates)

pytestmark = pytest.mark.skipif(host.compiler() is None,
                                reason="needs g++ to run the kernels' CUDA source on the CPU")


def _env(*paths):
    """This environment with the stand-in (and ``paths``) first on PYTHONPATH."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        [STANDIN, ROOT, *paths]
        + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])))
    env.pop("TINYTF_DEVICE", None)
    return env


def _run(args, timeout=600):
    proc = subprocess.run([sys.executable, *args], cwd=ROOT, env=_env(), capture_output=True,
                          text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc.stdout, proc.stderr


def _summary(stdout):
    return json.loads(stdout.strip().splitlines()[-1])


STEP_SCRIPT = r"""
import json, os, sys
import cupy
from tinytf.training import config, loop, trainer
data, out, precision = sys.argv[1:4]
cfg = config.apply_overrides(config.TrainConfig(
    data=data, out=out, device="gpu", precision=precision, vocab_size=300, max_tokens=120,
    warmup=4, lr_factor=1.0, seed=3, clip_norm=0.5, save_interval=1000), sys.argv[4:])
t = trainer.Trainer(cfg, log_stream=open(os.devnull, "w"))
assert type(t.model.embed.weight.data) is cupy.ndarray
stream = loop.forever(t.batches)
t.train_step([next(stream)])              # the first step builds Adam's flat buffers
steps = []
for _ in range(2):
    batches = [next(stream)]
    cupy.transfers.clear()
    update = t.launch_step(batches)
    launched = dict(cupy.transfers)
    result = t.settle(update)
    steps.append({"launched": launched, "settled": dict(cupy.transfers), "result": result})
print(json.dumps(steps))
"""


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
@pytest.mark.parametrize("precision", ["float32", "fp16"])
def test_a_gpu_training_step_reads_the_device_only_when_it_settles(data_dir, tmp_path,
                                                                   precision):
    """launch_step (batches to the device, forward, backward,
    all-reduce scaling, norm, clipping, the skip flag, Adam, under fp16 the loss scale)
    read nothing back from the device; settle reads exactly two numbers, the gradient
    norm and the loss. This is the GPU path: fused kernels and cuBLAS plans."""
    stdout, _ = _run(["-c", STEP_SCRIPT, data_dir, str(tmp_path / "run"), precision, *TINY])
    steps = json.loads(stdout.strip().splitlines()[-1])
    for step in steps:
        assert step["launched"] == {}, step
        assert step["settled"] == {"float": 2}, step
        assert step["result"]["tokens"] > 0
    if precision == "float32":
        assert not any(s["result"]["skipped"] for s in steps)


def _without_key_biases(name, value):
    """``value`` without the key projection's bias: its gradient is zero in exact
    arithmetic (softmax ignores a shift common to all keys), so each side holds rounding
    noise there, which Adam turns into steps of size lr in either direction."""
    d = 16
    if name.endswith("qkv.bias"):
        return np.concatenate([value[:d], value[2 * d:]])
    if name.endswith("kv.bias"):
        return value[d:]
    return value


def _train(data_dir, out, *extra, device="gpu"):
    sets = [a for s in TINY for a in ("--set", s)]
    return _run(["train.py", "--data", data_dir, "--out", str(out), "--device", device,
                 "--vocab-size", "300", "--max-tokens", "120", "--warmup", "4",
                 "--lr-factor", "1", "--seed", "3", "--log-interval", "1", *sets, *extra])


def test_train_and_translate_on_the_gpu_path_match_the_cpu(data_dir, tmp_path):
    """train.py --device gpu (float32, no dropout) ends where the CPU run ends, up to
    float32 rounding: same losses, same parameters; resuming works; translate.py --device
    gpu with beam search writes what the CPU writes from the same checkpoint."""
    gpu_out, gpu_log = _train(data_dir, tmp_path / "gpu", "--max-steps", "3")
    cpu_out, _ = _train(data_dir, tmp_path / "cpu", "--max-steps", "3", device="cpu")
    gpu, cpu = _summary(gpu_out), _summary(cpu_out)
    assert gpu["steps"] == cpu["steps"] == 3
    assert gpu["dev_loss"] == pytest.approx(cpu["dev_loss"], rel=1e-4)
    a = checkpoint.load(tmp_path / "gpu" / checkpoint.LAST).model
    b = checkpoint.load(tmp_path / "cpu" / checkpoint.LAST).model
    for name in a:
        x, y = _without_key_biases(name, a[name]), _without_key_biases(name, b[name])
        np.testing.assert_allclose(x, y, rtol=1e-4, atol=1e-5, err_msg=name)
    resumed, _ = _train(data_dir, tmp_path / "gpu", "--max-steps", "4", "--resume")
    assert _summary(resumed)["steps"] == 4

    source = os.path.join(data_dir, "dev.en")
    outs = {}
    for device in ("gpu", "cpu"):
        stdout, _ = _run(["translate.py", "--model", str(tmp_path / "cpu"), "--input", source,
                          "--device", device, "--beam", "2", "--max-len-b", "5"])
        outs[device] = stdout
    assert outs["gpu"] == outs["cpu"] and len(outs["gpu"].splitlines()) == 6


@pytest.mark.filterwarnings("ignore::RuntimeWarning")
def test_bf16_and_the_cuda_graph_fallback_on_the_gpu_path(data_dir, tmp_path):
    """--precision bf16 stores activations as bfloat16 (ml_dtypes) through the kernels and
    the GEMMs and trains; --cuda-graph finds that this device cannot capture, says why and
    trains on eagerly."""
    pytest.importorskip("ml_dtypes")
    stdout, stderr = _train(data_dir, tmp_path / "bf16", "--max-steps", "2", "--precision",
                            "bf16", "--cuda-graph")
    summary = _summary(stdout)
    assert summary["steps"] == 2 and summary["precision"] == "bf16"
    assert summary["cuda_graphs"] == 0 and np.isfinite(summary["dev_loss"])
    with open(tmp_path / "bf16" / "summary.json", encoding="utf-8") as f:
        assert json.load(f)["cuda_graphs"] == 0          # the kept summary has it too
    # (The stand-in fails at the first thing capture needs that it lacks: libcublas.)
    assert "--cuda-graph: capturing or replaying the step failed (" in stderr
    assert "training continues without CUDA graphs" in stderr


@requires_mpi
def test_gpu_collectives_and_two_rank_training_on_the_gpu_path(data_dir, tmp_path):
    """Under mpirun -n 2 with "GPU" arrays: tests/mpi_scripts/gpu_check.py (broadcast,
    all-reduce with a missing gradient, divergence, through the host-staging transport
    that `auto` picks without NCCL), then train.py --device gpu on two ranks, which ends
    where train.py on two CPU ranks ends."""
    code, out, _ = run_mpi([os.path.join(SCRIPTS, "gpu_check.py")], env=_env(SCRIPTS))
    assert code == 0 and "gpu_check OK" in out and "host: checks passed" in out, out[-3000:]
    assert "go through pinned host buffers and MPI" in out        # what auto chose, and why
    dev_loss = {}
    for device in ("gpu", "cpu"):
        sets = [a for s in TINY for a in ("--set", s)]
        code, out, _ = run_mpi(
            ["train.py", "--data", data_dir, "--out", str(tmp_path / device), "--device",
             device, "--vocab-size", "300", "--max-tokens", "120", "--warmup", "4",
             "--lr-factor", "1", "--seed", "3", "--max-steps", "2", *sets], env=_env())
        assert code == 0, out[-3000:]
        summary = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
        assert summary["ranks"] == 2 and summary["steps"] == 2
        dev_loss[device] = summary["dev_loss"]
    assert dev_loss["gpu"] == pytest.approx(dev_loss["cpu"], rel=1e-4)


GPU_TEST_FILES = ["tests/fast/test_gpu.py", "tests/fast/test_kernels.py", "tests/fast/test_amp.py",
                  "tests/engine/test_engine.py"]
# Left to a real GPU: CUDA-graph capture (the stand-in has none), and two 30-step training
# loops that take a minute each here (train.py's bf16 and fp16 runs above cover the paths).
NEEDS_A_REAL_GPU = ("not captured and not training_steps_lower_the_loss "
                    "and not loss_scaling_skips_overflow")


def test_the_gpu_test_suite_passes_on_the_stand_in():
    """The GPU halves of the test files (skipped in this process for want of CuPy) run
    against the stand-in: every fused kernel and cuBLAS layout against NumPy/float64 on
    "GPU" arrays, the whole Transformer's loss and gradients on the GPU path against the
    CPU's, mixed precision, beam search, checkpoints of a GPU model."""
    stdout, _ = _run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *GPU_TEST_FILES,
                      "-k", NEEDS_A_REAL_GPU], timeout=900)
    last = stdout.strip().splitlines()[-1]
    assert "failed" not in last and "error" not in last, stdout[-3000:]
    assert "needs a GPU" not in stdout, stdout[-3000:]
    passed = int(last.split(" passed")[0].split()[-1])
    assert passed >= 200, last


DECODE_SCRIPT = r"""
import json
import numpy as np
import cupy
import tinytf
from tinytf.decoding import search
from tinytf.engine.tensor import no_grad
from tinytf.models.transformer import Transformer, TransformerConfig
V = 101
cfg = TransformerConfig.preset("tiny", vocab_size=V, d_model=16, n_heads=2, d_ff=32,
                               n_encoder_layers=1, n_decoder_layers=1, dropout=0.0, max_len=40)
tinytf.manual_seed(0)
model = Transformer(cfg).to("gpu").eval()
src = np.random.default_rng(0).integers(4, V, (6, 9))
out = {}
with no_grad():
    for name in ("greedy", "beam"):
        state = model.start_decoding(model.encode(cupy.asarray(src)), cupy.asarray(src))
        steps = []
        def step_fn(tokens, state):
            steps.append(1)
            return model.decode_step(tokens, state)
        cupy.transfers.clear()
        cupy.transferred_bytes.clear()
        max_lens = np.full(6, 12)
        if name == "greedy":
            hyps = search.greedy_search(step_fn, state, 6, max_lens)
        else:
            hyps = search.beam_search(step_fn, state, 6, max_lens, beam_size=4)
        out[name] = {"steps": len(steps), "reads": sum(cupy.transfers.values()),
                     "bytes": sum(cupy.transferred_bytes.values())}
print(json.dumps(out))
"""


def test_decoding_reads_back_the_choices_not_the_scores():
    """Greedy search on the GPU path brings back two numbers per sentence and step (the
    argmax and its log-probability), beam search O(beam) per sentence, never the (N, V)
    scores: on a GPU that copy would cost more than the decoder step."""
    stdout, _ = _run(["-c", DECODE_SCRIPT])
    out = json.loads(stdout.strip().splitlines()[-1])
    n, k, vocab = 6, 4, 101
    for name, per_row in (("greedy", 2 * 8), ("beam", 4 * k * 8)):
        steps, reads, nbytes = out[name]["steps"], out[name]["reads"], out[name]["bytes"]
        assert steps >= 2, out
        assert nbytes <= steps * n * per_row, out          # int64 / float32 per choice
        assert nbytes < steps * n * vocab * 4 / 4, out     # far from the scores themselves
        assert reads <= 4 * steps, out
