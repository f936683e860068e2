"""Reading the suite's own JSON files (reports, baselines, buffer manifests, checkpoint stamps)
from paths a person or a script passes: a bounded read of a regular file (a device would be read
until memory runs out, a FIFO would hang), and a parse whose failures, nesting too deep included,
come back as one line. Each caller turns `Unreadable` into its own error (a usage error, bad
buffers, a checkpoint that is not whole).
"""

from __future__ import annotations

import json
import os
import stat
from typing import Any

MAX_BYTES = 256 << 20  # far above any report, baseline or stamp the suite writes


class Unreadable(Exception):
    """Why a file cannot be read: one line, without the path (the caller adds it)."""


class NotJson(Unreadable):
    """A file that was read but holds no JSON document the suite could have written."""


class NotUtf8(NotJson):
    pass


def read_bytes(path: str | os.PathLike, limit: int = MAX_BYTES, fd: int | None = None) -> bytes:
    """The bytes of the regular file at `path` (or already open as `fd`, read from its start),
    refusing anything else (a device, a FIFO, a directory) and anything over `limit` bytes,
    without blocking on open."""
    try:
        # a FIFO's open would wait for a writer; a dup leaves the caller's fd open
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK) if fd is None else os.dup(fd)
    except IsADirectoryError:
        raise Unreadable("it is a directory, not a file") from None
    except OSError as exc:
        raise Unreadable(exc.strerror or str(exc)) from None
    with os.fdopen(fd, "rb") as fh:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = "a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else \
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "not a regular file"
            raise Unreadable(f"it is {kind}, not a regular file")
        fh.seek(0)
        data = fh.read(limit + 1)  # a file that grows past its size is caught by the bound too
    if len(data) > limit:
        raise Unreadable(f"it is larger than {limit >> 20} MiB, more than any file of the suite")
    return data


def load(path: str | os.PathLike, limit: int = MAX_BYTES, fd: int | None = None) -> Any:
    """The JSON document at `path` (UTF-8; or open as `fd`). Unreadable says what is wrong: not a
    regular file, too large, not UTF-8 (with the byte), not JSON (with the place), nested too
    deeply."""
    data = read_bytes(path, limit, fd)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise NotUtf8(f"not UTF-8 text (byte {exc.start})") from None
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise NotJson(f"not valid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})") from None
    except RecursionError:
        raise NotJson(DEEP) from None


DEEP = "its JSON nests deeper than any file the suite writes"
