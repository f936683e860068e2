"""Gate `split-muon`: the arm passes `tiny` on the CPU and every saboteur fails it there, by
parity; on a GPU the captured cases join the outputs and the same holds."""

import pytest
import torch

import gatecheck
import gates
from gates import split_muon as sm
from suite.harness import parity
from suite.harness.gate import Bitwise, Tolerance
from suite.harness.results import Check

GATE = gates.get("split-muon")
CPU = torch.device("cpu")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.fixture(scope="module")
def judged_cpu():
    return gatecheck.judge_setup(GATE, "tiny", CPU)


@pytest.fixture(scope="module")
def judged_cuda():
    return gatecheck.judge_setup(GATE, "tiny", "cuda")


def test_presets_and_cases_match_the_issue():
    assert GATE.preset("tiny").where == "any" and not GATE.needs_cuda
    assert [p.name for p in GATE.default_presets(CPU)] == ["tiny"]
    assert [p.name for p in GATE.default_presets(torch.device("cuda"))] == ["d1024", "d2048"]
    assert [p.name for p in GATE.default_presets(torch.device("cuda"), all_gates=True)] == ["d1024"]
    assert all(p.params["steps"] >= 10 for p in GATE.presets)
    splits = sm._case_splits(GATE.preset("d2048"))
    assert splits == {"input-major": ((2, 6), (3, 3), 1), "qkv": ((3072, 2048), (2048, 512, 512), 0),
                      "gate-up": ((16384, 2048), (8192, 8192), 0), "experts": ((4, 2048, 2048), (1024, 1024), 0)}
    assert sm.CONFIGS == (("spectral", True), ("spectral", False), ("rms", True), ("rms", False))
    model = sm._model_shapes(GATE.preset("d1024"))
    assert model["qkv"] == [(1536, 1024)] * 24 and model["gate-up"] == [(8192, 1024)] * 24
    assert all(p.memory_bytes > 0 for p in GATE.presets if p.where == "cuda")


def test_buffers_describe_their_split():
    preset = GATE.preset("tiny")
    buffers = GATE.make_buffers(preset, 0, CPU)
    for case, (shape, sizes, dim) in sm._case_splits(preset).items():
        assert sm._split(buffers, case) == (sizes, dim)
        assert buffers[f"param/{case}"].shape == shape
        assert all(f"grad{k:02d}/{case}" in buffers for k in range(preset.params["steps"]))
    assert GATE.buffer_params(buffers) == {"steps": preset.params["steps"]}


def test_parity_modes():
    assert GATE.parity_for("qkv/rms-nesterov/step03") == Bitwise()
    assert GATE.parity_for("qkv-captured/spectral-plain/final") == Bitwise()
    assert GATE.parity_for("ns/gate-up") == Tolerance(k=2.0)


def test_arm_passes_tiny_on_the_cpu(judged_cpu):
    _, outputs = gatecheck.arm_result(GATE, judged_cpu)
    runs = {name.rsplit("/", 1)[0] for name in outputs if not name.startswith("ns/")}
    assert len(runs) == len(sm.CASES) * len(sm.CONFIGS)  # no captured run on the CPU
    assert {name for name in outputs if name.startswith("ns/")} == {f"ns/{case}" for case in sm.CASES}


@pytest.mark.parametrize("saboteur", GATE.saboteurs, ids=lambda s: s.name)
def test_every_saboteur_fails_tiny_on_the_cpu(judged_cpu, saboteur):
    assert saboteur.caught_by == Check.PARITY
    result, _ = gatecheck.sabotaged_result(GATE, judged_cpu, saboteur)
    assert "/step00" in result.first_divergence  # every sabotage shows on the first step


def test_wrong_dim_saboteur_splits_the_other_dimension_evenly():
    params = [torch.zeros(24, 16, requires_grad=True)]
    group = sm._wrong_dim(params, (16, 4, 4), 0, "spectral", True, False).param_groups[0]
    assert group["split_dim"] == 1 and group["split_sizes"] == (6, 5, 5)


def test_ns_truth_is_each_block_s_float64_direction():
    preset = GATE.preset("tiny")
    buffers = GATE.make_buffers(preset, 1, CPU)
    truth = GATE.truth(buffers, preset)
    for case in sm.CASES:
        arm = sm._direction(buffers, case, batch_ns=True)
        assert truth[f"ns/{case}"].dtype == torch.float64
        assert ((arm.double() - truth[f"ns/{case}"]).norm() / truth[f"ns/{case}"].norm()) < 0.05


def test_bench_cases_and_criteria():
    assert [case.name for case in GATE.benches] == ["split-step", "ns-batched", "split-captured"]
    roles = {case.name: {c.role: c.name for c in GATE.contenders_for(case)} for case in GATE.benches}
    assert roles == {
        "split-step": {"reference": "whole-matrix", "arm": "split-block"},
        "ns-batched": {"reference": "split-block one-by-one", "arm": "split-block"},
        "split-captured": {"reference": "split-block eager", "arm": "split-block captured"},
    }
    assert all(case.modes == ("eager",) and case.l2 == "warm" and case.gpu_busy and case.ceiling == "gemm"
               for case in GATE.benches)
    assert GATE.benches[2].cold_calls == 4  # the capture happens on the fourth call
    from suite.harness.criteria import applicable

    def claims(preset, case):  # what a bench of the case judges, its reference named "ref"
        return [c.title("ref", "gemm") for c in applicable(GATE.criteria, preset, case, "eager", "ref", {"ref"})]

    assert claims("d1024", "split-step") == claims("d2048", "split-step") == ["speedup over ref >= 0.9x"]
    assert claims("d1024", "ns-batched") == ["speedup over ref >= 1.5x"] and claims("d2048", "ns-batched") == []
    assert claims("d1024", "split-captured") == claims("d2048", "split-captured") == [
        "within 1.05x of ref's device-busy time"]


def test_ns_flops_count_every_block():
    preset = GATE.preset("d1024")
    d = 1024
    # per layer: q [d, d], k and v [d/4, d], gate and up [4d, d], wo [d, d], down [d, 4d]
    per_matrix = {(d, d): 6 * d**3, (d // 4, d): 4 * (d // 4) ** 2 * d + 2 * (d // 4) ** 3, (d, 4 * d): 18 * d**3}
    layer = 2 * per_matrix[(d, d)] + 2 * per_matrix[(d // 4, d)] + 3 * per_matrix[(d, 4 * d)]
    assert sm._ns_flops(preset) == 24 * 5 * layer
    assert sm._step_bytes(preset) == 10 * 24 * (1536 + 1024 + 8192 + 4096) * 1024


def test_bench_contenders_build_on_the_cpu():
    """The step callables the bench times, eagerly (the captured one needs CUDA)."""
    preset = GATE.preset("tiny")
    buffers = GATE.make_buffers(preset, 0, CPU)
    for contender in GATE.contenders:
        if contender.name == "split-block captured":
            continue
        case = next(case for case in GATE.benches if contender.timed_in(case))
        step = contender.build(case, buffers, preset)
        step()


@pytest.mark.cuda
@needs_cuda
def test_arm_passes_tiny_on_the_gpu_with_its_capture(judged_cuda):
    preset, buffers, expected = judged_cuda
    result, outputs = parity.judge_arm(GATE, preset, buffers, expected)
    assert result.passed, result.failures[:5]
    captured = {name for name in outputs if "-captured/" in name}
    assert len(captured) == len(sm.CAPTURED_CASES) * len(sm.CONFIGS) * (preset.params["steps"] + 2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("saboteur", GATE.saboteurs, ids=lambda s: s.name)
def test_every_saboteur_fails_tiny_on_the_gpu(judged_cuda, saboteur):
    expected = judged_cuda[2]
    _, outputs = gatecheck.sabotaged_result(GATE, judged_cuda, saboteur)
    # the captured run is sabotaged too, and caught there (the report keeps only the first failures)
    captured = [name for name in outputs if "-captured/" in name]
    assert captured and any(not parity.bitwise_check(name, outputs[name], expected.reference[name]).passed
                            for name in captured)


@pytest.mark.cuda
@needs_cuda
def test_captured_split_step_is_bitwise_its_eager_step():
    """Muon's capture contract with splits: CapturedOptimizer replays the eager split step's bits."""
    from suite.arms.graph import CapturedOptimizer
    from suite.arms.muon import Muon

    gen = torch.Generator(device="cuda").manual_seed(0)
    shape, sizes = (96, 64), (64, 16, 16)
    init = torch.randn(shape, generator=gen, device="cuda")
    grads = [torch.randn(shape, generator=gen, device="cuda") for _ in range(8)]
    results = []
    for captured in (False, True):
        p = init.clone().requires_grad_()
        p.grad = torch.zeros_like(p)
        optimizer = Muon([{"params": [p], "split_sizes": sizes}], lr=0.02, capturable=captured)
        stepper = CapturedOptimizer(optimizer) if captured else optimizer
        for grad in grads:
            p.grad.copy_(grad)
            stepper.step()
        results.append(p.detach().clone())
    assert torch.equal(results[0].view(torch.int32), results[1].view(torch.int32))


def test_captured_case_plumbing_on_the_cpu(monkeypatch):
    """The GPU's captured qkv and experts runs, with Muon(capturable=True) stepped eagerly in place
    of the graph: the arm adds the runs, the reference mirrors their eager ones, and a saboteur
    shows there."""
    monkeypatch.setattr(sm, "_on_gpu", lambda buffers: True)
    monkeypatch.setattr(sm, "CapturedOptimizer", lambda optimizer: optimizer)
    judged = gatecheck.judge_setup(GATE, "tiny", CPU)
    preset, buffers, expected = judged
    _, outputs = gatecheck.arm_result(GATE, judged)
    captured = [name for name in outputs if "-captured/" in name]
    assert len(captured) == len(sm.CAPTURED_CASES) * len(sm.CONFIGS) * (preset.params["steps"] + 2)
    sabotaged = sm._arm_with(sm._unsplit)(buffers, preset)
    assert all(not parity.bitwise_check(name, sabotaged[name], expected.reference[name]).passed
               for name in captured if name.endswith("/final"))
