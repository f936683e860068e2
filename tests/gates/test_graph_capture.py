"""Gate `graph-capture`: its pieces and the shared training loop (gates.optimizer_runs) on the CPU, the
whole gate and its saboteurs on the GPU."""


import pytest
import torch
from torch.optim import lr_scheduler
from typer.testing import CliRunner

import gatecheck
import gates
from cli import app
from gates import graph_capture as gc
from gates import optimizer_runs
from suite.arms.graph import CapturedOptimizer
from suite.errors import ExitCode
from suite.harness import parity
from suite.harness.runner import RunOptions, Runner

GATE = gates.get("graph-capture")
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def test_presets_match_the_issue_shapes():
    medium = GATE.preset("medium")
    shapes = gc.transformer_shapes(medium)
    assert sum(len(s) == 2 for s in shapes.values()) == 168 and len(shapes) == 216
    assert medium.params["params"] == 24 * 16 * 1024 * 1024 + 48 * 1024
    # K >= 10 saved gradient sets: warm-up, capture, replays, a resume at K/2
    assert all(p.params["steps"] >= 12 for p in GATE.presets)
    assert [p.name for p in GATE.default_presets(torch.device("cuda"))] == ["dispatch-bound", "medium"]
    # every scenario where the saboteurs run and where the tensors are many; the larger presets
    # judge those whose bits depend on the shapes
    assert GATE.preset("tiny").params["scenarios"] == GATE.preset("dispatch-bound").params["scenarios"] == gc.ALL
    assert len(gc.ALL) == 13
    assert GATE.preset("medium").params["scenarios"] == [
        "muon/resume", "muon/onecycle", "adamw/resume", "adamw/onecycle-lr", "adamw-fused/resume",
        "adamw-fused/onecycle-lr"]


def test_buffers_hold_initial_params_and_k_gradient_sets():
    preset = GATE.preset("tiny")
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    names = optimizer_runs.param_names(buffers)
    assert len(names) == 2 * 9
    assert all(f"grad{k:02d}/{n}" in buffers for k in range(preset.params["steps"]) for n in names)
    assert GATE.buffer_params(buffers) == {"steps": 20, "params": preset.params["params"]}
    assert not torch.equal(buffers["grad00/layers.0.wq"], buffers["grad01/layers.0.wq"])


def test_schedule_swings_at_least_eightfold():
    factor = optimizer_runs.lambda_schedule(20)
    values = [factor(k) for k in range(20)]
    assert max(values) / min(values) >= 8 - 1e-9 and values[0] == pytest.approx(0.125)


def test_scenarios_per_optimizer():
    assert optimizer_runs.SCENARIOS["muon"] == ("constant", "schedule", "wd-change", "resume", "onecycle")
    # torch AdamW reads weight decay and betas as host numbers: neither can change under capture
    for kind in ("adamw", "adamw-fused"):
        assert optimizer_runs.SCENARIOS[kind] == ("constant", "schedule", "resume", "onecycle-lr")


def test_schedulers_attach_to_the_stepper():
    params = {"w": torch.zeros(4, 4, requires_grad=True), "g": torch.zeros(4, requires_grad=True)}
    captured = CapturedOptimizer(optimizer_runs.make_optimizer("muon", params, capturable=True))
    assert optimizer_runs.make_scheduler("constant", captured, 20) is None
    schedule = optimizer_runs.make_scheduler("schedule", captured, 20)
    assert isinstance(schedule, lr_scheduler.LambdaLR) and schedule.optimizer is captured
    onecycle = optimizer_runs.make_scheduler("onecycle", captured, 20)
    assert isinstance(onecycle, lr_scheduler.OneCycleLR) and onecycle.optimizer is captured
    assert onecycle.cycle_momentum and onecycle.use_beta1  # Muon's defaults hold betas
    assert not optimizer_runs.make_scheduler("onecycle-lr", captured, 20).cycle_momentum


@pytest.mark.parametrize("scenario", optimizer_runs.SCENARIOS["muon"])
def test_muon_scenarios_capturable_eager_are_bitwise_plain_on_cpu(scenario):
    """The training loop with Muon(capturable=True) stepped eagerly against Muon(capturable=False):
    the contract the GPU gate extends to the replayed graph. Smaller than `tiny`: bf16 matmuls are slow
    on the CPU."""
    preset = gc._preset("cpu", layers=1, d=32, steps=8, scenarios=gc.ALL)
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    steps = preset.params["steps"]
    plain = optimizer_runs.train("muon", scenario, buffers, steps)
    capturable = optimizer_runs.train("muon", scenario, buffers, steps, wrap=lambda optimizer, params: optimizer)
    assert plain.keys() == capturable.keys() and len(plain) == (steps + 1) * len(optimizer_runs.param_names(buffers))
    checks = [parity.bitwise_check(name, capturable[name], plain[name]) for name in plain]
    failures = [check.message for check in checks if not check.passed]
    assert not failures, failures[:3]


def test_cpu_run_names_the_cuda_need():
    runner = CliRunner()
    named = runner.invoke(app, ["gate", "graph-capture", "--device", "cpu", "--reports", "/tmp/suite-test-reports"])
    assert named.exit_code == ExitCode.COULD_NOT_RUN and "needs CUDA" in named.output


def test_run_on_cpu_lists_it_as_skipped():
    # a run of every gate, planned: the other gates' CPU runs are their own tests' (minutes)
    plan = Runner(RunOptions(device=torch.device("cpu"), explicit=False))
    units, skipped, refused = plan.plan([gates.get(name) for name in gates.names()])
    assert [s.gate for s in skipped] == ["graph-capture"] and not refused
    assert "graph-capture" not in {u.gate.name for u in units}


@pytest.fixture(scope="module")
def judged_tiny():
    return gatecheck.judge_setup(GATE, "tiny", "cuda")


@pytest.mark.cuda
@needs_cuda
def test_captured_step_is_bitwise_eager_in_every_scenario(judged_tiny):
    _, outputs = gatecheck.arm_result(GATE, judged_tiny)
    prefixes = {name.split("/")[0] for name in outputs}
    assert prefixes == {"muon-constant", "muon-schedule", "muon-wd-change", "muon-resume", "muon-onecycle",
                        "adamw-constant", "adamw-schedule", "adamw-resume", "adamw-onecycle-lr",
                        "adamw-fused-constant", "adamw-fused-schedule", "adamw-fused-resume",
                        "adamw-fused-onecycle-lr"}


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("saboteur", GATE.saboteurs, ids=lambda s: s.name)
def test_every_saboteur_fails_the_gate_with_its_first_divergence(judged_tiny, saboteur):
    result, _ = gatecheck.sabotaged_result(GATE, judged_tiny, saboteur)
    assert "/step" in result.first_divergence  # names the step and tensor where it began
