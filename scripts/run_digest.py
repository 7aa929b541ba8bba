#!/usr/bin/env python
"""A fixed-seed training run's digest, to show a refactor keeps behaviour bitwise.

Trains ``train.py`` from this checkout for a few updates on the shipped corpus (a fresh run
directory under a temporary folder, one thread), then prints one SHA-256 per checkpoint
section (every parameter, every optimizer array) and one over all of them together::

    python scripts/run_digest.py            # before the change: note the lines
    python scripts/run_digest.py            # after: the same lines, or the change moved a bit

The runs exercise dropout from the first epoch, two accumulated batches per update and
gradient clipping, beside the tiny preset's defaults.
"""
import argparse
import hashlib
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNS = {
    "tiny-defaults": ["--max-steps", "40"],
    "dropout-accum-clip": ["--max-steps", "30", "--set", "dropout_from_epoch=1",
                           "--update-freq", "2", "--clip-norm", "1.0", "--max-tokens", "1024"],
}


def digest(path: str) -> dict:
    """{section: sha256 hex} over the arrays of checkpoint ``path``, in sorted key order."""
    out = {}
    with np.load(path, allow_pickle=False) as z:
        for section in ("model", "optim"):
            h = hashlib.sha256()
            for key in sorted(k for k in z.files if k.startswith(section + "/")):
                a = z[key]
                h.update(key.encode() + str(a.dtype).encode() + str(a.shape).encode())
                h.update(np.ascontiguousarray(a).tobytes())
            out[section] = h.hexdigest()
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", nargs="*", default=list(RUNS), choices=list(RUNS))
    args = p.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", OPENBLAS_NUM_THREADS="1", TINYTF_THREADS="1",
               PYTHONPATH=ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.runs:
            out = os.path.join(tmp, name)
            cmd = [sys.executable, os.path.join(ROOT, "train.py"), "--out", out,
                   "--data", os.path.join(ROOT, "data", "ende"), "--seed", "1",
                   "--workers", "1", "--log-interval", "10", "--set", "test_bleu=false",
                   *RUNS[name]]
            subprocess.run(cmd, check=True, env=env, cwd=tmp,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            d = digest(os.path.join(out, "checkpoint_last.npz"))
            print(f"{name}: model {d['model'][:16]} optim {d['optim'][:16]}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
