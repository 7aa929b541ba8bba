"""Writing a command's output so that a write the disk refuses is never lost in silence.

CPython's buffered standard output can drop, without an error, the rest of a large write
that the file system cuts short: into a redirected standard output on an 8 KiB tmpfs
(CPython 3.11), ``write(1, ..., 22527)`` returns 8192, the rest of the block is gone and
the command exits 0. :func:`write_all` writes a block straight to the stream's file
descriptor instead, repeating a short write until all of it is written or the file system
says why not (an OSError: ``ENOSPC``, ``EDQUOT``, ``EFBIG``), which the command reports.
:func:`drop_stdout` is what a command does once its standard output is gone, and
:func:`note` writes a line for a human (progress, a warning) to a stream that may be gone.
"""
from __future__ import annotations

import errno
import io
import os
import sys


def write_all(stream, data: bytes) -> None:
    """Write ``data`` to the binary ``stream`` (an open file, ``sys.stdout.buffer``) and
    flush it: all of it, or an OSError. What the stream still buffers goes first; a stream
    without a file descriptor (an in-memory buffer) gets an ordinary write and flush."""
    stream.flush()
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, io.UnsupportedOperation):
        stream.write(data)
        stream.flush()
        return
    view = memoryview(data)
    while view:
        written = os.write(fd, view)
        if written == 0:    # a file system that neither writes nor says why
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        view = view[written:]


def drop_stdout() -> None:
    """Point the standard output at /dev/null, once its reader went away (a closed pipe) or
    its disk refused a write: what it still buffers cannot be written, and Python's own
    flush at exit must not report that a second time. A standard output without a file
    descriptor (a test's buffer) is left as it is."""
    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError, AttributeError, io.UnsupportedOperation):
        pass


def note(text: str, stream=None) -> Exception | None:
    """``text`` as a line on ``stream`` (stderr). A stream that went away (a closed pipe:
    ``2>&1 | tee`` whose reader ended; a closed file) takes no line and stops nothing:
    returns what it raised, None when the line was written."""
    try:
        print(text, file=stream or sys.stderr, flush=True)
    except (OSError, ValueError) as e:
        return e
    return None
