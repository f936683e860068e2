"""The CLI end to end on the CPU: commands, report directories and every exit code."""

import dataclasses
import json

import pytest
import torch
from typer.testing import CliRunner

import gates
import toygate
from cli import app
from suite.errors import ExitCode
from suite.harness import runner as runner_module
from suite.harness.results import GateResult

cli = CliRunner()


def invoke(*args):
    return cli.invoke(app, [str(a) for a in args], catch_exceptions=False)


def report_dirs(root):
    return sorted(d for d in root.iterdir() if not d.name.startswith("."))


@pytest.fixture
def reports(tmp_path):
    return tmp_path / "reports"


@pytest.fixture
def toy_gates(monkeypatch):
    """Register the toy gates next to the real ones."""
    real_get = gates.get
    toys = {"toy-wrong": toygate.GATE, "toy-cuda": toygate.CUDA_GATE, "toy-bench": toygate.BENCH_GATE}
    monkeypatch.setattr(gates, "GATE_MODULES", {**gates.GATE_MODULES, **{n: "toygate" for n in toys}})
    monkeypatch.setattr(gates, "get", lambda name: toys[name] if name in toys else real_get(name))


def test_list_shows_gates_presets_and_peers():
    result = invoke("list", "--device", "cpu")
    assert result.exit_code == 0
    assert "rmsnorm" in result.output and "16384x4096" in result.output and "F.rms_norm" in result.output


def test_gate_rmsnorm_on_cpu_passes_and_writes_a_whole_report(reports):
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--reports", reports)
    assert result.exit_code == ExitCode.OK, result.output
    (run_dir,) = report_dirs(reports)
    assert sorted(p.name for p in run_dir.iterdir()) == ["benchmark.json", "junit.xml", "report.json", "report.md"]
    report = json.loads((run_dir / "report.json").read_text())
    (gate_result,) = report["results"]
    assert gate_result["status"] == "passed" and gate_result["preset"] == "tiny"
    assert len(gate_result["saboteurs"]) == 6 and all(s["caught"] for s in gate_result["saboteurs"])
    assert report["fingerprint"]["device_slug"] == "cpu"


def test_bench_on_cpu_is_skipped_not_failed(reports):
    result = invoke("bench", "rmsnorm", "--device", "cpu", "--reports", reports)
    assert result.exit_code == ExitCode.OK
    report = json.loads((report_dirs(reports)[0] / "report.json").read_text())
    assert report["results"][0]["bench_skipped"] == "timing needs CUDA"
    assert "skipped: timing needs" in result.output


def test_unknown_gate_and_preset_are_usage_errors(reports):
    result = invoke("gate", "rmsnrom", "--reports", reports)
    assert result.exit_code == ExitCode.USAGE and "Did you mean 'rmsnorm'" in result.output
    result = invoke("gate", "rmsnorm", "--preset", "huge", "--device", "cpu", "--reports", reports)
    assert result.exit_code == ExitCode.USAGE and "tiny" in result.output


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-GPU refusal")
def test_cuda_without_a_gpu_could_not_run(reports):
    result = invoke("gate", "rmsnorm", "--device", "cuda", "--reports", reports)
    assert result.exit_code == ExitCode.COULD_NOT_RUN and "no usable CUDA device" in result.output


def test_gpu_preset_on_cpu_could_not_run(reports):
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--preset", "16384x4096", "--reports", reports)
    assert result.exit_code == ExitCode.COULD_NOT_RUN and "needs CUDA" in result.output


def test_failing_arm_exits_1(reports, toy_gates):
    result = invoke("gate", "toy-wrong", "--device", "cpu", "--reports", reports)
    assert result.exit_code == ExitCode.FAILED and "relative error" in result.output


def test_cuda_gate_named_on_cpu_could_not_run_but_run_lists_it(reports, toy_gates):
    named = invoke("gate", "toy-cuda", "--device", "cpu", "--reports", reports)
    assert named.exit_code == ExitCode.COULD_NOT_RUN and "needs CUDA" in named.output
    monkey_gates = [gates.get("rmsnorm"), toygate.CUDA_GATE]
    report = runner_module.Runner(runner_module.RunOptions(device=torch.device("cpu"), explicit=False)).run(
        monkey_gates, "run"
    )
    assert report.exit_code == ExitCode.OK and [s.gate for s in report.skipped] == ["toy-cuda"]
    strict = runner_module.Runner(
        runner_module.RunOptions(device=torch.device("cpu"), explicit=False, strict=True)
    ).run(monkey_gates, "run")
    assert strict.exit_code == ExitCode.COULD_NOT_RUN


def test_a_gate_missing_its_extra_is_skipped_by_run_and_could_not_run_when_named(reports, toy_gates):
    lacking = dataclasses.replace(toygate.BENCH_GATE, name="toy-lacking", missing=lambda: "needs foo: pip install foo")
    options = runner_module.RunOptions(device=torch.device("cpu"), explicit=False)
    report = runner_module.Runner(options).run([gates.get("rmsnorm"), lacking], "run")
    assert report.exit_code == ExitCode.OK
    assert [(s.gate, s.reason) for s in report.skipped] == [("toy-lacking", "needs foo: pip install foo")]
    named = runner_module.Runner(dataclasses.replace(options, explicit=True)).run([lacking], "gate")
    assert named.exit_code == ExitCode.COULD_NOT_RUN and named.results[0].reason == "needs foo: pip install foo"


def test_ambiguous_timing_exits_4(reports, monkeypatch):
    def ambiguous(self, unit):
        return GateResult(gate=unit.gate.name, arm=unit.gate.arm_name, preset=unit.preset.name, preset_params={},
                          device="cpu", status="ambiguous", reason="timing stayed ambiguous")

    monkeypatch.setattr(runner_module.Runner, "_run_unit", ambiguous)
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--reports", reports)
    assert result.exit_code == ExitCode.AMBIGUOUS


def test_record_then_gate_on_saved_buffers_and_corruption(tmp_path, reports):
    out = tmp_path / "buffers"
    assert invoke("record", "rmsnorm", "--preset", "tiny-gemma", "--out", out, "--device", "cpu").exit_code == 0
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--buffers", out, "--reports", reports, "--no-sabotage")
    assert result.exit_code == ExitCode.OK, result.output
    report = json.loads((report_dirs(reports)[0] / "report.json").read_text())
    gate_result = report["results"][0]
    assert gate_result["preset"] == "tiny-gemma" and gate_result["buffers"]["source"] == "loaded"
    assert gate_result["preset_params"]["offset"] == 1.0
    data = bytearray((out / "buffers.safetensors").read_bytes())
    data[-3] ^= 0x55
    (out / "buffers.safetensors").write_bytes(bytes(data))
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--buffers", out, "--reports", reports)
    assert result.exit_code == ExitCode.COULD_NOT_RUN and "corrupt" in result.output


def test_training_loop_dump_needs_its_params(tmp_path, reports):
    from suite.files.buffers import save_buffers

    x = torch.randn(6, 32).to(torch.bfloat16)
    tensors = {"x": x, "weight": torch.ones(32), "dy": torch.randn(6, 32).to(torch.bfloat16) * 1e-3}
    save_buffers(tensors, tmp_path / "dump")
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--buffers", tmp_path / "dump", "--reports", reports)
    assert result.exit_code == ExitCode.COULD_NOT_RUN and "eps" in result.output
    save_buffers(tensors, tmp_path / "dump", params={"eps": 1e-5, "offset": 0.0}, overwrite=True)
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--buffers", tmp_path / "dump", "--reports", reports, "--no-sabotage")
    assert result.exit_code == ExitCode.OK, result.output


def test_report_renders_again_and_env_runs(reports):
    invoke("gate", "rmsnorm", "--device", "cpu", "--reports", reports, "--no-sabotage")
    run_dir = report_dirs(reports)[0]
    shown = invoke("report", run_dir)
    assert shown.exit_code == 0 and "rmsnorm" in shown.output
    assert invoke("report", run_dir, "--format", "junit").output.lstrip().startswith("<?xml")
    assert invoke("report", run_dir, "--format", "pdf").exit_code == ExitCode.USAGE
    assert invoke("env", "--device", "cpu").exit_code == 0


def test_baseline_save_refuses_a_report_without_bench(reports, tmp_path):
    invoke("gate", "rmsnorm", "--device", "cpu", "--reports", reports, "--no-sabotage")
    result = invoke("baseline", "save", "--reports", reports, "--baselines", tmp_path / "baselines")
    assert result.exit_code == ExitCode.USAGE


def test_default_presets_larger_than_the_card_are_listed_not_run(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (14.5 * 2**30, 16 * 2**30))
    plan = runner_module.Runner(runner_module.RunOptions(device=torch.device("cuda"), explicit=False))
    units, skipped, refused = plan.plan([gates.get("rmsnorm")])
    # the saboteurs run once, at the smallest preset (tiny), before the standard presets
    assert [u.preset.name for u in units] == ["tiny", "4096x2048", "8192x2880", "16384x4096"]
    assert len(skipped) == 1 and "4096x65536" in skipped[0].reason and "14.5 GiB free" in skipped[0].reason
    assert not refused


def test_a_gate_whose_every_default_preset_is_too_large_says_so_once(monkeypatch):
    pytest.importorskip("transformers", minversion="5")
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (14.5 * 2**30, 16 * 2**30))
    named = runner_module.Runner(runner_module.RunOptions(device=torch.device("cuda"), explicit=True))
    units, skipped, refused = named.plan([gates.get("train-step")])
    assert not units and all("free on this GPU" in s.reason for s in skipped)
    assert len(skipped) == len({s.reason for s in skipped})  # one line per preset, none twice
    (refusal,) = refused
    assert "every default preset" in refusal.reason and "--preset" in refusal.reason
    # a run of every gate: its real models are none of that run's presets, and it says where they run
    every = runner_module.Runner(runner_module.RunOptions(device=torch.device("cuda"), explicit=False))
    units, skipped, refused = every.plan([gates.get("train-step")])
    assert not units and not refused and [s.reason for s in skipped] == [
        "no preset of gate train-step on cuda is in a run of every gate: suite bench train-step runs them"]


def test_any_unknown_preset_is_a_usage_error(reports):
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--preset", "tiny", "--preset", "tinny", "--reports", reports)
    assert result.exit_code == ExitCode.USAGE and "tinny" in result.output
    result = invoke("gate", "all", "--device", "cpu", "--preset", "tinny", "--reports", reports)
    assert result.exit_code == ExitCode.USAGE


def test_a_preset_named_twice_runs_once(reports):
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--preset", "tiny", "--preset", "tiny", "--no-sabotage",
                    "--reports", reports)
    assert result.exit_code == ExitCode.OK, result.output
    (report,) = [json.loads(p.read_text()) for p in reports.glob("*/report.json")]
    assert [(r["gate"], r["preset"]) for r in report["results"]] == [("rmsnorm", "tiny")]


def test_buffers_recorded_for_another_preset_is_a_usage_error(tmp_path, reports):
    out = tmp_path / "buffers"
    invoke("record", "rmsnorm", "--preset", "tiny-fp32", "--out", out, "--device", "cpu")
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--buffers", out, "--preset", "tiny", "--reports", reports)
    assert result.exit_code == ExitCode.USAGE and "--preset tiny-fp32" in result.output


def test_unwritable_reports_is_a_usage_error(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--no-sabotage", "--reports", blocker)
    assert result.exit_code == ExitCode.USAGE and "cannot write --reports" in result.output


def test_compare_that_compares_nothing_is_not_a_pass(reports, tmp_path):
    from factories import make_report
    from suite.harness.store import write_report

    path = write_report(make_report(), reports, "bench")
    (tmp_path / "none").mkdir()
    result = invoke("baseline", "compare", path, "--baselines", tmp_path / "none")
    assert result.exit_code == ExitCode.COULD_NOT_RUN and "nothing compared" in result.output


# ---- a new gate needs no harness change; saboteur placement; machine-readable listings ----


def test_a_gate_written_against_the_contract_alone_gates_and_benches(reports, toy_gates):
    result = invoke("bench", "toy-bench", "--device", "cpu", "--reports", reports, "--sabotage")
    assert result.exit_code == ExitCode.OK, result.output
    report = json.loads((report_dirs(reports)[0] / "report.json").read_text())
    (gate_result,) = report["results"]
    parity = gate_result["parity"]
    assert parity["mode"] == "mixed"
    assert {t["name"]: t["mode"] for t in parity["tensors"]} == {"sums": "tolerance", "largest": "bitwise"}
    assert [s["name"] for s in gate_result["saboteurs"] if s["caught"]] == ["drops-last-column"]
    (bench,) = gate_result["bench"]
    assert bench["mode"] == "wall" and bench["ceiling"] == "none"
    timed = {c["name"]: c for c in bench["contenders"]}
    assert timed["absent"]["unavailable"] == "not installed here"
    assert timed["arm"]["median_ms"] > 0 and timed["einsum"]["median_ms"] > 0
    assert [c["name"] for c in bench["criteria"]] == ["not slower than reference"]
    # setup=True: each build's seconds beside its timing; recommend=True: each against the reference
    assert timed["arm"]["setup_s"] >= 0 and timed["absent"]["setup_s"] is None
    assert {r["contender"]: r["against"] for r in bench["recommendations"]} == {"arm": "reference",
                                                                               "einsum": "reference"}
    markdown = (report_dirs(reports)[0] / "report.md").read_text()
    assert "## Recommendations" in markdown and "setup " in markdown
    assert set(gate_result["phases"]) >= {"buffers", "reference", "parity", "saboteur drops-last-column", "bench sum wall",
                                          "recheck"}
    # one run after the bench proves the arm deterministic and rechecks it: no third run
    assert parity["deterministic"] and parity["recheck_after_timing"] and parity["second_run_after_timing"]


def test_a_case_can_cap_its_rounds_and_timings_below_the_runs_policy(reports, toy_gates, monkeypatch):
    # a checkpoint save of seconds: one timing a round and a few rounds, whatever the policy says
    (case,) = toygate.BENCH_GATE.benches
    capped = dataclasses.replace(toygate.BENCH_GATE, benches=(dataclasses.replace(case, calls_per_round=1, max_rounds=4),))
    monkeypatch.setattr(gates, "get", lambda name: capped)
    result = invoke("bench", "toy-bench", "--device", "cpu", "--reports", reports)
    assert result.exit_code == ExitCode.OK, result.output
    (gate_result,) = json.loads((report_dirs(reports)[0] / "report.json").read_text())["results"]
    (bench,) = gate_result["bench"]
    assert bench["rounds"] == 4 and bench["calls_per_round"] == 1


def test_a_bench_that_cannot_time_here_still_gets_its_determinism_run(reports):
    result = invoke("bench", "rmsnorm", "--device", "cpu", "--reports", reports)
    assert result.exit_code == ExitCode.OK, result.output
    (gate_result,) = json.loads((report_dirs(reports)[0] / "report.json").read_text())["results"]
    assert gate_result["bench_skipped"] == "timing needs CUDA"
    assert list(gate_result["phases"])[-1] == "determinism"
    assert gate_result["parity"]["deterministic"] is True and gate_result["parity"]["recheck_after_timing"] is None


def test_saboteurs_run_once_at_the_smallest_preset_unless_thorough(reports, toy_gates):
    result = invoke("gate", "toy-bench", "--device", "cpu", "--preset", "wide", "--reports", reports)
    assert result.exit_code == ExitCode.OK, result.output
    report = json.loads((report_dirs(reports)[-1] / "report.json").read_text())
    by_preset = {r["preset"]: r for r in report["results"]}
    assert list(by_preset) == ["tiny", "wide"]  # tiny added, for the saboteurs
    assert [s["name"] for s in by_preset["tiny"]["saboteurs"]] == ["drops-last-column"]
    assert by_preset["wide"]["saboteurs"] == [] and "run at preset tiny" in by_preset["wide"]["saboteurs_note"]
    result = invoke("gate", "toy-bench", "--device", "cpu", "--preset", "wide", "--thorough", "--reports", reports)
    report = json.loads((report_dirs(reports)[-1] / "report.json").read_text())
    assert [(r["preset"], len(r["saboteurs"])) for r in report["results"]] == [("wide", 1)]


def test_thorough_still_runs_a_saboteur_that_shows_at_none_of_the_runs_presets(reports):
    # dw-order-varies needs an fp32 weight; tiny-gemma's is fp16: it runs once at tiny
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--preset", "tiny-gemma", "--thorough", "--reports", reports)
    assert result.exit_code == ExitCode.OK, result.output
    report = json.loads((report_dirs(reports)[-1] / "report.json").read_text())
    ran = {r["preset"]: [s["name"] for s in r["saboteurs"]] for r in report["results"]}
    assert ran["tiny"] == ["dw-order-varies"]
    assert len(ran["tiny-gemma"]) == 5 and "dw-order-varies" not in ran["tiny-gemma"]


def test_saboteurs_do_not_run_on_recorded_buffers(tmp_path, reports):
    out = tmp_path / "buffers"
    assert invoke("record", "rmsnorm", "--preset", "tiny-fp32", "--out", out, "--device", "cpu").exit_code == 0
    result = invoke("gate", "rmsnorm", "--device", "cpu", "--buffers", out, "--reports", reports)
    assert result.exit_code == ExitCode.OK, result.output
    report = json.loads((report_dirs(reports)[0] / "report.json").read_text())
    own, recorded = report["results"]
    assert own["preset"] == "tiny" and own["buffers"]["source"] == "fresh" and len(own["saboteurs"]) == 6
    assert recorded["buffers"]["source"] == "loaded" and recorded["saboteurs"] == []
    assert "not applicable on recorded buffers" in recorded["saboteurs_note"]


def test_list_and_env_print_json():
    listing = json.loads(invoke("list", "--device", "cpu", "--json").output)
    rmsnorm = next(g for g in listing["gates"] if g["name"] == "rmsnorm")
    assert {c["name"] for c in rmsnorm["contenders"]} >= {"reference", "arm", "F.rms_norm"}
    assert [p["name"] for p in rmsnorm["presets"] if p["default_here"]] == ["tiny"]
    assert [p["name"] for p in rmsnorm["presets"] if p["in_run_here"]] == ["tiny"]
    env = json.loads(invoke("env", "--device", "cpu", "--json").output)
    assert env["fingerprint"]["device_slug"] == "cpu"
    # every registered gate, its parity runnable on the CPU unless it needs CUDA
    assert {g["gate"]: g["parity"] for g in env["gates"]} == {
        name: not gates.get(name).needs_cuda for name in gates.names()}


def test_gate_names_are_never_cut_in_a_narrow_pipe():
    narrow = CliRunner(env={"COLUMNS": "80"})
    for command in (["list", "--device", "cpu"], ["env", "--device", "cpu"]):
        output = narrow.invoke(app, command).output
        assert "graph-capture" in output and "rmsnorm" in output, output
    # `suite list | grep GATE` finds each of its contenders whole, one a line
    listed = narrow.invoke(app, ["list", "--device", "cpu"]).output
    rows = [line for line in listed.splitlines() if "graph-capture" in line]
    for contender in ("reference", "AdamW foreach captured", "AdamW for-loop"):
        assert any(contender in row for row in rows), listed


def _commands(command, path=()):
    yield command, list(path)
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


def test_every_help_text_reaches_the_terminal_whole():
    """Help is rendered as Markdown (paragraphs rewrapped), where a bare <gate> is an HTML tag and
    vanishes: every option's help and every docstring paragraph must show word for word."""
    import re

    import typer

    def words(text: str) -> str:
        return " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split())

    checked = 0
    for command, path in _commands(typer.main.get_command(app)):
        shown = words(CliRunner().invoke(app, [*path, "--help"], terminal_width=2000, env={"COLUMNS": "2000"}).output)
        texts = [param.help for param in command.params if getattr(param, "help", None)] + [command.help or ""]
        for paragraph in (p for text in texts for p in text.split("\n\n") if p.strip()):
            assert words(paragraph.replace("`", "")) in shown, (path, paragraph, shown)
            checked += 1
    assert checked > 60, checked
    assert "baselines/<device-slug>/<gate>.json" in CliRunner().invoke(app, ["baseline", "save", "--help"]).output


def test_checkpoint_verify_says_whole_or_names_the_fault(tmp_path):
    import torch

    from suite.arms.checkpoint import TENSORS, save_checkpoint

    root = save_checkpoint(tmp_path / "step-5", {"w": torch.randn(300, 300)}, step=5)
    result = invoke("checkpoint", "verify", root)
    assert result.exit_code == ExitCode.OK and "whole checkpoint of step 5 (format 2, 2 files verified)" in result.output
    data = bytearray((root / TENSORS).read_bytes())
    data[len(data) // 2] ^= 0x40
    (root / TENSORS).write_bytes(bytes(data))
    result = invoke("checkpoint", "verify", root)
    assert result.exit_code == 3 and f"{TENSORS} does not match its sha256" in " ".join(result.output.split())


@pytest.mark.parametrize("name", ["rmsnorm", "moe-bwd", "split-muon", "skip-step", "checkpoint"])
def test_a_gates_own_recording_loads_as_its_buffers(tmp_path, name):
    """`suite record GATE --preset tiny` then `--buffers` of it: the params it recorded are
    enough (skip-step and checkpoint had asked for params only their GPU presets set)."""
    assert invoke("record", name, "--preset", "tiny", "--device", "cpu", "--out", tmp_path / "rec").exit_code == 0
    gate = gates.get(name)
    runner = runner_module.Runner(runner_module.RunOptions(device=torch.device("cpu"), buffers_dir=tmp_path / "rec"))
    buffers, preset, provenance = runner._buffers(gate, gate.preset("tiny"), recorded=True)
    assert provenance.source == "loaded" and set(gate.preset("tiny").params) <= set(preset.params)


def test_list_into_a_pipe_keeps_each_row_on_one_line():
    """`suite list | grep GATE`: a gate's presets and summary on its one line, never wrapped."""
    listed = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["list", "--device", "cpu"]).output
    (row,) = [line for line in listed.splitlines() if line.startswith("rmsnorm ") and "tiny **" in line]
    gate = gates.get("rmsnorm")
    assert all(p.name in row for p in gate.presets) and gate.summary in row


def test_the_summary_into_a_pipe_keeps_each_row_and_reason_on_one_line(tmp_path):
    """A CI log or `suite gate ... | grep PRESET`: a row whole, its reason unwrapped at 80 columns
    (the boxed table had folded the bench column to eight characters a line)."""
    result = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["gate", "rmsnorm", "--preset", "tiny", "--preset", "4096x2048",
                                                          "--device", "cpu", "--no-sabotage", "--reports", str(tmp_path)])
    lines = result.output.splitlines()
    reason = "preset 4096x2048 of gate rmsnorm needs CUDA; use --preset tiny on the CPU"
    rows = {line.split()[1]: line for line in lines if line.split()[:1] == ["rmsnorm"]}
    assert rows["4096x2048"].split()[2] == "could_not_run" and rows["4096x2048"].endswith(reason)
    assert rows["tiny"].split()[2:5:2] == ["passed", "pass"]
    assert f"rmsnorm [4096x2048]: {reason}" in lines


def test_env_into_a_pipe_keeps_each_gates_row_on_one_line():
    """`suite env | grep GATE`: what a gate lacks here on its one line, never wrapped."""
    shown = CliRunner(env={"COLUMNS": "80"}).invoke(app, ["env", "--device", "cpu"]).output
    (row,) = [line for line in shown.splitlines() if line.startswith("graph-capture ")]
    assert row.split()[1:3] == ["no", "no"] and row.endswith("CUDA (the gate needs a GPU); CUDA for timing")
    assert any(line.split()[:2] == ["device_slug", "cpu"] for line in shown.splitlines())


def test_a_gate_missing_its_extra_is_not_marked_as_run_by_suite_run(monkeypatch):
    """Without transformers, `suite run` skips train-step: list and env must not say it runs."""
    train_step = gates.get("train-step")
    monkeypatch.setattr(gates, "get", lambda name, real=gates.get: dataclasses.replace(
        train_step, missing=lambda: "transformers is not installed") if name == "train-step" else real(name))
    listing = json.loads(invoke("list", "--device", "cpu", "--json").output)
    presets = next(g for g in listing["gates"] if g["name"] == "train-step")["presets"]
    assert not any(p["in_run_here"] for p in presets)
    env = json.loads(invoke("env", "--device", "cpu", "--json").output)
    row = next(g for g in env["gates"] if g["gate"] == "train-step")
    assert not row["parity"] and row["missing"][0] == "transformers is not installed"
