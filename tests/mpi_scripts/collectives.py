"""Run under mpirun -n 2: every communicator primitive against values computed by hand.

Prints "collectives OK" from rank 0; any failed assert ends the job non-zero (the
abort-on-exception hook of ``distributed.create_communicator``).
"""
import os

import numpy as np
from dp_common import ROOT  # noqa: F401 - puts the repository on sys.path

from tinytf import nn, optim
from tinytf.distributed import communicator as distributed


def main() -> None:
    comm = distributed.create_communicator()
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
    # Parameters in Adam's flat buffers: summed in place, chunk by chunk (a tiny chunk
    # size: several), with the same None rules; a gradient set from outside is gathered.
    flat_params = {name: nn.Parameter(np.zeros(shape, dtype=np.float32))
                   for name, shape in [("u", (3, 5)), ("w", (11,)), ("x", (4,)), ("y", (2,))]}
    opt = optim.Adam(list(flat_params.items())[::-1], lr=1e-3)
    for p in flat_params.values():
        p.grad = np.zeros(p.shape, dtype=np.float32)
    opt.step()                                             # builds the flat buffers
    flat = distributed._flat_buffer(sorted(flat_params.items()))
    assert flat is not None
    for name, p in flat_params.items():
        p.grad = p.grad_buffer
        p.grad[...] = (ord(name) - ord("t")) * (r + 1)     # u: 1, w: 3, x: 4, y: 5 per rank
    if r == 0:
        flat_params["x"].grad = None            # one rank only: its slot must count as 0
    flat_params["y"].grad = None                                        # no rank
    outside = np.full((11,), 7.0 * (r + 1), dtype=np.float32)
    flat_params["w"].grad = outside                          # not the buffer's slot
    small.allreduce_grads(list(flat_params.items()), scale=0.5)
    plan = small._plan(sorted(flat_params.items()))
    assert plan.buckets == [] and len(plan.chunks(flat.grad)) == 2    # no packing
    expected = {"u": 1 * 3 * 0.5, "w": 7 * 3 * 0.5, "x": 4 * 2 * 0.5}
    for name, p in flat_params.items():
        if name == "y":
            assert p.grad is None
        else:
            assert p.grad is p.grad_buffer, name              # still the buffer's slot
            np.testing.assert_array_equal(p.grad, expected[name], err_msg=name)
    assert not np.shares_memory(outside, flat.grad) and (outside == 7.0 * (r + 1)).all()
    # Broadcast in place: rank 0's values, the parameters still views of the buffer;
    # the divergence compares the flat buffers without changing them.
    for p in flat_params.values():
        p.data[...] = 10 * (r + 1)
    assert small.param_divergence(list(flat_params.items())) == 10.0
    assert all((p.data == 10 * (r + 1)).all() for p in flat_params.values())
    small.broadcast_params(list(flat_params.items()))
    assert all((p.data == 10).all() for p in flat_params.values())
    assert flat.linked(flat.params)
    assert small.param_divergence(list(flat_params.items())) == 0.0
    # The GPU transport "auto": NCCL only if every rank can use it; all ranks agree.
    choice = distributed.MPICommunicator(comm.comm, gpu_transport="auto")._resolve_auto()
    code = ["host", "nccl"].index(choice)
    assert comm.allreduce_scalars([code, -code], op="min") == [code, -code], choice
    if comm.is_root:
        print("collectives OK", flush=True)


if __name__ == "__main__":
    main()
