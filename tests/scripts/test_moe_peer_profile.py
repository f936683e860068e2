"""scripts/moe_peer_profile.py: which contenders it profiles in a case, and the errors for a
preset the case is not timed at or a contender it does not time (the profile itself needs a
GPU: here the profiler is stubbed and the calls it would time are counted)."""

from __future__ import annotations

import json

import pytest
import torch

from scriptload import load_script

CPU = torch.device("cpu")


def loaded(monkeypatch):
    """The script, its profiler stubbed (the calls it would profile are kept)."""
    profile = load_script("moe_peer_profile")
    profiled = []
    monkeypatch.setattr(profile, "kernel_times", lambda call, calls: profiled.append(call) or {"k": 1.0})
    return profile, profiled


@pytest.mark.parametrize("argv, message", [
    (["--case", "block", "--preset", "nope"], "gate 'moe-bwd' has no preset 'nope'; its presets are: tiny,"),
    (["--case", "block", "--preset", "tiny"], "case block is timed at ['olmoe', 'qwen3-30b-a3b', 'mixtral',"),
    (["--case", "block", "--preset", "mixtral-4k", "--contender", "arm"],
     "['arm'] not timed in case block at mixtral-4k; its contenders: ['block grouped_mm', 'block suite', 'block liger']"),
])
def test_a_case_or_contender_not_timed_at_the_preset_is_a_usage_error(monkeypatch, capsys, argv, message):
    profile, profiled = loaded(monkeypatch)
    with pytest.raises(SystemExit) as stop:
        profile.main(argv, CPU)
    assert stop.value.code == 2 and message in capsys.readouterr().err and not profiled


def test_a_case_other_than_fwd_bwd_profiles_its_own_contenders(monkeypatch, tmp_path):
    profile, profiled = loaded(monkeypatch)
    profile.main(["--case", "combine-bwd", "--preset", "tiny", "--json", str(tmp_path / "p.json")], CPU)
    timed = json.loads((tmp_path / "p.json").read_text())
    want = [c.name for c in profile.GATE.contenders_for(next(c for c in profile.GATE.benches if c.name == "combine-bwd"),
                                                        profile.GATE.preset("tiny"))]
    assert sorted(timed) == sorted(f"combine-bwd tiny/{name}" for name in want) and len(profiled) == len(want) >= 2


def test_gaps_count_idle_device_time_once_and_name_the_kernel_each_held_back():
    profile = load_script("moe_peer_profile")
    # two overlapping kernels, a 30 us gap, one kernel, a 5 us gap, one more
    span, busy, idle, gaps = profile.gaps_of([(0, 10, "a"), (5, 20, "b"), (50, 60, "c"), (65, 70, "d")])
    assert (span, busy, idle) == (70, 35, 35)
    assert gaps == [(30, "c"), (5, "d")]


def test_timeline_runs_each_mode_of_the_case(monkeypatch, tmp_path):
    profile, profiled = loaded(monkeypatch)
    seen = []
    monkeypatch.setattr(profile, "timeline", lambda call, calls, mode, path: seen.append((mode, path)) or dict(
        span_ms=1.0, busy_ms=0.5, idle_ms=0.5, kernels=3.0, gaps=[(500.0, "k")], stalls={"cudaMalloc": 1.0}))
    profile.main(["--timeline", "--case", "bwd", "--preset", "tiny", "--contender", "arm",
                  "--json", str(tmp_path / "p.json")], CPU)
    assert [mode for mode, _ in seen] == ["graph", "eager"] and not profiled
    # named by case too: a later case's traces of the same contender keep these
    assert all(path.endswith(f"trace-bwd_tiny_arm-{mode}.json") for mode, path in seen)
    assert json.loads((tmp_path / "p.json").read_text())["bwd tiny/arm"]["eager"]["stalls"] == {"cudaMalloc": 1.0}
