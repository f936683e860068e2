"""Gate `rmsnorm` on the CPU: the arm passes every tiny preset and every saboteur is caught,
by the check it is meant to trip."""

import pytest
import torch

import gates
from suite.harness import parity

GATE = gates.get("rmsnorm")
TINY = [p for p in GATE.presets if p.where == "any"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=[p.name for p in TINY])
def judged(request):
    preset = GATE.preset(request.param)
    buffers = GATE.make_buffers(preset, 0, CPU)
    return preset, buffers, parity.expected_outputs(GATE, preset, buffers)


def test_arm_passes(judged):
    preset, buffers, expected = judged
    result, outputs = parity.judge_arm(GATE, preset, buffers, expected)
    assert result.passed, result.failures
    assert result.deterministic and result.inputs_unchanged
    assert {t.name for t in result.tensors} == {"y", "dx", "dw"}


@pytest.mark.parametrize("saboteur", GATE.saboteurs, ids=lambda s: s.name)
def test_every_saboteur_fails_the_gate(judged, saboteur):
    preset, buffers, expected = judged
    if not saboteur.applies(preset):
        pytest.skip(f"{saboteur.name} cannot show on {preset.name}")
    copies = {n: t.clone() for n, t in buffers.items()}
    result, _ = parity.judge_arm(GATE, preset, copies, expected, arm=saboteur.fn)
    assert not result.passed
    assert saboteur.caught_by in result.checks_failed(), result.failures


def test_every_saboteur_applies_to_the_default_cpu_preset():
    tiny = GATE.preset("tiny")
    assert all(s.applies(tiny) for s in GATE.saboteurs)


def test_closed_form_truth_matches_float64_autograd():
    preset = GATE.preset("tiny-gemma")
    buffers = GATE.make_buffers(preset, 3, CPU)
    truth = GATE.truth(buffers, preset)
    eps, offset = preset.params["eps"], preset.params["offset"]
    x = buffers["x"].double().requires_grad_()
    w = buffers["weight"].double().requires_grad_()
    y = x * torch.rsqrt(x.square().mean(-1, keepdim=True) + eps) * (offset + w)
    dx, dw = torch.autograd.grad(y, (x, w), buffers["dy"].double())
    for name, value in (("y", y), ("dx", dx), ("dw", dw)):
        torch.testing.assert_close(truth[name], value, rtol=1e-12, atol=0)


def test_buffers_are_reproducible_and_not_degenerate():
    preset = GATE.preset("tiny")
    a, b = GATE.make_buffers(preset, 5, CPU), GATE.make_buffers(preset, 5, CPU)
    assert all(torch.equal(a[n], b[n]) for n in a)
    rms = a["x"].float().square().mean(-1).sqrt().flatten()
    assert rms.max() / rms.min() > 100  # rows span decades, so eps matters on the small ones
    assert a["dy"].abs().max() < 1e-4 and a["dy"].abs().max() > 0


def test_bench_bytes_match_the_issue_counting():
    preset = GATE.preset("16384x4096")
    n = 16384 * 4096
    fwd, fwd_bwd = (case.bytes(preset) for case in GATE.benches)
    assert fwd == 4 * n + 2 * 4096 and fwd_bwd == 10 * n + 4 * 4096
