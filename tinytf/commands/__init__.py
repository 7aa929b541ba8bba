"""The command-line programs, installed as commands by ``pip install``:

- ``tinytf-train`` (:mod:`.train`; ``python train.py`` in a checkout),
- ``tinytf-translate`` (:mod:`.translate`; ``python translate.py``),
- ``tinytf-average`` (:mod:`.average`: average a run's last checkpoints),
- ``tinytf-bpe`` (:mod:`tinytf.commands.bpe`: learn, encode, decode).

Each ``main(argv)`` returns the exit status: 0 done, 1 internal error (a traceback), 2 usage
or data error (one line naming the file), 128 + N stopped by signal N (141: a closed pipe).
"""

import os
import sys

from tinytf.engine import backend


def device_default() -> str:
    """``--device``'s default: ``$TINYTF_DEVICE`` ("cpu" or "gpu"; "cpu" when unset). Any
    other value is a usage error: one line on stderr, exit 2."""
    try:
        return backend.default_device()
    except ValueError as e:
        print(f"{os.path.basename(sys.argv[0]) or 'tinytf'}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
