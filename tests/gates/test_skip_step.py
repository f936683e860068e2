"""Gate skip-step on the CPU: the arm against the float64 host loop at every scenario (Muon, AdamW
fused; eager), and each saboteur failed by parity. On a GPU the captured mode and torch's
capturable AdamW join, and host reads are counted by CUDA's sync debug mode as well."""

from __future__ import annotations

import pytest
import torch

import gates.skip_step as ss
from gatecheck import arm_result, judge_setup, sabotaged_result

GATE = ss.GATE


@pytest.fixture(scope="module")
def tiny():
    return judge_setup(GATE, "tiny")


def test_every_scenario_passes_bit_for_bit(tiny):
    result, outputs = arm_result(GATE, tiny)
    assert {name.split("/")[2] for name in outputs} == set(ss.SCENARIOS)
    # what the scenarios are for: each event skipped, the drift and the early spike not
    for kind in ("muon", "adamw-fused"):
        skipped = {s: int(outputs[f"{kind}/eager/{s}/skips"].sum()) for s in ss.SCENARIOS}
        assert skipped["drift"] == 0 and skipped["early-spike"] == 0 and skipped["threshold"] == 0
        assert all(skipped[s] == 1 for s in ("loss-spike", "grad-spike", "nan-loss", "inf-grad", "constant"))
        assert all(int(outputs[f"{kind}/eager/{s}/host_reads"]) == 0 for s in ss.SCENARIOS)


@pytest.mark.parametrize("name", [s.name for s in GATE.saboteurs])
def test_each_saboteur_is_caught(tiny, name):
    sabotaged_result(GATE, tiny, next(s for s in GATE.saboteurs if s.name == name))


def test_the_threshold_spike_lies_between_the_biased_and_the_unbiased_band():
    values = ss.scenario_values("threshold", 300, seed=7)
    history = values[:150]
    assert not ss.host_skips(history, values[150])
    assert ss.host_skips(history, values[150], correction=0)


def test_the_host_counter_sees_every_read_and_restores_torch():
    t = torch.tensor([1.5])
    with ss.counted_host_reads(torch.device("cpu")) as count:
        t.item(), t.tolist(), bool(t > 0), float(t)
    assert count[0] == 4
    assert t.item() == 1.5 and float(t) == 1.5 and count[0] == 4  # torch's own reads again, uncounted
