"""Writes that a reader sees whole or not at all: the one way reports, buffer recordings and
baselines reach the disk.

Everything is written under a hidden temporary name in the destination's own directory (so
the rename stays on one filesystem), flushed with fsync, published by one rename, and then the
directory is fsynced so that the rename itself survives a power cut. An interrupt (an
exception, SIGINT, SIGTERM, SIGHUP) removes the temporaries on the way out; one left by a
writer that could not clean up (SIGKILL, a power cut) is removed by the next writer in that
directory once it is STALE_TMP_S old.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path
from typing import Iterator

TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600  # older than any write takes: its writer is gone
# what a rename onto an existing, non-empty directory fails with (Linux, BSD)
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY)


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def remove_stale_temps(directory: Path) -> None:
    cutoff = time.time() - STALE_TMP_S
    for leftover in directory.glob(TMP_PREFIX + "*"):
        try:
            if leftover.lstat().st_mtime >= cutoff:
                continue  # may belong to a writer still at work
            if leftover.is_dir() and not leftover.is_symlink():
                shutil.rmtree(leftover, ignore_errors=True)
            else:
                leftover.unlink()
        except OSError:
            pass  # another writer removed it first


def write_bytes(path: Path, data: bytes) -> None:
    """Write a file and flush it to the disk (a file of a directory being staged)."""
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())


@contextlib.contextmanager
def staging_directory(parent: Path, stem: str) -> Iterator[Path]:
    """A hidden temporary directory in `parent` to build a whole directory in, removed on the
    way out unless publish_directory moved it into place."""
    parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(parent)
    while True:
        staged = parent / f"{TMP_PREFIX}{stem}-{secrets.token_hex(4)}"
        try:
            staged.mkdir()  # not mkdtemp: the published directory keeps the umask's permissions
            break
        except FileExistsError:
            continue
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # already gone when published


def publish_directory(staged: Path, final: Path, *, replace: bool = False) -> None:
    """Move a whole staged directory to `final` in one rename, then sync the parent.

    An existing non-empty `final` fails with OSError (EEXIST / ENOTEMPTY) unless `replace`.
    Replacing moves the old directory aside first and puts it back if the new one cannot take
    its place, so an error or an interrupt leaves the old directory or the new one, never
    neither; only a SIGKILL between the two renames leaves the old one beside it as `.old-*`.
    """
    fsync_path(staged)
    aside: list[Path] = []
    try:
        while True:
            try:
                os.rename(staged, final)
                break
            except OSError as exc:
                if exc.errno not in _TAKEN or not replace:
                    raise
            moved = final.with_name(f".old-{final.name}-{secrets.token_hex(4)}")
            with contextlib.suppress(FileNotFoundError):  # a concurrent writer moved it first
                os.rename(final, moved)
                aside.append(moved)
    except BaseException:
        if aside and not final.exists():
            os.rename(aside.pop(), final)
        raise
    finally:
        for moved in aside:
            shutil.rmtree(moved, ignore_errors=True)
    fsync_path(final.parent)


def _stage_file(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f"{TMP_PREFIX}{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it private; these files are shared and committed
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return Path(tmp)


def replace_files(contents: dict[Path, str]) -> None:
    """Replace each file whole, and all of them or none: every file is staged and synced
    before the first rename, and an error or interrupt while renaming puts back the files
    already replaced."""
    staged: dict[Path, Path] = {}
    replaced: dict[Path, bytes | None] = {}  # path -> what it held before (None: nothing)
    try:
        for parent in {path.parent for path in contents}:
            parent.mkdir(parents=True, exist_ok=True)
            remove_stale_temps(parent)
        for path, text in contents.items():
            staged[path] = _stage_file(path, text.encode("utf-8"))
        for path, tmp in staged.items():
            before = path.read_bytes() if path.exists() else None
            os.replace(tmp, path)
            replaced[path] = before
    except BaseException:
        for path, before in replaced.items():
            if before is None:
                path.unlink(missing_ok=True)
            else:
                os.replace(_stage_file(path, before), path)
        raise
    finally:
        for tmp in staged.values():
            tmp.unlink(missing_ok=True)  # already renamed away when published
    for parent in {path.parent for path in contents}:
        fsync_path(parent)
