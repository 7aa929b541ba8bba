"""Data-parallel training (tinytf.distributed): ranks agree and equal one big-batch process.

The MPI tests launch ``mpirun -n 2`` on the scripts in tests/mpi_scripts/ (through
``distributed.mpirun_command``, the same flags the docs give) and compare what the ranks
saved with a single-process run of the same code in this test process. They skip, with the
reason, when mpi4py or mpirun is missing; CI installs both.
"""
from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
from mpi_support import ROOT, SCRIPTS, TIMEOUT, requires_mpi, run_mpi  # noqa: E402

from tinytf import nn, optim
from tinytf.distributed import communicator as distributed
from tinytf.utils import checkpoint

sys.path.insert(0, SCRIPTS)
import dp_common as common  # noqa: E402  (tests/mpi_scripts/dp_common.py)


def load(path):
    with np.load(path) as f:
        return {k: f[k] for k in f.files}


def reference_run(kind, steps):
    """([gradients], [parameters]) at each of ``steps`` single-process steps on the whole
    global batch, seeded as rank 0."""
    model = common.build_model(kind, seed=1)
    grads, params = [], []
    common.train(model, kind, distributed.SingleCommunicator(), steps,
                 on_grads=lambda k: grads.append(common.grads(model)),
                 on_step=lambda k: params.append(model.state_dict()))
    return grads, params


def max_diff(a, b):
    assert sorted(a) == sorted(b)
    return max(float(np.abs(a[k] - b[k]).max()) for k in a)


# ----- without MPI ----------------------------------------------------------------------

def test_init_without_launcher_is_single_process(monkeypatch):
    for var in distributed._LAUNCHER_VARS:
        monkeypatch.delenv(var, raising=False)
    comm = distributed.create_communicator()
    assert isinstance(comm, distributed.SingleCommunicator)
    assert (comm.rank, comm.size, comm.local_rank, comm.is_root) == (0, 1, 0, True)
    monkeypatch.setenv("TINYTF_DISTRIBUTED", "0")
    monkeypatch.setenv("OMPI_COMM_WORLD_SIZE", "4")
    assert isinstance(distributed.create_communicator(), distributed.SingleCommunicator)


def test_single_communicator_is_the_identity():
    comm = distributed.SingleCommunicator()
    p = nn.Parameter(np.arange(4.0))
    q = nn.Parameter(np.ones(2))
    p.grad = np.full(4, 2.0, dtype=np.float32)
    comm.broadcast_params([("p", p), ("q", q)])
    comm.allreduce_grads([("p", p), ("q", q)], scale=0.25)
    np.testing.assert_array_equal(p.grad, np.full(4, 0.5, dtype=np.float32))
    assert p.grad.dtype == np.float32 and q.grad is None
    assert comm.allreduce_scalars([3, 4.5], op="max") == [3.0, 4.5]
    assert comm.allreduce_scalars(7) == 7.0
    assert comm.any(True) and not comm.any(False)
    assert comm.param_divergence([("p", p)]) == 0.0
    with pytest.raises(ValueError, match="op must be"):
        comm.allreduce_scalars([1], op="mean")
    with pytest.raises(ZeroDivisionError):  # guard() lets exceptions through with one rank
        with comm.guard():
            1 / 0


def test_bucket_plan_keeps_sorted_order_and_splits_by_size_and_dtype():
    named = [(n, nn.Parameter(np.zeros(s), dtype=d)) for n, s, d in [
        ("a", (10,), np.float32), ("b", (5, 10), np.float32), ("c", (300,), np.float32),
        ("d", (5,), np.float64), ("e", (6,), np.float64)]]
    plan = distributed._BucketPlan(named, bucket_bytes=1024)
    spans = [(b.start, b.stop, b.buffer.dtype) for b in plan.buckets]
    # a and b share 1 KiB; c (1200 bytes) would overflow it, so it gets a bucket of its
    # own (a parameter is never split); d changes the dtype and starts another.
    assert spans == [(0, 2, np.float32), (2, 3, np.float32), (3, 5, np.float64)]
    assert plan.buckets[0].buffer.size == 10 + 50
    assert plan.nbytes == 60 * 4 + 300 * 4 + 11 * 8
    assert plan.buckets[0].views()[1].shape == (5, 10)
    assert plan.flat is None


def test_flat_parameters_travel_as_chunks_of_their_buffer():
    """Parameters that share Adam's flat buffers need no buckets: the collectives run on
    contiguous views of the buffer, about bucket_bytes each, that tile it exactly."""
    named = sorted((n, nn.Parameter(np.zeros(s, dtype=np.float32))) for n, s in [
        ("w", (30, 7)), ("b", (7,)), ("v", (100,))])
    assert distributed._flat_buffer(named) is None          # no optimizer yet
    opt = optim.Adam(named[::-1], lr=1e-3)                   # another order than sorted
    for _, p in named:
        p.grad = np.ones(p.shape, dtype=np.float32)
    opt.step()
    flat = distributed._flat_buffer(named)
    assert flat is not None and flat.grad.size == 317
    plan = distributed._BucketPlan(named, bucket_bytes=400, flat=flat)
    chunks = plan.chunks(flat.grad)
    assert plan.buckets == [] and [c.size for c in chunks] == [100, 100, 100, 17]
    assert all(np.shares_memory(c, flat.grad) and c.flags.c_contiguous for c in chunks)
    assert plan.nbytes == 317 * 4
    assert distributed._flat_buffer(named[:2]) is None       # a subset is not the buffer
    named[0][1].data = np.zeros((7,), dtype=np.float32)      # replaced from outside
    assert distributed._flat_buffer(named) is None


@pytest.mark.parametrize("env, expected", [
    ({}, "auto"), ({"TINYTF_NCCL": "1"}, "nccl"), ({"TINYTF_NCCL": "0"}, "host"),
    ({"TINYTF_CUDA_AWARE_MPI": "1"}, "cuda-aware"), ({"TINYTF_GPU_TRANSPORT": " NCCL "}, "nccl"),
    ({"TINYTF_GPU_TRANSPORT": "host", "TINYTF_NCCL": "1"}, "host")])
def test_gpu_transport_from_the_environment(monkeypatch, env, expected):
    for name in ("TINYTF_NCCL", "TINYTF_CUDA_AWARE_MPI", "TINYTF_GPU_TRANSPORT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    assert distributed.gpu_transport_from_env() == expected


def test_nccl_is_not_chosen_without_a_gpu_for_each_rank():
    usable, why = distributed.nccl_usable(local_size=10 ** 6)
    assert not usable and why      # no CuPy, no NCCL, or fewer GPUs than ranks: a reason


def test_mpirun_command_has_the_container_flags():
    cmd = distributed.mpirun_command(3, ["python", "train.py"])
    assert cmd[1:3] == ["-n", "3"] and cmd[-2:] == ["python", "train.py"]
    if shutil.which("mpirun") and distributed._open_mpi_major(cmd[0]):
        assert "--oversubscribe" in cmd and "btl" in cmd
        assert ("--allow-run-as-root" in cmd) == (os.geteuid() == 0)


# ----- under mpirun -n 2 ----------------------------------------------------------------

@requires_mpi
def test_collectives():
    code, out, _ = run_mpi([os.path.join(SCRIPTS, "collectives.py")])
    assert code == 0 and "collectives OK" in out, out


@requires_mpi
@pytest.mark.parametrize("kind", ["lm", "transformer"])
def test_two_ranks_equal_one_process_with_the_union_batch(kind, tmp_path):
    """Broadcast makes different initial parameters identical; after 1 and after K steps
    both ranks hold identical parameters equal to single-process training on the union of
    their batches (float64, 1e-6). The gradients are compared too (1e-9): Adam's step is
    invariant to a wrong global scale of the gradient, the gradient is not."""
    steps = 3
    code, out, _ = run_mpi([os.path.join(SCRIPTS, "train_steps.py"), kind, str(steps),
                            str(tmp_path)])
    assert code == 0, out
    assert "divergence=0.0" in out, out
    init = [load(tmp_path / f"init_rank{r}.npz") for r in range(2)]
    bcast = [load(tmp_path / f"bcast_rank{r}.npz") for r in range(2)]
    assert max_diff(init[0], init[1]) > 1e-3          # seeded differently ...
    assert max_diff(bcast[0], init[0]) == 0.0         # ... until rank 0's values won
    assert max_diff(bcast[1], init[0]) == 0.0
    ref_grads, ref_params = reference_run(kind, steps)
    for k in range(1, steps + 1):
        grads = [load(tmp_path / f"grads{k}_rank{r}.npz") for r in range(2)]
        assert max_diff(grads[0], grads[1]) == 0.0, f"gradients differ at step {k}"
        assert max_diff(grads[0], ref_grads[k - 1]) < 1e-9, f"gradients, step {k}"
        ranks = [load(tmp_path / f"step{k}_rank{r}.npz") for r in range(2)]
        assert max_diff(ranks[0], ranks[1]) == 0.0, f"ranks differ after step {k}"
        assert max_diff(ranks[0], init[0]) > 1e-3, "the step did not move the parameters"
        assert max_diff(ranks[0], ref_params[k - 1]) < 1e-6, f"parameters, step {k}"


@requires_mpi
def test_dividing_by_the_number_of_ranks_is_not_the_union_batch(tmp_path):
    """Negative control: the two shares hold different numbers of target tokens, so the
    per-rank-mean recipe keeps the ranks in step but does not equal the union batch; the
    test above would catch it."""
    batch = common.global_batch(1)
    model = common.build_model("lm", seed=1)
    tokens = [common.loss_sum(model, "lm", common.shard(batch, r, 2))[1] for r in range(2)]
    assert tokens[0] != tokens[1]
    code, out, _ = run_mpi([os.path.join(SCRIPTS, "train_steps.py"), "lm", "1",
                            str(tmp_path), "per-rank-mean"])
    assert code == 0 and "divergence=0.0" in out, out
    ref_grads, ref_params = reference_run("lm", 1)
    assert max_diff(load(tmp_path / "grads1_rank0.npz"), ref_grads[0]) > 1e-4
    assert max_diff(load(tmp_path / "step1_rank0.npz"), ref_params[0]) > 1e-4


@requires_mpi
@pytest.mark.parametrize("mode,code,message", [
    ("raise", 1, "ValueError: deliberate failure on rank 1 (raise)"),
    ("guard", 1, "ValueError: deliberate failure on rank 1 (guard)"),
    ("abort", 3, "rank 1 of 2 aborting: rank 1 gave up on purpose"),
    ("exit", 4, "rank 1 of 2 aborting: SystemExit(4)"),
])
def test_a_failing_rank_ends_the_job_within_30_seconds(mode, code, message):
    """Rank 0 waits in an all-reduce that rank 1 never joins: without the abort this hangs."""
    returncode, out, seconds = run_mpi([os.path.join(SCRIPTS, "fail.py"), mode], timeout=30)
    assert returncode == code, out
    assert message in out, out
    assert "passed the all-reduce" not in out
    assert seconds < 30


# ----- train.py under mpirun -------------------------------------------------------------

TRAIN_ARGS = ["--vocab-size", "400", "--max-tokens", "256", "--seed", "3", "--log-interval", "1",
              "--save-interval-updates", "1", "--validate-interval-updates", "1000", "--keep-last", "0",
              "--set", "d_model=32", "--set", "n_heads=2", "--set", "d_ff=64",
              "--set", "n_encoder_layers=1", "--set", "n_decoder_layers=1",
              # Dropout masks are drawn per rank: without it the runs must agree exactly.
              "--set", "dropout=0", "--set", "valid_bleu_sentences=4",
              # A schedule that ignores the budget: runs of 3 and 5 steps share their rates.
              "--lr-schedule", "inverse_sqrt", "--lr", "1e-3", "--warmup", "4",
              # Adam: RAdam (the tiny preset's) takes no step in its first 5 updates.
              "--optimizer", "adam"]


def run_train(out_dir, data_dir, *extra, ranks=None):
    """train.py on a tiny model and corpus: in this process's Python, or on ``ranks``."""
    argv = [os.path.join(ROOT, "train.py"), "--data", str(data_dir), "--out", str(out_dir),
            *TRAIN_ARGS, *extra]
    if ranks is not None:
        return run_mpi(argv, n=ranks)
    env = {k: v for k, v in os.environ.items() if k not in distributed._LAUNCHER_VARS}
    proc = subprocess.run([sys.executable, *argv], cwd=ROOT, env=env, capture_output=True,
                          timeout=TIMEOUT)
    return proc.returncode, (proc.stdout + proc.stderr).decode(errors="replace"), None


@pytest.fixture(scope="module")
def train_runs(tmp_path_factory):
    """Run A: 2 ranks for 3 steps, then --resume to 5. Run B: 1 process, --update-freq 2
    (the union of the two ranks' batches: rank r reads batches r, r + 2, ...), 5 steps."""
    if not os.path.isfile(os.path.join(ROOT, "train.py")):
        pytest.skip("train.py is not there yet")
    tmp = tmp_path_factory.mktemp("mpi_train")
    data = tmp / "data"
    data.mkdir()
    for split, lines in (("train", 400), ("dev", 12), ("test", 12)):
        for lang in ("en", "de"):
            with open(os.path.join(ROOT, "data", "ende", f"{split}.{lang}"),
                      encoding="utf-8") as f:
                (data / f"{split}.{lang}").write_text(
                    "".join(f.readline() for _ in range(lines)), encoding="utf-8")
    first = run_train(tmp / "a", data, "--max-steps", "3", ranks=2)
    resumed = run_train(tmp / "a", data, "--max-steps", "5", "--resume", ranks=2)
    single = run_train(tmp / "b", data, "--max-steps", "5", "--update-freq", "2")
    return {"dir": tmp, "first": first, "resumed": resumed, "single": single}


def checkpoint_arrays(path):
    """(parameters, Adam moments) of a checkpoint, as name -> array dicts."""
    ckpt = checkpoint.load(str(path))
    return ckpt.model, {k: v for k, v in ckpt.optim.items() if hasattr(v, "shape")}


@requires_mpi
def test_train_py_on_two_ranks_equals_one_process_with_twice_the_batches(train_runs):
    for name in ("first", "resumed", "single"):
        code, out, _ = train_runs[name]
        assert code == 0, f"{name}:\n{out[-4000:]}"
    code, out, _ = train_runs["first"]
    summaries = [json.loads(ln) for ln in out.splitlines() if ln.startswith("{")]
    assert len(summaries) == 1, out                  # only rank 0 prints the summary ...
    assert summaries[0]["ranks"] == 2 and summaries[0]["steps"] == 3
    assert out.count("training tiny") == 1, out      # ... and logs
    for step in (3, 5):   # 3: the first MPI run; 5: after --resume under MPI
        (a, a_adam), (b, b_adam) = (
            checkpoint_arrays(train_runs["dir"] / run / f"checkpoint_{step}.npz")
            for run in ("a", "b"))
        # float32; the two runs add the same two batch gradients (in either order), so
        # they agree to the bit here, but allow for a BLAS that splits sums differently.
        assert max_diff(a, b) < 1e-5, f"parameters after step {step}"
        assert max_diff(a_adam, b_adam) < 1e-5, f"Adam moments after step {step}"


@requires_mpi
def test_a_run_of_two_ranks_resumes_in_one_process(train_runs, tmp_path):
    """Run A's checkpoint of step 3 (2 ranks) resumed in one process with --update-freq 2:
    the same batches per update from where the two ranks had got to, so step 5 equals run
    B's (one process, --update-freq 2 from the start); without it, a warning says so."""
    def at_step_3(name):
        run = tmp_path / name
        shutil.copytree(train_runs["dir"] / "a", run)
        for file in os.listdir(run):
            if file.startswith("checkpoint_") and file != "checkpoint_3.npz" or \
                    file == "summary.json":
                os.unlink(run / file)
        shutil.copy(run / "checkpoint_3.npz", run / checkpoint.LAST)
        return run

    data = train_runs["dir"] / "data"
    run = at_step_3("same")
    code, out, _ = run_train(run, data, "--max-steps", "5", "--resume", "--update-freq", "2")
    assert code == 0, out[-3000:]
    assert "resuming on 1 rank(s) a run that trained on 2" in out and \
        "with the same 2 batches per update" in out and "resuming with changed" not in out
    (a, a_adam), (b, b_adam) = (checkpoint_arrays(d / "checkpoint_5.npz")
                                for d in (run, train_runs["dir"] / "b"))
    assert max_diff(a, b) < 1e-5 and max_diff(a_adam, b_adam) < 1e-5
    code, out, _ = run_train(at_step_3("fewer"), data, "--max-steps", "4", "--resume")
    assert code == 0 and "an update now holds 1 batches of --max-tokens where it held 2 " \
        "(--update-freq 2 keeps them)" in out, out[-3000:]


@requires_mpi
def test_a_resumed_gpu_run_takes_one_gpu_per_rank_without_device_gpu(train_runs, tmp_path):
    """``mpirun -n 2 train.py --out RUN --resume`` where RUN trained on the GPU (its
    checkpoint's device) and ``--device gpu`` is not given again: each rank makes its own
    GPU current (local rank % GPUs), as with ``--device gpu``, not both the first. The CuPy
    stand-in with two devices; train.py's main runs up to the training, which a probe
    replaces (tests/mpi_scripts/gpu_choice.py)."""
    ckpt = checkpoint.load(str(train_runs["dir"] / "a" / checkpoint.LAST))
    meta = {**ckpt.meta, "train_config": {**ckpt.meta["train_config"], "device": "gpu"}}
    run = tmp_path / "gpu-run"
    run.mkdir()
    checkpoint.save(str(run / checkpoint.LAST), ckpt.model, optim_state=ckpt.optim, meta=meta)
    env = {**os.environ, "TINYTF_STANDIN_GPUS": "2",
           "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests", "standin"),
                                          os.environ.get("PYTHONPATH", "")])}
    env.pop("TINYTF_DEVICE", None)
    script = os.path.join(SCRIPTS, "gpu_choice.py")
    for given in ([], ["--device", "gpu"]):
        code, out, _ = run_mpi([script, "--out", str(run), "--resume", *given], env=env)
        assert code == 0, out[-3000:]
        seen = [json.loads(line) for line in out.splitlines() if line.startswith('{"rank"')]
        assert sorted((r["rank"], r["gpu"], r["device"]) for r in seen) == \
            [(0, 0, "gpu"), (1, 1, "gpu")], (given, out[-3000:])


@requires_mpi
def test_train_py_error_on_every_rank_exits_non_zero(tmp_path):
    if not os.path.isfile(os.path.join(ROOT, "train.py")):
        pytest.skip("train.py is not there yet")
    code, out, _ = run_mpi([os.path.join(ROOT, "train.py"), "--data",
                            str(tmp_path / "missing"), "--out", str(tmp_path / "run")],
                           timeout=30)
    assert code != 0 and "no such file" in out, out


@requires_mpi
def test_sigusr1_to_mpirun_stops_every_rank_with_a_checkpoint(train_runs, tmp_path):
    """Open MPI forwards SIGUSR1 to the ranks: every rank stops after the same update, rank
    0 writes that update's checkpoint, and the job exits 138 (128 + SIGUSR1)."""
    argv = [os.path.join(ROOT, "train.py"), "--data", str(train_runs["dir"] / "data"),
            "--out", str(tmp_path / "run"), *TRAIN_ARGS, "--max-steps", "100000"]
    env = {k: v for k, v in os.environ.items() if k != "TINYTF_DISTRIBUTED"}
    proc = subprocess.Popen(distributed.mpirun_command(2, [sys.executable, *argv]), cwd=ROOT,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        for line in proc.stdout:
            if line.startswith("step 3 |"):
                proc.send_signal(signal.SIGUSR1)
                break
        rest, _ = proc.communicate(timeout=TIMEOUT)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signal.SIGUSR1, rest[-3000:]
    summary = json.loads(next(ln for ln in rest.splitlines() if ln.startswith("{")))
    assert summary["stopped"] == "signal" and summary["ranks"] == 2
    assert checkpoint.load(tmp_path / "run" / checkpoint.LAST).step == summary["steps"]


@requires_mpi
def test_ranks_given_different_corpora_stop_at_once(train_runs, tmp_path):
    """Rank 1 reads another training corpus than rank 0 (MPMD: each rank its own --data):
    the job stops before training with a message naming the rank and the files."""
    other = tmp_path / "other"
    shutil.copytree(train_runs["dir"] / "data", other)
    with open(other / "train.de", "a", encoding="utf-8") as f:
        f.write("Ein Satz mehr.\n")
    with open(other / "train.en", "a", encoding="utf-8") as f:
        f.write("One more sentence.\n")
    base = [os.path.join(ROOT, "train.py"), "--out", str(tmp_path / "run"), *TRAIN_ARGS,
            "--max-steps", "3"]
    first = distributed.mpirun_command(1, [sys.executable, *base, "--data",
                                           str(train_runs["dir"] / "data")])
    cmd = first + [":", "-n", "1", sys.executable, *base, "--data", str(other)]
    env = {k: v for k, v in os.environ.items() if k != "TINYTF_DISTRIBUTED"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=TIMEOUT)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "rank 1: the training corpus" in out, out[-3000:]
    assert "step 1 |" not in out


@requires_mpi
def test_a_time_budget_decides_dropout_alike_on_every_rank(train_runs, tmp_path):
    """The tiny preset's dropout for a time budget is decided at the first update of
    epoch 3 from rank 0's clock: both ranks switch together (no rank waits in a collective
    the other left), and the checkpoint holds the choice."""
    args = [*TRAIN_ARGS, "--set", "dropout=0.1", "--max-minutes", "10000", "--max-epochs",
            "8", "--budget-min-updates", "0", "--save-interval-updates", "1000",
            "--log-interval", "1000"]
    code, out, _ = run_train(tmp_path / "run", train_runs["dir"] / "data", *args, ranks=2)
    assert code == 0, out[-4000:]
    assert out.count("dropout: from epoch 3: the budget holds about 8.0 epochs at the pace "
                     "of epochs 1-2") == 1, out[-4000:]
    summary = json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])
    assert summary["ranks"] == 2 and summary["epoch"] == 8
    assert summary["dropout_from_epoch"] == 3 and summary["stopped"] == "max_epochs"
    saved = checkpoint.load(str(tmp_path / "run" / checkpoint.LAST)).meta["train_config"]
    assert saved["dropout_from_epoch"] == 3
