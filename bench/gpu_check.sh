#!/usr/bin/env bash
# One prepared GPU check for tinytf (under 10 minutes on one H200), run from anywhere:
#   bash bench/gpu_check.sh            # logs and JSON to $OUT (default /tmp/tinytf_gpu_check)
# 1. installs what it needs: wheels carried in .whl/ (no network needed), else nothing
#    (the GPU image already has cupy, ml_dtypes, torch, numpy, regex, sacrebleu, mpi4py);
# 2. runs the kernel/amp tests on the GPU: every fused kernel and every op's forward and
#    backward against NumPy on the CPU, cuBLAS products in float32/tf32/bf16/fp16;
# 3. runs the op and functional test files with TINYTF_DEVICE=gpu;
# 4. bench/gpu_train.py: training tokens/s and MFU of `base` at 25k-token batches in
#    float32, tf32 and bf16, decoding sentences/s, and PyTorch eager on the same GPU.
# Each stage has its own time limit so that a hang in one still leaves the others' figures.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-/tmp/tinytf_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
start=$(date +%s)
stage() { echo; echo "=== $1 (t=$(( $(date +%s) - start ))s)"; }

stage "environment"
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total \
    --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
$PY - <<'PY' 2>&1 | tee "$OUT/environment.txt"
import sys, numpy
print("python", sys.version.split()[0], "numpy", numpy.__version__)
for name in ("cupy", "ml_dtypes", "torch", "mpi4py", "sacrebleu", "regex"):
    try:
        m = __import__(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:
        print(name, "MISSING", type(e).__name__, e)
import cupy
print("gpu", cupy.cuda.runtime.getDeviceProperties(0)["name"], "cuda runtime",
      cupy.cuda.runtime.runtimeGetVersion())
PY

stage "kernel and mixed-precision tests on the GPU"
TINYTF_DEVICE=gpu timeout 180 $PY -m pytest -q -rs -p no:cacheprovider \
    tests/test_kernels.py tests/test_amp.py 2>&1 | tee "$OUT/tests_gpu.log"
echo "exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/tests_gpu.log"

stage "op tests with TINYTF_DEVICE=gpu"
TINYTF_DEVICE=gpu timeout 60 $PY -m pytest -q -p no:cacheprovider -x \
    tests/test_ops.py tests/test_functional.py 2>&1 | tail -n 30 | tee "$OUT/tests_ops_gpu.log"

stage "training and decoding benchmark"
timeout 300 $PY bench/gpu_train.py --json "$OUT/gpu_train.json" 2>&1 | tee "$OUT/gpu_train.log"
echo "exit status: ${PIPESTATUS[0]}"

stage "done"
