#!/usr/bin/env bash
# One prepared GPU check for tinytf (about 8 minutes on one H200), run from anywhere:
#   bash bench/gpu_check.sh [quick|full]      # logs and JSON to $OUT (default /tmp/tinytf_gpu_check)
# 1. environment: GPU, driver, CuPy (and whether it has bfloat16), PyTorch; wheels carried
#    in .whl/ are installed first (the GPU machine has no network);
# 2. the GPU tests: every fused kernel and every op forward and backward against NumPy,
#    cuBLAS products in float32/tf32/bf16/fp16 (tests/fast/test_kernels.py, tests/fast/test_amp.py),
#    the whole Transformer's loss and gradients against the CPU, mixed precision against
#    float32, incremental and beam decoding against the CPU (tests/fast/test_gpu.py);
# 3. bench/gpu_train.py: training tokens/s and MFU of `base` at 25k-token batches in
#    float32, tf32 and bf16, and bf16 with the step replayed as a CUDA graph (its
#    gradients checked against the ordinary step's), the GPU time of one attention call
#    (graph-replayed), decoding sentences/s, and PyTorch eager on the same GPU;
# 4. the command-line tools: train.py --device gpu --precision bf16 (tiny) on the shipped
#    corpus for 60 seconds, then 30 seconds with --cuda-graph, then translate.py --device gpu
#    (beam 4) on the test set with BLEU;
# 5. mpirun -n 2 with CuPy (when mpirun and mpi4py are there): the GPU collectives checked
#    against host sums (tests/mpi_scripts/gpu_check.py), then train.py on two ranks for 30 s.
# Each stage has its own time limit, so a hang in one still leaves the others' figures.
# "quick" runs fewer benchmark steps and skips 4b (--cuda-graph) and 5 (mpirun), about 5
# minutes; "full" (default) the whole thing. TINYTF_GPU_CHECK_SECONDS (default 560) bounds the
# whole check: each stage's limit is cut to the time left, so the script ends inside a 600 s call.
set -uo pipefail
cd "$(dirname "$0")/.."
MODE=${1:-full}
OUT=${OUT:-/tmp/tinytf_gpu_check}
mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY=${PYTHON:-python3}
start=$(date +%s)
BUDGET=${TINYTF_GPU_CHECK_SECONDS:-560}
stage() { echo; echo "=== $1 (t=$(( $(date +%s) - start ))s)"; }
# limit N: N seconds, or what is left of the budget if less (at least 1).
limit() {
    local left=$(( start + BUDGET - $(date +%s) ))
    if (( left < $1 )); then echo $(( left > 1 ? left : 1 )); else echo "$1"; fi
}
# Open MPI refuses root without these (the GPU machines run commands as root).
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1

stage "environment"
if compgen -G ".whl/*.whl" > /dev/null; then
    $PY -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/site .whl/*.whl && export PYTHONPATH="/tmp/site:$PYTHONPATH"
fi
nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,memory.used,memory.total \
    --format=csv 2>&1 | tee "$OUT/nvidia_smi.txt"
echo "mpirun: $(command -v mpirun || echo none)" | tee -a "$OUT/nvidia_smi.txt"
$PY - <<'PY' 2>&1 | tee "$OUT/environment.txt"
import sys, numpy
print("python", sys.version.split()[0], "numpy", numpy.__version__)
for name in ("cupy", "ml_dtypes", "torch", "mpi4py", "sacrebleu", "regex", "hypothesis"):
    try:
        m = __import__(name)
        print(name, getattr(m, "__version__", "?"))
    except Exception as e:
        print(name, "MISSING", type(e).__name__, e)
import cupy
print("gpu", cupy.cuda.runtime.getDeviceProperties(0)["name"], "cuda runtime",
      cupy.cuda.runtime.runtimeGetVersion())
try:
    import ml_dtypes
    a = cupy.arange(4, dtype=cupy.float32).astype(ml_dtypes.bfloat16)
    print("cupy bfloat16: yes", a.dtype, (a * a).dtype, cupy.asnumpy(a.astype(cupy.float32)))
except Exception as e:
    print("cupy bfloat16: NO", type(e).__name__, e)
PY

stage "GPU tests (kernels, mixed precision, the whole model)"
timeout $(limit 170) $PY -m pytest -q -rs -p no:cacheprovider --durations=8 -k "not captured" \
    tests/fast/test_kernels.py tests/fast/test_amp.py tests/fast/test_gpu.py 2>&1 | tee "$OUT/tests_gpu.log"
echo "exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/tests_gpu.log"
# CUDA-graph capture on its own: a capture that hangs must not take the other results along.
timeout $(limit 60) $PY -m pytest -q -rs -p no:cacheprovider -k "captured" tests/fast/test_gpu.py 2>&1 \
    | tee "$OUT/tests_graph.log"
echo "exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/tests_graph.log"

stage "training and decoding benchmark"
if [ "$MODE" = quick ]; then steps=(--steps 5 --warmup 2 --decode-sentences 256); \
    else steps=(--steps 10 --warmup 3); fi
timeout $(limit 200) $PY bench/gpu_train.py "${steps[@]}" --json "$OUT/gpu_train.json" \
    --profile-dir "$OUT" 2>&1 | tee "$OUT/gpu_train.log"
echo "exit status: ${PIPESTATUS[0]}"

stage "train.py and translate.py on the GPU (shipped corpus, tiny, bf16, 60 s; then 30 s with --cuda-graph)"
RUN=/tmp/tinytf_gpu_run
rm -rf "$RUN" "$RUN-graph"
TRAIN_ARGS=(--device gpu --precision bf16 --preset tiny --max-tokens 4096 --log-interval 100
    --save-interval-updates 500 --set valid_bleu_sentences=200)
timeout $(limit 100) $PY train.py "${TRAIN_ARGS[@]}" --max-minutes 1 --out "$RUN" \
    > "$OUT/train_gpu.json" 2> "$OUT/train_gpu.log"
echo "exit status: $?"; grep -E "valid|test BLEU|stopped" "$OUT/train_gpu.log" | tail -n 12
tail -n 3 "$OUT/train_gpu.log"; cat "$OUT/train_gpu.json"
# The same run with each step replayed as a CUDA graph (one per padded batch shape).
[ "$MODE" = quick ] || timeout $(limit 80) $PY train.py "${TRAIN_ARGS[@]}" --max-minutes 0.5 --cuda-graph \
    --set test_bleu=false --out "$RUN-graph" \
    > "$OUT/train_gpu_graph.json" 2> "$OUT/train_gpu_graph.log"
echo "exit status: $?"; grep -E "cuda-graph|valid|stopped" "$OUT/train_gpu_graph.log" | tail -n 6
cat "$OUT/train_gpu_graph.json"
timeout $(limit 60) $PY translate.py --model "$RUN" --device gpu --precision bf16 --beam 4 \
    --input data/ende/test.en --reference data/ende/test.de --output "$OUT/test_hyp.de" \
    2>&1 | tail -n 2 | tee "$OUT/translate_gpu.log"

stage "mpirun -n 2 with CuPy (both ranks on this node's GPUs; NCCL only with a GPU per rank)"
if [ "$MODE" = quick ]; then
    echo "skipped in quick mode"
elif $PY -c "import mpi4py" 2>/dev/null && command -v mpirun > /dev/null; then
    MPIRUN=$($PY -c "from tinytf.distributed import communicator; print(' '.join(communicator.mpirun_command(2, [])))")
    timeout $(limit 60) $MPIRUN $PY tests/mpi_scripts/gpu_check.py 2>&1 | tail -n 12 | tee "$OUT/mpi_gpu.log"
    echo "exit status: ${PIPESTATUS[0]}" | tee -a "$OUT/mpi_gpu.log"
    rm -rf /tmp/tinytf_mpi_run
    timeout $(limit 80) $MPIRUN $PY train.py --device gpu --precision bf16 --preset tiny \
        --max-tokens 4096 --max-minutes 0.5 --log-interval 100 \
        --set valid_bleu_sentences=100 --set test_bleu=false --out /tmp/tinytf_mpi_run \
        > "$OUT/train_mpi.json" 2> "$OUT/train_mpi.log"
    echo "exit status: $?"; tail -n 4 "$OUT/train_mpi.log"; cat "$OUT/train_mpi.json"
else
    echo "skipped: no mpirun or mpi4py on this machine" | tee "$OUT/mpi_gpu.log"
fi

stage "done"
