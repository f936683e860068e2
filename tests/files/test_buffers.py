import json

import pytest
import torch

from suite.errors import BadBuffers
from suite.files.buffers import MANIFEST, TENSORS, load_buffers, read_manifest, save_buffers


def sample():
    return {
        "x": torch.randn(4, 6).to(torch.bfloat16),
        "w": torch.randn(6),
        "t": torch.randn(6, 4).t(),  # non-contiguous: saved as its values
    }


def test_round_trip_keeps_values_dtypes_and_manifest(tmp_path):
    tensors = sample()
    save_buffers(tensors, tmp_path, gate="g", preset="tiny", seed=7, params={"eps": 1e-6})
    loaded, manifest = load_buffers(tmp_path, expect_gate="g", required=("x", "w"))
    for name, t in tensors.items():
        assert torch.equal(loaded[name], t) and loaded[name].dtype == t.dtype
    assert manifest.gate == "g" and manifest.preset == "tiny" and manifest.seed == 7
    assert manifest.params == {"eps": 1e-6}
    assert manifest.tensors["x"].shape == [4, 6] and manifest.tensors["x"].dtype == "torch.bfloat16"
    assert len(manifest.sha256[TENSORS]) == 64 and "torch" in manifest.versions
    assert not list(tmp_path.glob(".tmp-*"))


def test_training_loop_dump_without_gate(tmp_path):
    save_buffers({"x": torch.ones(2)}, tmp_path)
    loaded, manifest = load_buffers(tmp_path, expect_gate="rmsnorm")
    assert manifest.gate is None and torch.equal(loaded["x"], torch.ones(2))


def test_corrupt_file_is_refused_by_digest(tmp_path):
    save_buffers(sample(), tmp_path)
    path = tmp_path / TENSORS
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(BadBuffers, match="corrupt or was changed"):
        load_buffers(tmp_path)


def test_missing_manifest_and_missing_file(tmp_path):
    with pytest.raises(BadBuffers, match="suite record"):
        load_buffers(tmp_path)
    save_buffers(sample(), tmp_path)
    (tmp_path / TENSORS).unlink()
    with pytest.raises(BadBuffers, match="missing"):
        load_buffers(tmp_path)


def test_garbled_manifest(tmp_path):
    save_buffers(sample(), tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(BadBuffers, match="is not a buffer manifest: not valid JSON"):
        read_manifest(tmp_path)


def test_manifest_that_lies_about_shapes(tmp_path):
    save_buffers(sample(), tmp_path)
    manifest = json.loads((tmp_path / MANIFEST).read_text())
    manifest["tensors"]["x"]["shape"] = [6, 4]
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    with pytest.raises(BadBuffers, match="'x' is torch.bfloat16"):
        load_buffers(tmp_path)


def test_mismatched_gate_and_missing_tensors(tmp_path):
    save_buffers(sample(), tmp_path, gate="other")
    with pytest.raises(BadBuffers, match="recorded for gate 'other'"):
        load_buffers(tmp_path, expect_gate="rmsnorm")
    save_buffers(sample(), tmp_path, gate="rmsnorm", overwrite=True)
    with pytest.raises(BadBuffers, match=r"lacks the tensors \['dy'\]"):
        load_buffers(tmp_path, expect_gate="rmsnorm", required=("x", "dy"))


def test_empty_save_is_refused(tmp_path):
    with pytest.raises(BadBuffers):
        save_buffers({}, tmp_path)
