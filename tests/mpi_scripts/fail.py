"""Run under mpirun: rank 1 fails while rank 0 waits in a collective; must not hang.

usage: fail.py MODE   with MODE one of
  raise  - an uncaught exception (create_communicator() installed the abort-on-exception hook)
  guard  - an exception inside ``with comm.guard():`` (hook switched off)
  abort  - an explicit ``comm.abort("...", code=3)``
  exit   - ``sys.exit(4)`` inside ``comm.guard()``
"""
import contextlib
import sys
import time

import numpy as np
from dp_common import ROOT  # noqa: F401 - puts the repository on sys.path

from tinytf import nn
from tinytf.distributed import communicator as distributed


def main(mode: str) -> None:
    comm = distributed.create_communicator(install_excepthook=(mode == "raise"))
    p = nn.Parameter(np.ones(3))
    p.grad = np.ones(3, dtype=np.float32)
    with contextlib.nullcontext() if mode == "raise" else comm.guard():
        if comm.rank == 1:
            time.sleep(0.5)  # let rank 0 block in the all-reduce first
            if mode == "abort":
                comm.abort("rank 1 gave up on purpose", code=3)
            if mode == "exit":
                sys.exit(4)
            raise ValueError(f"deliberate failure on rank {comm.rank} ({mode})")
        comm.allreduce_grads([("p", p)])   # never completes: rank 1 is not coming
        print("rank 0 passed the all-reduce: the test is broken", flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
