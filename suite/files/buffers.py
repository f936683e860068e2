"""Saved buffers: one safetensors file plus a manifest that makes it checkable.

`save_buffers` / `load_buffers` are the public API a training loop uses to dump its real
tensors in the format gates read (`suite gate NAME --buffers DIR`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import platform
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Mapping

import torch
from pydantic import BaseModel, Field, ValidationError
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from suite.files import jsonfile
from suite.errors import BadBuffers, UsageError
from suite.files import atomic

MANIFEST = "manifest.json"
TENSORS = "buffers.safetensors"
MANIFEST_VERSION = 1


class TensorEntry(BaseModel):
    shape: list[int]
    dtype: str


class BufferManifest(BaseModel):
    manifest_version: int = MANIFEST_VERSION
    gate: str | None = None  # None for tensors a training loop dumped on its own
    preset: str | None = None
    seed: int | None = None
    params: dict[str, Any] = Field(default_factory=dict)
    tensors: dict[str, TensorEntry]
    sha256: dict[str, str]  # file name -> digest
    created_utc: str
    versions: dict[str, str]


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    found = {"python": platform.python_version(), "torch": torch.__version__}
    for package in ("triton", "suite"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def _host_copies(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The tensors as contiguous CPU tensors safetensors can write, after checking every one:
    a bad entry is refused before anything is written."""
    if not isinstance(tensors, Mapping) or not tensors:
        raise BadBuffers("save_buffers got no tensors; pass a dict of name -> tensor")
    for name, t in tensors.items():
        if not isinstance(name, str) or not name:
            raise BadBuffers(f"buffer names must be non-empty strings, not {name!r}")
        if name == "__metadata__":
            raise BadBuffers("the name '__metadata__' is reserved by safetensors; save that tensor under another name")
        if not isinstance(t, torch.Tensor):
            raise BadBuffers(
                f"buffer {name!r} is a {type(t).__name__}, not a torch.Tensor; pass numbers as params={{...}}")
        if t.is_meta:
            raise BadBuffers(f"buffer {name!r} is a meta tensor (a shape without values); pass the real tensor")
        if t.layout != torch.strided:
            raise BadBuffers(f"buffer {name!r} is a {t.layout} tensor; pass it dense (.to_dense())")
    host, storages = {}, set()
    for name, t in tensors.items():
        copy = t.detach().contiguous().cpu()
        storage = copy.untyped_storage().data_ptr()
        if storage in storages:  # one tensor (or views of it) under two names: safetensors refuses shared memory
            copy = copy.clone()
        storages.add(copy.untyped_storage().data_ptr())
        host[name] = copy
    return host


def _checked_params(params: Mapping[str, Any] | None) -> dict[str, Any]:
    """params as the manifest will hold them: JSON values, numbers finite (JSON has no NaN)."""
    checked = dict(params or {})
    for key, value in checked.items():
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise BadBuffers(
                f"params[{key!r}] = {value!r} cannot be kept in the manifest ({exc}); "
                "pass plain JSON values and finite numbers"
            ) from exc
    return checked


def check_destination(out_dir: str | os.PathLike, overwrite: bool = False,
                      how_to_overwrite: str = "--overwrite (save_buffers(..., overwrite=True))") -> None:
    """Refuse to write a recording where one already is (unless overwrite) or where anything
    else is: replacing the directory would delete it. how_to_overwrite: the caller's own switch,
    which the refusal names."""
    out = Path(out_dir)
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"{out} is a file, not a directory; choose a new directory for the recording")
    held = {p.name for p in out.iterdir()}
    if not held:
        return
    if MANIFEST not in held or held - {MANIFEST, TENSORS}:
        raise UsageError(
            f"{out} is not empty and not a buffer recording ({len(held)} entries); "
            "choose a new or empty directory, the recording replaces the whole directory"
        )
    if not overwrite:
        raise UsageError(
            f"{out} already holds a recording; pass {how_to_overwrite} to replace it, or choose another directory"
        )


def save_buffers(
    tensors: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    *,
    gate: str | None = None,
    preset: str | None = None,
    seed: int | None = None,
    params: Mapping[str, Any] | None = None,
    overwrite: bool = False,
) -> Path:
    """Write `tensors` to out_dir/buffers.safetensors with out_dir/manifest.json.

    Everything is checked before anything is written. The recording is built in a hidden
    directory beside out_dir and published by one rename (suite.files.atomic), so a reader
    or a concurrent save sees the previous recording or this one whole, never a mix, and an
    interrupted or failed save leaves nothing behind. An existing recording is replaced only
    with overwrite=True.
    """
    host = _host_copies(tensors)
    params = _checked_params(params)
    check_destination(out_dir, overwrite)
    out = Path(os.path.abspath(out_dir))  # "." and ".." named: the rename needs the real parent
    with atomic.staging_directory(out.parent, out.name) as staged:
        save_file(host, str(staged / TENSORS))
        # safetensors creates its file private; the recording's files share the umask's mode
        os.chmod(staged / TENSORS, 0o666 & ~atomic.umask())
        atomic.fsync_path(staged / TENSORS)
        manifest = BufferManifest(
            gate=gate,
            preset=preset,
            seed=seed,
            params=params,
            tensors={n: TensorEntry(shape=list(t.shape), dtype=str(t.dtype)) for n, t in host.items()},
            sha256={TENSORS: file_sha256(staged / TENSORS)},
            created_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            versions=_versions(),
        )
        atomic.write_bytes(staged / MANIFEST, manifest.model_dump_json(indent=2).encode("utf-8"))
        try:
            atomic.publish_directory(staged, out, replace=overwrite)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise UsageError(
                    f"{out_dir} was written by another save meanwhile; pass --overwrite (overwrite=True) to replace it"
                ) from exc
            raise
    return Path(out_dir)


def expect_buffer(gate: str, buffers: Mapping[str, torch.Tensor], name: str, shape: tuple[int, ...] | None = None,
                  dtypes: tuple[torch.dtype, ...] | None = None) -> torch.Tensor:
    """buffers[name], or BadBuffers naming it when its shape or dtype is not what the gate runs on
    (a tampered or hand-made recording), before any of the gate's code runs on it."""
    t = buffers[name]
    if (shape is not None and tuple(t.shape) != tuple(shape)) or (dtypes is not None and t.dtype not in dtypes):
        wanted = " or ".join(str(d).removeprefix("torch.") for d in dtypes) if dtypes else "any dtype"
        raise BadBuffers(f"{gate} buffer {name!r} must be {wanted}, shape {list(shape) if shape is not None else 'any'}; "
                         f"got {str(t.dtype).removeprefix('torch.')}, shape {list(t.shape)}; record them again with "
                         f"`suite record {gate} --out DIR`")
    return t


def read_manifest(directory: str | os.PathLike) -> BufferManifest:
    directory = Path(directory)
    path = directory / MANIFEST
    try:
        if not directory.exists():
            raise BadBuffers(f"{directory} does not exist; pass a buffer directory (`suite record GATE --preset P "
                             "--out DIR` or suite.files.buffers.save_buffers writes one)")
        if directory.is_file() and (directory.parent / MANIFEST).is_file():
            raise BadBuffers(f"{directory} is a file of a buffer recording; pass its directory, {directory.parent}")
        if not path.is_file():
            raise BadBuffers(
                f"{directory} holds no {MANIFEST}; it is not a buffer directory. "
                "Write one with `suite record GATE --preset P --out DIR` or suite.files.buffers.save_buffers."
            )
    except OSError as exc:  # a directory this user may not enter
        raise BadBuffers(f"cannot read {directory}: {exc.strerror or exc}") from None
    try:
        return BufferManifest.model_validate(jsonfile.load(path))
    except jsonfile.NotJson as exc:
        raise BadBuffers(f"{path} is not a buffer manifest: {exc}; record the buffers again") from None
    except jsonfile.Unreadable as exc:
        raise BadBuffers(f"cannot read {path}: {exc}") from None
    except ValidationError as exc:
        raise BadBuffers(f"{path} is not a valid buffer manifest ({exc.__class__.__name__}: {exc}); record the buffers again") from exc
    except RecursionError:
        raise BadBuffers(f"{path} is not a valid buffer manifest: {jsonfile.DEEP}; record the buffers again") from None


def load_buffers(
    directory: str | os.PathLike,
    device: torch.device | str = "cpu",
    *,
    expect_gate: str | None = None,
    required: tuple[str, ...] = (),
) -> tuple[dict[str, torch.Tensor], BufferManifest]:
    """Load and verify a buffer directory: digest, tensor names, shapes, dtypes, gate."""
    directory = Path(directory)
    manifest = read_manifest(directory)
    if manifest.manifest_version != MANIFEST_VERSION:
        raise BadBuffers(
            f"{directory}: manifest version {manifest.manifest_version}, this suite reads version "
            f"{MANIFEST_VERSION}; record the buffers again with this suite"
        )
    if expect_gate and manifest.gate and manifest.gate != expect_gate:
        raise BadBuffers(
            f"{directory} was recorded for gate {manifest.gate!r}, not {expect_gate!r}; "
            f"record buffers for it with `suite record {expect_gate} --out DIR`"
        )
    tensor_file = directory / TENSORS
    if not tensor_file.is_file():
        raise BadBuffers(f"{directory}: {TENSORS} is missing; record the buffers again")
    digest = file_sha256(tensor_file)
    if digest != manifest.sha256.get(TENSORS):
        raise BadBuffers(
            f"{tensor_file} is corrupt or was changed after recording: sha256 {digest[:16]}... "
            f"does not match the manifest's {str(manifest.sha256.get(TENSORS))[:16]}...; record the buffers again"
        )
    try:
        tensors = load_file(str(tensor_file), device=str(device))
    except (SafetensorError, OSError, RuntimeError) as exc:
        raise BadBuffers(f"{tensor_file} cannot be read as safetensors ({exc}); record the buffers again") from exc
    if set(tensors) != set(manifest.tensors):
        raise BadBuffers(
            f"{directory}: the file holds {sorted(tensors)} but the manifest lists {sorted(manifest.tensors)}"
        )
    for name, entry in manifest.tensors.items():
        t = tensors[name]
        if list(t.shape) != entry.shape or str(t.dtype) != entry.dtype:
            raise BadBuffers(
                f"{directory}: tensor {name!r} is {str(t.dtype)}{list(t.shape)}, "
                f"the manifest says {entry.dtype}{entry.shape}"
            )
    missing = [name for name in required if name not in tensors]
    if missing:
        raise BadBuffers(
            f"{directory} lacks the tensors {missing} that gate {expect_gate!r} needs "
            f"(it has {sorted(tensors)}); save them with save_buffers under those names"
        )
    return tensors, manifest
