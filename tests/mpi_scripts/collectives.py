"""Run under mpirun -n 2: every communicator primitive against values computed by hand.

Prints "collectives OK" from rank 0; any failed assert ends the job non-zero (the
abort-on-exception hook of ``distributed.init``).
"""
import os

import numpy as np
from dp_common import ROOT  # noqa: F401 - puts the repository on sys.path

from tinytf import distributed, nn


def main() -> None:
    comm = distributed.init()
    r, n = comm.rank, comm.size
    assert isinstance(comm, distributed.MPICommunicator) and n == 2, (type(comm), n)
    assert comm.is_root == (r == 0)
    assert 0 <= comm.local_rank < comm.local_size <= n
    assert comm.local_rank == int(os.environ.get("OMPI_COMM_WORLD_LOCAL_RANK", comm.local_rank))

    # Scalars: sum / max / min, list in -> list out, number in -> number out.
    assert comm.allreduce_scalars([r + 1, 10 * r], op="sum") == [3.0, 10.0]
    assert comm.allreduce_scalars([r + 1], op="max") == [2.0]
    assert comm.allreduce_scalars(r + 1.5, op="min") == 1.5
    assert comm.any(r == 1) and not comm.any(False)
    assert comm.broadcast_object({"rank": r}) == {"rank": 0}
    comm.barrier()

    # Gradients: several buckets (tiny bucket size), two dtypes, None on one or all ranks.
    small = distributed.MPICommunicator(comm.comm, bucket_bytes=64)
    params = {name: nn.Parameter(np.zeros(shape), dtype=dtype) for name, shape, dtype in [
        ("a", (3, 4), np.float32), ("b", (5,), np.float32), ("c", (2, 2), np.float64),
        ("d", (40,), np.float32), ("e", (7,), np.float32)]}
    expected = {}
    for i, (name, p) in enumerate(sorted(params.items())):
        if name == "b" and r == 0:
            p.grad = None                                  # None here, a gradient on rank 1
        elif name == "e":
            p.grad = None                                  # None everywhere: stays None
        else:
            p.grad = np.full(p.shape, (i + 1) * (r + 1), dtype=p.dtype)
        expected[name] = None if name == "e" else np.full(
            p.shape, (i + 1) * (3 if name != "b" else 2), dtype=p.dtype)
    plan = small._plan(sorted(params.items()))
    assert len(plan.buckets) >= 4, len(plan.buckets)      # a and d each fill one alone
    small.allreduce_grads(list(params.items()), scale=0.5)
    for name, p in params.items():
        if expected[name] is None:
            assert p.grad is None, name
        else:
            assert p.grad.dtype == p.dtype, (name, p.grad.dtype)
            np.testing.assert_array_equal(p.grad, expected[name] * 0.5, err_msg=name)

    # Broadcast: rank 1's different values become rank 0's.
    for name, p in params.items():
        p.data[...] = r + 1
    assert small.param_divergence(params.items()) == 1.0
    small.broadcast_params(params.items())
    assert all((p.data == 1).all() for p in params.values())
    assert small.param_divergence(params.items()) == 0.0
    if comm.is_root:
        print("collectives OK", flush=True)


if __name__ == "__main__":
    main()
