"""Gate checkpoint on the CPU: resume bit for bit (AdamW fused, Muon), whole after SIGKILLs spread
over a save (64 here, 240 in the gate), the four faults refused, and each saboteur caught."""

from __future__ import annotations

import dataclasses
import hashlib
import json

import pytest
import torch

import gates.checkpoint as gc
from suite.arms import checkpoint_files as ck_files
from gatecheck import arm_result, sabotaged_result
from suite.errors import UsageError
from suite.harness import parity

GATE = gc.GATE


@pytest.fixture(scope="module")
def judged():
    preset = GATE.preset("tiny")
    preset = dataclasses.replace(preset, params={**preset.params, "kills": 64})  # CI: at least 50 kills
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    return preset, buffers, parity.expected_outputs(GATE, preset, buffers)


def test_resume_is_bitwise_and_every_kill_leaves_a_whole_checkpoint(judged):
    result, outputs = arm_result(GATE, judged)
    assert outputs["crash/whole"].numel() == 64 and bool(outputs["crash/whole"].all())
    assert {"adamw-fused/params", "muon/params"} <= set(outputs)


@pytest.mark.parametrize("name", [s.name for s in GATE.saboteurs])
def test_each_saboteur_is_caught(judged, name):
    sabotaged_result(GATE, judged, next(s for s in GATE.saboteurs if s.name == name))


def test_the_kills_cover_every_stage_of_a_save(tmp_path, monkeypatch):
    points = gc._points(lambda at: gc.ck.save_checkpoint(tmp_path / "c", gc._state(1.0, 20000), 1, at=at))
    stages = {p.split(":")[0] for p in points}
    assert {gc.ck.TENSORS, gc.ck.STATE, gc.ck.META, "staging created", "staged synced", "renamed",
            "parent synced"} <= stages
    monkeypatch.setattr(ck_files, "CHUNK_BYTES", 256)  # the crash test's chunks
    crash_points = gc._points(lambda at: gc.ck.save_checkpoint(tmp_path / "d", gc._state(1.0, 20000), 1, at=at))
    inside = [p for p in crash_points if p.startswith(gc.ck.STATE) and p.endswith("bytes")]
    assert len(inside) >= 60 and len(crash_points) >= 70  # most kills land inside a file
    monkeypatch.undo()
    overwrite = gc._points(lambda at: gc.ck.save_checkpoint(tmp_path / "c", gc._state(2.0, 20000), 2,
                                                            overwrite=True, at=at))
    assert "exchanged" in overwrite or "moved aside" in overwrite


def test_kill_points_take_every_step_between_writes_then_spread_inside_files():
    points = ["staging created", "a: opened", *[f"a: {i} bytes" for i in range(100)], "a: synced", "renamed",
              "meta.json: opened", "meta.json: 5 bytes", "meta.json: synced", "parent synced"]
    chosen = gc.kill_points(points, 20)
    between = [i for i, p in enumerate(points) if not p.endswith(" bytes")]
    assert len(chosen) == 20 and set(between) <= set(chosen) and len(set(chosen)) == 20
    assert gc.kill_points(points, 500) == list(range(len(points)))


def test_the_tensors_file_is_safetensors_with_every_dtype_and_its_stamp_hashes_its_bytes(tmp_path):
    from safetensors.torch import load_file

    tensors = {"f32": torch.randn(3, 5), "bf16": torch.randn(7).bfloat16(), "bool": torch.tensor([True, False]),
               "i64": torch.arange(4), "scalar": torch.tensor(2.5), "empty": torch.zeros(0, 3),
               "u8": torch.arange(9, dtype=torch.uint8), "f8": torch.randn(6).to(torch.float8_e4m3fn)}
    entry = gc.ck.write_tensors(tmp_path / "t.safetensors", tensors, lambda point: None)
    loaded = load_file(tmp_path / "t.safetensors")
    assert loaded.keys() == tensors.keys()
    for name, t in tensors.items():
        assert loaded[name].dtype == t.dtype and loaded[name].shape == t.shape
        assert torch.equal(loaded[name].view(torch.uint8), t.view(torch.uint8)) if t.dim() else \
            torch.equal(loaded[name], t)
    assert entry == {"bytes": (tmp_path / "t.safetensors").stat().st_size,
                     "sha256": _chunked_sha256(tmp_path / "t.safetensors", ck_files.HASH_CHUNK_BYTES),
                     "chunk_bytes": ck_files.HASH_CHUNK_BYTES}
    with pytest.raises(UsageError, match="complex64"):
        gc.ck.write_tensors(tmp_path / "c", {"c": torch.zeros(2, dtype=torch.complex64)}, lambda point: None)


def test_views_strided_tied_and_every_dtype_come_back_bit_for_bit(tmp_path):
    flat = torch.randn(24)
    weight = torch.randn(4, 6)
    state = {"first": flat[:12], "second": flat[12:].view(3, 4),  # two views of one storage
             "transposed": weight.t(),  # not contiguous
             "tied": [weight, weight], "scalar": torch.tensor(3, dtype=torch.int16),
             "bits": torch.randn(5).to(torch.float8_e5m2), "mask": torch.tensor([[True], [False]])}
    gc.ck.save_checkpoint(tmp_path / "c", state, step=7)
    loaded = gc.ck.load_checkpoint(tmp_path / "c")
    assert loaded.step == 7
    for key in ("first", "second", "transposed", "scalar", "bits", "mask"):
        got, want = loaded.state[key], state[key]
        assert got.dtype == want.dtype and got.shape == want.shape
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.reshape(-1).view(torch.uint8))
    assert all(torch.equal(t, weight) for t in loaded.state["tied"])


def test_host_copies_arrive_in_order_and_the_hash_backlog_stays_bounded(tmp_path, monkeypatch):
    tensors = {f"t{i}": torch.full((i + 1, 3), float(i)) for i in range(7)}
    for ahead in (1, 2, 10):
        views = list(ck_files._host_views(tensors, ahead))
        assert [bytes(v) for v in views] == [t.numpy().tobytes() for t in tensors.values()]
    # written in 16-byte pieces, hashed in 24-byte chunks that span them, one chunk waiting at
    # most: the digest is still the file's, and reading it back (a load, a verify) agrees
    monkeypatch.setattr(ck_files, "CHUNK_BYTES", 16)
    monkeypatch.setattr(ck_files, "HASH_CHUNK_BYTES", 24)
    monkeypatch.setattr(ck_files, "HASH_BACKLOG", 1)
    path = tmp_path / "t.safetensors"
    entry = gc.ck.write_tensors(path, tensors, lambda point: None)
    assert entry["sha256"] == _chunked_sha256(path, 24) and entry["chunk_bytes"] == 24
    assert gc.ck.file_sha256(path, 24) == entry["sha256"]
    assert ck_files.read_hashed(path, path.stat().st_size, 24)[2] == entry["sha256"]
    got, size, digest = ck_files.read_tensors(path, path.stat().st_size, 24)
    assert digest == entry["sha256"] and size == path.stat().st_size
    assert list(got) == list(tensors) and all(torch.equal(got[name], t) for name, t in tensors.items())


def _chunked_sha256(path, chunk_bytes: int) -> str:
    """The stamp's digest computed here, apart from the arm's code: the sha256 of the chunks' own."""
    data = path.read_bytes()
    return hashlib.sha256(b"".join(hashlib.sha256(data[i:i + chunk_bytes]).digest()
                                   for i in range(0, len(data), chunk_bytes))).hexdigest()


def test_a_format_1_checkpoint_still_loads_and_a_changed_chunk_is_caught(tmp_path):
    state = {"w": torch.randn(64, 64), "step": 3}
    root = gc.ck.save_checkpoint(tmp_path / "c", state, step=3)
    meta = json.loads((root / gc.ck.META).read_text())
    assert meta["format_version"] == 2
    # rewritten as format 1 wrote it: one sha256 over each file's bytes, no chunk size
    old = {**meta, "format_version": 1,
           "files": {name: {"bytes": e["bytes"], "sha256": hashlib.sha256((root / name).read_bytes()).hexdigest()}
                     for name, e in meta["files"].items()}}
    old["stamp_sha256"] = gc.ck.stamp_digest(old)
    (root / gc.ck.META).write_text(json.dumps(old))
    assert torch.equal(gc.ck.load_checkpoint(root).state["w"], state["w"])
    assert gc.ck.read_stamp(root, verify=True)["format_version"] == 1
    # a byte changed in either format's tensors file: the file's digest differs (format 2: its
    # chunk's digest, and so the digest over the chunks')
    fresh = gc.ck.save_checkpoint(tmp_path / "c2", state, step=3)
    for where in (root, fresh):
        data = bytearray((where / gc.ck.TENSORS).read_bytes())
        data[-1] ^= 1
        (where / gc.ck.TENSORS).write_bytes(bytes(data))
        with pytest.raises(gc.ck.CheckpointError, match="does not match its sha256"):
            gc.ck.load_checkpoint(where)
        with pytest.raises(gc.ck.CheckpointError, match="does not match its sha256"):
            gc.ck.read_stamp(where, verify=True)


def _tensors_file(path, header: bytes, body: bytes = b""):
    path.write_bytes(len(header).to_bytes(8, "little") + header + body)
    return path


@pytest.mark.parametrize("header, body", [
    (b'{"a":{"dtype":"F32","shape":[Infinity],"data_offsets":[0,4]}}', b"\0" * 4),
    (b'{"a":{"dtype":"F32","shape":[0,1000000000000000000000000000000],"data_offsets":[0,0]}}', b""),
    (b"[" * 100000 + b"]" * 100000, b""),
    (b'{"a":{"dtype":"F32","shape":"4","data_offsets":[0,16]}}', b"\0" * 16),
    (b'{"a":{"dtype":"F32","shape":[1.0],"data_offsets":[0,4]}}', b"\0" * 4),
    (b'{"a":{"dtype":"F32","shape":[true],"data_offsets":[0,4]}}', b"\0" * 4),
    (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":"04"}}', b"\0" * 4),
    (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}',
     b"\0" * 4),  # overlapping
    (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}', b"\0" * 8),  # a gap before it
    (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}', b"\0" * 5),  # bytes after the last
    (b'{"a":{"dtype":"C64","shape":[1],"data_offsets":[0,8]}}', b"\0" * 8),
    (b'{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}', b"\0" * 4),
    (b'{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,4]}}', b"\0" * 4),
    (b'{"a":[]}', b""),
    (b'{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'.decode().encode("utf-16"), b"\0" * 4),
])
def test_the_reader_refuses_a_header_that_does_not_describe_its_bytes(header, body, tmp_path):
    path = _tensors_file(tmp_path / "t", header, body)
    with pytest.raises(gc.ck.CheckpointError, match="not a safetensors file this suite wrote"):
        ck_files.read_tensors(path, path.stat().st_size, 0)


def test_a_changed_header_is_named_by_the_stamp_first(tmp_path):
    """A byte flipped in the tensors file's header fails the header's own checks too; the load
    names what the stamp sees, a file changed after it was written."""
    gc.ck.save_checkpoint(tmp_path / "c", {"w": torch.arange(4.0)}, step=1)
    path = tmp_path / "c" / gc.ck.TENSORS
    data = bytearray(path.read_bytes())
    data[9] ^= 0xFF  # inside the JSON header
    path.write_bytes(bytes(data))
    with pytest.raises(gc.ck.CheckpointError, match="does not match its sha256"):
        gc.ck.load_checkpoint(tmp_path / "c")


def test_a_loaded_cpu_tensor_owns_its_memory_and_tied_ones_stay_tied(tmp_path):
    weight, step = torch.randn(256, 256), torch.tensor(3.0)
    gc.ck.save_checkpoint(tmp_path / "c", {"tied": [weight, weight], "step": step}, step=1)
    state = gc.ck.load_checkpoint(tmp_path / "c").state
    # a kept step counter must not hold the file's buffer (256 KB here, gigabytes in a run)
    assert state["step"].untyped_storage().nbytes() == 4 and torch.equal(state["step"], step)
    assert state["tied"][0] is state["tied"][1] and torch.equal(state["tied"][0], weight)


def test_a_slice_and_its_base_come_back_apart_with_their_values(tmp_path):
    """Two views of one storage that differ are two tensors in the file (safetensors keeps no
    aliasing): each comes back with its values, sharing no memory (docs/arms/checkpoint.md)."""
    base = torch.arange(12.0)
    gc.ck.save_checkpoint(tmp_path / "c", {"base": base, "slice": base[2:5], "t": base.view(3, 4).t()}, step=1)
    state = gc.ck.load_checkpoint(tmp_path / "c").state
    assert torch.equal(state["slice"], base[2:5]) and torch.equal(state["t"], base.view(3, 4).t())
    state["base"][3] = 100.0
    assert state["slice"].tolist() == [2.0, 3.0, 4.0]


def test_each_bench_contender_saves_or_loads_the_benched_state_on_the_cpu():
    """The bench runs at small and medium only (wall clock, on the GPU host): each contender's
    build, at the tiny preset's state, saves a file the state loads back from, or loads one
    holding every tensor of it, as timed."""
    from safetensors.torch import load_file

    from suite.arms.checkpoint import load_checkpoint

    preset = GATE.preset("tiny")
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    state = gc._bench_state(buffers)
    flat = gc._flat_tensors(state)
    assert flat and all(isinstance(t, torch.Tensor) for t in flat.values())
    for contender in GATE.contenders:
        (case,) = [case for case in GATE.benches if contender.timed_in(case)]
        call = contender.build(case, buffers, preset)
        done = call()
        disk = done[-1] if isinstance(done, tuple) else done
        target = disk.root / "ckpt"
        if case.name == gc.SAVE:
            if contender.role == "arm":
                back = load_checkpoint(target).state
                assert all(torch.equal(back["params"][n], p) for n, p in state["params"].items()), contender.name
            elif contender.name.startswith("torch.save"):
                back = torch.load(target, weights_only=True)
                assert all(torch.equal(back["params"][n], p) for n, p in state["params"].items()), contender.name
            else:  # safetensors, and the same bytes written plainly
                back = load_file(target)
                assert back.keys() == flat.keys() and all(torch.equal(back[k], flat[k]) for k in flat), contender.name
        else:
            loaded = done[0]
            if contender.role == "arm":
                loaded = loaded.state
            tensors = gc._flat_tensors(loaded) if "params" in loaded else loaded
            assert tensors.keys() == flat.keys() and all(torch.equal(tensors[k], flat[k]) for k in flat), contender.name
