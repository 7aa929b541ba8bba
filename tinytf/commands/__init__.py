"""The command-line programs, installed as commands by ``pip install``:

- ``tinytf-train`` (:mod:`.train`; ``python train.py`` in a checkout),
- ``tinytf-translate`` (:mod:`.translate`; ``python translate.py``),
- ``tinytf-average`` (:mod:`.average`: average a run's last checkpoints),
- ``tinytf-prepare`` (:mod:`.prepare`: a run directory's BPE and encoded corpus, ahead of
  training; ``python -m tinytf.commands.prepare``),
- ``tinytf-bpe`` (:mod:`.bpe`: learn, encode, decode).

Each ``main(argv)`` returns the exit status: 0 done, 1 internal error (a traceback), 2 usage
or data error (one line naming the file), 128 + N stopped by signal N (141: a closed pipe).

A program sets up its own process, which ``import tinytf`` leaves alone: importing this
package sets ``OPENBLAS_THREAD_TIMEOUT=16`` while NumPy is not loaded yet (and the variable
is unset), and each ``main`` calls :func:`start_process` (glibc keeps freed memory).
docs/architecture.md, "Both cores" and "Freed memory", has the reasons and the figures.
"""

import logging
import os
import sys

if "numpy" not in sys.modules:
    # OpenBLAS's idle threads spin for 2^28 cycles after each product before they sleep,
    # taking a core from the row-parallel threads of tinytf.fast.cpu.threads; at 2^16 they
    # still spin between the products of one batched matmul but sleep during the row ops.
    # OpenBLAS reads it when NumPy loads it, so it is set only before that, and never over
    # the user's own setting.
    os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "16")

from tinytf.engine import backend  # noqa: E402 - after the variable above
from tinytf.fast.cpu import memory  # noqa: E402


class WarningLines(logging.Handler):
    """The library's warnings (``tinytf`` loggers, WARNING and up) as ``warning: ...``
    lines on stderr: what a command shows of them (a library user configures ``logging``)."""

    def __init__(self):
        super().__init__(logging.WARNING)

    def emit(self, record: logging.LogRecord) -> None:
        from tinytf.utils.streams import note  # noqa: PLC0415
        note(f"warning: {record.getMessage()}")


def start_process() -> None:
    """What a command does to its process when it starts: glibc keeps freed memory for the
    next step (:func:`tinytf.fast.cpu.memory.keep_by_default`; ``TINYTF_KEEP_MEMORY=0`` or a
    malloc tuning of the user's own leaves it as it is), and the library's warnings are
    shown on stderr (:class:`WarningLines`)."""
    memory.keep_by_default()
    logger = logging.getLogger("tinytf")
    if not any(isinstance(h, WarningLines) for h in logger.handlers):
        logger.addHandler(WarningLines())


def add_file_pairs(p, what: str = "") -> None:
    """``--train``, ``--valid`` and ``--test``, each a source file and a target file of any
    names (train.py's and tinytf-prepare's data options)."""
    pair = dict(nargs=2, metavar=("SRC_FILE", "TGT_FILE"))
    p.add_argument("--train", dest="train_files", **pair,
                   help=f"the training pair, any file names{what}")
    p.add_argument("--valid", dest="valid_files", **pair,
                   help="the dev pair that validation scores (with --train)")
    p.add_argument("--test", dest="test_files", **pair,
                   help="an optional test pair, scored at the end (with --train)")


def device_default() -> str:
    """``--device``'s default: ``$TINYTF_DEVICE`` ("cpu" or "gpu"; "cpu" when unset). Any
    other value is a usage error: one line on stderr, exit 2."""
    try:
        return backend.default_device()
    except ValueError as e:
        print(f"{os.path.basename(sys.argv[0]) or 'tinytf'}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
