"""`pytest --suite`: the gates as pytest items, in one process and over xdist workers, on the
CPU with the toy gates (tests/support/toygate.py) registered beside the real ones: the items, their
outcomes as the gates' verdicts, the merged report, a worker's GPU, `suite run --gpus`."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest

from suite.harness import pytest_plugin
from suite.harness.results import RunReport

SUPPORT = Path(__file__).resolve().parents[1] / "support"
# the toy gates, registered in every process of the run (the workers load the conftest too)
CONFTEST = f"""
import sys
sys.path.insert(0, {str(SUPPORT)!r})
import gates, toygate
toys = {{"toy-wrong": toygate.GATE, "toy-cuda": toygate.CUDA_GATE, "toy-bench": toygate.BENCH_GATE,
        "toy-crash": toygate.CRASH_GATE}}
real_get = gates.get
gates.GATE_MODULES.update({{name: "toygate" for name in toys}})
gates.get = lambda name: toys[name] if name in toys else real_get(name)
"""


@pytest.fixture(autouse=True)
def _not_inside_a_worker(monkeypatch):
    """This file may itself run in an xdist worker (pytest -n 2): the runs it starts are no
    worker of that run, so they must not read its worker id and take a GPU by it."""
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)


@pytest.fixture
def suite_dir(pytester: pytest.Pytester) -> pytest.Pytester:
    pytester.makeconftest(CONFTEST)
    pytester.makepyfile(test_unrelated="def test_a_users_own_test():\n    assert sum([1, 2]) == 3\n")
    return pytester


def run(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, RunReport]:
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-v", "--suite", "--suite-device", "cpu",
                                           "--suite-reports", str(pytester.path / "reports"), *args, timeout=600)
    (report_dir,) = (pytester.path / "reports").iterdir()
    report = RunReport.model_validate_json((report_dir / "report.json").read_text())
    return result, report


VERBOSE = re.compile(r"suite::(?P<name>.+?)\s+(?P<word>PASSED|FAILED|SKIPPED|XFAIL)\b|"
                     r"(?P<word2>PASSED|FAILED|SKIPPED|XFAIL)\s+suite::(?P<name2>.+?)(?:\s+-\s|\s*$)")


def outcomes(result: pytest.RunResult) -> dict[str, str]:
    """item name -> PASSED / FAILED / SKIPPED / XFAIL, from pytest's verbose lines (one
    process: `suite::NAME WORD [ n%]`; xdist: `[gwK] [ n%] WORD suite::NAME`)."""
    found = {}
    for line in result.outlines:
        match = VERBOSE.search(line)
        if match and not line.startswith(("FAILED ", "SKIPPED ", "XFAIL ")):  # not the summary's lines
            found[match["name"] or match["name2"]] = match["word"] or match["word2"]
    return found


def test_a_gate_a_bench_case_and_a_recheck_are_items_and_the_report_is_the_runs(suite_dir):
    result, report = run(suite_dir, "--suite-gate", "toy-bench", "--suite-bench")
    assert outcomes(result) == {"toy-bench[tiny]::gate": "PASSED", "toy-bench[tiny]::sum wall": "PASSED",
                                "toy-bench[tiny]::recheck": "PASSED"}
    assert "test_a_users_own_test" not in result.stdout.str()  # under --suite the gates are the items
    assert "collected 3 items" in result.stdout.str()  # collected as pytest collects, so counted
    assert report.exit_code == 0 and report.what == "run"
    (gate,) = report.results
    assert gate.gate == "toy-bench" and gate.status == "passed" and [b.case for b in gate.bench] == ["sum"]
    assert gate.parity.passed and gate.saboteurs and all(s.caught for s in gate.saboteurs)
    assert gate.fingerprint is not None and gate.fingerprint.device_slug == "cpu"
    assert {"junit.xml", "report.md", "benchmark.json"} <= {p.name for p in next((suite_dir.path / "reports").iterdir()).iterdir()}


def test_a_failing_gate_fails_its_item_with_the_gates_one_line_reason(suite_dir):
    result, report = run(suite_dir, "--suite-gate", "toy-wrong")
    assert outcomes(result) == {"toy-wrong[tiny]::gate": "FAILED"}
    assert "failed: parity" in result.stdout.str() and "Traceback" not in result.stdout.str()
    assert report.exit_code == 1 and report.results[0].status == "failed"
    # with a bench the unit ends in its recheck: skipped, neither a pass nor a second failure
    result, report = run_again(suite_dir, "--suite-gate", "toy-wrong", "--suite-bench")
    assert outcomes(result) == {"toy-wrong[tiny]::gate": "FAILED", "toy-wrong[tiny]::recheck": "SKIPPED"}
    assert report.exit_code == 1 and [r.status for r in report.results] == ["failed"]


def test_a_named_gate_that_cannot_run_here_fails_and_an_unnamed_one_is_skipped(suite_dir):
    result, report = run(suite_dir, "--suite-gate", "toy-cuda")
    assert outcomes(result) == {"toy-cuda": "FAILED"}
    assert "could not run: gate toy-cuda needs CUDA" in result.stdout.str()
    assert report.exit_code == 3
    result, report = run_again(suite_dir, "--suite-gate", "all", "--suite-preset", "tiny", "-k", "toy-cuda")
    assert outcomes(result) == {"toy-cuda": "SKIPPED"} and report.exit_code == 0
    assert [s.gate for s in report.skipped] == ["toy-cuda"]


def run_again(pytester: pytest.Pytester, *args: str) -> tuple[pytest.RunResult, RunReport]:
    shutil.rmtree(pytester.path / "reports")
    return run(pytester, *args)


def test_two_workers_run_the_units_each_whole_with_the_verdicts_of_one(suite_dir):
    one, alone = run(suite_dir, "--suite-gate", "toy-bench", "--suite-gate", "toy-wrong", "--suite-bench")
    result, spread = run_again(suite_dir, "--suite-gate", "toy-bench", "--suite-gate", "toy-wrong", "--suite-bench",
                               "-n", "2")
    assert outcomes(result) == outcomes(one)
    workers = {line.split("]")[0].strip("[") for line in result.outlines if line.startswith("[gw")}
    assert workers == {"gw0", "gw1"}
    # a unit's items on one worker, in order: its recheck saw its gate run and carried the result
    assert [(r.gate, r.status) for r in spread.results] == [(r.gate, r.status) for r in alone.results]
    assert {r.fingerprint.device for r in spread.results} == {"cpu"}
    assert spread.exit_code == alone.exit_code == 1


def test_a_unit_whose_worker_died_could_not_run_and_the_others_still_report(suite_dir):
    result, report = run(suite_dir, "--suite-gate", "toy-crash", "--suite-gate", "toy-bench", "--suite-bench",
                         "-n", "2")
    assert outcomes(result)["toy-crash[tiny]::gate"] == "FAILED"
    # run once (xdist's loadscope would run the crashed unit again on each new worker: 9 failures)
    result.assert_outcomes(failed=1, passed=3)
    status = {r.gate: (r.status, r.reason) for r in report.results}
    assert status["toy-bench"] == ("passed", None)
    assert status["toy-crash"][0] == "could_not_run" and "crashed" in status["toy-crash"][1]
    assert report.exit_code == 3


def test_a_unit_cut_short_by_k_or_x_could_not_run_and_one_left_out_is_not_in_the_report(suite_dir):
    result, report = run(suite_dir, "--suite-gate", "toy-bench", "--suite-gate", "toy-wrong", "--suite-bench",
                         "-k", "gate")  # the bench unit's gate item runs, its recheck does not
    status = {r.gate: (r.status, r.reason) for r in report.results}
    assert status["toy-wrong"][0] == "failed" and status["toy-bench"][0] == "could_not_run"
    assert "did not run" in status["toy-bench"][1] and report.exit_code == 1  # a failure outranks could-not-run
    result, report = run_again(suite_dir, "--suite-gate", "toy-bench", "--suite-gate", "toy-wrong", "-k", "toy-bench")
    assert [(r.gate, r.status) for r in report.results] == [("toy-bench", "passed")] and report.exit_code == 0
    result, report = run_again(suite_dir, "--suite-gate", "toy-wrong", "--suite-gate", "toy-bench", "-x")
    assert {r.gate: r.status for r in report.results} == {"toy-wrong": "failed", "toy-bench": "could_not_run"}


def test_every_item_deselected_writes_no_report_and_a_gate_named_twice_runs_once(suite_dir):
    result = suite_dir.runpytest_subprocess("-p", "no:cacheprovider", "--suite", "--suite-device", "cpu",
                                            "--suite-reports", str(suite_dir.path / "reports"), "--suite-gate",
                                            "toy-bench", "-k", "nothing-is-called-this", timeout=300)
    assert result.ret == pytest.ExitCode.NO_TESTS_COLLECTED  # not a report that passes what did not run
    assert "no gate ran (every item was deselected), so no report was written" in result.stdout.str()
    assert not list((suite_dir.path / "reports").iterdir())  # checked writable at the start, left empty
    result, report = run(suite_dir, "--suite-gate", "toy-bench", "--suite-gate", "toy-bench")
    assert outcomes(result) == {"toy-bench[tiny]::gate": "PASSED"} and report.what == "gate toy-bench"
    assert [r.gate for r in report.results] == ["toy-bench"]


@pytest.mark.parametrize("args, message", [
    (("--suite-gate", "nope"), "ERROR: no gate named 'nope'"),
    (("--suite-preset", "nope"), "ERROR: no gate of this run has the preset(s) ['nope']"),
    (("--suite-device", "cuda"), "ERROR: --device cuda: this machine has no usable CUDA device"),
    (("--suite-seed", "-3"), "--suite-seed: must be a whole number from 0 to 2^64-1, not '-3'"),
    (("--suite-profile", "rxt"), "--suite-profile: invalid choice: 'rxt'"),
    (("--suite-gate", "nope", "-n", "2"), "ERROR: no gate named 'nope'"),
    (("--suite-reports", "{tmp}/a-file"), "ERROR: cannot write --suite-reports {tmp}/a-file: it is a file"),
])
def test_a_bad_name_or_option_is_a_usage_error_and_leaves_no_report(suite_dir, args, message):
    if "cuda" in args and torch_cuda_available():
        pytest.skip("this host has a GPU")
    (suite_dir.path / "a-file").write_text("")
    args = [arg.replace("{tmp}", str(suite_dir.path)) for arg in args]
    result = suite_dir.runpytest_subprocess("-p", "no:cacheprovider", "--suite", "--suite-reports",
                                            str(suite_dir.path / "reports"), *args, timeout=300)
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert message.replace("{tmp}", str(suite_dir.path)) in result.stderr.str() + result.stdout.str()
    assert "INTERNALERROR" not in result.stdout.str() + result.stderr.str()
    assert not (suite_dir.path / "reports").exists()


def test_a_report_the_disk_refuses_at_the_end_is_written_to_a_temporary_directory(suite_dir):
    suite_dir.makeconftest(CONFTEST + """
import suite.harness.store as store
real_write = store.write_report

def full(report, reports_dir, what=None):
    if "suite-reports-" not in str(reports_dir):
        raise OSError(28, "No space left on device")
    return real_write(report, reports_dir, what)

store.write_report = full
""")
    result = suite_dir.runpytest_subprocess("-p", "no:cacheprovider", "--suite", "--suite-device", "cpu",
                                            "--suite-gate", "toy-bench", timeout=300)
    out = result.stdout.str()
    assert "cannot write the report under reports (No space left on device); wrote it to" in out
    saved = Path(re.search(r"suite: report (\S+suite-reports-\S+) ", out)[1])
    assert RunReport.model_validate_json((saved / "report.json").read_text()).exit_code == 0
    shutil.rmtree(saved.parent)


def test_collect_only_lists_the_items_and_writes_no_report(suite_dir):
    result = suite_dir.runpytest_subprocess("-p", "no:cacheprovider", "--suite", "--suite-device", "cpu",
                                            "--suite-reports", str(suite_dir.path / "reports"), "--suite-gate",
                                            "toy-bench", "--collect-only", "-q", timeout=300)
    assert "suite::toy-bench[tiny]::gate" in result.stdout.str()
    assert not (suite_dir.path / "reports").exists()


def torch_cuda_available() -> bool:
    import torch

    return torch.cuda.is_available()


def test_a_worker_takes_its_own_gpu_before_cuda_starts(monkeypatch):
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw1")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    pytest_plugin.pytest_load_initial_conftests(None, None, ["--suite", "-n", "2"])
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "5" and os.environ["SUITE_PHYSICAL_DEVICE"] == "5"
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    with pytest.raises(pytest.UsageError, match="gw2 has no GPU of its own"):
        pytest_plugin.pytest_load_initial_conftests(None, None, ["--suite"])
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,5")
    pytest_plugin.pytest_load_initial_conftests(None, None, ["tests"])  # not a --suite run: untouched
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "3,5"


@pytest.mark.parametrize("status, outcome", [("could_not_run", "could not run: why"), ("failed", "failed: why"),
                                             ("ambiguous", "xfail"), ("passed", None)])
def test_a_verdict_is_never_a_pass_unless_the_gate_passed(status, outcome):
    if outcome is None:
        pytest_plugin._SuiteItem.judge(status, "why")
    elif outcome == "xfail":
        with pytest.raises(pytest.xfail.Exception, match="ambiguous: why"):
            pytest_plugin._SuiteItem.judge(status, "why")
    else:
        with pytest.raises(pytest_plugin._Verdict, match=outcome):
            pytest_plugin._SuiteItem.judge(status, "why")


def test_without_suite_the_plugin_is_idle(suite_dir):
    result = suite_dir.runpytest_subprocess("-p", "no:cacheprovider", "-q")
    result.assert_outcomes(passed=1)
    assert not (suite_dir.path / "reports").exists()


def test_suite_options_without_suite_are_a_usage_error(suite_dir):
    """Alone, --suite-gate and the rest collected nothing of the suite and said nothing."""
    result = suite_dir.runpytest_subprocess("-p", "no:cacheprovider", "-q", "--suite-gate", "rmsnorm", "--suite-seed", "3")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines(["*--suite-gate, --suite-seed given without --suite: add --suite*"])


def test_spread_runs_the_gates_over_two_workers_into_one_report(tmp_path):
    report, path, status = pytest_plugin.spread(2, "cpu", None, ["tiny"], str(tmp_path / "r"),
                                                gates=["rmsnorm", "split-muon"])
    assert status == 0 and report.exit_code == 0 and Path(path).parent == tmp_path / "r"
    assert sorted(r.gate for r in report.results) == ["rmsnorm", "split-muon"]
    assert {r.fingerprint.device for r in report.results} == {"cpu"}
    assert RunReport.model_validate_json((Path(path) / "report.json").read_text()) == report


def test_suite_run_gpus_exits_with_the_spread_runs_code(tmp_path, monkeypatch, capsys):
    from typer.testing import CliRunner

    from cli import app
    from factories import make_report

    asked = {}

    def spread(workers, device, profile, presets, reports, seed, thorough, strict):
        asked.update(workers=workers, device=device, presets=presets)
        report = make_report()
        report.exit_code = 4
        return report, str(tmp_path / "the-report"), 0

    monkeypatch.setattr(pytest_plugin, "spread", spread)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2}, raising=False)  # a 3-core host
    out = CliRunner().invoke(app, ["run", "--gpus", "2", "--device", "cpu", "--preset", "tiny"])
    assert out.exit_code == 4, out.output
    assert asked == {"workers": 2, "device": "cpu", "presets": ["tiny"]} and "the-report" in "".join(out.output.split())
    for bad in ("two", "0", "all", "4", "99999999999999999999"):  # all: a CPU has no GPUs to count; 4: > cores
        out = CliRunner().invoke(app, ["run", "--gpus", bad, "--device", "cpu"])
        assert out.exit_code == 2 and "--gpus must be 'all' or a number" in out.output, (bad, out.output)
        assert "from 1 to its 3 cores" in " ".join(out.output.split()), out.output
    asked.clear()
    out = CliRunner().invoke(app, ["run", "--gpus", "2", "--device", "cpu", "--preset", "nope"])
    assert out.exit_code == 2 and "no gate of this run has the preset(s) ['nope']" in out.output and not asked


@pytest.mark.parametrize("status, code, said", [(pytest.ExitCode.INTERRUPTED, 130, "interrupted"),
                                                (pytest.ExitCode.INTERNAL_ERROR, 3, "the report may be incomplete"),
                                                (pytest.ExitCode.TESTS_FAILED, 3, "the report is incomplete")])
def test_suite_run_gpus_never_passes_a_run_pytest_did_not_finish(tmp_path, monkeypatch, status, code, said):
    from typer.testing import CliRunner

    from cli import app
    from factories import make_report

    def spread(*args):
        report = make_report()
        report.exit_code = 0
        return (None if status == pytest.ExitCode.INTERRUPTED else report), str(tmp_path / "r"), int(status)

    monkeypatch.setattr(pytest_plugin, "spread", spread)
    out = CliRunner().invoke(app, ["run", "--gpus", "2", "--device", "cpu"])
    assert out.exit_code == code and said in out.output, out.output
