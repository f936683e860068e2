"""The parity module alone, on a toy gate (y = 3x, dx = 3 dy) with hand-made arms."""

import pytest
import torch

from suite.errors import CouldNotRun
from suite.harness import parity, render
from suite.harness.results import Check
from suite.harness.gate import Bitwise, Gate, Preset, Tolerance

PRESET = Preset("toy", {"rows": 8, "cols": 16}, where="any")


def toy_buffers(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return {
        "x": torch.randn(8, 16, generator=gen).to(torch.bfloat16),
        "dy": torch.randn(8, 16, generator=gen).to(torch.bfloat16),
    }


def toy_reference(buffers, preset):
    return {"y": (buffers["x"].float() * 3).to(torch.bfloat16), "dx": (buffers["dy"].float() * 3).to(torch.bfloat16)}


def toy_truth(buffers, preset):
    return {"y": buffers["x"].double() * 3, "dx": buffers["dy"].double() * 3}


def toy_gate(arm=toy_reference, mode=Tolerance(k=2.0, floor=1e-6), nondeterministic=None):
    return Gate(
        name="toy",
        summary="y = 3x",
        arm_name="tests.toy",
        needs_cuda=False,
        presets=(PRESET,),
        make_buffers=lambda preset, seed, device: toy_buffers(seed),
        reference=toy_reference,
        arm=arm,
        truth=toy_truth,
        parity=mode,
        nondeterministic=nondeterministic,
    )


def judge(gate, buffers=None):
    buffers = buffers or toy_buffers()
    expected = parity.expected_outputs(gate, PRESET, buffers)
    return parity.judge_arm(gate, PRESET, buffers, expected, nondeterministic=gate.nondeterministic)[0]


# ---- bitwise ----


def test_bitwise_identical_passes():
    t = torch.randn(5, 7)
    check = parity.bitwise_check("t", t, t.clone())
    assert check.passed and check.differing == 0 and check.max_ulp == 0


def test_bitwise_counts_signed_zero_as_a_difference():
    check = parity.bitwise_check("t", torch.tensor([0.0, 1.0]), torch.tensor([-0.0, 1.0]))
    assert not check.passed and check.differing == 1 and check.first_index == [0] and check.max_ulp == 0


def test_bitwise_reports_first_index_and_ulp():
    ref = torch.ones(3, 4, dtype=torch.bfloat16)
    arm = ref.clone()
    arm[1, 2] = torch.nextafter(torch.tensor(1.0), torch.tensor(2.0)).to(torch.bfloat16)  # rounds to 1: no diff
    bits = arm.view(torch.int16)
    bits[2, 1] += 3  # three bf16 ULPs above 1.0
    bits[2, 3] -= 1
    check = parity.bitwise_check("t", arm, ref)
    assert check.differing == 2 and check.first_index == [2, 1] and check.max_ulp == 3


def test_bitwise_ulp_across_zero_and_nan_payloads():
    ref = torch.tensor([1e-45, float("nan")], dtype=torch.float32)
    arm = torch.tensor([-1e-45, 0.0], dtype=torch.float32)
    arm[1] = float("nan")
    arm.view(torch.int32)[1] |= 1  # another NaN payload
    check = parity.bitwise_check("t", arm, ref)
    assert check.differing == 2
    assert check.max_ulp >= 2  # -1 ulp to +1 ulp is two steps; the NaN payload differs too


def test_bitwise_flags_unwritten_nan_as_poison():
    ref = torch.zeros(4)
    arm = ref.clone()
    arm[3] = float("nan")
    check = parity.bitwise_check("t", arm, ref)
    assert not check.passed and check.problems[0].check == Check.POISON


def test_bitwise_rejects_dtype_and_shape_mismatch():
    assert "dtype" in parity.bitwise_check("t", torch.zeros(2), torch.zeros(2, dtype=torch.float64)).message
    assert "shape" in parity.bitwise_check("t", torch.zeros(2), torch.zeros(3)).message


# ---- tolerance ----


def _tol(arm, ref, truth):
    return parity.tolerance_check("t", arm, ref, truth, k=2.0, floor=1e-6)


def test_tolerance_passes_reference_quality_and_fails_worse():
    truth = torch.randn(64, 32, dtype=torch.float64)
    ref = truth.to(torch.bfloat16)
    assert _tol(ref.clone(), ref, truth).passed
    noisy = (truth * (1 + 0.05 * torch.randn_like(truth))).to(torch.bfloat16)
    check = _tol(noisy, ref, truth)
    assert not check.passed and check.arm_rel_l2 > check.limit_rel_l2


def test_tolerance_catches_an_error_confined_to_one_small_row():
    truth = torch.randn(64, 32, dtype=torch.float64)
    truth[5] *= 1e-4  # a small-magnitude row: invisible to the whole-tensor norm
    ref = truth.to(torch.bfloat16)
    arm = ref.clone()
    arm[5] *= 1.5
    check = _tol(arm, ref, truth)
    assert check.arm_rel_l2 <= check.limit_rel_l2  # the tensor-wide error hides it
    assert not check.passed and "worst-row" in check.message


def test_tolerance_requires_matching_nonfinite_positions():
    truth = torch.randn(4, 8, dtype=torch.float64)
    truth[0, 0] = float("inf")
    ref = truth.float()
    arm = ref.clone()
    arm[0, 0] = 1.0
    check = _tol(arm, ref, truth)
    assert not check.passed and check.nonfinite_match is False


def test_tolerance_flags_nan_where_truth_is_finite_as_poison():
    truth = torch.randn(4, 8, dtype=torch.float64)
    arm = truth.float()
    arm[3, 7] = float("nan")
    check = _tol(arm, truth.float(), truth)
    assert not check.passed and check.problems[0].check == Check.POISON


def test_tolerance_excuses_nonfinite_the_reference_shares_where_the_truth_is_finite():
    """The buffers overflow the working dtype: not the arm's fault, counted apart."""
    truth = torch.randn(4, 8, dtype=torch.float64)
    ref, arm = truth.float(), truth.float()
    ref[1, 2] = arm[1, 2] = float("nan")
    ref[2, 3] = arm[2, 3] = float("inf")
    check = _tol(arm, ref, truth)
    assert check.passed and check.overflowed == 2 and check.nonfinite_match


def test_tolerance_still_blames_nonfinite_the_reference_does_not_share():
    truth = torch.randn(4, 8, dtype=torch.float64)
    ref, arm = truth.float(), truth.float()
    ref[1, 2] = arm[1, 2] = float("inf")
    arm[3, 4] = float("nan")
    check = _tol(arm, ref, truth)
    assert not check.passed and check.problems[0].check == Check.POISON and check.overflowed == 1


def test_judge_says_the_buffers_overflow_when_both_paths_do():
    buffers = toy_buffers()
    buffers["x"][2] = 3e38  # y = 3x overflows bf16 and fp32, not the float64 truth
    with pytest.raises(CouldNotRun, match=r"the buffers overflow bfloat16: .*\(y: 16 elements\)"):
        judge(toy_gate(), buffers)


def test_judge_fails_an_arm_that_overflows_where_the_reference_does_not():
    def overflowing(buffers, preset):
        out = toy_reference(buffers, preset)
        out["y"][0, 0] = float("inf")
        return out

    result = judge(toy_gate(overflowing))
    assert not result.passed and any(f.check == Check.NONFINITE for f in result.failures)


def test_tolerance_rejects_constant_output():
    truth = torch.randn(4, 8, dtype=torch.float64) * 1e-9  # tiny values: a zero output is "close"
    check = parity.tolerance_check("t", torch.zeros(4, 8), truth.float(), truth, k=2.0, floor=1.0)
    assert not check.passed and "degenerate" in check.message


def test_a_constant_the_reference_gives_too_is_not_degenerate():
    """An exact constant (the gradient of probabilities renormalised over one expert is zero)
    whose float64 truth is rounding noise around it: the arm matching the reference passes; a
    constant arm beside a reference that varies still fails."""
    truth = torch.randn(4, 8, dtype=torch.float64) * 1e-17
    zeros = torch.zeros(4, 8)
    assert parity.tolerance_check("t", zeros, zeros.clone(), truth, k=2.0, floor=1e-6).passed
    varying = truth.float() + torch.randn(4, 8) * 1e-3
    check = parity.tolerance_check("t", zeros, varying, varying.double(), k=2.0, floor=1.0)
    assert not check.passed and "degenerate" in check.message


def test_tolerance_zero_truth_row_must_be_reproduced_exactly():
    truth = torch.randn(4, 8, dtype=torch.float64)
    truth[2] = 0
    arm = truth.float()
    arm[2, 0] = 1e-30
    check = _tol(arm, truth.float(), truth)
    assert not check.passed and "truth is all zero" in check.message
    assert check.arm_zero_rows == pytest.approx(1e-30) and check.ref_zero_rows == 0.0


def test_a_reference_with_noise_on_zero_rows_still_bounds_the_other_rows():
    # once, the reference's noise on an all-zero row made every limit infinite
    truth = torch.randn(64, 32, dtype=torch.float64)
    truth[3] = 0
    ref = truth.to(torch.bfloat16)
    ref[3, 0] = 1e-6  # the reference's rounding noise where the truth is zero
    arm = ref.clone()
    arm[5] *= 1.5  # a wrong row elsewhere
    check = _tol(arm, ref, truth)
    assert not check.passed and "worst-row" in check.message and check.limit_rel_max < 1
    noisy = ref.clone()
    noisy[3, 1] = 1e-6  # as much noise again on the zero row: within k = 2 of the reference's
    assert _tol(noisy, ref, truth).passed


def test_an_exactly_reproduced_zero_row_hides_no_other_row():
    # the zero row's 0/0 once turned the worst-row figure into NaN, which compared as a pass
    truth = torch.randn(64, 32, dtype=torch.float64)
    truth[3] = 0
    truth[5] *= 1e-4
    ref = truth.to(torch.bfloat16)
    arm = ref.clone()
    arm[5] *= 1.5
    check = _tol(arm, ref, truth)
    assert not check.passed and "worst-row" in check.message and check.arm_rel_max > 0.4


def _cancelling_dot_products(seed):
    """dprobs-like [T, 2] rows of dot products, one of which cancels to near 0, computed from
    bf16-rounded operands twice with independent rounding (arm and reference)."""
    gen = torch.Generator().manual_seed(seed)
    g, y = (torch.randn(4096, 2, 64, generator=gen, dtype=torch.float64) for _ in range(2))
    y[7, :, 0] -= (g[7] * y[7]).sum(-1) / g[7, :, 0] - 1e-6  # row 7's two dots cancel to ~1e-6
    truth = (g * y).sum(-1)

    def rounded():
        noise = 1 + 2.0**-9 * torch.randn(y.shape, generator=gen, dtype=torch.float64)
        return (g * y * noise).sum(-1).float()

    return truth, rounded(), rounded()


def test_row_floor_judges_a_cancelling_row_against_the_rows_scale():
    for seed in range(4):
        truth, arm, ref = _cancelling_dot_products(seed)
        plain = parity.tolerance_check("dprobs", arm, ref, truth, k=2.0, floor=1e-6)
        assert plain.arm_rel_max > 1e3 and plain.ref_rel_max > 1e3  # noise over a zero: a draw
        floored = parity.tolerance_check("dprobs", arm, ref, truth, k=2.0, floor=1e-6, row_floor=0.1)
        assert floored.arm_rel_max < 0.1 and floored.row_floor == 0.1


@pytest.mark.parametrize("row_floor", [0.1, 1.0])
def test_row_floor_still_catches_an_error_confined_to_small_rows(row_floor):
    # moe-bwd judges dprobs at 1.0: a wiped row of a twentieth of the typical norm still shows
    truth, arm, ref = _cancelling_dot_products(0)
    small = truth.norm(dim=1).argsort()[:4]  # the smallest rows, near the floor
    if row_floor == 1.0:
        norms = truth.norm(dim=1)
        small = (norms - 0.05 * norms.square().mean().sqrt()).abs().argsort()[:1]
    arm = arm.clone()
    arm[small] = 0.0
    check = parity.tolerance_check("dprobs", arm, ref, truth, k=2.0, floor=1e-6, row_floor=row_floor)
    assert check.arm_rel_l2 <= check.limit_rel_l2  # the tensor-wide error hides it
    assert not check.passed and "worst-row" in check.message


def _rounded_twice_with_a_tail(seed, cols, arm_noise):
    """[2048, cols] rows, 5% of them cancelling to between 1e-2 and 1e-6 of the typical norm,
    computed twice with independent rounding at the tensor's scale (as a bf16 sum of large
    terms rounds): the reference with bf16's unit roundoff, the arm with `arm_noise` of it.
    How much rounding a row collects varies by row and path (e ** N(0, 1/4)), so each side loses
    tail rows the other keeps."""
    gen = torch.Generator().manual_seed(seed)
    truth = torch.randn(2048, cols, generator=gen, dtype=torch.float64)
    tail = torch.randperm(2048, generator=gen)[:102]
    truth[tail] *= 10.0 ** -(2 + 4 * torch.rand(102, 1, generator=gen, dtype=torch.float64))
    scale = 2.0**-8 * truth.norm(dim=1).square().mean().sqrt() / cols**0.5

    def rounded(amount):
        per_row = (0.5 * torch.randn(2048, 1, generator=gen, dtype=torch.float64)).exp()
        noise = torch.randn(truth.shape, generator=gen, dtype=torch.float64)
        return (truth + amount * scale * per_row * noise).float()

    return truth, rounded(arm_noise), rounded(1.0)


# as moe-bwd judges them: [T, k] probability gradients at row_floor 1.0, weight gradients at 0.1
# (without a floor the worst row is itself a draw over the tail, see the row_floor tests above)
@pytest.mark.parametrize(("cols", "row_floor"), [(2, 1.0), (64, 0.1), (512, 0.1)])
def test_rows_lost_to_rounding_at_random_never_fail_an_arm_with_less_noise(cols, row_floor):
    """Which rows near zero a rounded computation loses is a draw (a real OLMoE's bf16 expert
    gradients: stock and the suite each lose ~8200 of 131072 rows, different ones each time);
    an arm with less noise than the reference passes whatever the tail."""
    drawn = 0  # rows the arm loses and the reference keeps: the draw this is about
    for seed in range(4):
        truth, arm, ref = _rounded_twice_with_a_tail(seed, cols, arm_noise=0.7)
        lost = (arm.double() - truth).norm(dim=1) >= truth.norm(dim=1)
        kept = (ref.double() - truth).norm(dim=1) < truth.norm(dim=1)
        drawn += int((lost & kept).sum())
        check = parity.tolerance_check("dw", arm, ref, truth, k=2.0, floor=1e-6, row_floor=row_floor,
                                       rounding=torch.finfo(torch.bfloat16).eps)
        assert check.passed, check.message
        assert check.overflowed == 0  # rows both lose at random are no overflow either
    assert drawn


@pytest.mark.parametrize("row_floor", [0.0, 0.1, 1.0])
def test_rows_the_reference_keeps_and_the_arm_zeroes_fail(row_floor):
    truth, arm, ref = _rounded_twice_with_a_tail(0, 64, arm_noise=1.0)
    norms = truth.norm(dim=1)
    typical = (norms - 1.5 * norms.square().mean().sqrt()).abs().argsort()[:3]
    arm[typical] = 0.0
    check = parity.tolerance_check("dw", arm, ref, truth, k=2.0, floor=1e-6, row_floor=row_floor,
                                   rounding=torch.finfo(torch.bfloat16).eps)
    assert not check.passed and "3 rows lose their whole value" in check.message


def test_rows_both_lose_above_rounding_are_an_overflow():
    """RMSNorm of x scaled by 1e30: x*x overflows, rsqrt gives 0, and both paths output zeros."""
    truth = torch.randn(64, 32, dtype=torch.float64)
    zeros = torch.zeros(64, 32)
    check = parity.tolerance_check("y", zeros, zeros.clone(), truth, k=2.0, floor=1e-6)
    assert check.overflowed == 64 * 32


# ---- poisoning and whole-arm judgement ----


def test_poisoned_allocations_fill_nan_and_restore_state():
    before = (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory)
    with parity.poisoned_allocations():
        assert torch.isnan(torch.empty(16)).all()
        assert (torch.empty(4, dtype=torch.int32) == torch.iinfo(torch.int32).max).all()
    assert (torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory) == before


def test_judge_passes_a_correct_arm():
    result = judge(toy_gate())
    assert result.passed and result.inputs_unchanged and result.deterministic


def test_judge_catches_unwritten_output_through_poison():
    def lazy(buffers, preset):
        out = toy_reference(buffers, preset)
        y = torch.empty_like(out["y"])
        y[:-1] = out["y"][:-1]
        return {"y": y, "dx": out["dx"]}

    result = judge(toy_gate(lazy))
    assert not result.passed and any(f.check == Check.POISON for f in result.failures)


def test_judge_catches_modified_inputs():
    def sloppy(buffers, preset):
        out = toy_reference(buffers, preset)
        buffers["dy"].mul_(2)
        return out

    result = judge(toy_gate(sloppy))
    assert not result.inputs_unchanged and any(f.check == Check.INPUTS for f in result.failures)


def test_judge_catches_nondeterminism_unless_declared():
    def jittery(buffers, preset):
        out = toy_reference(buffers, preset)
        noise = torch.randint(0, 2, out["y"].shape).to(torch.int16)
        return {"y": (out["y"].view(torch.int16) ^ noise).view(torch.bfloat16), "dx": out["dx"]}

    flagged = judge(toy_gate(jittery, mode=Bitwise()))
    assert flagged.deterministic is False and any(f.check == Check.DETERMINISM for f in flagged.failures)
    declared = judge(toy_gate(toy_reference, nondeterministic="atomics in the reduction"))
    assert declared.deterministic is None and declared.nondeterministic_reason == "atomics in the reduction"


def test_judge_reports_missing_outputs():
    result = judge(toy_gate(lambda b, p: {"y": toy_reference(b, p)["y"]}))
    assert not result.passed and any(f.check == Check.OUTPUTS for f in result.failures)


def test_reference_that_modifies_inputs_is_a_gate_bug():
    def bad_reference(buffers, preset):
        buffers["x"].zero_()
        return toy_reference(buffers, preset)

    gate = toy_gate()
    gate = Gate(**{**gate.__dict__, "reference": bad_reference})
    with pytest.raises(RuntimeError, match="modified the input buffers"):
        parity.expected_outputs(gate, PRESET, toy_buffers())


def test_the_second_run_after_timing_proves_determinism_and_rechecks():
    gate = toy_gate()
    buffers = toy_buffers()
    expected = parity.expected_outputs(gate, PRESET, buffers)
    verdict, outputs = parity.judge_arm(gate, PRESET, buffers, expected, second_run=False)
    assert verdict.passed and verdict.deterministic is None  # left for the second run
    parity.second_run(gate, PRESET, buffers, expected.input_digests, outputs, verdict, after_timing=True)
    assert verdict.passed and verdict.deterministic and verdict.recheck_after_timing
    assert verdict.second_run_after_timing
    buffers["x"].add_(1)  # what a timed arm writing into its input would leave behind
    verdict, _ = parity.judge_arm(gate, PRESET, toy_buffers(), expected, second_run=False)
    parity.second_run(gate, PRESET, buffers, expected.input_digests, outputs, verdict, after_timing=True)
    assert not verdict.passed and verdict.recheck_after_timing is False
    assert verdict.failures[0].check == Check.INPUTS and "timing left the input buffers ['x']" in verdict.failures[0].message
    # no second run on modified inputs, and the report says so
    assert verdict.deterministic is None and not verdict.second_run_after_timing
    lines = "\n".join(render._parity_section(verdict))
    assert "deterministic (two runs, same bits): not run (timing modified the inputs)" in lines


@pytest.mark.parametrize("after_timing", [False, True])
def test_a_nondeterministic_arm_fails_the_deferred_second_run(after_timing):
    calls = []

    def flaky(buffers, preset):  # every other call rounds y through fp16 first: other bits
        calls.append(1)
        out = toy_reference(buffers, preset)
        return {**out, "y": out["y"].half().to(torch.bfloat16) + (len(calls) % 2) * 2.0 ** -6}

    gate = toy_gate(flaky, mode=Tolerance(k=1e6, floor=1.0))
    buffers = toy_buffers()
    expected = parity.expected_outputs(gate, PRESET, buffers)
    verdict, outputs = parity.judge_arm(gate, PRESET, buffers, expected, second_run=False)
    assert verdict.passed
    parity.second_run(gate, PRESET, buffers, expected.input_digests, outputs, verdict, after_timing=after_timing)
    assert not verdict.passed and verdict.deterministic is False
    (failure,) = verdict.failures
    assert failure.check == Check.DETERMINISM and "two runs on the same inputs differ in ['y']" in failure.message
    assert ("the second after timing" in failure.message) is after_timing
    assert verdict.recheck_after_timing is (False if after_timing else None)


def test_large_tensors_are_judged_in_chunks(monkeypatch):
    monkeypatch.setattr(parity, "CHUNK_ELEMENTS", 64)
    truth = torch.randn(40, 32, dtype=torch.float64)
    ref = truth.float()
    arm = ref.clone()
    arm[39, 31] += 1.0
    check = _tol(arm, ref, truth)
    assert not check.passed
    bits = parity.bitwise_check("t", arm, ref)
    assert bits.differing == 1 and bits.first_index == [39, 31]


def test_first_divergence_follows_the_reference_order():
    steps = ["step02", "step10", "step03"]  # not sorted: the reference's order decides

    def outputs(buffers, preset, drift_from=None):
        out, x = {}, buffers["x"].float()
        for i, name in enumerate(steps):
            x = x * 1.5 + (1.0 if drift_from is not None and i >= drift_from else 0.0)
            out[name] = x.clone()
        return out

    gate = Gate(**{**toy_gate(mode=Bitwise()).__dict__, "reference": outputs, "arm": lambda b, p: outputs(b, p, 1)})
    result = judge(gate)
    assert not result.passed and result.first_divergence.startswith("parity: step10")
    assert [t.name for t in result.tensors] == steps


def test_bits_checksum_sees_one_bit_and_a_swap(monkeypatch):
    monkeypatch.setattr(parity, "CHUNK_ELEMENTS", 100)  # several chunks
    t = torch.randn(64, 32)
    base = parity.bits_checksum(t)
    flipped = t.clone()
    flipped.view(torch.int32)[3, 4] ^= 1
    swapped = t.clone()
    swapped[0, 0], swapped[0, 1] = t[0, 1], t[0, 0]
    assert parity.bits_checksum(flipped) != base and parity.bits_checksum(swapped) != base
    assert parity.bits_checksum(t.clone()) == base
    assert parity.bits_checksum(torch.zeros(3, dtype=torch.bool)) == 0
    assert parity._input_digests({"t": t}) != parity._input_digests({"t": t.reshape(32, 64)})


def test_a_gate_with_thousands_of_outputs_keeps_its_report_short():
    names = [f"step{i:04d}" for i in range(500)]

    def outputs(buffers, preset, drift_from=None):
        x = buffers["x"].float()
        return {n: x + (1.0 if drift_from is not None and i >= drift_from else 0.0) for i, n in enumerate(names)}

    gate = Gate(**{**toy_gate(mode=Bitwise()).__dict__, "reference": outputs,
                   "arm": lambda b, p: outputs(b, p, drift_from=400)})
    result = judge(gate)
    assert not result.passed and result.first_divergence.startswith("parity: step0400")
    assert result.counts() == (500, 400) and result.outputs_checked == 500
    assert len(result.tensors) == parity.KEPT_CHECKS and not any(t.passed for t in result.tensors)
    assert result.tensors[0].name == "step0400"
    assert len(result.failures) == parity.KEPT_FAILURES + 1
    assert str(result.failures[-1]) == f"parity: {100 - parity.KEPT_FAILURES} more outputs fail (first 20 listed)"

    passing = judge(Gate(**{**gate.__dict__, "arm": outputs}))
    assert passing.passed and passing.counts() == (500, 500) and passing.tensors == []
    few = judge(toy_gate(mode=Bitwise()))
    assert few.outputs_checked is None and few.counts() == (len(few.tensors), len(few.tensors))


def test_bits_checksum_is_the_position_weighted_sum_across_chunks():
    t = torch.randn(parity.CHUNK_ELEMENTS + 70_000)
    words = t.view(torch.int32).to(torch.int64)
    expected = (words * (torch.arange(words.numel()) % 65521 + 1)).sum()
    assert parity.bits_checksum(t) == expected
    assert parity.bits_checksum(t[:5000]) == expected.new_tensor(
        (words[:5000] * (torch.arange(5000) % 65521 + 1)).sum())


def test_bits_checksums_are_bits_checksum_of_each_tensor(monkeypatch):
    monkeypatch.setattr(parity, "STACKED_BYTES", 8 * 96 * 2)  # stacks of two 96-element tensors
    gen = torch.Generator().manual_seed(3)
    tensors = [torch.randn(8, 12, generator=gen) for _ in range(5)]  # one shape, three stacks
    tensors += [torch.randn(12, 8, generator=gen).to(torch.bfloat16), torch.randn(96, generator=gen).double(),
                torch.randn(7, generator=gen).half(), torch.zeros(0), torch.tensor([True, False, True]),
                torch.randn(16, 12, generator=gen)[::2], torch.randint(-9, 9, (3, 4), generator=gen)]
    tensors.append(torch.randn(parity.CHUNK_ELEMENTS + 5, generator=gen))  # longer than a chunk: alone
    assert [int(s) for s in parity.bits_checksums(tensors)] == [int(parity.bits_checksum(t)) for t in tensors]
