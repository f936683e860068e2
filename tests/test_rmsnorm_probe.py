"""scripts/rmsnorm_launch_probe.py on the CPU: its pure helpers, its arguments, and one run of
every section at tiny sizes with the CUDA calls stood in for (the kernels run under Triton's
interpreter), so a typo cannot wait for the GPU machine to show."""

from __future__ import annotations

import contextlib
import json
import time
from types import SimpleNamespace

import pytest
import torch

from scriptload import load_script
from suite.harness.timers import CudaTimer


@pytest.fixture(scope="module")
def probe():
    return load_script("rmsnorm_launch_probe")


def test_json_goes_to_out_unless_given(probe, monkeypatch, tmp_path):
    monkeypatch.setenv("OUT", str(tmp_path))
    assert probe.parse_args([]).json == str(tmp_path / "rmsnorm_probe.json")
    assert probe.parse_args(["--json", "x.json"]).json == "x.json"
    monkeypatch.delenv("OUT")
    assert probe.parse_args([]).json is None


def test_gb_per_s_counts_4_and_10_bytes_per_element(probe):
    assert probe.gb_per_s("fwd", 1000, 1000, 1.0) == pytest.approx(4.0)
    assert probe.gb_per_s("fwd+bwd", 1000, 1000, 2.0) == pytest.approx(5.0)


def test_without_cuda_it_says_so(probe, monkeypatch, capsys):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe.main([]) == 3
    assert "needs a CUDA GPU" in capsys.readouterr().err


class _Event:
    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = time.perf_counter()

    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3


class _CpuTimer(CudaTimer):
    """The harness's CUDA timer with the CPU standing in: no device to enter, a CPU flush
    buffer, and the call itself for its captured replay."""

    def _flush_buffer(self):
        return torch.empty(1 << 14, dtype=torch.int8)

    def capture(self, fn):
        return fn


def test_every_section_runs(probe, monkeypatch, tmp_path, capsys):
    if torch.cuda.is_available():
        pytest.skip("the real thing runs on a GPU")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    props = SimpleNamespace(name="stand-in", multi_processor_count=1, L2_cache_size=1 << 14)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda *a: props)
    monkeypatch.setattr(probe, "DEVICE", "cpu")
    monkeypatch.setattr(probe, "timer", lambda: _CpuTimer("cuda"))
    monkeypatch.setattr(probe, "HOST_SHAPE", (4, 64))
    monkeypatch.setattr(probe, "SHAPES", ((16, 64), (8, 96)))
    out = tmp_path / "probe.json"
    args = ["--skip-compile", "--host-calls", "1", "--host-batches", "1", "--window", "2",
            "--windows", "1", "--replays", "1", "--json", str(out)]
    assert probe.main(args) == 0
    result = json.loads(out.read_text())
    assert not [name for name, value in result.items() if isinstance(value, dict) and "error" in value]
    assert all(value is True for value in result["checks"].values())
    assert set(result["host_us_at_8x4096"]) >= {"arm", "arm kernel[grid]", "F.rms_norm"}
    assert "16x64 fwd+bwd arm two-stage dW" in result["graph_device"]
    assert "8x96 fwd F.rms_norm" in result["eager_back_to_back"]
    printed = capsys.readouterr().out
    assert "arm <= F" in printed and "FAILED" not in printed
