"""Under mpirun with the CuPy stand-in: the GPU that ``train.py``'s main leaves current on
each rank when the run starts (``tinytf.training.run.train`` replaced by a probe that prints it)."""
import json
import sys

import cupy

from tinytf.commands import train as command


def probe(cfg, comm, process_exits, log_stream=None):
    print(json.dumps({"rank": comm.rank, "gpu": cupy.cuda.runtime.getDevice(),
                      "device": cfg.device}), flush=True)
    return {"stopped": "probe"}


command.train = probe
sys.exit(command.main(sys.argv[1:]))
