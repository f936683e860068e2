"""Gate `checkpoint`: directory-atomic checkpoints (suite.arms.checkpoint), on any machine.

- Parity, bit for bit: K steps, a checkpoint, a fresh model and optimizer loaded from it, K more
  steps, against 2K steps without a stop: AdamW fused and Muon (eager), and on CUDA Muon inside a
  CapturedOptimizer, whose live hyperparameters travel in its state_dict.
- Crash injection: a forked writer SIGKILLs itself at a point of the save chosen by the writer's
  own hooks (every step between writes: a file opened or synced, the staging, the publishing
  rename or exchange; the rest spread evenly over the chunks inside every file), in a save into a
  new directory beside an old checkpoint and in an overwrite of the old one. After each kill, `latest_checkpoint` must return
  the old checkpoint or the new one, and `load_checkpoint` must verify it; the other is never half
  there. Also: a truncated file, a flipped byte, a missing meta.json, an edited stamp and a newer
  format version must each be refused by `load_checkpoint`, and passed over by `latest_checkpoint`.
- Bench (wall clock): save and load of the preset's state against torch.save + fsync (the same
  durability), torch.save alone, torch.load, safetensors' save_file / load_file, and the disk's
  own rate for the same bytes (one plain write + fsync), measured in the same run.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import tempfile
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import load_file, save_file

from gates.graph_capture import transformer_shapes as _shapes  # its medium: 403 M params
from gates.optimizer_runs import flat_params, fresh_params, set_saved_grads
from suite.arms import checkpoint as ck
from suite.arms import checkpoint_files as ck_files
from suite.arms.graph import CapturedOptimizer
from suite.arms.muon import Muon
from suite.files import atomic
from suite.harness.criteria import NotSlowerThan, SpeedupOver
from suite.harness.gate import BenchCase, Bitwise, Buffers, Contender, Gate, Outputs, Preset, Saboteur

ADAMW_LR, MUON_LR, WEIGHT_DECAY = 3e-4, 0.02, 0.01


# ---- training: K steps, a checkpoint, K more --------------------------------------------------


def make_buffers(preset: Preset, seed: int, device: torch.device) -> Buffers:
    gen = torch.Generator().manual_seed(seed)
    sets = preset.params["grad_sets"]
    buffers: Buffers = {}
    for name, shape in _shapes(preset).items():
        buffers[f"param/{name}"] = (torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
                                    if len(shape) == 2 else torch.ones(shape)).to(device)
        buffers[f"grads/{name}"] = (torch.randn((sets, *shape), generator=gen) * 1e-3).to(device)
    return buffers


def kinds(device: torch.device, preset: Preset) -> tuple[str, ...]:
    every = ("adamw-fused", "muon", "muon-captured") if device.type == "cuda" else ("adamw-fused", "muon")
    return tuple(k for k in every if k in preset.params.get("kinds", every))


def _optimizer(kind: str, params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    matrices = [p for p in params.values() if p.dim() == 2]
    vectors = [p for p in params.values() if p.dim() == 1]
    if kind == "adamw-fused":
        return torch.optim.AdamW(matrices + vectors, lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, fused=True)
    muon = Muon([{"params": matrices, "use_muon": True}, {"params": vectors, "use_muon": False, "lr": ADAMW_LR}],
                lr=MUON_LR, weight_decay=WEIGHT_DECAY, capturable=kind == "muon-captured")
    return CapturedOptimizer(muon) if kind == "muon-captured" else muon


def _steps(params: dict[str, torch.Tensor], optimizer: torch.optim.Optimizer, buffers: Buffers, start: int,
           count: int) -> None:
    for step in range(start, start + count):
        set_saved_grads(params, buffers, step)
        optimizer.step()


def _resumed(kind: str, buffers: Buffers, k: int, save: Callable, load: Callable) -> torch.Tensor:
    params = fresh_params(buffers)
    optimizer = _optimizer(kind, params)
    _steps(params, optimizer, buffers, 0, k)
    with tempfile.TemporaryDirectory() as root:
        path = Path(root) / "step"
        save(path, {"params": {n: p for n, p in params.items()}, "optimizer": optimizer.state_dict()}, k)
        state = load(path).state
    params = fresh_params(buffers)  # a fresh model and optimizer, as a restarted run builds them
    with torch.no_grad():
        for name, p in params.items():
            p.copy_(state["params"][name])
    optimizer = _optimizer(kind, params)
    optimizer.load_state_dict(state["optimizer"])
    _steps(params, optimizer, buffers, k, k)
    return flat_params(params)


# ---- crash injection -----------------------------------------------------------------------------


def _points(write: Callable[[Callable[[str], None]], None]) -> list[str]:
    """Every point a write passes, from a dry run."""
    seen: list[str] = []
    write(seen.append)
    return seen


def kill_points(points: list[str], kills: int) -> list[int]:
    """`kills` indices into `points`: every step between writes (a file opened, synced, the
    directory staged, fsynced, renamed) first, the rest spread evenly over the points inside
    files, so a short window such as the one between a rename and the stamp is never stepped over."""
    inside = [i for i, point in enumerate(points) if point.endswith(" bytes")]
    between = [i for i in range(len(points)) if i not in set(inside)]
    if kills >= len(points):
        return list(range(len(points)))
    chosen = between[:kills]
    rest = kills - len(chosen)
    chosen += [inside[j * len(inside) // rest] for j in range(rest)] if rest > 0 else []
    return sorted(chosen)


def _killed_at(index: int, write: Callable[[Callable[[str], None]], None]) -> int:
    """Fork a writer that SIGKILLs itself at its index-th point; its wait status."""
    pid = os.fork()
    if pid == 0:  # the writer: nothing of the parent's cleanup may run here
        count = [0]

        def at(point: str) -> None:
            if count[0] == index:
                os.kill(os.getpid(), signal.SIGKILL)
            count[0] += 1

        try:
            write(at)
        finally:
            os._exit(0)  # reached only when index lies past the last point
    _, status = os.waitpid(pid, 0)
    return status


def _state(value: float, size: int) -> dict[str, Any]:
    # a loss history in the JSON, so its file spans many of the crash test's chunks
    return {"model": {"w": torch.full((size,), value), "b": torch.arange(16.0) + value},
            "optimizer": {"state": {0: {"step": torch.tensor(value)}}, "param_groups": [{"lr": 1e-3, "betas": (0.9, 0.95)}]},
            "losses": [value + i / 1000 for i in range(2000)]}


Save = Callable[..., Path]
Load = Callable[..., Any]
Latest = Callable[..., Path | None]


def crash_checks(kills: int, save: Save, load: Load, latest: Latest, chunk_bytes: int = 256) -> torch.Tensor:
    """1 per kill where the root then held the old checkpoint or the new one, whole, and nothing
    half-written was returned; 0 where not. Kills alternate between a save into a new directory
    beside the old and an overwrite of the old, each at points spread over its whole write."""
    results = []
    chunk = ck_files.CHUNK_BYTES
    ck_files.CHUNK_BYTES = chunk_bytes  # many points inside each file
    try:
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            for mode in ("beside", "overwrite"):
                target = root / ("step-2" if mode == "beside" else "step-1")

                def write(at, target=target, mode=mode):
                    save(target, _state(2.0, 20000), 2, overwrite=mode == "overwrite", at=at)

                def reset():
                    for entry in root.iterdir():
                        shutil.rmtree(entry, ignore_errors=True)
                    save(root / "step-1", _state(1.0, 20000), 1)

                reset()
                points = _points(write)
                reset()
                share = kills // 2 if mode == "beside" else kills - kills // 2
                for index in kill_points(points, share):
                    _killed_at(index, write)
                    results.append(_survived(root, load, latest))
                    reset()
    finally:
        ck_files.CHUNK_BYTES = chunk
    return torch.tensor(results, dtype=torch.int8)


def _survived(root: Path, load: Load, latest: Latest) -> int:
    found = latest(root)
    if found is None:
        return 0
    try:
        state = load(found).state
    except Exception:  # refused, or a broken file raising in the reader: either way not whole
        return 0
    value = float(state["model"]["w"][0])
    whole = value in (1.0, 2.0) and bool((state["model"]["w"] == value).all()) and bool(
        (state["model"]["b"] == torch.arange(16.0) + value).all()) and state["losses"] == _state(value, 1)["losses"]
    return int(whole)


def corruption_checks(save: Save, load: Load, latest: Latest) -> torch.Tensor:
    """1 per fault refused by load and passed over by latest (which returns the whole older one;
    a flipped byte only when it hashes, verify=True): a truncated file, a flipped byte, a missing
    meta.json, a stamp edited after the save, a newer format."""

    def truncate(d: Path):
        path = d / ck.TENSORS
        path.write_bytes(path.read_bytes()[:-7])

    def flip(d: Path):
        path = d / ck.TENSORS
        data = bytearray(path.read_bytes())
        data[len(data) // 2] ^= 0x01
        path.write_bytes(bytes(data))

    def drop_meta(d: Path):
        (d / ck.META).unlink()

    def edited(d: Path):
        meta = json.loads((d / ck.META).read_text())
        meta["step"] = 99
        (d / ck.META).write_text(json.dumps(meta))

    def newer(d: Path):
        meta = json.loads((d / ck.META).read_text())
        meta["format_version"] = ck.FORMAT_VERSION + 1
        meta["stamp_sha256"] = ck.stamp_digest(meta)  # a stamp a newer suite wrote: whole, of its own
        (d / ck.META).write_text(json.dumps(meta))

    results = []
    for fault in (truncate, flip, drop_meta, edited, newer):
        with tempfile.TemporaryDirectory() as tmp:
            root = Path(tmp)
            save(root / "step-1", _state(1.0, 1000), 1)
            save(root / "step-2", _state(2.0, 1000), 2)
            fault(root / "step-2")
            try:
                load(root / "step-2")
                refused = False
            except ck.CheckpointError:
                refused = True
            except Exception:  # the reader choked on the damage: not refused by a check
                refused = False
            # the cheap check (stamp and sizes) cannot see a flipped byte; verify=True hashes
            passed_over = latest(root, verify=True) == root / "step-1" and (
                fault is flip or latest(root) == root / "step-1")
            results.append(int(refused and passed_over))
    return torch.tensor(results, dtype=torch.int8)


# ---- reference and arm ---------------------------------------------------------------------------


def reference(buffers: Buffers, preset: Preset) -> Outputs:
    device = next(iter(buffers.values())).device
    outputs: Outputs = {}
    k = preset.params["k"]
    for kind in kinds(device, preset):
        params = fresh_params(buffers)
        optimizer = _optimizer(kind, params)
        _steps(params, optimizer, buffers, 0, 2 * k)  # no stop
        outputs[f"{kind}/params"] = flat_params(params)
    if preset.params["kills"]:  # the bench presets leave the kills to tiny
        outputs["crash/whole"] = torch.ones(preset.params["kills"], dtype=torch.int8, device=device)
    outputs["corruption/refused"] = torch.ones(5, dtype=torch.int8, device=device)
    return outputs


def _arm_with(save: Save = ck.save_checkpoint, load: Load = ck.load_checkpoint,
              latest: Latest = ck.latest_checkpoint) -> Callable[[Buffers, Preset], Outputs]:
    def arm(buffers: Buffers, preset: Preset) -> Outputs:
        device = next(iter(buffers.values())).device
        outputs: Outputs = {f"{kind}/params": _resumed(kind, buffers, preset.params["k"], save, load)
                            for kind in kinds(device, preset)}
        if preset.params["kills"]:
            outputs["crash/whole"] = crash_checks(preset.params["kills"], save, load, latest).to(device)
        outputs["corruption/refused"] = corruption_checks(save, load, latest).to(device)
        return outputs

    return arm


# ---- saboteurs: the protocol broken one way each --------------------------------------------------


def _stamp_after_publish(directory, state, step, overwrite=False, at=lambda point: None) -> Path:
    """Publishes the directory before its stamp is written into it."""
    final = Path(directory)
    with atomic.staging_directory(final.parent, final.name) as staged:
        tensors: dict[str, torch.Tensor] = {}
        structure = ck.split_state(state, "state", tensors, {})
        files = {ck.TENSORS: ck.write_tensors(staged / ck.TENSORS, tensors, at),
                 ck.STATE: ck.write_file(staged / ck.STATE, json.dumps(structure).encode(), at)}
        atomic.publish_directory(staged, final, replace=overwrite, at=at)
    meta = {"format_version": ck.FORMAT_VERSION, "step": step, "files": files}
    meta["stamp_sha256"] = ck.stamp_digest(meta)
    ck.write_file(final / ck.META, json.dumps(meta).encode(), at)
    return final


def _in_place(directory, state, step, overwrite=False, at=lambda point: None) -> Path:
    """Writes into the target directory itself: no staging, no rename."""
    final = Path(directory)
    final.mkdir(parents=True, exist_ok=True)
    for stale in final.iterdir():
        stale.unlink()
    ck.write_checkpoint_files(final, state, step, at)
    return final


def _unverified_load(directory, map_location=None):
    """Loads without checking the stamp or the hashes."""
    root = Path(directory)
    tensors = load_file(root / ck.TENSORS)
    structure = json.loads((root / ck.STATE).read_text())
    return ck.Checkpoint(state=ck.join_state(structure, tensors, map_location, {}), step=-1, meta={})


def _trusting_latest(root, verify=False):
    """The newest visible directory, stamp or not."""
    entries = [e for e in Path(root).iterdir() if e.is_dir() and not e.name.startswith(".")]
    return max(entries, key=lambda e: e.name) if entries else None


SABOTEURS = (
    Saboteur("stamp-after-publish", "the directory is renamed into place before its last file is written",
             _arm_with(save=_stamp_after_publish)),
    Saboteur("stamp-unchecked", "load_checkpoint reads the files without verifying the stamp",
             _arm_with(load=_unverified_load)),
    Saboteur("in-place", "the files are written into the target directory itself", _arm_with(save=_in_place)),
    Saboteur("latest-trusts-existence", "latest_checkpoint returns the newest directory, whole or not",
             _arm_with(latest=_trusting_latest)),
)


# ---- bench ---------------------------------------------------------------------------------------


class _Disk:
    """A directory for one contender's files, removed when the bench's process ends."""

    def __init__(self) -> None:
        self.root = Path(tempfile.mkdtemp(prefix="suite-checkpoint-bench-"))

    def __del__(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)


_BENCH_STATE: dict[int, dict[str, Any]] = {}


def _bench_state(buffers: Buffers) -> dict[str, Any]:
    """The state every contender saves: params and AdamW state after one step, built once per
    buffers (the medium preset's is 4.8 GB)."""
    if id(buffers) not in _BENCH_STATE:
        _BENCH_STATE.clear()
        params = fresh_params(buffers)
        optimizer = _optimizer("adamw-fused", params)
        _steps(params, optimizer, buffers, 0, 1)
        _BENCH_STATE[id(buffers)] = {"params": {n: p.detach() for n, p in params.items()},
                                     "optimizer": optimizer.state_dict()}
    return _BENCH_STATE[id(buffers)]


def _flat_tensors(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    ck.split_state(state, "state", tensors, {})
    return tensors


def _fsynced(path: Path) -> None:
    atomic.fsync_path(path)


def _save_build(how: str) -> Callable[[BenchCase, Buffers, Preset], Callable[[], Any]]:
    def build(case: BenchCase, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
        disk, state = _Disk(), _bench_state(buffers)
        target = disk.root / "ckpt"
        if how == "arm":
            ck.save_checkpoint(target, state, 1)
            return lambda: (ck.save_checkpoint(target, state, 1, overwrite=True), disk)
        if how == "torch.save + fsync":
            return lambda: (torch.save(state, target), _fsynced(target), disk)
        if how == "torch.save":
            return lambda: (torch.save(state, target), disk)
        if how == "safetensors save_file + fsync":
            tensors = _flat_tensors(state)
            return lambda: (save_file(tensors, target), _fsynced(target), disk)
        with tempfile.TemporaryDirectory() as tmp:  # the disk: the same bytes, one write + fsync
            save_file(_flat_tensors(state), Path(tmp) / "bytes")
            data = (Path(tmp) / "bytes").read_bytes()

        def write():
            with open(target, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
            return disk

        return write

    return build


def _load_build(how: str) -> Callable[[BenchCase, Buffers, Preset], Callable[[], Any]]:
    def build(case: BenchCase, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
        disk, state = _Disk(), _bench_state(buffers)
        target = disk.root / "ckpt"
        if how == "arm":
            ck.save_checkpoint(target, state, 1)
            return lambda: (ck.load_checkpoint(target), disk)
        if how == "torch.load":
            torch.save(state, target)
            return lambda: (torch.load(target, weights_only=True), disk)
        save_file(_flat_tensors(state), target)
        # onto the state's own device, as the others load (onto the CPU it maps the file, and a
        # page is read only when touched)
        device = str(next(iter(state["params"].values())).device)
        return lambda: (load_file(target, device=device), disk)

    return build


SAVE, LOAD = "save", "load"
CONTENDERS = (
    Contender("torch.save + fsync", "reference", _save_build("torch.save + fsync"), cases=(SAVE,),
              note="torch.save of the same state, then fsync: the same durability"),
    Contender("save_checkpoint", "arm", _save_build("arm"), cases=(SAVE,),
              note="staged, hashed, fsynced, published by an exchange over the previous one, the old one removed"),
    Contender("torch.save", "peer", _save_build("torch.save"), cases=(SAVE,), note="no fsync: the page cache"),
    Contender("safetensors save_file + fsync", "peer", _save_build("safetensors save_file + fsync"), cases=(SAVE,)),
    Contender("disk: one write + fsync", "peer", _save_build("disk"), cases=(SAVE,),
              note="the same bytes in one plain write and fsync: the disk's rate"),
    Contender("torch.load", "reference", _load_build("torch.load"), cases=(LOAD,), note="weights_only=True"),
    Contender("load_checkpoint", "arm", _load_build("arm"), cases=(LOAD,),
              note="the stamp, every sha256, then the tensors"),
    Contender("safetensors load_file", "peer", _load_build("safetensors"), cases=(LOAD,),
              note="no verification; onto the state's device"),
)


def _state_bytes(preset: Preset) -> int:
    params = sum(math.prod(s) for s in _shapes(preset).values())
    return 3 * 4 * params  # params, exp_avg, exp_avg_sq in fp32


BENCHES = (
    # at the sizes the targets are about: a tiny state's save is a few fixed fsyncs. One timing a
    # round and 5 rounds: on a disk near 1 GB/s a medium save takes seconds and seven are timed
    # a round, and the bench must fit one 10-minute call
    BenchCase(SAVE, "save the state (params + AdamW state) as a checkpoint", bytes=_state_bytes, ceiling="none",
              l2="warm", modes=("wall",), window=1, calls_per_round=1, max_rounds=5, presets=("small", "medium")),
    BenchCase(LOAD, "load and verify it", bytes=_state_bytes, ceiling="none", l2="warm", modes=("wall",), window=1,
              calls_per_round=1, max_rounds=5, presets=("small", "medium")),
)

PRESETS = (
    # 48 kills a mode: every step between writes (10 a save) and 38 points spread inside its files
    Preset("tiny", dict(layers=2, d=16, grad_sets=8, k=4, kills=96), where="any",
           note="parity and 96 kills, seconds"),
    Preset("tiny-gpu", dict(layers=2, d=16, grad_sets=8, k=4, kills=240), where="cuda", in_all=False,
           memory_bytes=1 << 30, note="tiny with the state on the GPU: Muon in a CapturedOptimizer resumes too"),
    Preset("small", dict(layers=6, d=512, grad_sets=2, k=2, kills=0, kinds=["adamw-fused"]), where="any",
           standard=False, note="25 M params + AdamW state (302 MB): the bench where the disk is slow"),
    Preset("medium", dict(layers=24, d=1024, grad_sets=2, k=2, kills=0, kinds=["adamw-fused"]), where="any",
           standard=False, memory_bytes=24 << 30,
           note="403 M params + AdamW state (4.8 GB), the graph-capture gate's medium: the save and load bench"),
)

GATE = Gate(
    name="checkpoint",
    summary="Directory-atomic checkpoints: resume bit for bit, whole after any kill, faults refused",
    arm_name="suite.arms.checkpoint",
    needs_cuda=False,
    presets=PRESETS,
    make_buffers=make_buffers,
    reference=reference,
    arm=_arm_with(),
    parity=Bitwise(),
    saboteurs=SABOTEURS,
    contenders=CONTENDERS,
    benches=BENCHES,
    criteria=(NotSlowerThan("torch.save + fsync", modes=("wall",)),
              SpeedupOver(0.8, "disk: one write + fsync", presets=("small", "medium"), cases=(SAVE,))),
)
