"""The run report: one versioned pydantic model; JSON is the source, the rest are renderings."""

from __future__ import annotations

import itertools
import json
import os
import re
import secrets
import shutil
import time
import xml.etree.ElementTree as ET
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, TypeVar

from pydantic import BaseModel, Field, ValidationError
from tabulate import tabulate

from suite.errors import ExitCode, UsageError

SCHEMA_VERSION = 1

Verdict = Literal["faster", "same", "slower", "ambiguous"]
Status = Literal["passed", "failed", "could_not_run", "ambiguous", "skipped"]


class TensorCheck(BaseModel):
    """One output tensor of the arm judged against the reference (bitwise) or truth (tolerance)."""

    name: str
    shape: list[int]
    dtype: str
    passed: bool
    message: str = ""
    # bitwise mode
    differing: int | None = None
    first_index: list[int] | None = None
    max_ulp: int | None = None
    # tolerance mode: relative errors against the float64 truth, and the limits applied
    arm_rel_l2: float | None = None
    ref_rel_l2: float | None = None
    limit_rel_l2: float | None = None
    arm_rel_max: float | None = None
    ref_rel_max: float | None = None
    limit_rel_max: float | None = None
    nonfinite_match: bool | None = None


class ParityResult(BaseModel):
    mode: Literal["bitwise", "tolerance"]
    k: float | None = None
    floor: float | None = None
    passed: bool
    # every output's check; a gate with thousands of outputs keeps only its failing ones (the
    # first of them), and the counts below say how many there were
    tensors: list[TensorCheck]
    outputs_checked: int | None = None  # None: tensors holds every check
    outputs_passed: int | None = None
    inputs_unchanged: bool
    deterministic: bool | None  # None when the gate declares the arm nondeterministic
    nondeterministic_reason: str | None = None
    recheck_after_timing: bool | None = None  # None when no timing ran
    first_divergence: str | None = None  # the first failing output, in the reference's order
    failures: list[str] = Field(default_factory=list)

    def counts(self) -> tuple[int, int]:
        """(outputs checked, outputs passed), whether or not tensors was trimmed."""
        if self.outputs_checked is None:
            return len(self.tensors), sum(t.passed for t in self.tensors)
        return self.outputs_checked, self.outputs_passed


class SaboteurResult(BaseModel):
    name: str
    description: str
    expected_check: str
    caught: bool
    failures: list[str] = Field(default_factory=list)


class ContenderTiming(BaseModel):
    name: str  # "reference", "arm" or a peer's name
    role: Literal["reference", "arm", "peer"]
    unavailable: str | None = None  # why it was not timed
    method: str = "eager"  # "graph" when CUDA-graph replays were timed, else why not
    cold_ms: float | None = None  # the first call (compile, autotune, capture), timed alone
    median_ms: float | None = None  # median of the per-round medians
    round_medians_ms: list[float] = Field(default_factory=list)
    gbps: float | None = None
    tflops: float | None = None
    ceiling_fraction: float | None = None  # of measured copy bandwidth or bf16 GEMM rate
    gpu_busy_ms: float | None = None  # host-bound benches: kernel time per call, beside the wall time


class Comparison(BaseModel):
    """arm against one other implementation: speedup = other's time / arm's time."""

    against: str
    speedup: float
    ci_low: float
    ci_high: float
    verdict: Verdict


class CriterionCheck(BaseModel):
    name: str
    passed: bool
    detail: str
    ambiguous: bool = False  # not passed because timing could not decide, not because it lost


class BenchResult(BaseModel):
    case: str
    description: str
    l2: Literal["cold", "warm"]
    host_bound: bool
    window: int
    bytes: int
    flops: int
    warmup_calls: int
    rounds: int
    calls_per_round: int
    noise_floor: float  # relative spread of reference-vs-reference (A/A), e.g. 0.012 = 1.2%
    aa_log_ratios: list[float]
    contenders: list[ContenderTiming]
    comparisons: list[Comparison]
    criteria: list[CriterionCheck]
    passed: bool
    ambiguous: bool


class Ceilings(BaseModel):
    copy_gbps: float  # device-to-device copy, bytes read + written
    copy_bytes: int
    gemm_bf16_tflops: float
    gemm_n: int


class BufferProvenance(BaseModel):
    source: Literal["fresh", "loaded"]
    seed: int
    directory: str | None = None
    sha256: dict[str, str] = Field(default_factory=dict)  # file name -> digest (loaded buffers)


class GateResult(BaseModel):
    gate: str
    arm: str
    preset: str
    preset_params: dict[str, Any]
    device: str
    status: Status
    reason: str | None = None
    parity: ParityResult | None = None
    saboteurs: list[SaboteurResult] = Field(default_factory=list)
    bench: list[BenchResult] = Field(default_factory=list)
    bench_skipped: str | None = None
    buffers: BufferProvenance | None = None
    duration_s: float = 0.0
    peak_memory_bytes: int | None = None  # CUDA: the most the gate held at once, bench included


class SkippedGate(BaseModel):
    gate: str
    reason: str


class Fingerprint(BaseModel):
    device_slug: str  # e.g. "nvidia-h200" or "cpu"
    gpu_name: str | None = None
    compute_capability: str | None = None
    gpu_memory_bytes: int | None = None
    sm_count: int | None = None
    driver: str | None = None
    cuda: str | None = None
    torch: str
    triton: str | None = None
    python: str
    platform: str
    git_sha: str | None = None
    git_dirty: bool | None = None
    clocks: dict[str, int] = Field(default_factory=dict)  # MHz, when nvidia-smi answers
    profile: str = "none"  # "rtx" when Triton configs were held to 99 KB of shared memory


class RunReport(BaseModel):
    schema_version: int = SCHEMA_VERSION
    run_id: str
    what: str  # "gate rmsnorm", "bench all", "run"
    command: str
    started_utc: str
    finished_utc: str
    fingerprint: Fingerprint
    ceilings: Ceilings | None = None
    results: list[GateResult]
    skipped: list[SkippedGate] = Field(default_factory=list)
    exit_code: int


# --------------------------------------------------------------------------------------------
# Reading, rendering and writing. Everything below works from the model alone, never from
# live objects, so a saved report.json can be re-rendered anywhere.
# --------------------------------------------------------------------------------------------

REPORT_FILES = ("report.json", "report.md", "junit.xml", "benchmark.json")
TMP_PREFIX = ".tmp-"
STALE_TMP_S = 3600  # a temp dir this old belongs to a run that died; the next write removes it

_EXIT_MEANINGS = {
    ExitCode.OK: "every gate that ran passed",
    ExitCode.FAILED: "a gate failed (parity, determinism, anti-cheat or performance)",
    ExitCode.USAGE: "usage error (unknown gate or preset, bad option)",
    ExitCode.COULD_NOT_RUN: (
        "a gate could not run (no CUDA for a CUDA gate, out of memory, compile error or bad buffers)"
    ),
    ExitCode.AMBIGUOUS: "timing stayed ambiguous against the noise floor, which is never a pass",
}

M = TypeVar("M", bound=BaseModel)


def slugify(text: str) -> str:
    """Lower-case words joined by '-': "gate rmsnorm" -> "gate-rmsnorm", safe in paths."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


def exit_code_meaning(code: int) -> str:
    try:
        return _EXIT_MEANINGS[ExitCode(code)]
    except ValueError:
        return "not an exit code this suite sets"


# ---- JSON ----------------------------------------------------------------------------------


def to_json(report: RunReport) -> str:
    return report.model_dump_json(indent=2)


def read_versioned_json(path: str | Path, model: type[M], schema_version: int, kind: str) -> M:
    """Load a versioned JSON document into `model`, or raise UsageError saying what is wrong.

    Shared by run reports and baselines, which are read back by a person's command and
    must fail with a message naming the file, not a traceback.
    """
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise UsageError(f"cannot read {kind} {path}: {exc.strerror or exc}") from exc
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise UsageError(
            f"{path} is not a {kind}: not valid JSON ({exc.msg} at line {exc.lineno}, "
            f"column {exc.colno})"
        ) from exc
    if not isinstance(data, dict):
        raise UsageError(f"{path} is not a {kind}: expected a JSON object, found {type(data).__name__}")
    found = data.get("schema_version")
    if found != schema_version:
        found_text = "no schema_version" if found is None else f"schema_version {found!r}"
        raise UsageError(
            f"{path} has {found_text}; this suite reads {kind}s of schema_version "
            f"{schema_version}. Re-create it with this version of the suite, or read it "
            f"with the version that wrote it."
        )
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        raise UsageError(f"{path} is not a valid {kind}: {_summarise(exc)}") from exc


def _summarise(exc: ValidationError, limit: int = 5) -> str:
    problems = [
        f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg']}"
        for err in exc.errors()
    ]
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return f"{len(problems)} problem(s): " + "; ".join(problems[:limit]) + more


def load_report(path: str | Path) -> RunReport:
    return read_versioned_json(path, RunReport, SCHEMA_VERSION, "run report")


# ---- Markdown ------------------------------------------------------------------------------

_DASH = "—"


def _f(value: float | int | None, spec: str) -> str:
    return _DASH if value is None else format(value, spec)


def _pct(value: float | None, digits: int = 1) -> str:
    return _DASH if value is None else f"{100 * value:.{digits}f}%"


def _yes(value: bool | None, none: str = _DASH) -> str:
    return none if value is None else ("yes" if value else "**NO**")


def _cell(text: object) -> str:
    # A '|' or newline inside a cell would break the Markdown table around it.
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown_table(headers: list[str], rows: list[list[object]]) -> str:
    # disable_numparse keeps the figures exactly as formatted (no re-rounding by tabulate)
    return tabulate(
        [[_cell(c) for c in row] for row in rows], headers=headers, tablefmt="github",
        disable_numparse=True,
    )


def _status(status: str) -> str:
    return status if status in ("passed", "skipped") else f"**{status.replace('_', ' ').upper()}**"


def _parity_summary(result: GateResult) -> str:
    parity = result.parity
    if parity is None:
        return _DASH
    checked, ok = parity.counts()
    text = f"{parity.mode} {ok}/{checked} tensors ok"
    if not parity.passed:
        text += f"; FAILED: {parity.failures[0]}" if parity.failures else "; FAILED"
    return text


def bench_summary(result: GateResult) -> str:
    """One line per gate result: each case's arm time, fraction of the ceiling and speedup."""
    if result.bench_skipped and not result.bench:
        return f"skipped: {result.bench_skipped}"
    parts = []
    for bench in result.bench:
        arm = next((c for c in bench.contenders if c.role == "arm"), None)
        vs_ref = next((c for c in bench.comparisons if c.against == "reference"), None)
        text = bench.case
        if arm is not None and arm.median_ms is not None:
            text += f" {arm.median_ms:.4g} ms"
            if arm.ceiling_fraction is not None:
                text += f" ({arm.ceiling_fraction:.0%} of ceiling)"
        if vs_ref is not None:
            text += f", {vs_ref.speedup:.2f}x vs reference ({vs_ref.verdict})"
        if bench.ambiguous:
            text += " AMBIGUOUS"
        elif not bench.passed:
            text += " FAILED"
        parts.append(text)
    return "; ".join(parts) or _DASH


def _header(report: RunReport) -> list[str]:
    fp = report.fingerprint
    gpu = fp.gpu_name or "none (CPU)"
    if fp.gpu_memory_bytes is not None:
        gpu += f", {fp.gpu_memory_bytes / 2**30:.0f} GiB"
    if fp.sm_count is not None:
        gpu += f", {fp.sm_count} SMs"
    clocks = ", ".join(f"{k} {v} MHz" for k, v in fp.clocks.items()) or _DASH
    git = _DASH if fp.git_sha is None else fp.git_sha[:12] + (" (dirty)" if fp.git_dirty else "")
    machine = [
        ["GPU", gpu],
        ["compute capability", fp.compute_capability or _DASH],
        ["driver", fp.driver or _DASH],
        ["CUDA", fp.cuda or _DASH],
        ["torch", fp.torch],
        ["triton", fp.triton or _DASH],
        ["python", fp.python],
        ["platform", fp.platform],
        ["git", git],
        ["profile", fp.profile],
        ["clocks", clocks],
    ]
    lines = [
        f"# Suite report: {report.what}",
        "",
        f"- command: `{report.command}`",
        f"- run: {report.run_id}, {report.started_utc} to {report.finished_utc} (UTC)",
        f"- exit code: **{report.exit_code}**: {exit_code_meaning(report.exit_code)}",
        "",
        "## Machine",
        "",
        markdown_table(["machine", ""], machine),
        "",
    ]
    if report.ceilings is not None:
        c = report.ceilings
        lines += [
            "Measured ceilings (every bench's fraction of ceiling is of these):",
            "",
            f"- device copy: {c.copy_gbps:.0f} GB/s (bytes read + written, {c.copy_bytes / 2**20:.0f} MiB)",
            f"- bf16 GEMM: {c.gemm_bf16_tflops:.0f} TFLOP/s ({c.gemm_n}^3)",
            "",
        ]
    return lines


# a multi-step gate checks thousands of outputs: beyond this many, list only the failing ones
MAX_PARITY_ROWS = 40


def _parity_section(parity: ParityResult) -> list[str]:
    checked, ok = parity.counts()
    shown = parity.tensors
    if checked > MAX_PARITY_ROWS:
        shown = [t for t in parity.tensors if not t.passed][:MAX_PARITY_ROWS]
    if parity.mode == "bitwise":
        title = "bitwise"
        headers = ["tensor", "shape", "dtype", "ok", "differing", "first index", "max ULP", "message"]
        rows = [
            [t.name, list(t.shape), t.dtype, _yes(t.passed), _f(t.differing, "d"),
             _DASH if t.first_index is None else list(t.first_index), _f(t.max_ulp, "d"),
             t.message]
            for t in shown
        ]
    else:
        title = f"tolerance: arm error <= {parity.k:g} x reference error + {parity.floor:g}"
        # *_rel_max hold the worst row's relative L2 error (parity.py), so an error confined
        # to small rows shows even when the whole-tensor figure hides it
        headers = ["tensor", "shape", "dtype", "ok", "arm rel L2", "ref rel L2", "limit",
                   "arm worst row", "ref worst row", "limit", "NaN/Inf match", "message"]
        rows = [
            [t.name, list(t.shape), t.dtype, _yes(t.passed), _f(t.arm_rel_l2, ".3e"),
             _f(t.ref_rel_l2, ".3e"), _f(t.limit_rel_l2, ".3e"), _f(t.arm_rel_max, ".3e"),
             _f(t.ref_rel_max, ".3e"), _f(t.limit_rel_max, ".3e"), _yes(t.nonfinite_match),
             t.message]
            for t in shown
        ]
    if parity.deterministic is None:
        deterministic = f"not required ({parity.nondeterministic_reason or 'declared nondeterministic'})"
    else:
        deterministic = _yes(parity.deterministic)
    lines = [
        f"### Parity ({title}): {'passed' if parity.passed else '**FAILED**'}",
        "",
        markdown_table(headers, rows),
        "",
        f"- outputs checked: {checked}, passed: {ok}"
        + ("" if shown is parity.tensors else f" (the table lists the failing ones, at most {MAX_PARITY_ROWS})"),
        f"- first divergence: {parity.first_divergence or 'none'}",
        f"- inputs unchanged: {_yes(parity.inputs_unchanged)}",
        f"- deterministic (two runs, same bits): {deterministic}",
        f"- parity rechecked after timing: {_yes(parity.recheck_after_timing, 'not run (no timing)')}",
    ]
    lines += [f"- failure: {f}" for f in parity.failures]
    return lines + [""]


def _saboteur_section(saboteurs: list[SaboteurResult]) -> list[str]:
    rows = [
        [s.name, s.description, s.expected_check, "caught" if s.caught else "**MISSED**",
         "; ".join(s.failures) or _DASH]
        for s in saboteurs
    ]
    return [
        "### Saboteurs (known-bad arms the gate must fail)",
        "",
        markdown_table(
            ["saboteur", "what it does", "must be caught by", "result", "what the gate said"], rows
        ),
        "",
    ]


def _bench_section(bench: BenchResult) -> list[str]:
    versus = {c.against: c for c in bench.comparisons}
    rows = []
    for c in bench.contenders:
        if c.unavailable:
            rows.append([c.name, c.role] + [_DASH] * 6 + [f"unavailable: {c.unavailable}"])
            continue
        cmp = versus.get(c.name)
        speedup = _DASH if cmp is None else (
            f"{cmp.speedup:.2f}x [{cmp.ci_low:.2f}, {cmp.ci_high:.2f}] {cmp.verdict}"
        )
        rows.append([
            c.name, c.role, _f(c.cold_ms, ".3f"), _f(c.median_ms, ".4f"), _f(c.gbps, ".0f"),
            _f(c.tflops, ".1f"), _pct(c.ceiling_fraction, 0), speedup,
            "; ".join(note for note in (
                None if c.method == "eager" else f"timed: {c.method}",
                None if c.gpu_busy_ms is None else f"GPU busy {c.gpu_busy_ms:.4f} ms of the step",
            ) if note),
        ])
    status = "AMBIGUOUS" if bench.ambiguous else ("passed" if bench.passed else "FAILED")
    how = f"host-bound, window of {bench.window} calls" if bench.host_bound else "device time"
    lines = [
        f"### Bench {bench.case}: {bench.description}: {_status(status.lower())}",
        "",
        f"- {bench.l2} L2, {how}; {bench.warmup_calls} warm-up calls, {bench.rounds} rounds x "
        f"{bench.calls_per_round} calls; {bench.bytes:,} bytes and {bench.flops:,} FLOPs per call",
        f"- noise floor (reference vs itself, same run): {_pct(bench.noise_floor)}",
        "",
        markdown_table(
            ["contender", "role", "cold ms", "median ms", "GB/s", "TFLOP/s", "of ceiling",
             "arm speedup vs this [95% CI]", "note"],
            rows,
        ),
        "",
    ]
    lines += [
        f"- {'PASS' if c.passed else '**FAIL**'} {c.name}: {c.detail}" for c in bench.criteria
    ]
    return lines + [""]


def _result_section(result: GateResult) -> list[str]:
    lines = [
        f"## {result.gate} / {result.preset} on {result.device}: {_status(result.status)}",
        "",
        f"- arm: `{result.arm}`; preset: "
        + (", ".join(f"{k}={v}" for k, v in result.preset_params.items()) or _DASH)
        + f"; took {result.duration_s:.1f} s"
        + (f"; peak GPU memory {result.peak_memory_bytes / 2**30:.2f} GiB" if result.peak_memory_bytes else ""),
    ]
    if result.reason:
        lines.append(f"- reason: {result.reason}")
    if result.buffers is not None:
        b = result.buffers
        where = f"loaded from {b.directory}" if b.source == "loaded" else "fresh"
        lines.append(f"- buffers: {where}, seed {b.seed}, {len(b.sha256)} file(s) hashed")
    lines.append("")
    if result.parity is not None:
        lines += _parity_section(result.parity)
    if result.saboteurs:
        lines += _saboteur_section(result.saboteurs)
    if result.bench_skipped:
        lines += [f"Bench skipped: {result.bench_skipped}", ""]
    for bench in result.bench:
        lines += _bench_section(bench)
    return lines


def render_markdown(report: RunReport) -> str:
    lines = _header(report)
    summary = [
        [r.gate, r.preset, r.device, _status(r.status), _parity_summary(r), bench_summary(r)]
        for r in report.results
    ] + [[s.gate, _DASH, _DASH, "skipped", _DASH, s.reason] for s in report.skipped]
    lines += [
        "## Summary",
        "",
        markdown_table(["gate", "preset", "device", "status", "parity", "bench"], summary),
        "",
    ]
    for result in report.results:
        lines += _result_section(result)
    return "\n".join(lines).rstrip() + "\n"


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

    # The gate's whole duration is booked on its parity case; the others add no time.
    parity = case("parity", result.duration_s)
    cases = [parity]
    if result.parity is not None:
        if not result.parity.passed:
            detail = "\n".join(result.parity.failures + [
                f"{t.name}: {t.message}" for t in result.parity.tensors if not t.passed
            ])
            message = result.parity.failures[0] if result.parity.failures else "parity failed"
            _outcome(parity, "failure", message, detail)
    elif result.status == "skipped":
        _outcome(parity, "skipped", result.reason or "skipped")
    elif result.status == "could_not_run":
        _outcome(parity, "error", result.reason or "could not run")
    elif result.status == "failed":
        _outcome(parity, "failure", result.reason or "failed before parity was judged")

    for sab in result.saboteurs:
        c = case(f"saboteur:{sab.name}")
        if not sab.caught:
            _outcome(c, "failure", f"saboteur not caught: {sab.description}",
                     f"expected to be caught by {sab.expected_check}")
        cases.append(c)

    if result.bench_skipped:
        c = case("bench")
        _outcome(c, "skipped", result.bench_skipped)
        cases.append(c)
    for bench in result.bench:
        c = case(f"bench:{bench.case}")
        failed = [f"{k.name}: {k.detail}" for k in bench.criteria if not k.passed]
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
    dashboards built on it read them. One entry per timed (gate, preset, case, contender);
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
                param = f"{result.preset}-{bench.case}-{c.name}"
                name = f"{result.gate}[{param}]"
                cmp = versus.get(c.name)
                benchmarks.append({
                    "group": f"{result.gate}/{result.preset}/{bench.case}",
                    "name": name,
                    "fullname": f"gates/{result.gate}.py::{name}",
                    "params": {
                        "gate": result.gate, "preset": result.preset, "case": bench.case,
                        "contender": c.name, **result.preset_params,
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
                        "noise_floor": bench.noise_floor,
                        "bytes": bench.bytes,
                        "flops": bench.flops,
                        "arm_speedup": None if cmp is None else {
                            "speedup": cmp.speedup, "ci": [cmp.ci_low, cmp.ci_high],
                            "verdict": cmp.verdict,
                        },
                        "run_id": report.run_id,
                    },
                    "options": {
                        "rounds": bench.rounds,
                        "calls_per_round": bench.calls_per_round,
                        "warmup_calls": bench.warmup_calls,
                        "l2": bench.l2,
                        "host_bound": bench.host_bound,
                        "window": bench.window,
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


# ---- writing a report directory ------------------------------------------------------------


def _utc_stamp(iso: str) -> str:
    """YYYYmmddTHHMMSSZ of the run's start, so directories sort by when runs began."""
    try:
        when = datetime.fromisoformat(iso.replace("Z", "+00:00"))
    except ValueError:  # a hand-made report; the time of writing is the next best name
        when = datetime.now(timezone.utc)
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.astimezone(timezone.utc).strftime("%Y%m%dT%H%M%SZ")


def _remove_stale_tmp(reports_dir: Path) -> None:
    cutoff = time.time() - STALE_TMP_S
    for leftover in reports_dir.glob(TMP_PREFIX + "*"):
        try:
            if leftover.is_dir() and leftover.stat().st_mtime < cutoff:
                shutil.rmtree(leftover, ignore_errors=True)
        except OSError:
            pass  # another writer removed it first


def _write_file(path: Path, text: str) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        fh.write(text)
        fh.flush()
        # on disk before the rename publishes the directory, so a power cut cannot leave a
        # complete-looking directory of empty files
        os.fsync(fh.fileno())


def write_report(report: RunReport, reports_dir: str | Path, what: str | None = None) -> Path:
    """Write report.json, report.md, junit.xml and benchmark.json as one directory
    reports_dir/<UTC start time>_<what slug>, published by one rename: an interrupted run
    leaves the whole directory or none. `what` defaults to report.what."""
    reports_dir = Path(reports_dir)
    reports_dir.mkdir(parents=True, exist_ok=True)
    _remove_stale_tmp(reports_dir)
    # hidden, and without '_', so no reader's glob for "<time>_<what>" can pick it up
    tmp = reports_dir / f"{TMP_PREFIX}{slugify(report.run_id) or 'run'}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        contents = {
            "report.json": to_json(report),
            "report.md": render_markdown(report),
            "junit.xml": render_junit(report),
            "benchmark.json": json.dumps(render_pytest_benchmark(report), indent=4),
        }
        for name in REPORT_FILES:
            _write_file(tmp / name, contents[name])
        base = f"{_utc_stamp(report.started_utc)}_{slugify(what or report.what) or 'run'}"
        for n in itertools.count(1):
            final = reports_dir / (base if n == 1 else f"{base}-{n}")
            if final.exists():
                continue
            try:
                os.rename(tmp, final)
                return final
            except OSError:
                if not final.exists():
                    raise
                # another run took the name between the check and the rename; try the next
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def list_reports(reports_dir: str | Path) -> list[Path]:
    """Complete report directories, oldest first; temp dirs of unfinished writes are not reports."""
    reports_dir = Path(reports_dir)
    if not reports_dir.is_dir():
        return []
    return sorted(
        p for p in reports_dir.iterdir()
        if p.is_dir() and not p.name.startswith(".") and (p / "report.json").is_file()
    )
