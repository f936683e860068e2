"""Gate `rmsnorm` on the CPU: the arm passes every tiny preset and every saboteur is caught,
by the check it is meant to trip."""

import pytest
import torch

import gatecheck
import gates

GATE = gates.get("rmsnorm")
TINY = [p for p in GATE.presets if p.where == "any"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=[p.name for p in TINY])
def judged(request):
    return gatecheck.judge_setup(GATE, request.param)


def test_arm_passes(judged):
    result, outputs = gatecheck.arm_result(GATE, judged)
    assert {t.name for t in result.tensors} == {"y", "dx", "dw"}


@pytest.mark.parametrize("saboteur", GATE.saboteurs, ids=lambda s: s.name)
def test_every_saboteur_fails_the_gate(judged, saboteur):
    if not saboteur.applies(judged[0]):
        pytest.skip(f"{saboteur.name} cannot show on {judged[0].name}")
    gatecheck.sabotaged_result(GATE, judged, saboteur)


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


@pytest.mark.filterwarnings("ignore:Mismatch dtype between input and weight")  # F.rms_norm of tiny's fp32 weight
def test_every_eager_bench_contender_computes_the_references_norm_on_the_cpu():
    """What each contender's build times (the benches run on the GPU): the forward alone, or
    dx and dW, each within the gate's tolerance of the reference's. The compiled ones are timed
    on the GPU only (inductor's CPU build needs a C++ compiler CI may lack)."""
    preset = GATE.preset("tiny")
    buffers = GATE.make_buffers(preset, 0, CPU)
    reference = next(c for c in GATE.contenders if c.role == "reference")
    built = []
    for case in GATE.benches:
        want = reference.build(case, buffers, preset)()
        for contender in GATE.contenders:
            if "compile" in contender.name or contender.unavailable(CPU):
                continue
            got = contender.build(case, buffers, preset)()
            pairs = [(got, want)] if case.name == "fwd" else list(zip(got, want))
            for ours, theirs in pairs:
                assert ours.shape == theirs.shape and ours.dtype == theirs.dtype, contender.name
                torch.testing.assert_close(ours.float(), theirs.float(), rtol=2e-2, atol=2e-2, msg=contender.name)
            built.append((contender.name, case.name))
    assert {"arm", "fused", "F.rms_norm"} <= {name for name, _ in built} and len({c for _, c in built}) == 2
