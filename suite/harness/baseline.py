"""Committed figures per device, and judging a new run against them.

`save_baseline` writes baselines/<device-slug>/<gate>.json from a passed run; `compare`
judges a new run against those files, and refuses a different class of machine.

A gate's presets may need separate runs (one device call cannot hold them all), so a baseline
records, per preset, the runs its figures come from; saving replaces the presets the report
measured and keeps the others. One run cannot say how far the next lands from it on another
day, lease or host, where every contender of a bench moves together (docs/design-notes.md).
So a preset may hold several runs (`add=True`); their spread widens the bar
an entry's change must clear (`_judge`). That read-modify-write holds a lock beside each file,
so concurrent saves each keep their presets.
"""

from __future__ import annotations

import contextlib
import fcntl
import math
import statistics
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator, Literal

import numpy as np
from pydantic import ValidationError, computed_field, model_validator

from suite.errors import UsageError
from suite.files import atomic
from suite.harness.fingerprint import fingerprint_class, imitates_rtx
from suite.harness.results import (
    Amount,
    BenchResult,
    Fingerprint,
    GateResult,
    Record,
    Role,
    RunReport,
    ContenderTiming,
    Positive,
    Recommendation,
    TimingMode,
    read_versioned_json,
    validation_summary,
)
from suite.harness.stats import bootstrap_ci
from suite.harness.timing import TimingPolicy

# 3: entries name their timing mode (graph replays or eager calls)
# 4: a preset may hold several runs, and each entry names its run
BASELINE_SCHEMA_VERSION = 4
# Below this change a timing is "same" even when the run's noise floor is tighter: a 1%
# drift is not worth failing a build over.
MIN_CHANGE = 0.02
# Adding a run to a preset that holds this many drops its oldest: the spread should describe
# the machine as it is now.
MAX_RUNS_PER_PRESET = 5
# The fewest other contenders whose median change is taken for the machine's drift: one of
# them sharing the arm's code (and its regression) cannot move the median of three.
MIN_OTHERS = 3

EntryStatus = Literal["same", "improved", "regressed", "new", "missing"]


class BaselineEntry(Record):
    preset: str
    case: str
    mode: TimingMode
    contender: str
    role: Role
    run_id: str
    median_ms: float
    round_medians_ms: list[Positive]
    gbps: Amount | None = None
    tflops: Amount | None = None
    ceiling_fraction: Amount | None = None
    noise_floor: Amount  # of the run that produced it, relative (0.012 = 1.2%)
    # host time per call on the gate's host-probe shape: a record beside the figure, not compared
    # (best of 5 batches on a shape of its own, it is not the median the verdicts are about)
    host_us: Amount | None = None
    # cases that time the setup and recommend (train-step): the build's seconds and memory peak,
    # and this contender against its baseline in that run
    setup_s: Amount | None = None
    setup_peak_bytes: int | None = None
    call_peak_bytes: int | None = None  # eager benches on CUDA: the memory a warm call held at its peak
    recommendation: Recommendation | None = None

    @model_validator(mode="after")
    def _median_is_a_time(self) -> BaselineEntry:
        # every comparison divides by it: a zero or negative time is a hand edit or a bug
        if not (math.isfinite(self.median_ms) and self.median_ms > 0):
            raise ValueError(
                f"entry {self.preset}/{self.case}/{self.mode}/{self.contender} has median_ms "
                f"{self.median_ms}, not a positive time"
            )
        return self


class PresetRun(Record):
    """The run one preset's figures come from."""

    preset: str
    run_id: str
    command: str
    fingerprint: Fingerprint
    saved_utc: str


class Baseline(Record):
    schema_version: int = BASELINE_SCHEMA_VERSION
    gate: str
    fingerprint_class: dict[str, str | None]  # every run below is of this class
    runs: list[PresetRun]
    entries: list[BaselineEntry]

    @model_validator(mode="after")
    def _entries_name_a_saved_run(self) -> Baseline:
        saved = {(r.preset, r.run_id) for r in self.runs}
        if len(saved) != len(self.runs):
            raise ValueError("a preset lists the same run twice")
        orphans = sorted({f"{e.preset}/{e.run_id}" for e in self.entries} - {f"{p}/{r}" for p, r in saved})
        if orphans:
            raise ValueError(f"entries of runs the file does not list: {', '.join(orphans)}")
        return self

    def runs_of(self, preset: str) -> list[PresetRun]:
        """The runs behind a preset's figures, oldest first."""
        return [r for r in self.runs if r.preset == preset]


def _from_schema_3(data: dict[str, Any]) -> dict[str, Any]:
    """Schema 3 held one run per preset, its entries unnamed: each entry gets its preset's run.
    Anything malformed is left for validation to name."""
    runs, entries = data.get("runs"), data.get("entries")
    if not (isinstance(runs, list) and isinstance(entries, list)):
        return {**data, "schema_version": 4}
    run_of = {r.get("preset"): r.get("run_id") for r in runs if isinstance(r, dict)}
    named = [{**e, "run_id": run_of.get(e.get("preset"))} if isinstance(e, dict) else e for e in entries]
    return {**data, "schema_version": 4, "entries": named}


class EntryComparison(Record):
    gate: str
    preset: str
    case: str
    mode: TimingMode
    contender: str
    role: Role
    status: EntryStatus
    baseline_ms: float | None = None  # the center of the saved runs: their median
    baseline_runs: int = 0  # how many saved runs hold this entry
    spread: float | None = None  # relative gap between the saved runs' slowest and fastest
    new_ms: float | None = None
    ratio: float | None = None  # new / baseline; above 1 is slower
    ci_low: float | None = None  # the ratio's bootstrap CI over the new run's rounds
    ci_high: float | None = None
    others_moved: float | None = None  # median ratio of the bench's other reference and peers
    others: int = 0  # how many that median is of
    beyond_others: float | None = None  # ratio / others_moved, where the drift was judged
    threshold: float | None = None  # relative change needed to count
    note: str = ""


class ComparisonReport(Record):
    run_id: str
    baselines: dict[str, str]  # gate -> baseline file read
    forced: bool = False
    mismatches: dict[str, str] = {}  # gate -> how its baseline's fingerprint class differs
    entries: list[EntryComparison]

    @property
    def judged(self) -> list[EntryComparison]:
        """The arm's timings that had a baseline to be judged against."""
        return [e for e in self.entries if e.role == "arm" and e.status in ("same", "regressed", "improved")]

    @computed_field  # type: ignore[prop-decorator]
    @property
    def passed(self) -> bool:
        """Only the arm's regressions fail: the reference and peers are for information."""
        return not any(e.role == "arm" and e.status == "regressed" for e in self.entries)


def baseline_path(baselines_dir: str | Path, fp: Fingerprint, gate: str) -> Path:
    """baselines/<device slug>/<gate>.json; runs of another card held to the rtx profile's
    shared memory are another class of machine, kept beside its own in <device slug>-rtx-profile/
    (the RTX card's own runs, rtx by default, keep <device slug>/)."""
    folder = fp.device_slug + ("-rtx-profile" if imitates_rtx(fp) else "")
    return Path(baselines_dir) / folder / f"{gate}.json"


def load_baseline(path: str | Path) -> Baseline:
    try:  # a save of several files that was stopped midway is finished before any is read
        atomic.complete_journals(Path(path).parent)
    except OSError as exc:
        raise UsageError(f"cannot finish an interrupted baseline save in {Path(path).parent}: {exc}") from exc
    baseline = read_versioned_json(path, Baseline, BASELINE_SCHEMA_VERSION, "baseline", upgrades={3: _from_schema_3})
    # compare finds a gate's figures by the file's name: another gate's figures under it would
    # be judged as this gate's
    if Path(path).stem != baseline.gate:
        raise UsageError(
            f"{path} is not a valid baseline: its gate field says {baseline.gate!r} but the file is named for "
            f"{Path(path).stem!r}; rename it to {baseline.gate}.json or save the baseline again"
        )
    return baseline


def _entries(result: GateResult, run_id: str) -> list[BaselineEntry]:
    try:
        return _entries_of(result, run_id)
    except ValidationError as exc:
        raise UsageError(f"not saving run {run_id}: {validation_summary(exc)}") from exc


def _entries_of(result: GateResult, run_id: str) -> list[BaselineEntry]:
    return [
        BaselineEntry(
            preset=result.preset, case=bench.case, mode=bench.mode, contender=c.name, role=c.role,
            run_id=run_id, median_ms=c.median_ms, round_medians_ms=c.round_medians_ms, gbps=c.gbps,
            tflops=c.tflops, ceiling_fraction=c.ceiling_fraction, noise_floor=bench.noise_floor,
            host_us=c.host_us, setup_s=c.setup_s, setup_peak_bytes=c.setup_peak_bytes,
            call_peak_bytes=c.call_peak_bytes,
            recommendation=next((r for r in bench.recommendations if r.contender == c.name), None),
        )
        for bench in result.bench
        for c in bench.contenders
        if _a_figure_of_its_mode(c)
    ]


def _a_figure_of_its_mode(c: ContenderTiming) -> bool:
    """Timed, and the way its bench's mode says: a graph mode whose capture was refused timed
    eager calls, which are no figure of that mode to save or compare."""
    return c.median_ms is not None and not c.method


def _why_not_saved(result: GateResult) -> str:
    where = f"{result.gate}/{result.preset}"
    if result.status != "passed":
        return f"{where}: {result.status}" + (f" ({result.reason})" if result.reason else "")
    return f"{where}: " + (f"bench skipped ({result.bench_skipped})" if result.bench_skipped
                           else "no bench results")


def save_baseline(
    report: RunReport, baselines_dir: str | Path, gates: list[str] | None = None, replace: bool = False,
    add: bool = False,
) -> list[Path]:
    """Write one baseline file per gate from the report's passed bench results.

    Refuses a report in which a selected gate's parity failed (its timings belong to a wrong
    arm), and one with nothing to save. Results that did not pass are left out. The presets the
    report measured replace theirs in the file; other presets keep the figures of their own
    runs. With `add`, this run joins the runs its presets hold (the newest
    MAX_RUNS_PER_PRESET kept; saving one run twice keeps it once); with `replace`, the file
    holds this run alone. A file of another class of machine, or one that cannot be read, is
    only ever replaced whole, and only when asked.
    """
    if add and replace:
        raise UsageError("--add keeps a preset's earlier runs and --replace drops them: choose one")
    ran = list(dict.fromkeys(r.gate for r in report.results))
    if gates is not None:
        unknown = [g for g in gates if g not in ran]
        if unknown:
            raise UsageError(
                f"run {report.run_id} has no results for {', '.join(unknown)}; "
                f"it ran: {', '.join(ran) or 'nothing'}"
            )
    selected = [r for r in report.results if gates is None or r.gate in gates]
    if not selected:
        raise UsageError(f"run {report.run_id} has no gate results, so no bench results to save")

    wrong = [f"{r.gate}/{r.preset}" for r in selected if r.parity is not None and not r.parity.passed]
    if wrong:
        raise UsageError(
            f"not saving a baseline from run {report.run_id}: parity failed for "
            f"{', '.join(wrong)}, so its timings are of a wrong result. Fix the arm and re-run."
        )

    by_gate: dict[str, list[BaselineEntry]] = {}
    for result in selected:
        if result.status == "passed":
            entries = _entries(result, report.run_id)
            if entries:
                by_gate.setdefault(result.gate, []).extend(entries)
    empty = [g for g in dict.fromkeys(r.gate for r in selected) if g not in by_gate]
    # Without a list of gates, save what passed; a gate asked for by name must be saved.
    if not by_gate or (gates is not None and empty):
        reasons = [_why_not_saved(r) for r in selected if r.gate in empty]
        raise UsageError(
            f"run {report.run_id} has no passed bench results to save for "
            f"{', '.join(empty)}: " + "; ".join(reasons)
            + ". Run the benches on the GPU and save from that run's report."
        )

    fp = report.fingerprint
    new_class = one_class(report)
    saved = datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    paths = {gate: baseline_path(baselines_dir, fp, gate) for gate in by_gate}
    with _locked(list(paths.values())):
        baselines = {}
        for gate, entries in by_gate.items():
            path = paths[gate]
            kept_runs: list[PresetRun] = []
            kept_entries: list[BaselineEntry] = []
            if path.exists() and not replace:
                old = _mergeable(path, new_class)
                measured = {e.preset for e in entries}
                kept_runs = [r for r in old.runs if r.preset not in measured]
                if add:
                    for preset in dict.fromkeys(e.preset for e in entries):
                        kept_runs += _runs_kept_beside(old, preset, report.run_id)
                kept = {(r.preset, r.run_id) for r in kept_runs}
                kept_entries = [e for e in old.entries if (e.preset, e.run_id) in kept]
            runs = [PresetRun(preset=preset, run_id=report.run_id, command=report.command, fingerprint=fp,
                              saved_utc=saved)
                    for preset in dict.fromkeys(e.preset for e in entries)]
            baselines[path] = Baseline(gate=gate, fingerprint_class=new_class, runs=kept_runs + runs,
                                       entries=kept_entries + entries)
        # every file checked before any is written, and written all or none: a refusal or a
        # failure leaves all of them as they were
        atomic.replace_files({path: b.model_dump_json(indent=2) + "\n" for path, b in baselines.items()})
    return list(baselines)


def _runs_kept_beside(baseline: Baseline, preset: str, run_id: str) -> list[PresetRun]:
    """A preset's other runs that stay beside `run_id` when it is added (it stays: it was asked
    for): the newest by when they ran (run ids begin with their UTC start, to the microsecond),
    not by when they were saved, and never the same run twice."""
    others = sorted((r for r in baseline.runs_of(preset) if r.run_id != run_id), key=lambda r: r.run_id)
    return others[-(MAX_RUNS_PER_PRESET - 1):]


@contextlib.contextmanager
def _locked(paths: list[Path]) -> Iterator[None]:
    """An exclusive lock on a lock file beside each baseline file, taken in one order (so two
    saves cannot deadlock), held across the read-modify-write. The lock files stay: removing
    one while another save waits on it would let a third lock a new file of the same name."""
    with contextlib.ExitStack() as held:
        for path in sorted(paths):
            path.parent.mkdir(parents=True, exist_ok=True)
            lock = held.enter_context(open(path.with_name(f".{path.name}.lock"), "a"))
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _mergeable(path: Path, new_class: dict[str, str | None]) -> Baseline:
    """The existing baseline a save adds presets to; refuses one it must not merge with."""
    try:
        old = load_baseline(path)
    except UsageError as exc:
        raise UsageError(f"{exc}. Not merging into it: fix or remove it, or save with --replace") from exc
    difference = _class_difference(old.fingerprint_class, new_class)
    if difference:
        raise UsageError(
            f"{path} holds figures of another class of machine ({difference}); one baseline file "
            f"holds one class. Save with --replace to start it afresh from this run"
        )
    return old


def one_class(report: RunReport) -> dict[str, str | None]:
    """The report's class of machine; a run spread over several devices (pytest --suite -n)
    carries each result's fingerprint, and one whose devices are of two classes is refused:
    its timings compare against no one baseline."""
    def key(fp) -> str:
        return ", ".join(f"{k} {v}" for k, v in sorted(fingerprint_class(fp).items()))

    classes = {key(r.fingerprint): r for r in report.results if r.fingerprint}
    classes.setdefault(key(report.fingerprint), None)
    if len(classes) > 1:
        devices = "; ".join(f"{r.fingerprint.device}: {k}" if r else f"the run's: {k}" for k, r in classes.items())
        raise UsageError(f"run {report.run_id} mixes two classes of card ({devices}); save or compare each class's "
                         "results from a run of that class alone")
    return fingerprint_class(report.fingerprint)


def _class_difference(baseline: dict[str, str | None], new: dict[str, str | None]) -> str:
    return "; ".join(
        f"{key} {baseline.get(key)} (baseline) vs {new.get(key)} (this run)"
        for key in sorted(set(baseline) | set(new))
        if baseline.get(key) != new.get(key)
    )


def _center(samples: list[BaselineEntry]) -> float:
    """A baseline entry's figure: the median of its saved runs' medians (geometric for two)."""
    return math.exp(statistics.median(math.log(e.median_ms) for e in samples))


def _judge(
    gate: str, preset: str, bench: BenchResult, samples: list[BaselineEntry], new: ContenderTiming,
    others: list[float], note: str,
) -> EntryComparison:
    """One timing against its saved runs, judged like a comparison within a run: a change
    counts when it lies beyond the bar with its CI (over the new run's rounds) clear of no
    change. The bar is the widest of MIN_CHANGE, the new run's noise floor (the baseline's own
    floors say nothing about today's machine) and the gap between the saved runs' fastest and
    slowest (what moving between days, leases and hosts did to it before).

    `others` are the ratios (new / baseline) of the bench's other reference and peers. With at
    least MIN_OTHERS of them, their median is the machine's own drift, and the change must
    count beyond it as well as outright: a slower host moves every eager contender alike.
    With fewer, one of them sharing the arm's code (the eager Muon step the captured one
    replays) could carry a regression of the arm away, so the drift is shown, not used."""
    center = _center(samples)
    logs = [math.log(e.median_ms) for e in samples]
    spread_log = max(logs) - min(logs)
    threshold_log = max(math.log1p(bench.noise_floor), math.log1p(MIN_CHANGE), spread_log)
    policy = TimingPolicy()
    low, high = bootstrap_ci(new.round_medians_ms or [new.median_ms], policy.n_boot, policy.ci_level,
                             np.random.default_rng(0))
    change, change_low, change_high = (math.log(x / center) for x in (new.median_ms, low, high))
    others_moved = statistics.median(others) if others else None
    drift = math.log(others_moved) if len(others) >= MIN_OTHERS else None

    def counts(shift: float) -> EntryStatus:
        c, c_low, c_high = change - shift, change_low - shift, change_high - shift
        return ("regressed" if c > threshold_log and c_low > 0
                else "improved" if c < -threshold_log and c_high < 0 else "same")

    outright = counts(0.0)
    beyond = outright if drift is None else counts(drift)
    status = outright if beyond == outright else "same"
    notes = [note] if note else []
    if beyond != outright:  # either way: an arm that held still while the machine sped up is named
        notes.append(f"{outright} outright, {beyond} beyond the machine's drift: the bench's "
                     f"{len(others)} other contenders moved {100 * (others_moved - 1):+.1f}% (median)")
    if status != "same" and len(samples) == 1:
        notes.append("one saved run: how far runs drift apart is unknown (add runs: suite baseline save --add)")
    return EntryComparison(
        gate=gate, preset=preset, case=bench.case, mode=bench.mode, contender=new.name, role=new.role,
        status=status, baseline_ms=center, baseline_runs=len(samples), spread=math.expm1(spread_log),
        new_ms=new.median_ms, ratio=new.median_ms / center, ci_low=low / center, ci_high=high / center,
        others_moved=others_moved, others=len(others),
        beyond_others=None if drift is None else math.exp(change - drift),
        threshold=math.expm1(threshold_log), note="; ".join(notes),
    )


def compare(report: RunReport, baselines_dir: str | Path, force: bool = False) -> ComparisonReport:
    """Judge every timed entry of the run against the baseline of its gate on this device.

    Entries of the run without a baseline are "new"; baseline entries of a gate and preset
    the run measured but without that case or contender are "missing". Neither fails.
    """
    new_class = one_class(report)
    results = [r for r in report.results if r.bench]
    gates = list(dict.fromkeys(r.gate for r in results))

    baselines: dict[str, Baseline] = {}
    paths: dict[str, str] = {}
    mismatches: dict[str, str] = {}
    for gate in gates:
        path = baseline_path(baselines_dir, report.fingerprint, gate)
        if not path.exists():
            continue
        baselines[gate] = load_baseline(path)
        paths[gate] = str(path)
        difference = _class_difference(baselines[gate].fingerprint_class, new_class)
        if difference:
            mismatches[gate] = difference
    if mismatches and not force:
        detail = "; ".join(f"{paths[g]}: {d}" for g, d in mismatches.items())
        raise UsageError(
            f"cannot compare run {report.run_id} with baselines from a different class of "
            f"machine: {detail}. Re-measure on this setup and save a new baseline, or force the "
            f"comparison (each entry is then marked)."
        )

    entries: list[EntryComparison] = []
    for result in results:
        baseline = baselines.get(result.gate)
        note = f"fingerprint differs: {mismatches[result.gate]}" if result.gate in mismatches else ""
        saved: dict[tuple[str, str, str], list[BaselineEntry]] = {}
        for e in baseline.entries if baseline else []:
            if e.preset == result.preset:
                saved.setdefault((e.case, e.mode, e.contender), []).append(e)
        seen = set()
        for bench in result.bench:
            timed = [c for c in bench.contenders if _a_figure_of_its_mode(c)]
            # how the bench's reference and peers moved: a slower machine shows in all of them
            moved = {c.name: c.median_ms / _center(saved[(bench.case, bench.mode, c.name)])
                     for c in timed if c.role != "arm" and (bench.case, bench.mode, c.name) in saved}
            for c in timed:
                key = (bench.case, bench.mode, c.name)
                seen.add(key)
                if key in saved:
                    others = [r for name, r in moved.items() if name != c.name]
                    entries.append(_judge(result.gate, result.preset, bench, saved[key], c, others, note))
                else:
                    entries.append(EntryComparison(
                        gate=result.gate, preset=result.preset, case=bench.case, mode=bench.mode,
                        contender=c.name, role=c.role, status="new", new_ms=c.median_ms,
                        note=note or ("no baseline file" if baseline is None else "not in the baseline"),
                    ))
        for key, samples in saved.items():
            if key not in seen:
                e = samples[-1]
                entries.append(EntryComparison(
                    gate=result.gate, preset=result.preset, case=e.case, mode=e.mode,
                    contender=e.contender, role=e.role, status="missing", baseline_ms=_center(samples),
                    baseline_runs=len(samples), note=note or "in the baseline, not timed in this run",
                ))
    return ComparisonReport(
        run_id=report.run_id, baselines=paths, forced=force, mismatches=mismatches, entries=entries
    )
