"""A checkpoint's files on the disk: each written in pieces and hashed as it is written (a
format-2 sha256 over chunks hashed in parallel), the tensors as a safetensors file this module
writes and reads itself, and every file read back hashing the very bytes it decodes. Which files
a checkpoint holds, and its stamp, are `suite.arms.checkpoint`'s.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from suite.errors import CouldNotRun, UsageError

CHUNK_BYTES = 8 << 20  # files are written (and read) in pieces of this size
HASH_CHUNK_BYTES = 8 << 20  # ... and hashed in chunks of this size, each on its own, in parallel
HASH_THREADS = max(1, min(8, os.cpu_count() or 1))
HASH_BACKLOG = 16  # chunks written but not yet hashed, at most


class CheckpointError(CouldNotRun):
    """A checkpoint that is not whole or not this format; the message names the file and the fault."""


def _chunk_digest(pieces: list[memoryview]) -> bytes:
    digest = hashlib.sha256()
    for piece in pieces:
        digest.update(piece)
    return digest.digest()


class ChunkedSha256:
    """A file's sha256 as a format-2 stamp holds it: the sha256 of the concatenated sha256
    digests of its HASH_CHUNK_BYTES-long chunks (the last one shorter), in file order. Each chunk
    is hashed on its own by a pool of threads (hashlib leaves the GIL), so hashing keeps pace
    with a disk faster than one core's sha256, for writes and for verifying reads alike. Bytes
    are fed in order, in pieces of any length; at most HASH_BACKLOG chunks wait, each holding
    the memory its pieces view."""

    def __init__(self, pool: ThreadPoolExecutor, chunk_bytes: int = 0) -> None:
        self.pool, self.chunk_bytes = pool, chunk_bytes or HASH_CHUNK_BYTES
        self.pieces: list[memoryview] = []
        self.filled = 0
        self.waiting: deque = deque()
        self.digests: list[bytes] = []

    def update(self, view: memoryview) -> None:
        while len(view):
            take = min(len(view), self.chunk_bytes - self.filled)
            self.pieces.append(view[:take])
            self.filled += take
            view = view[take:]
            if self.filled == self.chunk_bytes:
                self._submit()

    def _submit(self) -> None:
        self.waiting.append(self.pool.submit(_chunk_digest, self.pieces))
        self.pieces, self.filled = [], 0
        while len(self.waiting) > HASH_BACKLOG:
            self.digests.append(self.waiting.popleft().result())

    def hexdigest(self) -> str:
        if self.filled:
            self._submit()
        self.digests += [future.result() for future in self.waiting]
        self.waiting.clear()
        return hashlib.sha256(b"".join(self.digests)).hexdigest()


def stamp_entry(written: int, digest: ChunkedSha256) -> dict[str, Any]:
    return {"bytes": written, "sha256": digest.hexdigest(), "chunk_bytes": digest.chunk_bytes}


def write_file(path: Path, data: bytes, at: Callable[[str], None]) -> dict[str, Any]:
    """`data` written in pieces, hashed as written, fsynced; its stamp entry."""
    with open(path, "wb") as fh, ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digest = ChunkedSha256(pool)
        at(f"{path.name}: opened")
        view = memoryview(data)
        for start in range(0, len(view), CHUNK_BYTES):
            piece = view[start:start + CHUNK_BYTES]
            fh.write(piece)
            digest.update(piece)
            at(f"{path.name}: {start + len(piece)} bytes")
        fh.flush()
        os.fsync(fh.fileno())
        entry = stamp_entry(len(data), digest)
        at(f"{path.name}: synced")
    return entry


# torch dtype -> safetensors' name for it (the format's spec); a checkpoint refuses any other
SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8",
                      torch.uint8: "U8", torch.bool: "BOOL", torch.float8_e4m3fn: "F8_E4M3",
                      torch.float8_e5m2: "F8_E5M2", torch.uint16: "U16", torch.uint32: "U32", torch.uint64: "U64"}


def _safetensors_header(tensors: dict[str, torch.Tensor]) -> bytes:
    """The safetensors file's head: an 8-byte little-endian length, then the JSON header padded
    with spaces to 8 bytes; the tensors follow back to back in this order. Written by us so the
    bytes can be hashed as they are written (save_file writes the file in one call and a hash
    must read it back); safetensors' own load_file reads it, and read_tensors loads it here."""
    entries: dict[str, Any] = {}
    offset = 0
    for name, t in tensors.items():
        if t.dtype not in SAFETENSORS_DTYPES:
            raise UsageError(f"save_checkpoint: tensor {name} is {t.dtype}, which safetensors does not store; "
                             f"convert it to one of {sorted(map(str, SAFETENSORS_DTYPES))}")
        size = t.numel() * t.element_size()
        entries[name] = {"dtype": SAFETENSORS_DTYPES[t.dtype], "shape": list(t.shape),
                         "data_offsets": [offset, offset + size]}
        offset += size
    body = json.dumps(entries, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    return len(body).to_bytes(8, "little") + body


def _host_bytes(t: torch.Tensor) -> memoryview:
    """t's bytes in host memory, in row-major order (a copy from the device, or of a strided view)."""
    host = t.to("cpu").contiguous()
    return memoryview(host.reshape(-1).view(torch.uint8).numpy()) if host.numel() else memoryview(b"")


def _host_views(tensors: dict[str, torch.Tensor], ahead: int = 2) -> Iterator[memoryview]:
    """Each tensor's host bytes in order, copied `ahead` (>= 1) tensors early on a worker thread
    (the copies leave the GIL): a GPU state's device-to-host copies overlap the writes. The host
    holds a few tensors' copies instead of the whole state's: `ahead` + 1 here, and those whose
    chunks still wait for the hash (at most HASH_BACKLOG chunks, see write_tensors)."""
    if ahead < 1:
        raise ValueError(f"_host_views: ahead must be >= 1, got {ahead}")
    items = list(tensors.values())
    with ThreadPoolExecutor(max_workers=1) as copier:
        queued = deque(copier.submit(_host_bytes, t) for t in items[:ahead])
        for t in items[ahead:]:
            view = queued.popleft().result()
            queued.append(copier.submit(_host_bytes, t))
            yield view
        while queued:
            yield queued.popleft().result()


def write_tensors(path: Path, tensors: dict[str, torch.Tensor], at: Callable[[str], None]) -> dict[str, Any]:
    """The tensors written in pieces as their host copies arrive, each chunk hashed on the pool
    while the next are written; the fsync waits on the disk while the pool finishes."""
    header = _safetensors_header(tensors)
    for device in {t.device for t in tensors.values() if t.is_cuda}:
        torch.cuda.current_stream(device).synchronize()  # the copier's stream sees the caller's work done
    written = 0
    with open(path, "wb") as fh, ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digest = ChunkedSha256(pool)
        at(f"{path.name}: opened")
        for view in itertools.chain([memoryview(header)], _host_views(tensors)):
            for start in range(0, len(view), CHUNK_BYTES):
                piece = view[start:start + CHUNK_BYTES]
                fh.write(piece)
                digest.update(piece)
                written += len(piece)
                at(f"{path.name}: {written} bytes")
        if written != len(header) + sum(t.numel() * t.element_size() for t in tensors.values()):
            raise CheckpointError(f"{path}: wrote {written} bytes where the header describes another count (a "
                                  "tensor resized during the save?)")
        fh.flush()
        os.fsync(fh.fileno())
        entry = stamp_entry(written, digest)
        at(f"{path.name}: synced")
    return entry


def hasher(pool: ThreadPoolExecutor, chunk_bytes: int):
    """The stamp's hash of a file as its entry says: format 2's over chunks of chunk_bytes, or
    (chunk_bytes 0) format 1's plain sha256, fed in order on the caller's thread."""
    return ChunkedSha256(pool, chunk_bytes) if chunk_bytes else hashlib.sha256()


def opened(path: Path, fd: int | None, buffering: int = -1):
    """`path` opened for reading, or the file already open as `fd`, from its start."""
    if fd is None:
        return open(path, "rb", buffering=buffering)
    fh = os.fdopen(os.dup(fd), "rb", buffering=buffering)
    fh.seek(0)
    return fh


def read_hashed(path: Path, size: int, chunk_bytes: int, fd: int | None = None) -> tuple[torch.Tensor, int, str]:
    """(the file's bytes as a uint8 tensor, how many there were, their stamp's sha256): read in
    pieces, hashed as they arrive while the next are read (hashing leaves the GIL). A file that
    grew or shrank since its size was taken reads as another size, and so fails the size check."""
    data = torch.empty(size, dtype=torch.uint8)  # not zero-filled: every byte is read into it
    view = memoryview(data.numpy())
    read = 0
    with opened(path, fd, 0) as fh, ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digest = hasher(pool, chunk_bytes)
        while read < size and (n := fh.readinto(view[read:read + CHUNK_BYTES])):
            digest.update(view[read:read + n])
            read += n
        if read == size and fh.read(1):
            read += 1
        return data, read, digest.hexdigest()


def file_sha256(path: Path, chunk_bytes: int = HASH_CHUNK_BYTES, fd: int | None = None) -> str:
    """The sha256 a stamp holds for the file at `path` (or open as `fd`; chunk_bytes 0: format
    1's, over the bytes)."""
    with opened(path, fd) as fh, ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digest = hasher(pool, chunk_bytes)
        while piece := fh.read(CHUNK_BYTES):
            digest.update(memoryview(piece))
        return digest.hexdigest()


_DTYPES_BY_NAME = {name: dtype for dtype, name in SAFETENSORS_DTYPES.items()}


def _count(value: Any) -> bool:
    """A JSON count: an int (not a bool, a float or a string) in 0..2^63-1."""
    return type(value) is int and 0 <= value < 1 << 63


def read_tensors(path: Path, size: int, chunk_bytes: int,
                  fd: int | None = None) -> tuple[dict[str, torch.Tensor], int, str]:
    """(a safetensors file's tensors, how many bytes it held, their stamp's sha256): the header
    read and validated first, then each tensor's bytes read straight into memory of its own in
    file order, hashed as they arrive while the next are read. No buffer of the whole file, so
    no copy out of it (safetensors' own `load` copies the file twice), and a tensor kept alone
    holds only its own bytes. The header must describe the bytes exactly, as safetensors
    validates it: UTF-8 JSON, each entry a known dtype, a shape of counts and two offsets, the
    entries back to back from the end of the header to the end of the file. Anything else is a
    CheckpointError (a stamp is no signature: its hashes can be remade). A file that grew or
    shrank since its size was taken reads as another size, and so fails the size check."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a safetensors file this suite wrote: {why}")

    with opened(path, fd, 0) as fh, ThreadPoolExecutor(max_workers=HASH_THREADS) as pool:
        digest = hasher(pool, chunk_bytes)
        head = fh.read(8)
        if len(head) < 8:
            raise bad("shorter than its header's length")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise bad(f"its header claims {length} bytes of {size - 8}")
        header = fh.read(length)
        digest.update(head)
        digest.update(header)
        read = 8 + len(header)
        tensors = {}
        for name, dtype, shape, nbytes in _entries(header, size - read, bad):
            raw = torch.empty(nbytes, dtype=torch.uint8)  # not zero-filled: every byte is read into it
            view = memoryview(raw.numpy())
            got = 0
            while got < nbytes and (n := fh.readinto(view[got:got + CHUNK_BYTES])):
                digest.update(view[got:got + n])
                got += n
            read += got
            if got < nbytes:
                break
            tensors[name] = raw.view(dtype).reshape(shape)
        if read == size and fh.read(1):
            read += 1
        return tensors, read, digest.hexdigest()


def tensor_names(path: Path, fd: int | None = None) -> set[str]:
    """The tensor names a safetensors file's header lists (its size verified by the caller)."""
    def bad(why: str) -> CheckpointError:
        return CheckpointError(f"{path} is not a safetensors file this suite wrote: {why}")

    with opened(path, fd) as fh:
        size = os.fstat(fh.fileno()).st_size
        length = int.from_bytes(fh.read(8), "little")
        if length > size - 8:
            raise bad(f"its header claims {length} bytes of {size - 8}")
        return {name for name, *_ in _entries(fh.read(length), size - 8 - length, bad)}


def _entries(header: bytes, body_bytes: int, bad: Callable[[str], CheckpointError]) -> list[tuple]:
    """(name, dtype, shape, bytes) of each tensor a safetensors header describes, in file order,
    the body being body_bytes long."""
    try:
        parsed = json.loads(header.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as exc:
        raise bad(f"its header is not UTF-8 JSON ({type(exc).__name__})") from None
    if not isinstance(parsed, dict):
        raise bad("its header is not a JSON object")
    entries = []
    for name, entry in parsed.items():
        if name == "__metadata__":
            continue
        if not (isinstance(entry, dict) and entry.get("dtype") in _DTYPES_BY_NAME
                and isinstance(entry.get("shape"), list) and all(map(_count, entry["shape"]))
                and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
                and all(map(_count, entry["data_offsets"]))):
            raise bad(f"entry {name!r} lacks a known dtype, a shape of counts or its two offsets")
        dtype, (start, stop) = _DTYPES_BY_NAME[entry["dtype"]], entry["data_offsets"]
        if stop - start != math.prod(entry["shape"]) * dtype.itemsize:
            raise bad(f"entry {name!r} ({entry['dtype']} {entry['shape']}) does not fit its offsets {start}..{stop}")
        entries.append((start, stop, name, dtype, entry["shape"]))
    entries.sort()
    reached = 0
    for start, stop, name, _, _ in entries:
        if start != reached:
            raise bad(f"entry {name!r} starts at {start}, not where the one before it ends ({reached})")
        reached = stop
    if reached != body_bytes:
        raise bad(f"its entries end at byte {reached} of the {body_bytes} after its header")
    return [(name, dtype, shape, stop - start) for start, stop, name, dtype, shape in entries]
