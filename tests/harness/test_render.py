"""The run report: JSON round trip, loading errors, and every rendering, on synthetic runs."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

import pytest
from factories import (
    make_bench,
    make_bitwise_result,
    make_could_not_run_result,
    make_report,
    make_tolerance_result,
)

import suite.files.atomic as atomic_mod
import suite.harness.results as results_mod
import suite.harness.store as store_mod
from suite.errors import ExitCode, UsageError
from suite.harness.render import exit_code_meaning, render_markdown, to_json
from suite.harness.render_ci import render_junit, render_pytest_benchmark
from suite.harness.results import GateResult, RunReport, SkippedGate, load_report, slugify
from suite.harness.store import REPORT_FILES, list_reports, write_report


def failing_report() -> RunReport:
    """Failed parities (both modes), a missed saboteur, an ambiguous bench, a slow bench."""
    rms = make_tolerance_result(
        parity_passed=False,
        saboteur_caught=False,
        benches=[make_bench("fwd", seed=1), make_bench("fwd+bwd", ambiguous=True, seed=2)],
    )
    slow = make_bitwise_result(
        parity_passed=False, benches=[make_bench("step", reference_ms=10.0, arm_ms=12.0, peers={})]
    )
    return make_report(results=[rms, slow, make_could_not_run_result()], skipped=[])


# ---- JSON ----------------------------------------------------------------------------------


def test_json_round_trip_is_equal(tmp_path):
    report = make_report()
    path = tmp_path / "report.json"
    path.write_text(to_json(report))
    assert load_report(path) == report
    assert json.loads(to_json(report))["schema_version"] == results_mod.SCHEMA_VERSION


@pytest.mark.parametrize("exit_code, loads", [(0, True), (3, True), (1, False), (4, False)])
def test_load_report_takes_only_the_exit_code_its_results_give(tmp_path, exit_code, loads):
    # passed results beside a skipped gate: 0, or 3 under --strict (the skip could not run)
    report = make_report(results=[make_tolerance_result()]).model_copy(update={"exit_code": exit_code})
    assert report.exit_code == exit_code and report.skipped
    path = tmp_path / "report.json"
    path.write_text(to_json(report))
    if loads:
        assert load_report(path).exit_code == exit_code
    else:
        with pytest.raises(UsageError, match=f"it says exit code {exit_code}, but its results \\(1 passed\\) give 0"):
            load_report(path)


def _parity_failed_but_listed_nothing(data):
    data["results"][0]["parity"]["passed"] = False


def _parity_failed_under_a_passed_status(data):
    parity = data["results"][0]["parity"]
    parity["passed"] = False
    parity["failures"] = [{"check": "parity", "message": "y: relative error 9.5e-02 > limit 3.8e-03"}]


def _status_failed_over_passing_verdicts(data):
    data["results"][1]["status"] = "failed"
    data["exit_code"] = 1


def _bench_failed_under_a_passed_status(data):
    data["results"][0]["bench"][0]["passed"] = False


def _nan_error(data):
    data["results"][0]["parity"]["tensors"][0]["arm_rel_l2"] = "NaN"


def _negative_error(data):
    data["results"][0]["parity"]["tensors"][0]["ref_rel_max"] = -1e-3


def _negative_duration(data):
    data["results"][0]["duration_s"] = -5.0


def _negative_phase(data):
    data["results"][0]["phases"] = {"parity": -0.5}


def _nan_run_duration(data):
    data["duration_s"] = "NaN"


def _result_twice(data):
    data["results"].append(data["results"][0])


def _bench_case_twice(data):
    data["results"][0]["bench"].append(data["results"][0]["bench"][0])


CONTRADICTIONS = [
    (_parity_failed_but_listed_nothing, "results.0.parity: passed is false, but it lists no failure"),
    (_parity_failed_under_a_passed_status, "results.0: rmsnorm/medium says passed, but its verdicts give failed "
                                           "(parity: parity: y: relative error 9.5e-02 > limit 3.8e-03)"),
    (_status_failed_over_passing_verdicts, "results.1: muon/small says failed, but its verdicts give passed"),
    (_bench_failed_under_a_passed_status, "results.0.bench.0: passed is false, but its criteria all passed"),
    (_nan_error, "results.0.parity.tensors.0.arm_rel_l2: nan is not an error ratio"),
    (_negative_error, "results.0.parity.tensors.0.ref_rel_max: -0.001 is not an error ratio"),
    (_negative_duration, "results.0.duration_s: Input should be greater than or equal to 0"),
    (_negative_phase, "results.0.phases.parity: Input should be greater than or equal to 0"),
    (_nan_run_duration, "duration_s: Input should be a finite number"),
    (_result_twice, "results: rmsnorm/medium (fresh buffers) is there twice, as results 0 and 3"),
    (_bench_case_twice, "results.0.bench: case fwd (graph) is there twice"),
]


@pytest.mark.parametrize("edit, says", CONTRADICTIONS, ids=[edit.__name__[1:] for edit, _ in CONTRADICTIONS])
def test_load_report_refuses_a_report_that_contradicts_itself(tmp_path, edit, says):
    """An edited (or broken) report is refused with the one thing that is wrong, never rendered:
    "status passed | parity FAILED" had exited 0."""
    data = json.loads(to_json(make_report()))
    edit(data)
    path = tmp_path / "edited.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError) as err:
        load_report(path)
    assert f"edited.json is not a valid run report: 1 problem(s): {says}" in str(err.value)


def test_a_recording_and_the_gates_own_preset_of_one_name_are_two_results():
    # `suite gate rmsnorm --buffers D` of a tiny recording also runs the saboteurs at the gate's own tiny preset
    recorded = make_tolerance_result(preset="tiny", benches=[])
    recorded.buffers = recorded.buffers.model_copy(update={"source": "loaded", "directory": "dumps/step1000"})
    report = make_report(results=[recorded, make_tolerance_result(preset="tiny", benches=[])], skipped=[])
    assert RunReport.model_validate_json(to_json(report)) == report


def test_load_report_not_json_names_file_and_problem(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text("{ not json")
    with pytest.raises(UsageError, match=r"broken\.json is not a run report: not valid JSON .*line 1"):
        load_report(path)


def test_load_report_wrong_schema_version_says_both_versions(tmp_path):
    data = json.loads(to_json(make_report()))
    data["schema_version"] = 99
    path = tmp_path / "old.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError) as err:
        load_report(path)
    assert "schema_version 99" in str(err.value)
    assert f"reads run reports of schema_version {results_mod.SCHEMA_VERSION}" in str(err.value)
    assert str(path) in str(err.value)


def test_load_report_missing_field_is_summarised(tmp_path):
    data = json.loads(to_json(make_report()))
    del data["run_id"]
    del data["results"][0]["parity"]["tensors"][1]["shape"]
    path = tmp_path / "partial.json"
    path.write_text(json.dumps(data))
    with pytest.raises(UsageError) as err:
        load_report(path)
    message = str(err.value)
    assert "partial.json is not a valid run report: 2 problem(s)" in message
    assert "run_id: Field required" in message
    assert "results.0.parity.tensors.1.shape: Field required" in message


def test_load_report_missing_file_and_non_object(tmp_path):
    with pytest.raises(UsageError, match="cannot read run report .*nowhere.json"):
        load_report(tmp_path / "nowhere.json")
    path = tmp_path / "list.json"
    path.write_text("[1, 2]")
    with pytest.raises(UsageError, match="expected a JSON object, found list"):
        load_report(path)


def test_usage_error_maps_to_exit_code_2():
    assert UsageError.exit_code == ExitCode.USAGE == 2


# ---- Markdown ------------------------------------------------------------------------------


def test_markdown_holds_the_key_figures():
    report = make_report()
    md = render_markdown(report)
    rms = report.results[0]
    fwd = rms.bench[0]
    arm = next(c for c in fwd.contenders if c.role == "arm")
    vs_ref = next(c for c in fwd.comparisons if c.against == "reference")

    assert md.startswith("# Suite report: run")
    assert "exit code: **3**: a gate could not run" in md
    for figure in ("NVIDIA H200", "9.0", "580.82.07", "13.0", "2.11.0+cu130", "3.6.0", "3.12.3",
                   "0123456789ab", "4275 GB/s", "685 TFLOP/s"):
        assert figure in md, figure
    # the summary row of every gate, the skipped one included
    assert re.search(r"\| rmsnorm +\| medium +\| cuda:0 +\| passed +\| 42.5 +\| tolerance 3/3 outputs ok", md)
    assert re.search(r"\| moe +\| medium +\| cuda:0 +\| \*\*COULD NOT RUN\*\*", md)
    assert re.search(r"\| graph +\|.*skipped.*needs CUDA graphs", md)
    # parity figures, anti-cheat checks, saboteurs, bench figures, noise floor, criteria
    assert f"{rms.parity.tensors[0].arm_rel_l2:.3e}" in md
    assert f"{rms.parity.tensors[0].limit_rel_l2:.3e}" in md
    assert "inputs unchanged: yes" in md
    assert "| fp32_accumulate_skipped" in md and "caught" in md
    assert f"{arm.median_ms:.4f}" in md and f"{arm.gbps:.0f}" in md
    assert f"{vs_ref.speedup:.2f}x [{vs_ref.ci_low:.2f}, {vs_ref.ci_high:.2f}] faster" in md
    assert f"{100 * arm.ceiling_fraction:.0f}%" in md
    assert "noise floor (reference vs itself, same run): 1.0%" in md
    assert "unavailable: liger-kernel is not installed" in md
    assert "- PASS not slower than reference" in md
    # bitwise table and a loaded buffer set
    assert "| differing" in md and "max ULP" in md
    assert "loaded from buffers/muon/small" in md
    assert "reason: CUDA out of memory" in md


def test_markdown_shows_failures_plainly():
    md = render_markdown(failing_report())
    assert "exit code: **1**: a gate failed" in md
    assert "### Parity (tolerance): **FAILED**" in md
    assert "### Parity (bitwise): **FAILED**" in md
    assert "**MISSED**" in md
    assert "### Bench fwd+bwd, graph: RMSNorm fwd+bwd: **AMBIGUOUS**" in md
    assert "- **FAIL** not slower than reference" in md
    assert "| [3, 511]" in md  # bitwise first differing index
    assert "fwd+bwd" in md and "AMBIGUOUS" in md


def test_markdown_escapes_pipes_in_cells():
    result = make_could_not_run_result(reason="compile error: a | b\nsecond line")
    md = render_markdown(make_report(results=[result], skipped=[SkippedGate(gate="x", reason="p|q")]))
    assert "p\\|q" in md
    summary = [line for line in md.splitlines() if line.startswith("| x ")]
    assert len(summary) == 1 and summary[0].count(" | ") == 6


def test_exit_code_meanings_cover_every_code():
    for code in ExitCode:
        assert exit_code_meaning(code) != exit_code_meaning(99)
    assert "ambiguous" in exit_code_meaning(4)


# ---- JUnit ---------------------------------------------------------------------------------


def _cases(root: ET.Element) -> dict[str, ET.Element]:
    return {f"{c.get('classname')}::{c.get('name')}": c for c in root.iter("testcase")}


def _assert_counts_consistent(root: ET.Element) -> None:
    for node in [root, *root.iter("testsuite")]:
        cases = list(node.iter("testcase"))
        assert int(node.get("tests")) == len(cases)
        for kind, attr in (("failure", "failures"), ("error", "errors"), ("skipped", "skipped")):
            assert int(node.get(attr)) == sum(c.find(kind) is not None for c in cases), (node.get("name"), kind)


def test_junit_of_a_mixed_run():
    xml = render_junit(make_report())
    assert xml.startswith('<?xml version="1.0" encoding="UTF-8"?>')
    root = ET.fromstring(xml.split("\n", 1)[1])
    assert root.tag == "testsuites"
    assert [s.get("name") for s in root.iter("testsuite")] == ["rmsnorm", "muon", "moe", "graph"]
    assert (root.get("tests"), root.get("failures"), root.get("errors"), root.get("skipped")) == ("9", "0", "1", "1")
    _assert_counts_consistent(root)
    cases = _cases(root)
    assert set(cases) == {
        "rmsnorm.medium::parity", "rmsnorm.medium::saboteur:fp32_accumulate_skipped",
        "rmsnorm.medium::bench:fwd:graph", "rmsnorm.medium::bench:fwd:eager", "rmsnorm.medium::bench:fwd+bwd:graph",
        "muon.small::parity", "muon.small::bench:step:eager", "moe.medium::parity", "graph::parity",
    }
    assert "out of memory" in cases["moe.medium::parity"].find("error").get("message")
    assert cases["graph::parity"].find("skipped") is not None


def test_junit_failures_errors_and_ambiguous():
    root = ET.fromstring(render_junit(failing_report()))
    _assert_counts_consistent(root)
    cases = _cases(root)
    assert "relative error" in cases["rmsnorm.medium::parity"].find("failure").get("message")
    assert cases["rmsnorm.medium::saboteur:fp32_accumulate_skipped"].find("failure") is not None
    assert cases["rmsnorm.medium::bench:fwd:graph"].find("failure") is None
    assert cases["rmsnorm.medium::bench:fwd+bwd:graph"].find("failure").get("message") == "ambiguous"
    assert "not slower than reference" in cases["muon.small::bench:step:graph"].find("failure").get("message")
    assert "step 2, params differs" in cases["muon.small::parity"].find("failure").get("message")
    # two parity failures, missed saboteur, ambiguous bench, slow bench; one could-not-run
    assert (root.get("failures"), root.get("errors"), root.get("skipped")) == ("5", "1", "0")


def test_junit_keeps_a_status_no_case_shows():
    # out of memory after parity passed: CI must still see an error, as the exit code says 3
    result = make_tolerance_result(benches=[])
    result = result.model_copy(update={"status": "could_not_run", "reason": "CUDA out of memory in bench"})
    root = ET.fromstring(render_junit(make_report(results=[result], skipped=[])))
    cases = _cases(root)
    assert cases["rmsnorm.medium::parity"].find("error") is None
    assert cases["rmsnorm.medium::run"].find("error").get("message") == "CUDA out of memory in bench"
    _assert_counts_consistent(root)


def test_junit_bench_skipped_and_control_characters():
    result = make_tolerance_result(benches=[])
    result = result.model_copy(update={"bench_skipped": "benches need CUDA \x07"})
    xml = render_junit(make_report(results=[result], skipped=[]))
    cases = _cases(ET.fromstring(xml))
    assert cases["rmsnorm.medium::bench"].find("skipped").get("message") == "benches need CUDA ?"


# ---- pytest-benchmark JSON -----------------------------------------------------------------


def test_pytest_benchmark_document_layout():
    report = make_report()
    doc = render_pytest_benchmark(report)
    assert set(doc) == {"machine_info", "commit_info", "benchmarks", "datetime", "version"}
    # rmsnorm fwd (graph, eager) and fwd+bwd (graph): reference, arm, torch_compile (liger
    # unavailable); muon: 2
    assert len(doc["benchmarks"]) == 11
    bench = next(b for b in doc["benchmarks"] if b["name"] == "rmsnorm[medium-fwd-graph-arm]")
    arm = report.results[0].bench[0].contenders[1]
    assert bench["group"] == "rmsnorm/medium/fwd/graph" and bench["params"]["mode"] == "graph"
    assert bench["stats"]["data"] == pytest.approx([ms / 1e3 for ms in arm.round_medians_ms])
    assert bench["stats"]["median"] == pytest.approx(arm.median_ms / 1e3)
    assert bench["stats"]["rounds"] == len(arm.round_medians_ms)
    assert bench["stats"]["iterations"] == 20
    for field in ("min", "max", "mean", "stddev", "rounds", "median", "iqr", "q1", "q3",
                  "iqr_outliers", "stddev_outliers", "outliers", "ld15iqr", "hd15iqr", "ops",
                  "total", "iterations", "data"):
        assert field in bench["stats"], field
    assert doc["commit_info"]["id"] == report.fingerprint.git_sha
    # the arm's speedup over a peer carries the floor that comparison was judged against
    peer = next(b for b in doc["benchmarks"] if b["name"] == "rmsnorm[medium-fwd-graph-torch_compile]")
    versus = next(c for c in report.results[0].bench[0].comparisons if c.against == "torch_compile")
    assert peer["extra_info"]["arm_speedup"]["noise_floor"] == versus.noise_floor
    json.dumps(doc)  # plain JSON, nothing pydantic left inside


def test_pytest_benchmark_compare_reads_it(tmp_path):
    path = tmp_path / "benchmark.json"
    path.write_text(json.dumps(render_pytest_benchmark(make_report()), indent=4))
    # pytest-benchmark's own tool; its storage only warns on a file it cannot load, so the
    # names in its table are the proof that it read ours
    done = subprocess.run(
        [sys.executable, "-m", "pytest_benchmark", "compare", "--group-by=group", str(path)],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert "Failed to load" not in done.stdout + done.stderr
    for name in ("rmsnorm[medium-fwd-graph-arm]", "rmsnorm[medium-fwd-eager-arm]",
                 "rmsnorm[medium-fwd+bwd-graph-torch_compile]", "muon[small-step-eager-reference]"):
        assert name in done.stdout, name
    assert "rmsnorm/medium/fwd/graph" in done.stdout


def test_pytest_benchmark_storage_loads_it(tmp_path):
    from pytest_benchmark.logger import Logger
    from pytest_benchmark.storage.file import FileStorage

    path = tmp_path / "0001_run.json"
    path.write_text(json.dumps(render_pytest_benchmark(make_report())))
    storage = FileStorage(tmp_path, logger=Logger(Logger.QUIET))
    benches = list(storage.load_benchmarks(str(path)))
    assert len(benches) == 11
    assert all(b["ops"] > 0 and b["source"] is not None for b in benches)


# ---- writing -------------------------------------------------------------------------------


def test_write_report_publishes_exactly_four_files(tmp_path):
    report = make_report(what="gate rmsnorm")
    path = write_report(report, tmp_path / "reports", report.what)
    assert path.parent == tmp_path / "reports"
    assert re.fullmatch(r"20261130T120000Z_gate-rmsnorm", path.name)
    assert sorted(p.name for p in path.iterdir()) == sorted(REPORT_FILES)
    assert [p.name for p in (tmp_path / "reports").iterdir()] == [path.name]  # no temp dir left
    assert load_report(path / "report.json") == report
    ET.fromstring((path / "junit.xml").read_text())
    assert json.loads((path / "benchmark.json").read_text())["benchmarks"]
    assert (path / "report.md").read_text() == render_markdown(report)


def test_write_report_adds_a_suffix_when_the_name_is_taken(tmp_path):
    report = make_report()
    first = write_report(report, tmp_path, "run")
    second = write_report(report, tmp_path, "run")
    assert second.name == first.name + "-2"
    assert list_reports(tmp_path) == [first, second]


@pytest.mark.parametrize("module, target", [(store_mod, "render_junit"), (atomic_mod, "write_bytes")])
def test_a_crash_while_writing_leaves_no_report_dir(tmp_path, monkeypatch, module, target):
    calls = []

    def boom(*args, **kwargs):
        calls.append(args)
        if target == "render_junit" or len(calls) == 3:
            raise RuntimeError("simulated crash")
        return original(*args, **kwargs)

    original = getattr(module, target)
    monkeypatch.setattr(module, target, boom)
    with pytest.raises(RuntimeError, match="simulated crash"):
        write_report(make_report(), tmp_path, "run")
    assert list(tmp_path.iterdir()) == []


def test_stale_temp_dirs_are_cleaned_and_never_listed(tmp_path):
    stale = tmp_path / ".tmp-dead-run"
    fresh = tmp_path / ".tmp-live-run"
    for d in (stale, fresh):
        d.mkdir()
        (d / "report.json").write_text("{}")
    hour_ago = time.time() - 2 * atomic_mod.STALE_TMP_S
    os.utime(stale, (hour_ago, hour_ago))
    assert list_reports(tmp_path) == []
    written = write_report(make_report(), tmp_path, "run")
    assert not stale.exists()
    assert fresh.exists()  # may belong to a run still writing
    assert list_reports(tmp_path) == [written]


@pytest.mark.parametrize("text, slug", [
    ("gate rmsnorm", "gate-rmsnorm"),
    ("bench all", "bench-all"),
    ("NVIDIA H200", "nvidia-h200"),
    ("NVIDIA GeForce RTX 5090", "nvidia-geforce-rtx-5090"),
    ("  fwd+bwd / medium ", "fwd-bwd-medium"),
    ("", ""),
])
def test_slugify(text, slug):
    assert slugify(text) == slug


def test_report_models_still_accept_minimal_results():
    # other stages build results piece by piece; the renderings must cope with the sparse ones
    bare = GateResult(gate="g", arm="a", preset="p", preset_params={}, device="cpu", status="failed",
                      reason="arm raised ValueError")
    report = make_report(results=[bare], skipped=[])
    assert "arm raised ValueError" in render_markdown(report)
    root = ET.fromstring(render_junit(report))
    assert root.get("failures") == "1"
    assert render_pytest_benchmark(report)["benchmarks"] == []


def test_a_slow_rate_keeps_three_figures_and_a_fast_one_is_whole():
    from suite.harness import render

    # a disk's rate under 1 GB/s printed as "1" hides how far a save is from it
    assert render._rate(0.84123) == "0.841" and render._rate(44.57) == "44.6" and render._rate(3443.4) == "3443"
    assert render._rate(None) == render._DASH


def test_a_missed_target_is_shown_but_fails_no_case():
    """An aim (a criteria.Target) missed: the Markdown says so beside the passing
    bars, the JUnit case stays green, and the bench keeps its pass."""
    from suite.harness.results import CriterionCheck

    bench = make_bench("fwd+bwd", seed=3)
    bench.criteria.append(CriterionCheck(name="target: speedup over sonicmoe >= 1.1x", passed=False, target=True,
                                         detail="arm vs sonicmoe: speedup 0.806x; needs >= 1.1x within the floor"))
    report = make_report(results=[make_tolerance_result(benches=[bench])], skipped=[])
    assert report.results[0].status == "passed" and report.exit_code == 0
    md = render_markdown(report)
    assert "- *missed* target: speedup over sonicmoe >= 1.1x: arm vs sonicmoe: speedup 0.806x" in md
    assert "**FAIL**" not in md
    root = ET.fromstring(render_junit(report).split("\n", 1)[1])
    assert root.get("failures") == "0"
