"""GPU paths of tinytf.distributed.communicator, for a machine with CuPy and one or more GPUs.

    mpirun -n 2 python tests/mpi_scripts/gpu_check.py [host] [cuda-aware] [nccl]

(add ``--allow-run-as-root`` as root; see docs/distributed.md). Default transports: host
staging always, NCCL when every rank has a GPU of its own (NCCL refuses two ranks on one
device); "cuda-aware" only when asked, since a non-CUDA-aware MPI crashes on device
pointers. For each transport it checks, against sums computed on the host:
broadcast_params, allreduce_grads (scaled; a gradient None on one rank; None everywhere),
param_divergence, and times the all-reduce of base-model-sized gradients (48M floats).
Prints "gpu_check OK" from rank 0; a failed check aborts the job non-zero.
"""
import os
import sys
import time

import numpy as np
from dp_common import TinyLM

import tinytf
from tinytf.distributed import communicator as distributed

BASE_FLOATS = 48_234_496  # parameters of the base preset


def host_grads(rank: int, shapes: dict) -> dict:
    """The gradients rank ``rank`` uses: reproducible anywhere from the rank alone."""
    rng = np.random.default_rng(1000 + rank)
    return {name: rng.standard_normal(shape).astype(np.float32) for name, shape in shapes.items()}


def check(comm, cupy) -> None:
    """One transport: broadcast, gradient sums, None handling, divergence."""
    tinytf.manual_seed(10 + comm.rank)                # different initial values per rank
    model = TinyLM().to("gpu")
    named = model.named_parameters()
    assert comm.param_divergence(model) > 0
    comm.broadcast_params(model)
    assert comm.param_divergence(model) == 0.0
    tinytf.manual_seed(10)
    reference = TinyLM()                              # rank 0's values, on the host
    for (name, p), (_, q) in zip(named, reference.named_parameters()):
        np.testing.assert_array_equal(p.data.get(), q.data, err_msg=name)

    shapes = {name: p.shape for name, p in named}
    none_here = named[0][0]                           # None on rank 0 only
    none_everywhere = named[1][0]
    for name, p in named:
        p.grad = cupy.asarray(host_grads(comm.rank, shapes)[name])
        if name == none_everywhere or (name == none_here and comm.rank == 0):
            p.grad = None
    expected = {name: sum(host_grads(r, shapes)[name] for r in range(comm.size)
                          if not (name == none_here and r == 0)) * 0.25 for name in shapes}
    comm.allreduce_grads(model, scale=0.25)
    for name, p in named:
        if name == none_everywhere:
            assert p.grad is None, name
            continue
        assert isinstance(p.grad, cupy.ndarray) and p.grad.dtype == np.float32, name
        np.testing.assert_allclose(p.grad.get(), expected[name], rtol=1e-6, atol=1e-6,
                                   err_msg=name)


def time_base_allreduce(comm, cupy) -> float:
    """Median milliseconds of allreduce_grads on one base-model-sized float32 gradient."""
    p = tinytf.nn.Parameter(cupy.zeros(BASE_FLOATS, dtype=np.float32))
    p.grad = cupy.ones(BASE_FLOATS, dtype=np.float32)
    named = [("base", p)]
    comm.allreduce_grads(named)                       # warm-up (NCCL set-up, pinned buffers)
    times = []
    for _ in range(5):
        comm.barrier()
        cupy.cuda.get_current_stream().synchronize()
        start = time.perf_counter()
        comm.allreduce_grads(named)
        cupy.cuda.get_current_stream().synchronize()
        times.append(time.perf_counter() - start)
    assert float(p.grad[:1].get()[0]) == comm.size ** 6   # summed in place: warm-up + 5 calls
    return 1e3 * float(np.median(times))


def main(transports) -> None:
    os.environ["TINYTF_DEVICE"] = "gpu"   # create_communicator() then picks local_rank's GPU
    comm = distributed.create_communicator()
    import cupy  # noqa: PLC0415
    assert comm.size > 1, "run me under mpirun -n 2 (or more)"
    n_gpus = cupy.cuda.runtime.getDeviceCount()
    if not transports:
        transports = ["host"] + (["nccl"] if n_gpus >= comm.local_size else [])
    for kind in transports:
        comm.gpu_transport, comm._gpu, comm._plans = kind, None, {}
        check(comm, cupy)
        ms = time_base_allreduce(comm, cupy)
        if comm.is_root:
            gbps = 2 * (comm.size - 1) / comm.size * 4 * BASE_FLOATS / (ms / 1e3) / 1e9
            print(f"{kind}: checks passed; base-size all-reduce {ms:.1f} ms "
                  f"(bus bandwidth {gbps:.1f} GB/s) on {comm.size} ranks, {n_gpus} GPU(s) "
                  f"per node", flush=True)
    comm.gpu_transport, comm._gpu = "auto", None
    comm._transport(cupy)                              # rank 0 says what "auto" picked
    if comm.is_root:
        print("gpu_check OK", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
