"""Directory-atomic checkpoints with a verified stamp.

A run that dies while it writes a checkpoint must find, on restart, the old checkpoint or the new
one, whole, and be able to tell which. Writing each file atomically is not enough: a crash between
the weights and their sidecar leaves a pair nothing can detect. So a checkpoint is a directory,
written whole under a temporary name beside its target and published by one rename
(`suite.files.atomic`: every file and the directory fsynced before, the parent after; an
overwrite swaps the two directories in one step where Linux can, so the path is never without a
whole checkpoint), and its last file is the stamp, `meta.json`: the train step, each file's size
and sha256, the library versions and the format version.

    save_checkpoint("ckpt/step-1000", {"model": model.state_dict(), "optimizer": opt.state_dict(),
                                       "rng": torch.get_rng_state()}, step=1000)
    state, step, meta = load_checkpoint(latest_checkpoint("ckpt", verify=True))

Tensors go to one safetensors file (their devices recorded; `map_location` overrides), the rest
to JSON, tuples, non-string dict keys, NaN and infinities kept. `load_checkpoint` verifies the stamp
and every hash before it returns anything; `latest_checkpoint` returns the newest directory whose
stamp verifies and ignores temporaries (the next save removes them).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import math
import numbers
import os
import stat
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable, Iterator, NamedTuple

import torch

from suite.arms.checkpoint_files import (
    SAFETENSORS_DTYPES,
    CheckpointError,
    file_sha256,
    read_hashed,
    read_tensors,
    tensor_names,
    write_file,
    write_tensors,
)
from suite.errors import UsageError
from suite.files import atomic, jsonfile

# 2: a file's sha256 is over its HASH_CHUNK_BYTES chunks' own digests (1: over its bytes; read still)
FORMAT_VERSION = 2
META, STATE, TENSORS = "meta.json", "state.json", "tensors.safetensors"
# a read that failed while another process replaced the directory is read again, this often
REREADS = 5


class Checkpoint(NamedTuple):
    state: dict[str, Any]
    step: int
    meta: dict[str, Any]


# ---- state <-> (JSON structure, tensors) ---------------------------------------------------------


def split_state(value: Any, path: str, tensors: dict[str, torch.Tensor], seen: dict[tuple, str]) -> Any:
    """`value` as JSON with each tensor replaced by a reference to its entry in `tensors`."""
    if isinstance(value, torch.Tensor):
        t = value.detach()
        if t.is_meta:
            raise UsageError(f"save_checkpoint: {path} is a meta tensor, which holds no data to save; "
                             "materialise it (to_empty, then load or initialise it) first")
        if t.layout != torch.strided:  # safetensors stores dense buffers alone
            raise UsageError(f"save_checkpoint: {path} is a {t.layout} tensor; store it dense (.to_dense()) or as its "
                             "index and value tensors")
        if t.dtype not in SAFETENSORS_DTYPES:  # here, where its path in the state is known
            hint = "torch.view_as_real() of it" if t.is_complex() else "it converted"
            raise UsageError(f"save_checkpoint: {path} is {t.dtype}, which safetensors does not store; save {hint}, "
                             f"as one of {sorted(map(str, SAFETENSORS_DTYPES))}")
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype, str(t.device)) if t.numel() else None
        if key in seen:  # the same tensor twice (tied weights): stored once
            return {"__tensor__": seen[key], "device": str(t.device)}
        name = f"t{len(tensors)}"
        tensors[name] = t  # where it lives: the writer copies it to the host as the file reaches it
        if key is not None:
            seen[key] = name
        return {"__tensor__": name, "device": str(t.device)}
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else {"__float__": repr(value)}
    if isinstance(value, tuple):
        return {"__tuple__": [split_state(v, f"{path}[{i}]", tensors, seen) for i, v in enumerate(value)]}
    if isinstance(value, list):
        return [split_state(v, f"{path}[{i}]", tensors, seen) for i, v in enumerate(value)]
    if isinstance(value, dict):
        if all(isinstance(k, str) for k in value) and not any(k.startswith("__") for k in value):
            return {k: split_state(v, f"{path}[{k!r}]", tensors, seen) for k, v in value.items()}
        items = []
        for k, v in value.items():
            if not isinstance(k, (str, int, float, bool)) and k is not None:
                raise UsageError(f"save_checkpoint: {path} has a key of type {type(k).__name__}; "
                                 "a checkpoint's dict keys are strings, numbers, booleans or None")
            items.append([k, split_state(v, f"{path}[{k!r}]", tensors, seen)])
        return {"__items__": items}
    raise UsageError(f"save_checkpoint: {path} is a {type(value).__name__}; a checkpoint holds tensors, numbers, "
                     "strings, booleans, None, and lists, tuples and dicts of them")


def join_state(value: Any, tensors: dict[str, torch.Tensor], map_location: str | torch.device | None,
          placed: dict[str, torch.Tensor]) -> Any:
    """`value` with each tensor reference replaced by its tensor on its device (or map_location),
    once per entry, so tied tensors come back tied."""
    if isinstance(value, list):
        return [join_state(v, tensors, map_location, placed) for v in value]
    if not isinstance(value, dict):
        return value
    if "__tensor__" in value:
        name = value["__tensor__"]
        if name not in placed:
            placed[name] = tensors[name].to(map_location if map_location is not None else _saved_on(value["device"]))
        return placed[name]
    if "__tuple__" in value:
        return tuple(join_state(v, tensors, map_location, placed) for v in value["__tuple__"])
    if "__float__" in value:
        return float(value["__float__"])
    if "__items__" in value:
        return {k: join_state(v, tensors, map_location, placed) for k, v in value["__items__"]}
    return {k: join_state(v, tensors, map_location, placed) for k, v in value.items()}


def _saved_on(device: str) -> torch.device:
    """The device a tensor was saved on, where this machine has it; else a UsageError naming
    map_location."""
    where = torch.device(device)
    if where.type == "cuda" and (not torch.cuda.is_available() or (where.index or 0) >= torch.cuda.device_count()):
        raise UsageError(f"load_checkpoint: its tensors were saved on {device}, which this machine lacks; pass "
                         "map_location='cpu' (or a device it has)")
    return where


def _tensor_refs(value: Any) -> Iterator[str]:
    """The tensor entries a state's JSON structure names."""
    if isinstance(value, list):
        for v in value:
            yield from _tensor_refs(v)
    elif isinstance(value, dict):
        if isinstance(value.get("__tensor__"), str):
            yield value["__tensor__"]
        else:
            for v in value.values():
                yield from _tensor_refs(v)


# ---- writing -----------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    import safetensors

    try:
        ours = version("suite")
    except PackageNotFoundError:  # run from a checkout that was never installed
        ours = "unknown"
    return {"torch": torch.__version__, "safetensors": safetensors.__version__, "suite": ours}


def write_checkpoint_files(directory: Path, state: dict[str, Any], step: int,
                           at: Callable[[str], None] = lambda point: None) -> None:
    """The checkpoint's files into an existing empty `directory`: tensors, state, then the stamp."""
    tensors: dict[str, torch.Tensor] = {}
    structure = split_state(state, "state", tensors, {})
    files = {TENSORS: write_tensors(directory / TENSORS, tensors, at),
             STATE: write_file(directory / STATE, json.dumps(structure).encode(), at)}
    meta = {"format_version": FORMAT_VERSION, "step": int(step), "files": files, "versions": _versions(),
            "saved_utc": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    meta["stamp_sha256"] = stamp_digest(meta)
    write_file(directory / META, json.dumps(meta, indent=2).encode(), at)


def save_checkpoint(directory: str | Path, state: dict[str, Any], step: int, overwrite: bool = False,
                    at: Callable[[str], None] = lambda point: None) -> Path:
    """Write `state` as a checkpoint at `directory`, whole or not at all (see the module).
    An existing checkpoint there is replaced only with overwrite=True, and anything else is
    never replaced; a symlink there stays, and what it points to is replaced. `at(point)` is
    called between the writer's steps (crash-injection tests)."""
    if not isinstance(state, dict):
        raise UsageError(f"save_checkpoint: state is a {type(state).__name__}; pass a dict")
    if not isinstance(step, numbers.Integral) or isinstance(step, bool) or step < 0:
        raise UsageError(f"save_checkpoint: step must be a whole number >= 0 (the train step), got "
                         f"{type(step).__name__} {step!r}")
    final = Path(directory)
    if len(os.fsencode(final.name)) > _name_max(final.parent):
        raise UsageError(f"save_checkpoint: the name {final.name[:40]}... is {len(os.fsencode(final.name))} bytes, "
                         f"longer than this filesystem's {_name_max(final.parent)}; pass a shorter name")
    # a link to a checkpoint (a `latest`) keeps pointing at it: the save replaces what it points to
    final = _link_target(final) if final.is_symlink() else final
    if final.exists() and not final.is_dir():
        raise UsageError(f"save_checkpoint: {final} is a file, not a directory; pass a directory path")
    if final.exists() and any(final.iterdir()):
        if not overwrite:
            raise UsageError(f"save_checkpoint: {final} already holds something; pass overwrite=True to replace "
                             "a checkpoint there")
        if not _holds_checkpoint(final):
            raise UsageError(f"save_checkpoint: {final} holds files that are not a checkpoint (no {META} stamp of "
                             "this suite naming every file there); it is never replaced: pass another directory")
    try:
        with atomic.staging_directory(final.parent, final.name) as staged:
            at("staging created")
            write_checkpoint_files(staged, state, step, at)
            atomic.publish_directory(staged, final, replace=overwrite, at=at)
    except OSError as exc:
        if exc.errno in (errno.EEXIST, errno.ENOTEMPTY) and not overwrite:
            raise UsageError(f"save_checkpoint: another save published a checkpoint at {final} meanwhile; pass "
                             "overwrite=True to replace it") from None
        raise
    return Path(directory)


def _link_target(link: Path) -> Path:
    """Where a symlink leads, through a chain of them."""
    target = Path(os.path.realpath(link))
    if target.is_symlink():  # realpath stops where links loop
        raise UsageError(f"save_checkpoint: {link} is a symlink that loops ({target} leads back to itself); point it "
                         "at a directory")
    return target


def _name_max(parent: Path) -> int:
    while not parent.exists():
        parent = parent.parent
    try:
        return os.pathconf(parent, "PC_NAME_MAX")
    except (OSError, ValueError):
        return 255


def _holds_checkpoint(directory: Path) -> bool:
    """Whether `directory` is a checkpoint of this suite, whole or damaged: its stamp parses and
    matches its own hash, and it names every file there. Another tool's meta.json never does."""
    try:
        meta = jsonfile.load(directory / META)
        files = meta["files"]
        names = {p.name for p in directory.iterdir()}
    except (jsonfile.Unreadable, OSError, KeyError, TypeError):
        return False
    return (isinstance(files, dict) and meta.get("stamp_sha256") == stamp_digest(meta)
            and names <= set(files) | {META})


# ---- reading -----------------------------------------------------------------------------------


def stamp_digest(meta: dict[str, Any]) -> str:
    """The stamp's own hash, over everything in it but this field: an edited stamp shows."""
    body = {k: v for k, v in meta.items() if k != "stamp_sha256"}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()


def _valid_entry(name: Any, entry: Any) -> bool:
    return (isinstance(name, str) and name not in ("", ".", "..", META) and "/" not in name and "\\" not in name
            and isinstance(entry, dict) and isinstance(entry.get("bytes"), int) and entry["bytes"] >= 0
            and isinstance(entry.get("sha256"), str) and len(entry["sha256"]) == 64
            and (type(entry.get("chunk_bytes", 1)) is int and 0 < entry.get("chunk_bytes", 1) <= 1 << 30))


def read_stamp(directory: str | Path, verify: bool = True) -> dict[str, Any]:
    """The stamp of a whole checkpoint: meta.json read, its own hash checked, and checked against
    the directory (every file it names present with its size, nothing else; with verify, every
    sha256). Raises CheckpointError naming the first fault."""
    meta, _ = _read(Path(directory), verify=verify, keep=False)
    return meta


def _identity(root: Path) -> tuple[int, int] | None:
    try:
        st = root.stat()
    except OSError:
        return None
    return st.st_dev, st.st_ino


def _read(root: Path, verify: bool, keep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the stamp, and when keep each file's contents: the tensors file's tensors, the state's
    JSON structure): every file read once, and judged by the bytes read, so what is decoded is
    what was verified. A read that fails while another process replaces the directory (an
    overwrite swaps it in one step) is read again from the new one."""
    for attempt in range(REREADS):
        before = _identity(root)
        try:
            return _read_once(root, verify, keep)
        except CheckpointError:
            if _identity(root) == before or attempt == REREADS - 1:
                raise
            time.sleep(0.001 * 2**attempt)  # a rename in progress elsewhere takes microseconds
    raise AssertionError("unreachable")


def _read_once(root: Path, verify: bool, keep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        return _read_files(root, verify, keep)
    except RecursionError:
        raise CheckpointError(f"{root}: a JSON file there nests too deeply to be one this suite wrote") from None
    except OSError as exc:
        raise CheckpointError(f"{root}: cannot read {exc.filename or 'it'} ({exc.strerror or exc})") from None


def _read_files(root: Path, verify: bool, keep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """Every file of the directory opened at once, then read through those handles: an
    overwrite that swaps the directory meanwhile (and removes the old one) cannot mix its files
    with ours, nor take one away halfway."""
    try:
        dir_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
    except (FileNotFoundError, NotADirectoryError):
        raise CheckpointError(f"{root} is not a directory") from None
    held: dict[str, int] = {}
    try:
        for name in os.listdir(dir_fd):
            with contextlib.suppress(FileNotFoundError):  # removed since the listing
                held[name] = os.open(name, os.O_RDONLY | os.O_NONBLOCK, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    try:
        return _judge_files(root, held, verify, keep)
    finally:
        for fd in held.values():
            os.close(fd)


def _judge_files(root: Path, held: dict[str, int], verify: bool, keep: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    if META not in held:
        raise CheckpointError(f"{root} has no {META}: not a whole checkpoint (a save that did not finish?)")
    try:
        meta = jsonfile.load(root / META, fd=held[META])
    except jsonfile.Unreadable as exc:
        raise CheckpointError(f"{root / META} is not a checkpoint stamp: {exc}") from None
    version = meta.get("format_version") if isinstance(meta, dict) else None
    if not isinstance(version, int):
        raise CheckpointError(f"{root / META} names no format_version")
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{root} is format {version}, newer than this suite reads ({FORMAT_VERSION}): "
                              "upgrade suite to load it")
    files = meta.get("files")
    if not isinstance(files, dict) or not isinstance(meta.get("step"), int) or not all(
            _valid_entry(name, entry) for name, entry in files.items()):
        raise CheckpointError(f"{root / META} lacks its step or a valid entry (plain file name, size, sha256) "
                              "for each file")
    if not {STATE, TENSORS} <= set(files):
        raise CheckpointError(f"{root / META} does not name {STATE} and {TENSORS}: not a checkpoint stamp")
    if meta.get("stamp_sha256") != stamp_digest(meta):
        raise CheckpointError(f"{root / META} does not match its own hash: the stamp was edited after the save")
    stray = sorted(set(held) - set(files) - {META})
    if stray:
        raise CheckpointError(f"{root} holds {stray[0]}, which its stamp does not name")
    contents: dict[str, Any] = {}
    for name, entry in files.items():
        path = root / name
        if name not in held or not stat.S_ISREG(os.fstat(held[name]).st_mode):
            raise CheckpointError(f"{root} lacks {name}, which its stamp names")
        fd = held[name]
        size = os.fstat(fd).st_size
        chunk_bytes = entry.get("chunk_bytes", 0)  # 0: format 1, one sha256 over the bytes
        # a load hashes the very bytes it decodes; a verify reads the state too, to check what it names
        if size == entry["bytes"] and (keep or (verify and name == STATE)):
            try:
                if name == TENSORS:
                    data, size, digest = read_tensors(path, size, chunk_bytes, fd)
                else:
                    data, size, digest = read_hashed(path, size, chunk_bytes, fd)
            except CheckpointError:
                # the stamp is judged first: a changed file is named as such, not by what changed
                if file_sha256(path, chunk_bytes, fd) != entry["sha256"]:
                    raise CheckpointError(f"{path} does not match its sha256 in {META}: the file changed after "
                                          "it was written") from None
                raise
        elif size == entry["bytes"] and verify:
            digest = file_sha256(path, chunk_bytes, fd)
        if size != entry["bytes"]:
            raise CheckpointError(f"{path} is {size} bytes, its stamp says {entry['bytes']}: cut short or "
                                  "written to after the save")
        if verify or keep:
            if digest != entry["sha256"]:
                raise CheckpointError(f"{path} does not match its sha256 in {META}: the file changed after it "
                                      "was written")
        if keep or (verify and name == STATE):
            contents[name] = data
    if STATE in contents:
        contents[STATE] = _state_structure(root, contents, keep, held[TENSORS])
    return meta, contents


def _state_structure(root: Path, contents: dict[str, Any], keep: bool, tensors_fd: int) -> Any:
    """The state's JSON structure, checked to name only tensors the tensors file holds (a load
    would otherwise fail after a verify said the checkpoint was whole)."""
    try:
        structure = json.loads(contents[STATE].numpy().tobytes().decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointError(f"{root / STATE} is not the state's JSON: {exc}") from None
    held = set(contents[TENSORS]) if keep else tensor_names(root / TENSORS, tensors_fd)
    missing = sorted(set(_tensor_refs(structure)) - held)
    if missing:
        raise CheckpointError(f"{root / STATE} names tensor {missing[0]!r}, which {TENSORS} does not hold: the "
                              "state was edited, or paired with another save's tensors")
    return structure


def load_checkpoint(directory: str | Path, map_location: str | torch.device | None = None) -> Checkpoint:
    """The state saved at `directory`, after its stamp and every hash are verified: decoded from
    the very bytes that were hashed."""
    meta, contents = _read(Path(directory), verify=True, keep=True)
    return Checkpoint(state=join_state(contents[STATE], contents[TENSORS], map_location, {}), step=meta["step"], meta=meta)


def _names(base: Path) -> set[str]:
    """The names in `base` but temporaries. A listing taken while another process swaps a
    directory into place can miss the name being swapped, so listings are taken until one adds
    nothing to those before it."""
    seen: set[str] = set()
    for _ in range(REREADS):
        names = {name for name in os.listdir(base) if not name.startswith(".")}
        if seen and names == seen:
            break
        seen |= names
    return seen


def latest_checkpoint(root: str | Path, verify: bool = False) -> Path | None:
    """The checkpoint under `root` with the highest step whose stamp verifies (sizes; with
    verify, hashes too); temporaries and directories that do not verify are passed over."""
    best: tuple[int, float, str] | None = None
    found = None
    base = Path(root)
    if not base.is_dir():
        return None
    for name in sorted(_names(base)):
        entry = base / name
        if not entry.is_dir():
            continue
        try:
            meta = read_stamp(entry, verify=verify)
            mtime = entry.stat().st_mtime
        except (CheckpointError, OSError):  # not whole, unreadable, or removed meanwhile
            continue
        key = (meta["step"], mtime, entry.name)
        if best is None or key > best:
            best, found = key, entry
    return found
