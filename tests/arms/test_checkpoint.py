"""suite.arms.checkpoint as a training loop calls it: what an overwrite may replace, a reader
racing a writer, siblings that are not checkpoints, a stamp whose state names a missing tensor,
and the arguments it refuses (the gate's kills and resume are in tests/gates/test_checkpoint.py)."""

from __future__ import annotations

import multiprocessing
import os
import time

import pytest
import torch

from restamp import rewrite_state
from suite.arms.checkpoint import (
    META,
    CheckpointError,
    latest_checkpoint,
    load_checkpoint,
    read_stamp,
    save_checkpoint,
)
from suite.errors import UsageError

AS_ROOT = hasattr(os, "geteuid") and os.geteuid() == 0


def test_an_overwrite_never_replaces_another_tools_directory(tmp_path):
    """A meta.json of another tool (not this suite's stamp) is no checkpoint: refused, every file kept."""
    other = tmp_path / "run"
    other.mkdir()
    files = {"meta.json": b'{"epoch": 3}', "weights.bin": b"\x00" * 64, "notes.md": b"# mine"}
    for name, data in files.items():
        (other / name).write_bytes(data)
    with pytest.raises(UsageError, match="not a checkpoint .* never replaced"):
        save_checkpoint(other, {"w": torch.ones(2)}, step=1, overwrite=True)
    assert {p.name: p.read_bytes() for p in other.iterdir()} == files
    # a checkpoint of ours with a file added beside it: not ours alone, so refused too
    ours = save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(2)}, step=1)
    (ours / "notes.md").write_text("mine")
    with pytest.raises(UsageError, match="never replaced"):
        save_checkpoint(ours, {"w": torch.zeros(2)}, step=2, overwrite=True)
    assert (ours / "notes.md").read_text() == "mine"


def test_an_overwrite_replaces_a_damaged_checkpoint_of_ours(tmp_path):
    root = save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(300)}, step=1)
    path = root / "tensors.safetensors"
    path.write_bytes(path.read_bytes()[:-8])  # cut short: no longer whole, still ours
    with pytest.raises(CheckpointError):
        read_stamp(root)
    save_checkpoint(root, {"w": torch.zeros(300)}, step=2, overwrite=True)
    assert load_checkpoint(root).step == 2


def _overwrite_for(root: str, seconds: float, ready) -> None:
    ready.set()
    end, step = time.monotonic() + seconds, 1
    while time.monotonic() < end:
        step += 1
        save_checkpoint(root, {"w": torch.full((4096,), float(step)), "step": step}, step=step, overwrite=True)


def test_a_reader_racing_overwrites_always_finds_a_whole_checkpoint(tmp_path):
    """Another process overwrites the only checkpoint again and again: every latest_checkpoint
    finds it and every load returns a whole one (its tensor and step agree)."""
    root = tmp_path / "ckpt" / "latest"
    save_checkpoint(root, {"w": torch.full((4096,), 1.0), "step": 1}, step=1)
    ctx = multiprocessing.get_context("fork")
    ready = ctx.Event()
    writer = ctx.Process(target=_overwrite_for, args=(str(root), 3.0, ready))
    writer.start()
    ready.wait(timeout=30)
    found = loads = 0
    try:
        while writer.is_alive():
            assert latest_checkpoint(root.parent, verify=True) == root
            found += 1
            state, step, _ = load_checkpoint(root)
            assert state["step"] == step and torch.all(state["w"] == float(step))
            loads += 1
    finally:
        writer.join(timeout=60)
    assert writer.exitcode == 0 and found > 20 and loads > 20


@pytest.mark.parametrize("damage", ["meta-a-directory", "unreadable", "deeply-nested"])
def test_a_sibling_that_is_no_checkpoint_is_passed_over(tmp_path, damage):
    good = save_checkpoint(tmp_path / "step-1", {"w": torch.ones(2)}, step=1)
    bad = tmp_path / "step-9"
    bad.mkdir()
    if damage == "meta-a-directory":
        (bad / META).mkdir()
    elif damage == "unreadable":
        if AS_ROOT:
            pytest.skip("root reads a directory whatever its mode")
        (bad / META).write_text("{}")
        bad.chmod(0)
    else:
        (bad / META).write_text("[" * 100_000 + "]" * 100_000)
    try:
        assert latest_checkpoint(tmp_path, verify=True) == good
        assert latest_checkpoint(tmp_path) == good
        with pytest.raises(CheckpointError):
            read_stamp(bad)
    finally:
        bad.chmod(0o755)


def test_verify_and_load_refuse_a_state_that_names_a_missing_tensor(tmp_path):
    """`suite checkpoint verify` said "whole" for a stamp whose state names a tensor the tensors
    file lacks; load_checkpoint then failed with a KeyError."""
    root = save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(2)}, step=1)
    rewrite_state(root, lambda state: state["w"].update({"__tensor__": "t7"}))
    for call in (lambda: read_stamp(root, verify=True), lambda: load_checkpoint(root)):
        with pytest.raises(CheckpointError, match="names tensor 't7', which tensors.safetensors does not hold"):
            call()


@pytest.mark.parametrize("step, words", [(1.7, "got float 1.7"), (None, "got NoneType None"), ("abc", "got str 'abc'"),
                                         (float("nan"), "got float nan"), (True, "got bool True"),
                                         (-1, "got int -1")])
def test_a_step_that_is_no_whole_number_is_refused(tmp_path, step, words):
    with pytest.raises(UsageError, match=f"step must be a whole number >= 0 \\(the train step\\), {words}"):
        save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(2)}, step=step)
    assert not (tmp_path / "ckpt").exists()


def test_targets_and_tensors_a_save_cannot_take_are_named(tmp_path):
    (tmp_path / "afile").write_text("x")
    with pytest.raises(UsageError, match="afile is a file, not a directory"):
        save_checkpoint(tmp_path / "afile", {"w": torch.ones(2)}, step=1)
    with pytest.raises(UsageError, match=r"state\['w'\] is a meta tensor"):
        save_checkpoint(tmp_path / "meta", {"w": torch.empty(2, device="meta")}, step=1)
    with pytest.raises(UsageError, match="longer than this filesystem's 255"):
        save_checkpoint(tmp_path / ("n" * 300), {"w": torch.ones(2)}, step=1)
    long = tmp_path / ("n" * 250)  # fits; its temporary's name must too
    assert load_checkpoint(save_checkpoint(long, {"w": torch.ones(2)}, step=1)).step == 1


def _save_at_once(root: str, value: float, start, results) -> None:
    start.wait()
    try:
        save_checkpoint(root, {"w": torch.full((64,), value)}, step=int(value))
        results.put("saved")
    except UsageError as exc:
        results.put(str(exc))


def test_the_loser_of_two_simultaneous_saves_is_told_to_pass_overwrite(tmp_path):
    ctx = multiprocessing.get_context("fork")
    for trial in range(10):
        root = str(tmp_path / f"ckpt{trial}")
        start, results = ctx.Barrier(2), ctx.Queue()
        workers = [ctx.Process(target=_save_at_once, args=(root, float(i + 1), start, results)) for i in range(2)]
        for w in workers:
            w.start()
        outcomes = sorted(results.get(timeout=60) for _ in workers)
        for w in workers:
            w.join(timeout=60)
        assert outcomes[-1] == "saved", outcomes
        assert outcomes[0] == "saved" or "overwrite=True" in outcomes[0], outcomes
        assert "ENOTEMPTY" not in outcomes[0] and "Errno" not in outcomes[0]


def test_a_checkpoint_saved_on_a_gpu_names_map_location_on_a_machine_without_one(tmp_path, monkeypatch):
    root = save_checkpoint(tmp_path / "ckpt", {"w": torch.ones(2)}, step=1)
    rewrite_state(root, lambda state: state["w"].update({"device": "cuda:0"}))  # as a GPU's save writes it
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(UsageError, match="saved on cuda:0, which this machine lacks; pass map_location='cpu'"):
        load_checkpoint(root)
    assert load_checkpoint(root, map_location="cpu").state["w"].device.type == "cpu"


def test_an_overwrite_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    """A `latest` link to a checkpoint had been replaced by a directory, and the link left behind
    as a temporary; the link must stay and point at the new checkpoint, saved in its target's place."""
    target = save_checkpoint(tmp_path / "runs" / "step-1", {"w": torch.ones(2)}, step=1)
    link = tmp_path / "latest"
    link.symlink_to(os.path.join("runs", "step-1"))
    assert save_checkpoint(link, {"w": torch.zeros(2)}, step=2, overwrite=True) == link
    assert link.is_symlink() and os.readlink(link) == os.path.join("runs", "step-1")
    assert load_checkpoint(target).step == 2 and torch.equal(load_checkpoint(link).state["w"], torch.zeros(2))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "runs"]
    assert [p.name for p in target.parent.iterdir()] == ["step-1"]  # no temporary beside the target either
    with pytest.raises(UsageError, match="already holds something; pass overwrite=True"):
        save_checkpoint(link, {"w": torch.ones(2)}, step=3)
    assert link.is_symlink() and load_checkpoint(link).step == 2


def test_a_tensor_safetensors_cannot_store_is_named_by_its_path_in_the_state(tmp_path):
    state = {"model": {f"w{i}": torch.ones(2) for i in range(16)}, "complex": torch.ones(2, dtype=torch.complex64)}
    with pytest.raises(UsageError, match=r"save_checkpoint: state\['complex'\] is torch.complex64, which safetensors "
                                         r"does not store"):
        save_checkpoint(tmp_path / "ckpt", state, step=1)
    assert list(tmp_path.iterdir()) == []


def test_a_symlink_that_loops_is_refused(tmp_path):
    (tmp_path / "a").symlink_to("b")
    (tmp_path / "b").symlink_to("a")
    with pytest.raises(UsageError, match="is a symlink that loops"):
        save_checkpoint(tmp_path / "a", {"w": torch.ones(2)}, step=1, overwrite=True)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "b"]
