"""The process settings: the GPU memory cap that emulates a smaller card (--gpu-memory)."""

from __future__ import annotations

import os

import pytest
import torch

from suite.errors import UsageError
from suite.harness.gate import Preset
from suite.harness.runner import RunOptions, Runner
from suite.settings import configure, gpu_memory_cap, resolve_gpu_memory


@pytest.fixture(autouse=True)
def _settings_restored(monkeypatch):
    # configure writes its decisions back to the environment: each test's go with it
    for name in ("SUITE_PROFILE", "SUITE_GPU_MEMORY"):
        monkeypatch.delenv(name, raising=False)


def test_the_option_wins_over_the_environment_and_none_means_the_whole_card(monkeypatch):
    monkeypatch.setenv("SUITE_GPU_MEMORY", "24")
    assert resolve_gpu_memory(None) == 24.0
    assert resolve_gpu_memory("16") == 16.0
    for whole in ("none", "0", "", " NONE "):
        assert resolve_gpu_memory(whole) is None


@pytest.mark.parametrize("bad", ["abc", "-4", "nan", "inf"])
def test_a_cap_that_is_no_size_is_a_usage_error_naming_the_fix(bad):
    with pytest.raises(UsageError, match=r"--gpu-memory must be a number of GiB above 0 \(16 for the RTX card\)"):
        resolve_gpu_memory(bad)


def test_on_the_cpu_the_cap_is_written_back_for_workers_and_caps_nothing():
    settings = configure("cpu", None, "16")
    assert gpu_memory_cap(settings.device) is None
    assert os.environ["SUITE_GPU_MEMORY"] == "16"


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_the_cap_holds_allocations_and_sizes_which_presets_run():
    """`suite run --gpu-memory 16` on an 80 GB card: an allocation past 16 GiB fails as on the RTX
    card, and a default preset that needs more is skipped, naming the cap."""
    device = torch.device("cuda")
    try:
        settings = configure("cuda", None, "2")
        assert gpu_memory_cap(settings.device) == 2 << 30
        with pytest.raises(torch.OutOfMemoryError):
            torch.empty(3 << 30, dtype=torch.uint8, device=device)
        runner = Runner(RunOptions(device=device))
        assert runner._free_memory() <= 2 << 30
        big = Preset("big", {"n": 64}, where="cuda", memory_bytes=3 << 30)
        assert runner.too_large(big).endswith("free on this GPU within --gpu-memory 2 GiB")
        assert runner.too_large(Preset("small", {"n": 64}, where="cuda", memory_bytes=1 << 30)) is None
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, torch.cuda.current_device())
        torch.cuda.empty_cache()
