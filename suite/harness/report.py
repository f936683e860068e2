"""The run report: one versioned pydantic model; JSON is the source, the rest are renderings."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

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
    tensors: list[TensorCheck]
    inputs_unchanged: bool
    poisoned: bool  # the arm's fresh allocations were NaN-filled before it ran
    deterministic: bool | None  # None when the gate declares the arm nondeterministic
    nondeterministic_reason: str | None = None
    recheck_after_timing: bool | None = None  # None when no timing ran
    failures: list[str] = Field(default_factory=list)


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
    cold_ms: float | None = None  # the first call (compile, autotune, capture), timed alone
    median_ms: float | None = None  # median of the per-round medians
    round_medians_ms: list[float] = Field(default_factory=list)
    gbps: float | None = None
    tflops: float | None = None
    ceiling_fraction: float | None = None  # of measured copy bandwidth or bf16 GEMM rate


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
