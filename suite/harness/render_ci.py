"""Renderings of a run report that CI tools read: JUnit XML (one testcase per parity, saboteur
and bench case and mode) and pytest-benchmark's JSON (`pytest-benchmark compare` reads it).
From the results model alone, as `render`'s.
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET
from typing import Any

from suite.harness.results import GateResult, RunReport


# ---- JUnit XML -----------------------------------------------------------------------------

_XML_INVALID = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f]")


def _x(text: object) -> str:
    # XML 1.0 cannot hold most control characters; one in an error message would make CI
    # reject the whole file.
    return _XML_INVALID.sub("?", str(text))


_OUTCOME_TYPE = {"failure": "failed", "error": "could_not_run"}


def _outcome(case: ET.Element, kind: str, message: str, detail: str = "") -> None:
    """kind: 'failure', 'error' (could not run) or 'skipped'."""
    node = ET.SubElement(case, kind, message=_x(message))
    if kind in _OUTCOME_TYPE:
        node.set("type", _OUTCOME_TYPE[kind])
    if detail:
        node.text = _x(detail)


def _junit_cases(result: GateResult) -> list[ET.Element]:
    classname = f"{result.gate}.{result.preset}"

    def case(name: str, seconds: float = 0.0) -> ET.Element:
        return ET.Element("testcase", classname=classname, name=name, time=f"{seconds:.3f}")

    # Each bench case books its own time; the parity case books the rest of the gate's.
    parity = case("parity", max(0.0, result.duration_s - sum(b.duration_s for b in result.bench)))
    cases = [parity]
    if result.parity is not None:
        if not result.parity.passed:
            detail = "\n".join([str(f) for f in result.parity.failures] + [
                f"{t.name}: {t.message}" for t in result.parity.tensors if not t.passed
            ])
            message = str(result.parity.failures[0]) if result.parity.failures else "parity failed"
            _outcome(parity, "failure", message, detail)
    elif result.status == "skipped":
        _outcome(parity, "skipped", result.reason or "skipped")
    elif result.status == "could_not_run":
        _outcome(parity, "error", result.reason or "could not run", result.traceback or "")
    elif result.status == "failed":
        _outcome(parity, "failure", result.reason or "failed before parity was judged")

    for sab in result.saboteurs:
        c = case(f"saboteur:{sab.name}")
        if not sab.caught:
            _outcome(c, "failure", f"saboteur not caught: {sab.description}",
                     f"expected to be caught by {sab.expected_check.value}")
        cases.append(c)

    if result.bench_skipped:
        c = case("bench")
        _outcome(c, "skipped", result.bench_skipped)
        cases.append(c)
    for bench in result.bench:
        c = case(f"bench:{bench.case}:{bench.mode}", bench.duration_s)
        failed = [f"{k.name}: {k.detail}" for k in bench.criteria if not k.passed and not k.target]
        if bench.ambiguous:
            _outcome(c, "failure", "ambiguous", "\n".join(failed))
        elif not bench.passed:
            _outcome(c, "failure", failed[0] if failed else "bench failed", "\n".join(failed))
        cases.append(c)

    # A status the cases above do not show (e.g. out of memory after parity passed) still has
    # to reach CI, or its counts would disagree with the exit code.
    shown = {child.tag for c in cases for child in c}
    needed = {"failed": "failure", "could_not_run": "error", "ambiguous": "failure"}.get(result.status)
    if needed is not None and needed not in shown:
        c = case("run")
        _outcome(c, needed, result.reason or result.status)
        cases.append(c)
    return cases


def render_junit(report: RunReport) -> str:
    fp = report.fingerprint
    by_gate: dict[str, list[ET.Element]] = {}
    time_by_gate: dict[str, float] = {}
    for result in report.results:
        by_gate.setdefault(result.gate, []).extend(_junit_cases(result))
        time_by_gate[result.gate] = time_by_gate.get(result.gate, 0.0) + result.duration_s
    for skipped in report.skipped:
        case = ET.Element("testcase", classname=skipped.gate, name="parity", time="0.000")
        _outcome(case, "skipped", skipped.reason)
        by_gate.setdefault(skipped.gate, []).append(case)

    root = ET.Element("testsuites", name=_x(f"suite {report.what}"))
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    properties = {
        "run_id": report.run_id, "command": report.command, "exit_code": report.exit_code,
        "device": fp.gpu_name or fp.device_slug, "torch": fp.torch, "git_sha": fp.git_sha or "",
    }
    for gate, cases in by_gate.items():
        counts = {
            "tests": len(cases),
            "failures": sum(c.find("failure") is not None for c in cases),
            "errors": sum(c.find("error") is not None for c in cases),
            "skipped": sum(c.find("skipped") is not None for c in cases),
        }
        suite = ET.SubElement(
            root, "testsuite", name=gate, timestamp=_x(report.started_utc),
            time=f"{time_by_gate.get(gate, 0.0):.3f}", **{k: str(v) for k, v in counts.items()},
        )
        props = ET.SubElement(suite, "properties")
        for name, value in properties.items():
            ET.SubElement(props, "property", name=name, value=_x(value))
        suite.extend(cases)
        for key in totals:
            totals[key] += counts[key]
    for key, value in totals.items():
        root.set(key, str(value))
    root.set("time", f"{sum(time_by_gate.values()):.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


# ---- pytest-benchmark JSON -----------------------------------------------------------------


def render_pytest_benchmark(report: RunReport) -> dict[str, Any]:
    """The run's timings in pytest-benchmark's saved format, so its `compare` tooling and
    dashboards built on it read them. One entry per timed (gate, preset, case, mode, contender);
    data = the per-round medians in seconds (pytest-benchmark stores seconds)."""
    # pytest-benchmark's own statistics, so every derived figure (quartiles, outliers, ops)
    # means exactly what its tools expect.
    from pytest_benchmark import __version__ as pb_version
    from pytest_benchmark.stats import Stats

    fp = report.fingerprint
    benchmarks = []
    for result in report.results:
        for bench in result.bench:
            versus = {c.against: c for c in bench.comparisons}
            for c in bench.contenders:
                if not c.round_medians_ms:
                    continue
                stats = Stats()
                for ms in c.round_medians_ms:
                    stats.update(ms / 1e3)
                stats_dict = stats.as_dict()
                stats_dict["data"] = list(stats.data)
                stats_dict["iterations"] = bench.calls_per_round
                param = f"{result.preset}-{bench.case}-{bench.mode}-{c.name}"
                name = f"{result.gate}[{param}]"
                cmp = versus.get(c.name)
                benchmarks.append({
                    "group": f"{result.gate}/{result.preset}/{bench.case}/{bench.mode}",
                    "name": name,
                    "fullname": f"gates/{result.gate}.py::{name}",
                    "params": {
                        "gate": result.gate, "preset": result.preset, "case": bench.case,
                        "mode": bench.mode, "contender": c.name, **result.preset_params,
                    },
                    "param": param,
                    "extra_info": {
                        "role": c.role,
                        "arm": result.arm,
                        "device": result.device,
                        "status": result.status,
                        "cold_ms": c.cold_ms,
                        "median_ms": c.median_ms,
                        "gbps": c.gbps,
                        "tflops": c.tflops,
                        "ceiling_fraction": c.ceiling_fraction,
                        "ceiling": bench.ceiling,
                        "host_us": c.host_us,
                        "noise_floor": bench.noise_floor,
                        "bytes": bench.bytes,
                        "flops": bench.flops,
                        "arm_speedup": None if cmp is None else {
                            "speedup": cmp.speedup, "ci": [cmp.ci_low, cmp.ci_high],
                            "verdict": cmp.verdict, "noise_floor": cmp.noise_floor,
                        },
                        "run_id": report.run_id,
                    },
                    "options": {
                        "rounds": bench.rounds,
                        "calls_per_round": bench.calls_per_round,
                        "warmup_calls": bench.warmup_calls,
                        "l2": bench.l2,
                        "window": c.window or bench.window,
                        "rotation": bench.rotation,
                        "timer": "suite (median of each round)",
                    },
                    "stats": stats_dict,
                })
    return {
        "machine_info": {
            "python_version": fp.python,
            **fp.model_dump(exclude={"git_sha", "git_dirty"}),
        },
        "commit_info": {
            "id": fp.git_sha or "unknown",
            "time": None,
            "author_time": None,
            "dirty": bool(fp.git_dirty),
            "project": "suite",
            "branch": "(unknown)",
        },
        "benchmarks": benchmarks,
        "datetime": report.finished_utc,
        "version": pb_version,
    }
