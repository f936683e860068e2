"""Renderings of a run report a person reads: JSON, Markdown (tabulate), the baseline
comparison table and the baseline pages (the ones CI tools read are `render_ci`'s). Each works
from the results model alone, never from live objects, so a saved report.json can be
re-rendered anywhere.
"""

from __future__ import annotations

from tabulate import tabulate

from suite.errors import ExitCode
from suite.harness.baseline import Baseline, BaselineEntry, ComparisonReport, load_baseline
from suite.harness.results import (
    BenchResult,
    GateResult,
    ParityResult,
    Recommendation,
    RunReport,
    SaboteurResult,
    TensorCheck,
)

_EXIT_MEANINGS = {
    ExitCode.OK: "every gate that ran passed",
    ExitCode.FAILED: "a gate failed (parity, determinism, anti-cheat or performance)",
    ExitCode.USAGE: "usage error (unknown gate or preset, bad option)",
    ExitCode.COULD_NOT_RUN: (
        "a gate could not run (no CUDA for a CUDA gate, out of memory, compile error or bad buffers)"
    ),
    ExitCode.AMBIGUOUS: "timing stayed ambiguous against the noise floor, which is never a pass",
    ExitCode.INTERRUPTED: "interrupted by SIGINT, SIGTERM or SIGHUP",
}


def exit_code_meaning(code: int) -> str:
    try:
        return _EXIT_MEANINGS[ExitCode(code)]
    except ValueError:
        return "not an exit code this suite sets"


def to_json(report: RunReport) -> str:
    return report.model_dump_json(indent=2)


# ---- Markdown ------------------------------------------------------------------------------

_DASH = "—"


def _f(value: float | int | None, spec: str) -> str:
    return _DASH if value is None else format(value, spec)


def _rate(value: float | None) -> str:
    """Three figures below 100 (a disk's rate under 1 GB/s, not "1"), whole numbers above."""
    return _DASH if value is None else format(value, ".0f" if value >= 100 else ".3g")


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
    text = f"{parity.mode} {ok}/{checked} outputs ok"
    if not parity.passed:
        text += f"; FAILED: {parity.failures[0]}" if parity.failures else "; FAILED"
    return text


def _speed(ms: float | None) -> str:
    return _DASH if ms is None else f"{ms:.4g} ms"


def bench_summary(result: GateResult) -> str:
    """One line per gate result: each case and mode's arm time, ceiling fraction and speedup."""
    if result.bench_skipped and not result.bench:
        return f"skipped: {result.bench_skipped}"
    parts = []
    for bench in result.bench:
        arm = next((c for c in bench.contenders if c.role == "arm"), None)
        reference = next((c.name for c in bench.contenders if c.role == "reference"), None)
        vs_ref = next((c for c in bench.comparisons if c.against == reference), None)
        text = f"{bench.case} ({bench.mode})"
        if arm is not None and arm.median_ms is not None:
            text += f" {_speed(arm.median_ms)}"
            if arm.ceiling_fraction is not None:
                text += f" ({arm.ceiling_fraction:.0%} of {bench.ceiling})"
        if vs_ref is not None:
            text += f", {vs_ref.speedup:.2f}x vs {reference} ({vs_ref.verdict})"
        if bench.ambiguous:
            text += " AMBIGUOUS"
        elif not bench.passed:
            text += " FAILED"
        parts.append(text)
    parts += [f"{e.case} ({e.mode}) COULD NOT RUN" for e in result.bench_errors]
    return "; ".join(parts) or _DASH


def _header(report: RunReport) -> list[str]:
    fp = report.fingerprint
    gpu = fp.gpu_name or "none (CPU)"
    if fp.gpu_memory_bytes is not None:
        gpu += f", {fp.gpu_memory_bytes / 2**30:.0f} GiB"
    if fp.sm_count is not None:
        gpu += f", {fp.sm_count} SMs"
    if fp.gpu_memory_cap_bytes is not None:
        gpu += f", held to {fp.gpu_memory_cap_bytes / 2**30:g} GiB (--gpu-memory)"
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


def _bitwise_rows(checks: list[TensorCheck]) -> tuple[list[str], list[list[object]]]:
    headers = ["output", "shape", "dtype", "ok", "differing", "first index", "max ULP", "problems"]
    rows = [
        [t.name, list(t.shape), t.dtype, _yes(t.passed), _f(t.differing, "d"),
         _DASH if t.first_index is None else list(t.first_index), _f(t.max_ulp, "d"), t.message]
        for t in checks
    ]
    return headers, rows


def _tolerance_rows(checks: list[TensorCheck]) -> tuple[list[str], list[list[object]]]:
    # *_rel_max hold the worst row's relative L2 error (parity.py), so an error confined to
    # small rows shows even when the whole-tensor figure hides it
    headers = ["output", "shape", "dtype", "ok", "k", "finite compared", "arm rel L2", "ref rel L2",
               "limit", "arm worst row", "ref worst row", "limit", "row floor", "NaN/Inf match", "problems"]
    rows = [
        [t.name, list(t.shape), t.dtype, _yes(t.passed), _f(t.k, "g"), _f(t.compared, ",d"),
         _f(t.arm_rel_l2, ".3e"), _f(t.ref_rel_l2, ".3e"), _f(t.limit_rel_l2, ".3e"),
         _f(t.arm_rel_max, ".3e"), _f(t.ref_rel_max, ".3e"), _f(t.limit_rel_max, ".3e"), _f(t.row_floor, "g"),
         _yes(t.nonfinite_match), t.message]
        for t in checks
    ]
    return headers, rows


def _parity_section(parity: ParityResult) -> list[str]:
    checked, ok = parity.counts()
    shown = parity.tensors
    if checked > MAX_PARITY_ROWS:
        shown = [t for t in parity.tensors if not t.passed][:MAX_PARITY_ROWS]
    lines = [f"### Parity ({parity.mode}): {'passed' if parity.passed else '**FAILED**'}", ""]
    for mode, rows_of in (("bitwise", _bitwise_rows), ("tolerance", _tolerance_rows)):
        checks = [t for t in shown if t.mode == mode]
        if checks:
            if mode == "tolerance":
                lines += ["Tolerance: the arm's error against the float64 truth must be at most k x the "
                          "reference's own error + the floor.", ""]
            lines += [markdown_table(*rows_of(checks)), ""]
    if parity.deterministic is None and parity.nondeterministic_reason is None and parity.recheck_after_timing is False:
        deterministic = "not run (timing modified the inputs)"
    elif parity.deterministic is None:
        deterministic = f"not required ({parity.nondeterministic_reason or 'declared nondeterministic'})"
    else:
        deterministic = _yes(parity.deterministic)
    after = parity.second_run_after_timing
    if after:
        deterministic += " (the second run came after timing)"
    lines += [
        f"- outputs checked: {checked}, passed: {ok}"
        + ("" if shown is parity.tensors else f" (the tables list the failing ones, at most {MAX_PARITY_ROWS})"),
        f"- first divergence: {parity.first_divergence or 'none'}",
        f"- inputs unchanged: {_yes(parity.inputs_unchanged)}",
        f"- deterministic (two runs, same bits): {deterministic}",
        f"- parity rechecked after timing: {_yes(parity.recheck_after_timing, 'not run (no timing)')}"
        + (" (by that second run)" if after else ""),
    ]
    lines += [f"- failure: {f}" for f in parity.failures]
    return lines + [""]


def _saboteur_section(saboteurs: list[SaboteurResult]) -> list[str]:
    rows = [
        [s.name, s.description, s.expected_check.value, "caught" if s.caught else "**MISSED**",
         "; ".join(str(f) for f in s.failures) or _DASH]
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


_MODE_TEXT = {
    "graph": "device time: CUDA-graph replays",
    "eager": "eager calls: the host's dispatch included",
    "wall": "host wall clock",
}


def _bench_section(bench: BenchResult) -> list[str]:
    versus = {c.against: c for c in bench.comparisons}
    rows = []
    for c in bench.contenders:
        if c.unavailable:
            rows.append([c.name, c.role] + [_DASH] * 7 + [f"unavailable: {c.unavailable}"])
            continue
        cmp = versus.get(c.name)
        speedup = _DASH if cmp is None else (
            f"{cmp.speedup:.2f}x [{cmp.ci_low:.2f}, {cmp.ci_high:.2f}] {cmp.verdict}"
        )
        rows.append([
            c.name, c.role, _f(c.cold_ms, ".3f"), _f(c.median_ms, ".4f"), _rate(c.gbps),
            _f(c.tflops, ".1f"), _pct(c.ceiling_fraction, 0), _f(c.host_us, ".1f"), speedup,
            "; ".join(note for note in (
                c.method or None,
                c.note or None,
                None if c.setup_s is None else f"setup {c.setup_s:.1f} s" + (
                    "" if c.setup_peak_bytes is None else f", {c.setup_peak_bytes / 2**30:.2f} GiB held at its peak"),
                None if c.call_peak_bytes is None else f"a call holds {c.call_peak_bytes / 2**30:.3f} GiB at its peak",
                None if c.gpu_busy_ms is None else f"GPU busy {c.gpu_busy_ms:.4f} ms of the step",
                None if c.idle_start_tail_ms is None else
                f"timed from an idle device (no lead-in call; {c.idle_start_tail_ms:.3f} ms queued at return)",
            ) if note),
        ])
    status = "AMBIGUOUS" if bench.ambiguous else ("passed" if bench.passed else "FAILED")
    per = f"windows of {bench.window} back-to-back calls" if bench.window > 1 else "one call per timing"
    single = [c.name for c in bench.contenders if c.window is not None and c.window < bench.window]
    if single:
        per += f" (one call for {', '.join(single)}: a millisecond or more a call)"
    rotated = f", {bench.rotation} input sets rotated" if bench.rotation > 1 else ""
    lines = [
        f"### Bench {bench.case}, {bench.mode}: {bench.description}: {_status(status.lower())}",
        "",
        f"- {_MODE_TEXT[bench.mode]}; {bench.l2} L2{rotated}; {per}; {bench.warmup_calls} warm-up "
        f"calls, {bench.rounds} rounds x {bench.calls_per_round} timings; {bench.bytes:,} bytes and "
        f"{bench.flops:,} FLOPs per call; took {bench.duration_s:.1f} s",
        f"- noise floor (reference vs itself, same run): {_pct(bench.noise_floor)}" + "".join(
            f"; {name}, timed twice a round too, judged against the wider of its own A/A and "
            f"the reference's: {_pct(versus[name].noise_floor)}"
            for name in bench.peer_aa_log_ratios if name in versus),
    ]
    if bench.host_probe:
        lines.append(f"- host us/call: measured on {bench.host_probe}, back-to-back calls, best of 5 batches")
    lines += [
        "",
        markdown_table(
            ["contender", "role", "cold ms", "median ms", "GB/s", "TFLOP/s", f"of {bench.ceiling}",
             "host us/call", "arm speedup vs this [95% CI]", "note"],
            rows,
        ),
        "",
    ]
    lines += [
        f"- {_verdict_word(c)} {c.name}: {c.detail}" for c in bench.criteria
    ]
    return lines + [""]


def _verdict_word(check) -> str:
    if check.target:
        return "MET" if check.passed else "*missed*"
    return "PASS" if check.passed else "**FAIL**"


def _phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.1f} s" for name, seconds in phases.items()) or _DASH


def _result_section(result: GateResult) -> list[str]:
    lines = [
        f"## {result.gate} / {result.preset} on {result.device}: {_status(result.status)}",
        "",
        f"- arm: `{result.arm}`; preset: "
        + (", ".join(f"{k}={v}" for k, v in result.preset_params.items()) or _DASH)
        + (f"; peak GPU memory {result.peak_memory_bytes / 2**30:.2f} GiB" if result.peak_memory_bytes else ""),
        f"- took {result.duration_s:.1f} s: {_phases(result.phases)}",
    ]
    if result.reason:
        lines.append(f"- reason: {result.reason}")
    if result.buffers is not None:
        b = result.buffers
        where = f"loaded from {b.directory}" if b.source == "loaded" else "fresh"
        lines.append(f"- buffers: {where}, seed {b.seed}, {len(b.sha256)} file(s) hashed")
    if result.saboteurs_note:
        lines.append(f"- saboteurs: {result.saboteurs_note}")
    lines.append("")
    if result.traceback:
        lines += ["Traceback of the error:", "", "```", result.traceback.rstrip(), "```", ""]
    if result.parity is not None:
        lines += _parity_section(result.parity)
    if result.saboteurs:
        lines += _saboteur_section(result.saboteurs)
    if result.bench_skipped:
        lines += [f"Bench skipped: {result.bench_skipped}", ""]
    for bench in result.bench:
        lines += _bench_section(bench)
    for error in result.bench_errors:
        lines += [f"Bench case {error.case} ({error.mode}) could not run: {error.message}", ""]
        if error.traceback:
            lines += ["```", error.traceback.rstrip(), "```", ""]
    return lines


def render_markdown(report: RunReport) -> str:
    lines = _header(report)
    summary = [
        [r.gate, r.preset, r.device, _status(r.status), f"{r.duration_s:.1f}", _parity_summary(r),
         bench_summary(r)]
        for r in report.results
    ] + [[s.gate, _DASH, _DASH, "skipped", _DASH, _DASH, s.reason] for s in report.skipped]
    per_gate: dict[str, float] = {}
    for r in report.results:
        per_gate[r.gate] = per_gate.get(r.gate, 0.0) + r.duration_s
    lines += [
        "## Summary",
        "",
        markdown_table(["gate", "preset", "device", "status", "s", "parity", "bench"], summary),
        "",
        f"- wall time: {report.duration_s:.1f} s in all; per gate: "
        + (", ".join(f"{g} {s:.1f} s" for g, s in per_gate.items()) or _DASH),
        "",
    ]
    for result in report.results:
        lines += _result_section(result)
    lines += _recommendation_section(report)
    return "\n".join(lines).rstrip() + "\n"


def _recommendation_section(report: RunReport) -> list[str]:
    """Last in the report: per preset and bench, each contender against its baseline, and whether
    to switch it on (faster beyond the noise floor) or leave it off."""
    rows = [
        [r.preset, bench.case, rec.contender, rec.against,
         f"{rec.speedup:.3f}x [{rec.ci_low:.3f}, {rec.ci_high:.3f}]", _pct(rec.noise_floor), rec.advice]
        for r in report.results for bench in r.bench for rec in bench.recommendations
    ]
    if not rows:
        return []
    return [
        "## Recommendations",
        "",
        "Each contender's speedup over its baseline (the baseline's time over its own; median over rounds, "
        "95% bootstrap CI), judged against the noise floor: switch it on only where it is faster.",
        "",
        markdown_table(["preset", "bench", "contender", "against", "speedup [95% CI]", "floor", "advice"], rows),
        "",
    ]


# ---- the baseline comparison table ---------------------------------------------------------


def render_comparison(cmp: ComparisonReport) -> str:
    regressed = [e for e in cmp.entries if e.role == "arm" and e.status == "regressed"]
    if not cmp.judged:
        verdict = "nothing compared: no arm timing of this run has a baseline entry"
    elif cmp.passed:
        verdict = "passed"
    else:
        verdict = f"**FAILED**: {len(regressed)} arm timing(s) regressed"
    lines = [f"# Comparison of run {cmp.run_id} with baselines: {verdict}", ""]
    for gate, path in cmp.baselines.items():
        lines.append(f"- {gate}: {path}")
    for gate, difference in cmp.mismatches.items():
        lines.append(f"- forced past a fingerprint mismatch for {gate}: {difference}")
    if cmp.baselines or cmp.mismatches:
        lines.append("")

    def ms(value: float | None) -> str:
        return "—" if value is None else f"{value:.4f}"

    def pct(ratio: float | None) -> str:
        return "—" if ratio is None else f"{100 * (ratio - 1):+.1f}%"

    def change(e) -> str:
        if e.ratio is None:
            return "—"
        ci = "" if e.ci_low is None else f" [{pct(e.ci_low)}, {pct(e.ci_high)}]"
        return pct(e.ratio) + ci

    rows = [
        [e.gate, e.preset, e.case, e.mode, e.contender, e.role, ms(e.baseline_ms),
         e.baseline_runs or "—", "—" if e.spread is None or e.baseline_runs < 2 else f"{100 * e.spread:.1f}%",
         ms(e.new_ms), change(e),
         "—" if e.others_moved is None else f"{pct(e.others_moved)} ({e.others})", pct(e.beyond_others),
         "—" if e.threshold is None else f"±{100 * e.threshold:.1f}%",
         f"**{e.status.upper()}**" if e.status == "regressed" and e.role == "arm" else e.status,
         e.note]
        for e in cmp.entries
    ]
    lines.append(markdown_table(
        ["gate", "preset", "case", "mode", "contender", "role", "baseline ms", "runs", "runs apart",
         "new ms", "change [95% CI]", "others moved (n)", "beyond others", "counts beyond", "status", "note"],
        rows,
    ))
    lines += [
        "",
        "baseline ms: the median of the saved runs; runs apart: their slowest over their fastest; "
        "others moved: the median change of the bench's other reference and peers; a change counts "
        "beyond the widest of 2%, the new run's noise floor and how far the saved runs lie apart, "
        "with its CI clear of no change, and, where at least 3 others moved, beyond their move "
        "(beyond others) as well.",
    ]
    return "\n".join(lines) + "\n"


# ---- baselines as pages (suite baseline show) ----


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def _center(entries: list[BaselineEntry], field: str) -> float | None:
    values = [getattr(e, field) for e in entries if getattr(e, field) is not None]
    return _median(values) if values else None


# every page `baseline_pages` renders says so near its top: how store.write_baseline_pages knows its own
WRITTEN_BY = "by `suite baseline show --write docs/results`"


def render_baseline(baseline: Baseline, source: str) -> str:
    """One gate's saved figures on one class of machine as a Markdown page: per preset its runs
    (run id, commit, command), then per bench case each contender's median ms in both timing
    modes (the median over the saved runs), throughput and share of the ceiling in the first
    mode it has, host time per call, and how far the saved runs lie apart. Deterministic: the
    same file renders to the same page, so CI can tell a stale page."""
    first = baseline.runs[0].fingerprint if baseline.runs else None
    machine = (f"{first.gpu_name or first.device_slug}, torch {first.torch}, triton {first.triton or '-'}"
               if first else "no runs saved")
    lines = [
        f"# {baseline.gate} on {machine}", "",
        f"Rendered from `{source}` {WRITTEN_BY}; do not edit by hand.",
        "Each figure is the median over the runs saved for its preset (`suite baseline save --add` keeps the newest 5);",
        "*apart* is how far those runs lie apart (slowest over fastest, minus one).", "",
    ]
    presets = list(dict.fromkeys(r.preset for r in baseline.runs))
    for preset in presets:
        lines += [f"## {preset}", "", "Runs:", ""]
        for run in baseline.runs_of(preset):
            sha = (run.fingerprint.git_sha or "unknown")[:7]
            lines.append(f"- `{run.run_id}` (commit {sha}, saved {run.saved_utc}): `{run.command}`")
        lines.append("")
        entries = [e for e in baseline.entries if e.preset == preset]
        for case in dict.fromkeys(e.case for e in entries):
            of_case = [e for e in entries if e.case == case]
            modes = list(dict.fromkeys(e.mode for e in of_case))
            setup = any(e.setup_s is not None for e in of_case)
            held = any(e.call_peak_bytes is not None for e in of_case)
            recommended = any(e.recommendation is not None for e in of_case)
            rows = []
            for contender in dict.fromkeys(e.contender for e in of_case):
                mine = [e for e in of_case if e.contender == contender]
                by_mode = {m: [e for e in mine if e.mode == m] for m in modes}
                lead = next(v for v in by_mode.values() if v)
                medians = [e.median_ms for e in lead]
                apart = max(medians) / min(medians) - 1 if len(medians) > 1 else None
                peak, call_peak = _center(lead, "setup_peak_bytes"), _center(mine, "call_peak_bytes")
                rows.append([
                    contender, lead[0].role,
                    *[_f(_center(by_mode[m], "median_ms"), ".4f") if by_mode[m] else _DASH for m in modes],
                    _f(_center(lead, "tflops"), ".1f"), _f(_center(lead, "gbps"), ".0f"),
                    _pct(_center(lead, "ceiling_fraction")), _f(_center(mine, "host_us"), ".1f"),
                    *([_f(_center(lead, "setup_s"), ".1f"), _f(None if peak is None else peak / 2**30, ".2f")]
                      if setup else []),
                    *([_f(None if call_peak is None else call_peak / 2**30, ".3f")] if held else []),
                    *([_advice(lead[-1].recommendation)] if recommended else []),
                    str(len(lead)), _pct(apart),
                ])
            headers = ["contender", "role", *[f"{m} ms" for m in modes], f"TFLOP/s ({modes[0]})",
                       f"GB/s ({modes[0]})", "of ceiling", "host us/call",
                       *(["setup s (compile, capture)", "setup peak GiB"] if setup else []),
                       *(["GiB a call holds (eager)"] if held else []),
                       *(["against its baseline (newest run) [95% CI]: advice"] if recommended else []),
                       "runs", "apart"]
            lines += [f"### {case}", "", markdown_table(headers, rows), ""]
    return "\n".join(lines).rstrip() + "\n"


def _advice(rec: Recommendation | None) -> str:
    if rec is None:
        return _DASH
    return f"{rec.speedup:.3f}x [{rec.ci_low:.3f}, {rec.ci_high:.3f}] over {rec.against}: {rec.advice}"


def baseline_pages(baselines_dir, gates: list[str] | None = None) -> dict[str, str]:
    """Every baseline file under baselines_dir (<machine>/<gate>.json) rendered: relative page
    path (<machine>/<gate>.md) -> Markdown, plus README.md, the index of the pages."""
    from pathlib import Path

    root = Path(baselines_dir)
    pages: dict[str, str] = {}
    for path in sorted(root.glob("*/*.json")):
        if gates and path.stem not in gates:
            continue
        relative = path.relative_to(root)
        pages[str(relative.with_suffix(".md"))] = render_baseline(load_baseline(path), f"{root.name}/{relative}")
    index = ["# Results", "", f"Each gate's saved figures per class of machine, rendered from `baselines/` "
             f"{WRITTEN_BY} (CI fails when a page here differs from what that renders).", ""]
    index += [f"- [{page.removesuffix('.md')}]({page})" for page in sorted(pages)]
    pages["README.md"] = "\n".join(index) + "\n"
    return pages
