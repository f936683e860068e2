"""The results of a run: one versioned pydantic model that every stage builds and every
renderer reads. Measuring code (parity, timing, runner, baseline, fingerprint) imports this
module; the renderers (render.py) and the report store (store.py) import it too, never the
reverse.
"""

from __future__ import annotations

import math
import re
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Callable, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from suite.files import jsonfile
from suite.errors import UsageError, combine

# 2: failures carry the check that found them; parity mode per output; bench modes; phases
SCHEMA_VERSION = 3

Verdict = Literal["faster", "same", "slower", "ambiguous"]
Status = Literal["passed", "failed", "could_not_run", "ambiguous", "skipped"]
Role = Literal["reference", "arm", "peer"]
# graph: CUDA-graph replays (device time); eager: plain calls, the host's dispatch included,
# timed with CUDA events; wall: the host's clock, for arms that are not CUDA kernels
TimingMode = Literal["graph", "eager", "wall"]
CeilingKind = Literal["copy", "gemm", "none"]

# What timing measured: a NaN, an infinity or a negative figure is a broken or edited report,
# never a measurement, and a comparison would read it as "no change"
Positive = Annotated[float, Field(gt=0, allow_inf_nan=False)]  # a time or ratio comparisons divide by
Amount = Annotated[float, Field(ge=0, allow_inf_nan=False)]  # a floor, a rate, a host time
LogRatio = Annotated[float, Field(allow_inf_nan=False)]


def _error_ratio(value: float) -> float:
    if math.isnan(value) or value < 0:
        raise ValueError(f"{value} is not an error ratio: a relative error is a number >= 0 (Infinity against an "
                         "all-zero truth)")
    return value


# a relative error parity measured: infinite against an all-zero truth (parity.tolerance_check), never NaN or < 0
ErrorRatio = Annotated[float, AfterValidator(_error_ratio)]


class Record(BaseModel):
    """A model that is written to disk and read back: infinities and NaN (an error ratio
    against an all-zero truth, say) are written as the strings "Infinity" and "NaN", which
    read back as floats, where JSON itself would have to drop them to null."""

    model_config = ConfigDict(ser_json_inf_nan="strings")


class Check(str, Enum):
    """The checks that can fail a parity judgement; a saboteur names the one it must trip."""

    OUTPUTS = "outputs"  # the arm's outputs differ from the reference's in names, shapes or dtypes
    PARITY = "parity"  # values differ beyond what the output's parity mode allows
    NONFINITE = "nonfinite"  # NaN/Inf where the truth has none, or the reverse
    POISON = "poison"  # an output element the arm never wrote (still NaN from the poisoning)
    DEGENERATE = "degenerate"  # constant where the truth is not, or nothing finite to compare
    DETERMINISM = "determinism"  # two runs on the same inputs differ
    INPUTS = "inputs"  # the arm modified its inputs


class Failure(Record):
    check: Check
    message: str

    def __str__(self) -> str:
        return f"{self.check.value}: {self.message}"


class TensorCheck(Record):
    """One output of the arm judged against the reference (bitwise) or the truth (tolerance)."""

    name: str
    shape: list[int]
    dtype: str
    mode: Literal["bitwise", "tolerance"]
    passed: bool
    problems: list[Failure] = Field(default_factory=list)
    # bitwise mode
    differing: int | None = None
    first_index: list[int] | None = None
    max_ulp: int | None = None
    # tolerance mode: relative errors against the float64 truth, and the limits applied
    k: Amount | None = None
    floor: Amount | None = None
    row_floor: Amount | None = None  # rows judged relative to at least this x the RMS row norm
    compared: int | None = None  # finite elements compared
    arm_rel_l2: ErrorRatio | None = None
    ref_rel_l2: ErrorRatio | None = None
    limit_rel_l2: ErrorRatio | None = None
    arm_rel_max: ErrorRatio | None = None  # the worst row's relative L2 error
    ref_rel_max: ErrorRatio | None = None
    limit_rel_max: ErrorRatio | None = None
    # the largest error norm of a row whose truth is all zero (those rows have no relative error)
    arm_zero_rows: ErrorRatio | None = None
    ref_zero_rows: ErrorRatio | None = None
    nonfinite_match: bool | None = None
    # elements NaN/Inf in both the reference and the arm where the truth is finite: the
    # buffers overflow the working dtype (not counted against the arm)
    overflowed: int | None = None

    @property
    def message(self) -> str:
        return "; ".join(str(p) for p in self.problems)


class ParityResult(Record):
    mode: Literal["bitwise", "tolerance", "mixed"]
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
    # the determinism run came after timing, so it was the recheck too (parity.second_run)
    second_run_after_timing: bool = False
    first_divergence: str | None = None  # the first failing output, in the reference's order
    failures: list[Failure] = Field(default_factory=list)

    @model_validator(mode="after")
    def _passed_means_no_failure(self) -> ParityResult:
        # judge_arm and second_run pass a verdict exactly when it lists no failure
        if self.passed and self.failures:
            raise ValueError(f"passed is true, but it lists {len(self.failures)} failure(s): {self.failures[0]}")
        if not self.passed and not self.failures:
            raise ValueError("passed is false, but it lists no failure")
        return self

    def counts(self) -> tuple[int, int]:
        """(outputs checked, outputs passed), whether or not tensors was trimmed."""
        if self.outputs_checked is None:
            return len(self.tensors), sum(t.passed for t in self.tensors)
        return self.outputs_checked, self.outputs_passed

    def checks_failed(self) -> set[Check]:
        return {f.check for f in self.failures}


class SaboteurResult(Record):
    name: str
    description: str
    expected_check: Check
    caught: bool
    failures: list[Failure] = Field(default_factory=list)


class ContenderTiming(Record):
    name: str
    role: Role
    unavailable: str | None = None  # why it was not timed
    method: str = ""  # how it was timed, when not as the bench's mode says (e.g. capture failed)
    cold_ms: Amount | None = None  # the first call (compile, autotune, capture), timed alone
    median_ms: Positive | None = None  # median of the per-round medians
    round_medians_ms: list[Positive] = Field(default_factory=list)
    gbps: Amount | None = None
    tflops: Amount | None = None
    ceiling_fraction: Amount | None = None  # of the case's measured ceiling
    gpu_busy_ms: Amount | None = None  # host-bound benches: kernel time per call, beside the wall time
    host_us: Amount | None = None  # host time per call on the gate's host-probe shape
    window: int | None = None  # calls per timing: the case's window, or 1 for calls too slow to batch (round_shape)
    # timed without a lead-in call: the device work its call had queued on return (ms), the
    # most an idle start added to each timing
    idle_start_tail_ms: Amount | None = None
    # cases that time the setup (BenchCase.setup): the build's seconds (compile, capture) and the
    # most device memory it held above what was allocated before it
    setup_s: Amount | None = None
    setup_peak_bytes: int | None = None
    # eager benches on CUDA: the most device memory one warm call held above what was allocated
    # before it (its outputs and temporaries), beside every contender's
    call_peak_bytes: int | None = None
    note: str = ""  # what the contender's setup saw (graph breaks, say)


class Comparison(Record):
    """arm against one other contender: speedup = other's time / arm's time."""

    against: str
    speedup: Positive
    ci_low: Positive
    ci_high: Positive
    verdict: Verdict
    # the relative floor it was judged against: the reference's A/A, or, for a peer the arm is
    # judged against, that peer's own A/A where it is wider
    noise_floor: Amount


class Recommendation(Comparison):
    """A contender against its baseline (BenchCase.recommend, `against`): switch it on where it
    is faster beyond the noise floor; speedup = the baseline's time / the contender's."""

    contender: str

    @property
    def advice(self) -> str:
        return {"faster": "switch on", "slower": "leave off", "same": "no gain: leave off"}.get(
            self.verdict, "undecided: leave off")


class CriterionCheck(Record):
    name: str
    passed: bool
    detail: str
    ambiguous: bool = False  # not passed because timing could not decide, not because it lost
    target: bool = False  # an aim (criteria.Target): passed says met, and a miss fails nothing


class BenchResult(Record):
    case: str
    description: str
    mode: TimingMode
    l2: Literal["cold", "warm"]
    ceiling: CeilingKind
    window: int  # calls per timed window (one event pair): the case's; a contender may time fewer
    rotation: int = 1  # input sets cycled through, so that calls miss the L2
    bytes: int
    flops: int
    warmup_calls: int
    rounds: int
    calls_per_round: int
    noise_floor: Amount  # relative spread of reference-vs-reference (A/A), e.g. 0.012 = 1.2%
    aa_log_ratios: list[LogRatio]
    # each peer the arm is judged against is timed twice a round too: its own A/A series
    peer_aa_log_ratios: dict[str, list[LogRatio]]
    contenders: list[ContenderTiming]
    comparisons: list[Comparison]
    criteria: list[CriterionCheck]
    passed: bool
    ambiguous: bool
    host_probe: str | None = None  # the shape host_us was measured on
    recommendations: list[Recommendation] = Field(default_factory=list)
    duration_s: Amount = 0.0

    @model_validator(mode="after")
    def _passed_follows_from_criteria(self) -> BenchResult:
        decided = bench_passed(self.criteria, self.ambiguous)
        if self.passed != decided:
            why = ("it is ambiguous" if self.ambiguous else
                   "its criteria all passed" if decided else "a criterion failed")
            raise ValueError(f"passed is {str(self.passed).lower()}, but {why}")
        return self


def bench_passed(criteria: list[CriterionCheck], ambiguous: bool) -> bool:
    """A bench's verdict from its criteria, as measure_bench sets it and a loaded report must
    say: a target (an aim) never fails a bench, and an ambiguous one never passes."""
    return all(c.passed for c in criteria if not c.target) and not ambiguous


class CaseError(Record):
    """A bench case that raised: the unit could not run it, its other cases' figures stand."""

    case: str
    mode: TimingMode
    message: str
    traceback: str | None = None  # where an unexpected exception was raised


class Ceilings(Record):
    copy_gbps: float  # device-to-device copy, bytes read + written
    copy_bytes: int
    gemm_bf16_tflops: float
    gemm_n: int


class BufferProvenance(Record):
    source: Literal["fresh", "loaded"]
    seed: int
    directory: str | None = None
    sha256: dict[str, str] = Field(default_factory=dict)  # file name -> digest (loaded buffers)


class GateResult(Record):
    gate: str
    arm: str
    preset: str
    preset_params: dict[str, Any]
    device: str
    status: Status
    reason: str | None = None
    parity: ParityResult | None = None
    saboteurs: list[SaboteurResult] = Field(default_factory=list)
    # where the saboteurs are not run here: the preset they ran at, or why they cannot apply
    saboteurs_note: str | None = None
    bench: list[BenchResult] = Field(default_factory=list)
    bench_errors: list[CaseError] = Field(default_factory=list)
    bench_skipped: str | None = None
    traceback: str | None = None  # where the harness or the arm raised unexpectedly
    buffers: BufferProvenance | None = None
    duration_s: Amount = 0.0
    phases: dict[str, Amount] = Field(default_factory=dict)  # phase -> wall seconds
    peak_memory_bytes: int | None = None  # CUDA: the most the gate held at once, bench included
    # the machine that ran it, where a run spread its units over several devices (pytest --suite -n)
    fingerprint: Fingerprint | None = None

    @property
    def unit(self) -> str:
        return f"{self.gate}/{self.preset}"

    @field_validator("bench")
    @classmethod
    def _each_case_timed_once(cls, bench: list[BenchResult]) -> list[BenchResult]:
        timed = [(b.case, b.mode) for b in bench]
        twice = next((key for key in timed if timed.count(key) > 1), None)
        if twice is not None:
            raise ValueError(f"case {twice[0]} ({twice[1]}) is there twice; a unit times a case once in each mode")
        return bench

    @model_validator(mode="after")
    def _status_follows_from_verdicts(self) -> GateResult:
        # the renderings and the exit code read the status, a reader reads the verdicts beside it:
        # a report where they disagree (edited, or half-copied) is refused instead of rendered
        if self.parity is None:
            if self.status == "passed":
                raise ValueError(f"{self.unit} says passed, but holds no parity verdict")
            return self
        given, reason = status_of(self)
        # over verdicts that pass (or stay ambiguous), a later step could not run: out of memory in
        # a bench, nothing timed under --strict. Over a failure it would hide the failure's exit 1
        later_step = self.status == "could_not_run" and given != "failed"
        if self.status != given and not later_step:
            raise ValueError(f"{self.unit} says {self.status}, but its verdicts give {given}"
                             + (f" ({reason})" if given != "passed" and reason else ""))
        return self


class SkippedGate(Record):
    gate: str
    reason: str


class Fingerprint(Record):
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
    gpu_memory_cap_bytes: int | None = None  # --gpu-memory: the process held to a smaller card's memory
    device: str | None = None  # the device a result ran on where a run used several ("cuda:1": the host's second GPU)


class RunReport(Record):
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
    duration_s: Amount = 0.0

    @field_validator("results")
    @classmethod
    def _each_unit_once(cls, results: list[GateResult]) -> list[GateResult]:
        # a recording's preset and the gate's own of the same name (its saboteurs' unit) are two units
        seen: dict[tuple, int] = {}
        for i, r in enumerate(results):
            source = (r.buffers.source, r.buffers.directory) if r.buffers else None
            first = seen.setdefault((r.gate, r.preset, source), i)
            if first != i:
                buffers = f"{source[0]} buffers" + (f" {source[1]}" if source[1] else "") if source else "no buffers"
                raise ValueError(f"{r.unit} ({buffers}) is there twice, as results {first} and {i}; a run judges "
                                 "a gate at a preset once")
        return results


def slugify(text: str) -> str:
    """Lower-case words joined by '-': "gate rmsnorm" -> "gate-rmsnorm", safe in paths."""
    return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-")


# ---- reading versioned JSON ------------------------------------------------------------------

M = TypeVar("M", bound=BaseModel)

# the fields that tell the suite's documents apart, and what each is for
_KINDS = {
    "run report": {"run_id", "results", "fingerprint"},
    "baseline": {"gate", "fingerprint_class", "entries"},
    "buffer manifest": {"manifest_version", "tensors"},
}
_KIND_USE = {
    "run report": "render it with `suite report PATH`, judge it with `suite baseline compare PATH`",
    "baseline": "`suite baseline compare` reads it from --baselines; pass a run's report.json here",
    "buffer manifest": "pass its directory to `suite gate NAME --buffers DIR`",
}


def read_versioned_json(
    path: str | Path, model: type[M], schema_version: int, kind: str,
    upgrades: dict[int, Callable[[dict[str, Any]], dict[str, Any]]] | None = None,
) -> M:
    """Load a versioned JSON document into `model`, or raise UsageError saying what is wrong.

    Shared by run reports and baselines, which are read back by a person's command and
    must fail with a message naming the file, not a traceback. `upgrades` maps an older
    schema_version to a function that rewrites such a document as the current one.
    """
    path = Path(path)
    try:
        data = jsonfile.load(path)
    except jsonfile.NotUtf8 as exc:
        raise UsageError(f"{path} is not a {kind}: {exc}; re-save it as UTF-8 JSON") from None
    except jsonfile.NotJson as exc:
        raise UsageError(f"{path} is not a {kind}: {exc}") from None
    except jsonfile.Unreadable as exc:
        raise UsageError(f"cannot read {kind} {path}: {exc}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path} is not a {kind}: expected a JSON object, found {type(data).__name__}")
    other = next((name for name, keys in _KINDS.items() if name != kind and keys <= data.keys()), None)
    if other is not None:
        raise UsageError(f"{path} is a {other}, not a {kind}; {_KIND_USE[other]}")
    found = data.get("schema_version")
    if found != schema_version and isinstance(found, int) and found in (upgrades or {}):
        data = upgrades[found](data)
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
        raise UsageError(f"{path} is not a valid {kind}: {validation_summary(exc)}") from exc
    except RecursionError:
        raise UsageError(f"{path} is not a valid {kind}: {jsonfile.DEEP}") from None


def validation_summary(exc: ValidationError, limit: int = 5) -> str:
    problems = [
        f"{'.'.join(str(p) for p in err['loc']) or '(top level)'}: {err['msg'].removeprefix('Value error, ')}"
        for err in exc.errors()
    ]
    more = f" (and {len(problems) - limit} more)" if len(problems) > limit else ""
    return f"{len(problems)} problem(s): " + "; ".join(problems[:limit]) + more


def status_of(result: GateResult) -> tuple[Status, str | None]:
    """A judged result's status and its one-line reason, from its verdicts (parity, saboteurs,
    benches): what the runner sets and what a loaded report must say."""
    reasons = []
    if not result.parity.passed:
        reasons.append("parity: " + "; ".join(str(f) for f in result.parity.failures))
    missed = [s.name for s in result.saboteurs if not s.caught]
    if missed:
        reasons.append(f"saboteurs not caught (the gate has no teeth for them): {missed}")
    # a criterion that failed outright outranks another that stayed ambiguous
    slow = [
        f"{b.case} ({b.mode}): {c.detail}" for b in result.bench for c in b.criteria
        if not c.passed and not c.ambiguous and not c.target
    ]
    if slow:
        reasons.append("performance: " + "; ".join(slow))
    if reasons:
        return "failed", " | ".join(reasons)
    if result.bench_errors:
        return "could_not_run", "bench: " + "; ".join(f"{e.case} ({e.mode}): {e.message}" for e in result.bench_errors)
    ambiguous = [f"{b.case} ({b.mode})" for b in result.bench if b.ambiguous]
    if ambiguous:
        return "ambiguous", f"timing stayed ambiguous against the noise floor for {ambiguous}"
    return "passed", result.bench_skipped


def run_exit_code(results: list[GateResult], skipped: list[SkippedGate], strict: bool) -> int:
    """A run's exit code from its results; under --strict a skipped gate could not run."""
    return int(combine([r.status for r in results] + (["could_not_run"] * len(skipped) if strict else [])))


def load_report(path: str | Path) -> RunReport:
    """A saved run report, whose exit code must be the one its results give (a hand-edited or
    half-copied report that says 0 over a failed gate is refused, not rendered as a pass)."""
    report = read_versioned_json(path, RunReport, SCHEMA_VERSION, "run report")
    possible = {run_exit_code(report.results, report.skipped, strict) for strict in (False, True)}
    if report.exit_code not in possible:
        statuses = [r.status for r in report.results]
        counts = ", ".join(f"{statuses.count(s)} {s}" for s in dict.fromkeys(statuses)) or "no results"
        raise UsageError(f"{path} is not a consistent run report: it says exit code {report.exit_code}, but its "
                         f"results ({counts}) give {min(possible)}; was it edited? run the gates again")
    return report
