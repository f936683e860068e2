"""Writes that a reader sees whole or not at all: the one way reports, buffer recordings and
baselines reach the disk.

Everything is written under a hidden temporary name in the destination's own directory (so
the rename stays on one filesystem), flushed with fsync, published by one rename, and then the
directory is fsynced so that the rename itself survives a power cut. Several files that must
change together (`replace_files`) are published through a journal: once every new file is
staged and synced, a journal naming their renames is published, and from then on the change
is committed; whoever finds a journal (the next writer, or a reader of one of its files)
completes it. A crash at any point leaves every file old or every file new.

What a writer leaves when it cannot clean up (SIGKILL, a power cut) is tidied by the next
writer in that directory. Every such entry names its owner, `<pid>.<host>`, the writer's
process id and a hash of its host's name:

    .tmp-<owner>-<what>-<random>      a file or directory being staged: removed
    .old-<owner>-<random>-<name>      `name` moved aside to be replaced: removed when `name`
                                      exists again, else moved back (the replacement never
                                      arrived, so the old one is the whole one)
    .journal-<owner>-<random>.json    renames to complete: completed, then removed

An entry is another writer's to tidy once its owner process no longer runs on this host, or,
where that cannot be known (another host, a reused pid, a name without an owner), once it is
STALE_TMP_S old.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import hashlib
import json
import os
import re
import secrets
import shutil
import socket
import time
from pathlib import Path
from typing import Callable, Iterator

TMP_PREFIX = ".tmp-"
OLD_PREFIX = ".old-"
JOURNAL_PREFIX = ".journal-"
STALE_TMP_S = 3600  # older than any write takes: its writer is gone
STEM_CHARS = 64  # of a staged temporary's name taken from its destination's
# what a rename onto an existing, non-empty directory fails with (Linux, BSD)
_TAKEN = (errno.EEXIST, errno.ENOTEMPTY)
_HOST = hashlib.sha1(socket.gethostname().encode()).hexdigest()[:4]
_OWNER = re.compile(r"(\d+)\.([0-9a-f]{4})")


def _owner() -> str:
    return f"{os.getpid()}.{_HOST}"  # read at each write: a forked child is a writer of its own


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _pid_runs(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def _abandoned(entry: Path, owner: str | None) -> bool:
    """Whether `entry`'s writer is gone: its owner no longer runs here, or it is stale."""
    match = _OWNER.fullmatch(owner or "")
    if match and match.group(2) == _HOST and not _pid_runs(int(match.group(1))):
        return True
    try:
        return entry.lstat().st_mtime < time.time() - STALE_TMP_S
    except FileNotFoundError:
        return False  # its writer finished meanwhile


def _remove(entry: Path) -> None:
    try:
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    except FileNotFoundError:
        pass  # another writer removed it first


def _owner_of(name: str, prefix: str) -> str | None:
    """The `<pid>.<host>` after the prefix, None for a name of an older version (no owner)."""
    head = name[len(prefix):].split("-", 1)[0]
    return head if _OWNER.fullmatch(head) else None


def complete_journals(directory: Path) -> None:
    """Finish the renames of every journal in `directory` (each published only once all its new
    files were staged and synced, so finishing it is always right), then remove it. Readers call
    this before reading, writers before writing. Idempotent: renames already done are skipped."""
    for journal in sorted(directory.glob(JOURNAL_PREFIX + "*.json")):
        try:
            renames = json.loads(journal.read_text(encoding="utf-8"))["renames"]
        except FileNotFoundError:
            continue  # its writer completed it meanwhile
        except (ValueError, KeyError) as exc:
            raise OSError(f"{journal} is not a journal this suite wrote ({exc}); remove it by hand") from exc
        for staged, final in renames:
            try:
                os.replace(directory / staged, directory / final)
            except FileNotFoundError:
                pass  # renamed already
        fsync_path(directory)
        journal.unlink(missing_ok=True)
        fsync_path(directory)


def tidy(directory: Path) -> None:
    """What writers that died left in `directory` (see the module's rules): journals completed,
    staged temporaries removed, old directories removed or put back."""
    complete_journals(directory)
    for entry in directory.glob(TMP_PREFIX + "*"):
        if _abandoned(entry, _owner_of(entry.name, TMP_PREFIX)):
            _remove(entry)
    for entry in directory.glob(OLD_PREFIX + "*"):
        owner = _owner_of(entry.name, OLD_PREFIX)
        if owner is not None:
            name = entry.name.split("-", 3)[3]  # .old-<owner>-<random>-<name>
        else:  # an older version's .old-<name>-<random>
            name = entry.name[len(OLD_PREFIX):].rsplit("-", 1)[0]
        if not _abandoned(entry, owner):
            continue
        if (directory / name).exists():
            _remove(entry)
        else:
            with contextlib.suppress(OSError):  # another writer put it back first
                os.rename(entry, directory / name)


def umask() -> int:
    """The process's umask, read without changing it where Linux tells it."""
    with contextlib.suppress(OSError, ValueError):
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


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
    tidy(parent)
    while True:
        # the stem only tells a reader whose temporary it is: cut, so a long name still fits NAME_MAX
        staged = parent / f"{TMP_PREFIX}{_owner()}-{stem[:STEM_CHARS]}-{secrets.token_hex(4)}"
        try:
            staged.mkdir()  # not mkdtemp: the published directory keeps the umask's permissions
            break
        except FileExistsError:
            continue
    try:
        yield staged
    finally:
        shutil.rmtree(staged, ignore_errors=True)  # already gone when published


_RENAME_EXCHANGE = 2  # renameat2's flag (Linux >= 3.15, glibc >= 2.28)
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one step (Linux renameat2 RENAME_EXCHANGE); False where this
    system or filesystem cannot."""
    renameat2 = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if renameat2 is None:
        return False
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.ENOSYS, errno.EINVAL, errno.ENOENT, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish_directory(staged: Path, final: Path, *, replace: bool = False,
                      at: Callable[[str], None] = lambda point: None) -> None:
    """Move a whole staged directory to `final` in one rename, then sync the parent.

    An existing non-empty `final` fails with OSError (EEXIST / ENOTEMPTY) unless `replace`.
    Replacing swaps the two directories in one step where Linux can (renameat2), so `final` is
    whole at every moment, then removes the old one (left under the staging name by a SIGKILL:
    a temporary the next writer removes). Elsewhere it moves the old directory aside first and
    puts it back if the new one cannot take its place, so an error or an interrupt leaves the
    old directory or the new one, never neither; a SIGKILL between the two renames leaves the
    old one aside, and the next writer in the parent puts it back (`tidy`). `at(point)` is
    called between the steps (crash-injection tests).
    """
    fsync_path(staged)
    at("staged synced")
    if replace and final.exists() and _exchange(staged, final):
        at("exchanged")
        fsync_path(final.parent)
        at("parent synced")
        shutil.rmtree(staged, ignore_errors=True)
        return
    aside: list[Path] = []
    try:
        while True:
            try:
                os.rename(staged, final)
                break
            except OSError as exc:
                if exc.errno not in _TAKEN or not replace:
                    raise
            moved = final.with_name(f"{OLD_PREFIX}{_owner()}-{secrets.token_hex(4)}-{final.name}")
            with contextlib.suppress(FileNotFoundError):  # a concurrent writer moved it first
                os.rename(final, moved)
                aside.append(moved)
                at("moved aside")
    except BaseException:
        if aside and not final.exists():
            os.rename(aside.pop(), final)
        raise
    finally:
        for moved in aside:
            shutil.rmtree(moved, ignore_errors=True)
    at("renamed")
    fsync_path(final.parent)
    at("parent synced")


def _stage_file(path: Path, data: bytes) -> Path:
    """`data` written and synced under a temporary name beside `path`."""
    while True:
        tmp = path.with_name(f"{TMP_PREFIX}{_owner()}-{path.name}-{secrets.token_hex(4)}")
        try:
            # O_EXCL: a name of its own; mode 0o666 less the umask, as open() would give the file
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
            break
        except FileExistsError:
            continue
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return tmp


def replace_files(contents: dict[Path, str]) -> None:
    """Replace each file of one directory whole, and all of them or none, whatever stops the
    writer: every file is staged and synced, then a journal of their renames is published (the
    commit), then the renames are made and the journal removed. An error or interrupt before
    the commit leaves every file as it was; after it, the renames are completed (here, or by
    the next writer or reader of the directory)."""
    parents = {path.parent for path in contents}
    if len(parents) != 1:
        raise ValueError(f"replace_files writes the files of one directory, got {sorted(map(str, parents))}")
    (directory,) = parents
    directory.mkdir(parents=True, exist_ok=True)
    tidy(directory)
    staged: list[Path] = []
    committed = False
    try:
        renames = []
        for path, text in contents.items():
            staged.append(_stage_file(path, text.encode("utf-8")))
            renames.append([staged[-1].name, path.name])
        staged.append(_stage_file(directory / "journal", json.dumps({"renames": renames}).encode("utf-8")))
        os.rename(staged[-1], directory / f"{JOURNAL_PREFIX}{_owner()}-{secrets.token_hex(4)}.json")
        committed = True
        fsync_path(directory)  # the journal, and the staged files it names, on the disk before any rename
    finally:
        if not committed:
            for tmp in staged:
                tmp.unlink(missing_ok=True)
    try:
        complete_journals(directory)
    except BaseException:
        complete_journals(directory)  # interrupted between renames: they take microseconds
        raise
