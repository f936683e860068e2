"""The runner's unit in its steps (start, time, finish), as `suite run` and the pytest items
take them; the CLI's end-to-end runs are in test_cli.py."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import toygate

from suite.harness.gate import Preset
from suite.harness.runner import RunOptions, Runner, Unit


def runner(**options) -> Runner:
    return Runner(RunOptions(device=torch.device("cpu"), **options))


def test_the_steps_give_the_result_run_unit_gives():
    unit = Unit(toygate.BENCH_GATE, toygate.PRESET, saboteurs=list(toygate.BENCH_GATE.saboteurs), bench=True)
    whole = runner()._run_unit(unit)
    steps = runner()
    run = steps.start(unit)
    plan, skipped = steps.bench_plan(unit)
    assert [(case.name, mode) for case, mode in plan] == [("sum", "wall")] and skipped is None
    for case, mode in plan:
        assert steps.time(run, case, mode) is run.result.bench[-1]
    result = steps.finish(run)
    assert (result.status, [b.case for b in result.bench]) == (whole.status, [b.case for b in whole.bench]) == (
        "passed", ["sum"])
    assert result.parity.deterministic and {"recheck", "bench sum wall", "parity"} <= set(result.phases)


def test_a_unit_that_fails_parity_is_not_timed_and_one_that_raises_could_not_run():
    steps = runner()
    run = steps.start(Unit(toygate.GATE, toygate.PRESET, bench=True))
    assert not run.timeable and run.result.bench_skipped.startswith("parity failed")
    assert steps.finish(run).status == "failed"

    def broken(buffers, preset):
        raise RuntimeError("launch failed")

    run = steps.start(Unit(dataclasses.replace(toygate.BENCH_GATE, arm=broken), toygate.PRESET, bench=True))
    assert run.raised[0] == "RuntimeError while running: launch failed" and not run.timeable
    result = steps.finish(run)
    assert result.status == "could_not_run" and "launch failed" in result.reason and result.traceback


def test_a_default_preset_too_large_for_the_free_memory_is_skipped_and_a_named_one_is_not():
    big = Preset("big", {"n": 32}, where="any", memory_bytes=2 << 30)
    free = 1 << 30
    assert runner().too_large(big, free) == "preset big needs about 2.0 GiB, more than the 1.0 GiB free on this GPU"
    assert runner().too_large(Preset("small", {}, where="any", memory_bytes=1 << 20), free) is None
    assert runner(presets=["big"]).too_large(big, free) is None  # named: it could not run, not a skip
    assert runner().too_large(big) is None  # the CPU has no free-memory figure


def test_a_case_whose_reference_cannot_run_here_is_skipped_and_named_not_a_failure():
    """A case with a reference or an arm of its own (moe-bwd's transformers blocks) that this
    installation lacks is left untimed, saying why; the unit's other cases and verdict stand."""
    lacking = tuple(dataclasses.replace(c, unavailable=lambda device: "transformers is not installed")
                    if c.role == "reference" else c for c in toygate.BENCH_GATE.contenders)
    gate = dataclasses.replace(toygate.BENCH_GATE, contenders=lacking)
    steps = runner()
    unit = Unit(gate, toygate.PRESET, bench=True)
    run = steps.start(unit)
    (case, mode), = steps.bench_plan(unit)[0]
    assert steps.time(run, case, mode) is None and run.raised is None
    result = steps.finish(run)
    assert result.status == "passed" and result.bench == []
    assert result.bench_skipped == "case sum not timed (reference: transformers is not installed)"


def test_a_contender_that_skips_a_preset_is_not_built_there_and_the_declaration_checks_it():
    """train-step's wide presets time three of its contenders: a model each would not fit beside
    the others. A skipped contender is not built at that preset (no row for it), and is at
    another; a gate whose case would lose its reference or arm at a preset is refused, as is
    a skip naming a preset the gate lacks."""
    built = []

    def recorded(name, contender):
        def build(case, buffers, preset):
            built.append((name, preset.name))
            return contender.build(case, buffers, preset)

        return dataclasses.replace(contender, build=build,
                                   skip_presets=("wide",) if name == "einsum" else contender.skip_presets)

    gate = dataclasses.replace(toygate.BENCH_GATE, contenders=tuple(
        recorded(c.name, c) for c in toygate.BENCH_GATE.contenders))
    for preset in gate.presets:
        steps = runner(presets=[preset.name])
        unit = Unit(gate, preset, bench=True)
        run = steps.start(unit)
        (case, mode), = steps.bench_plan(unit)[0]
        timed = steps.time(run, case, mode)
        steps.finish(run)
        assert ("einsum" in [c.name for c in timed.contenders]) == (preset.name != "wide")
    assert ("einsum", "tiny") in built and ("einsum", "wide") not in built
    arm = next(c for c in gate.contenders if c.role == "arm")
    with pytest.raises(ValueError, match="needs exactly one arm contender at preset 'wide'"):
        dataclasses.replace(gate, contenders=tuple(
            dataclasses.replace(c, skip_presets=("wide",)) if c is arm else c for c in gate.contenders))
    with pytest.raises(ValueError, match="skips presets the gate lacks"):
        dataclasses.replace(gate, contenders=(*gate.contenders[:-1], dataclasses.replace(
            gate.contenders[-1], skip_presets=("huge",))))


def test_a_case_that_raises_is_its_own_error_and_the_other_cases_keep_their_figures():
    """moe-bwd's host probe once raised for one case and the unit's every timed case was lost."""
    arm = next(c for c in toygate.BENCH_GATE.contenders if c.role == "arm")

    def build(case, buffers, preset):
        if case.name == "broken":
            raise RuntimeError("compiled peers are timed at olmoe only")
        return arm.build(case, buffers, preset)

    sum_case = toygate.BENCH_GATE.benches[0]
    gate = dataclasses.replace(
        toygate.BENCH_GATE, benches=(dataclasses.replace(sum_case, name="broken"), sum_case),
        contenders=tuple(dataclasses.replace(c, build=build) if c is arm else c
                         for c in toygate.BENCH_GATE.contenders))
    result = runner()._run_unit(Unit(gate, toygate.PRESET, bench=True))
    assert [b.case for b in result.bench] == ["sum"] and result.bench[0].contenders
    (error,) = result.bench_errors
    assert (error.case, error.mode) == ("broken", "wall") and "compiled peers" in error.message and error.traceback
    assert result.status == "could_not_run"
    assert result.reason == "bench: broken (wall): RuntimeError while running: compiled peers are timed at olmoe only"


def _stream_seen(device: torch.device):
    return torch.cuda.current_stream(device) if device.type == "cuda" else None


def _own_stream_gate(seen: list, device: torch.device):
    """toygate's bench gate with each case on a stream of its own, its arm noting the stream
    each build and each call ran on."""
    arm = next(c for c in toygate.BENCH_GATE.contenders if c.role == "arm")

    def build(case, buffers, preset):
        seen.append(("build", _stream_seen(device)))
        call = arm.build(case, buffers, preset)
        return lambda: seen.append(("call", _stream_seen(device))) or call()

    return dataclasses.replace(
        toygate.BENCH_GATE, benches=tuple(dataclasses.replace(b, own_stream=True) for b in toygate.BENCH_GATE.benches),
        contenders=tuple(dataclasses.replace(c, build=build) if c is arm else c for c in toygate.BENCH_GATE.contenders))


def test_a_case_on_a_stream_of_its_own_is_timed_as_any_other_off_cuda():
    seen = []
    result = runner()._run_unit(Unit(_own_stream_gate(seen, torch.device("cpu")), toygate.PRESET, bench=True))
    assert result.bench and all(b.contenders for b in result.bench) and not result.bench_errors
    assert {what for what, _ in seen} == {"build", "call"}


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_case_on_a_stream_of_its_own_builds_and_calls_there_and_leaves_the_default_stream_current():
    """BenchCase.own_stream: every build and call of the case, the host probe's too, on one
    stream, not the legacy default one (moe-bwd's bwd case: its backward runs where its build's
    forward ran)."""
    cuda = torch.device("cuda")
    seen = []
    gate = dataclasses.replace(_own_stream_gate(seen, cuda), host_probe=toygate.PRESET.name)
    result = Runner(RunOptions(device=cuda))._run_unit(Unit(gate, toygate.PRESET, bench=True))
    assert result.bench and not result.bench_errors
    assert all(c.host_us is not None for b in result.bench for c in b.contenders if not c.unavailable)
    streams = {stream for _, stream in seen}
    assert len(streams) == 1 and streams != {torch.cuda.default_stream(cuda)}
    assert torch.cuda.current_stream(cuda) == torch.cuda.default_stream(cuda)
