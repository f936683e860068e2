"""scripts/moe_host_probe.py on the CPU: the launches stubbed, every entry point called with
caller-owned buffers of the right shapes (a wrong one raises), the experts layer under autograd
and the routing too, and the figures written."""

from __future__ import annotations

import json

import torch

from scriptload import load_script
from suite import triton_support
from suite.arms.moe import launch


def test_the_probe_times_every_entry_point_and_restores_the_launch(tmp_path, capsys):
    probe = load_script("moe_host_probe")
    planned, kept = launch.PlannedLaunch.__call__, triton_support.KeptLaunches.__call__
    out = tmp_path / "probe.json"
    assert probe.main(["--tokens", "4", "--hidden", "32", "--ffn", "48", "--experts", "3", "--calls", "3",
                       "--json", str(out)]) == 0
    assert launch.PlannedLaunch.__call__ is planned and triton_support.KeptLaunches.__call__ is kept
    result = json.loads(out.read_text())
    calls = [row["call"] for row in result["rows"]]
    assert calls[:7] == ["expert_up", "expert_down", "combine", "combine_backward", "expert_down_backward",
                         "expert_up_backward", "combine (dx)"]
    assert all(row["host_us"] > 0 for row in result["rows"])
    cuda = torch.cuda.is_available()
    # on a CPU the views' row is left out: their gradients' copies run there, not the host's cost
    layers = ["experts fwd+bwd (autograd)", "gate_up_experts fwd+bwd (a model's weights)", *([probe.VIEWS] if cuda else []),
              "experts fwd+bwd, per layer of 8 in one backward", "route (logits -> Routing)"]
    assert calls[7:7 + len(layers)] == layers
    if not cuda:
        assert result["what"].startswith("python only") and len(calls) == 7 + len(layers)
    assert "sum of the entry points" in capsys.readouterr().out
