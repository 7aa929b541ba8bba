"""Run under mpirun: broadcast, then K data-parallel steps; save the parameters as we go.

usage: train_steps.py KIND STEPS OUT_DIR [per-rank-mean]

Writes OUT_DIR/init_rank{r}.npz (each rank seeded differently, before the broadcast),
bcast_rank{r}.npz (after it), grads{k}_rank{r}.npz (the all-reduced, scaled gradients)
and step{k}_rank{r}.npz (the parameters) at every step k, and prints
"divergence=<max |p - p_rank0|>" from rank 0 at the end. "per-rank-mean" switches to the
wrong normalisation (a negative control for the tests).
"""
import os
import sys

import numpy as np
from dp_common import build_model, grads, save_params, train

from tinytf.distributed import communicator as distributed


def main(kind: str, steps: int, out: str, per_rank_mean: bool = False) -> None:
    comm = distributed.create_communicator()
    assert comm.size > 1, "run me under mpirun -n 2 (or more)"
    model = build_model(kind, seed=1 + comm.rank)   # rank 0 has seed 1, as the reference
    save_params(model, os.path.join(out, f"init_rank{comm.rank}.npz"))
    comm.broadcast_params(model)
    save_params(model, os.path.join(out, f"bcast_rank{comm.rank}.npz"))
    train(model, kind, comm, steps, per_rank_mean=per_rank_mean,
          on_grads=lambda k: np.savez(os.path.join(out, f"grads{k}_rank{comm.rank}.npz"),
                                      **grads(model)),
          on_step=lambda k: save_params(model, os.path.join(out, f"step{k}_rank{comm.rank}.npz")))
    divergence = comm.param_divergence(model)
    if comm.is_root:
        print(f"divergence={divergence!r} allreduce_bytes={comm.allreduce_bytes}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4:] == ["per-rank-mean"])
