"""A run directory's own files, opened without following a symbolic link.

A run directory is a boundary: its lock and its logs are appended to and rewritten by
every start, so a link put in their place (by accident or by someone else) would send
those writes to a file outside it. :func:`open_own` opens the file itself or refuses:
``O_NOFOLLOW`` for the last component (Linux, macOS, the BSDs); elsewhere a link found by
``os.path.islink`` is refused the same way.
"""
from __future__ import annotations

import errno
import os

NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)

_FLAGS = {"a": os.O_WRONLY | os.O_CREAT | os.O_APPEND,
          "a+": os.O_RDWR | os.O_CREAT | os.O_APPEND}


def open_own(path, mode: str = "a"):
    """``open(path, mode)`` for ``mode`` "a" or "a+" (text, UTF-8), refusing a symbolic
    link in place of the file with an OSError whose message says so."""
    link = OSError(errno.ELOOP, "a symbolic link, which a run directory's files never follow",
                   os.fspath(path))
    if not NOFOLLOW and os.path.islink(path):
        raise link
    try:
        fd = os.open(path, _FLAGS[mode] | NOFOLLOW | getattr(os, "O_CLOEXEC", 0), 0o666)
    except OSError as e:
        # Linux says ELOOP for a link under O_NOFOLLOW; FreeBSD says EMLINK.
        if e.errno in (errno.ELOOP, errno.EMLINK) and os.path.islink(path):
            raise link from None
        raise
    return os.fdopen(fd, mode, encoding="utf-8")
