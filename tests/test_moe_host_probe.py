"""scripts/moe_host_probe.py on the CPU: the launches stubbed, every entry point called with
caller-owned buffers of the right shapes (a wrong one raises), and the figures written."""

from __future__ import annotations

import json

import torch

from scriptload import load_script
from suite.arms import moe_kernels


def test_the_probe_times_every_entry_point_and_restores_the_launch(tmp_path, capsys):
    probe = load_script("moe_host_probe")
    launch = moe_kernels.PlannedLaunch.__call__
    out = tmp_path / "probe.json"
    assert probe.main(["--tokens", "4", "--hidden", "32", "--ffn", "48", "--experts", "3", "--calls", "3",
                       "--json", str(out)]) == 0
    assert moe_kernels.PlannedLaunch.__call__ is launch
    result = json.loads(out.read_text())
    calls = [row["call"] for row in result["rows"]]
    assert calls[:7] == ["expert_up", "expert_down", "combine", "combine_backward", "expert_down_backward",
                         "expert_up_backward", "combine (dx)"]
    assert all(row["host_us"] > 0 for row in result["rows"])
    if not torch.cuda.is_available():
        assert result["what"].startswith("python only")
    assert "sum of the entry points" in capsys.readouterr().out
