"""Realistic RunReport objects from synthetic figures, for tests of whatever reads reports.

`make_report()` gives a run of four gates on an H200:
- rmsnorm/medium: tolerance parity, a caught saboteur, benches "fwd" and "fwd+bwd" with the
  reference, the arm, one timed peer (torch_compile) and one unavailable peer (liger);
- muon/small: bitwise parity, a host-bound "step" bench with reference and arm;
- graph: skipped (listed in report.skipped);
- moe/medium: could not run (out of memory).
Its exit code is therefore 3. Pieces are built by the smaller factories below, which tests
can call on their own to assemble other runs.
"""

from __future__ import annotations

import math
import random
import statistics

from suite.errors import combine
from suite.harness.results import (
    BenchResult,
    BufferProvenance,
    Ceilings,
    Check,
    Comparison,
    ContenderTiming,
    CriterionCheck,
    Failure,
    Fingerprint,
    GateResult,
    ParityResult,
    RunReport,
    SaboteurResult,
    SkippedGate,
    TensorCheck,
)

RMSNORM_PRESET = {"rows": 16384, "hidden": 4096, "dtype": "bfloat16"}
COPY_GBPS = 4275.0
GEMM_TFLOPS = 685.0


def make_fingerprint(**overrides) -> Fingerprint:
    fields = dict(
        device_slug="nvidia-h200",
        gpu_name="NVIDIA H200",
        compute_capability="9.0",
        gpu_memory_bytes=143771 * 2**20,
        sm_count=132,
        driver="580.82.07",
        cuda="13.0",
        torch="2.11.0+cu130",
        triton="3.6.0",
        python="3.12.3",
        platform="Linux-6.8.0-x86_64-with-glibc2.39",
        git_sha="0123456789abcdef0123456789abcdef01234567",
        git_dirty=False,
        clocks={"sm": 1980, "mem": 3201, "max_sm": 1980},
        profile="none",
    )
    fields.update(overrides)
    return Fingerprint(**fields)


def round_medians(median_ms: float, rounds: int, spread: float, seed: int) -> list[float]:
    """Per-round medians scattered by about `spread` (relative) around `median_ms`."""
    rng = random.Random(seed)
    return [median_ms * math.exp(rng.uniform(-spread, spread)) for _ in range(rounds)]


def make_timing(
    name: str, role: str, median_ms: float, *, rounds: int = 10, spread: float = 0.005,
    nbytes: int = 0, flops: int = 0, seed: int = 0,
) -> ContenderTiming:
    series = round_medians(median_ms, rounds, spread, seed)
    med = statistics.median(series)
    gbps = nbytes / (med * 1e-3) / 1e9 if nbytes else None
    tflops = flops / (med * 1e-3) / 1e12 if flops else None
    return ContenderTiming(
        name=name, role=role, cold_ms=med * 40, median_ms=med, round_medians_ms=series,
        gbps=gbps, tflops=tflops, ceiling_fraction=None if gbps is None else gbps / COPY_GBPS,
    )


def make_comparison(against: ContenderTiming, arm: ContenderTiming, noise_floor: float) -> Comparison:
    speedup = against.median_ms / arm.median_ms
    floor_log = math.log1p(noise_floor)
    verdict = "faster" if math.log(speedup) > floor_log else (
        "slower" if math.log(speedup) < -floor_log else "same")
    return Comparison(against=against.name, speedup=speedup, ci_low=speedup * 0.98,
                      ci_high=speedup * 1.02, verdict=verdict, noise_floor=noise_floor)


def make_bench(
    case: str = "fwd",
    *,
    description: str | None = None,
    reference_ms: float = 1.0,
    arm_ms: float = 0.25,
    peers: dict[str, float | str] | None = None,
    noise_floor: float = 0.01,
    nbytes: int = 4 * 16384 * 4096,
    flops: int = 0,
    rounds: int = 10,
    mode: str = "graph",
    host_bound: bool = False,
    ambiguous: bool = False,
    seed: int = 0,
) -> BenchResult:
    """A bench case. `peers` maps a peer's name to its median ms, or to the reason it is
    unavailable (a str). The arm passes when it is not slower than the reference."""
    peers = {"torch_compile": 0.3, "liger": "liger-kernel is not installed"} if peers is None else peers
    reference = make_timing("reference", "reference", reference_ms, rounds=rounds,
                            nbytes=nbytes, flops=flops, seed=seed)
    arm = make_timing("arm", "arm", arm_ms, rounds=rounds, nbytes=nbytes, flops=flops, seed=seed + 1)
    contenders = [reference, arm]
    for i, (name, value) in enumerate(peers.items()):
        if isinstance(value, str):
            contenders.append(ContenderTiming(name=name, role="peer", unavailable=value))
        else:
            contenders.append(make_timing(name, "peer", value, rounds=rounds, nbytes=nbytes,
                                          flops=flops, seed=seed + 2 + i))
    timed = [c for c in contenders if c.median_ms is not None and c.role != "arm"]
    comparisons = [make_comparison(c, arm, noise_floor) for c in timed]
    if ambiguous:
        comparisons[0] = comparisons[0].model_copy(update={"verdict": "ambiguous"})
    vs_ref = comparisons[0]
    criteria = [CriterionCheck(
        name="not slower than reference",
        passed=vs_ref.verdict != "slower",
        detail=f"{vs_ref.speedup:.2f}x, {vs_ref.verdict} (floor {100 * noise_floor:.1f}%)",
    )]
    rng = random.Random(seed)
    return BenchResult(
        case=case, description=description or f"RMSNorm {case}", mode="eager" if host_bound else mode,
        l2="warm" if host_bound else "cold", ceiling="copy", window=8 if host_bound else 1, bytes=nbytes,
        flops=flops, warmup_calls=25,
        rounds=rounds, calls_per_round=20, noise_floor=noise_floor,
        aa_log_ratios=[rng.uniform(-noise_floor, noise_floor) for _ in range(rounds)], peer_aa_log_ratios={},
        contenders=contenders, comparisons=comparisons, criteria=criteria,
        passed=all(c.passed for c in criteria) and not ambiguous, ambiguous=ambiguous,
    )


def tolerance_check(name: str, shape: list[int], arm: float, ref: float, k: float = 2.0,
                    floor: float = 1e-6) -> TensorCheck:
    limit = k * ref + floor
    problems = [] if arm <= limit else [Failure(check=Check.PARITY, message=(
        f"{name}: relative error {arm:.3e} > limit {limit:.3e}"))]
    return TensorCheck(
        name=name, shape=shape, dtype="torch.bfloat16", mode="tolerance", k=k, floor=floor, passed=arm <= limit,
        problems=problems, compared=math.prod(shape),
        arm_rel_l2=arm, ref_rel_l2=ref, limit_rel_l2=limit, arm_rel_max=arm * 3,
        ref_rel_max=ref * 3, limit_rel_max=k * ref * 3 + floor, nonfinite_match=True,
    )


def make_tolerance_result(
    gate: str = "rmsnorm",
    preset: str = "medium",
    *,
    parity_passed: bool = True,
    saboteur_caught: bool = True,
    benches: list[BenchResult] | None = None,
) -> GateResult:
    """A tolerance-parity gate result; its status follows from parity, saboteurs and benches."""
    shape = [RMSNORM_PRESET["rows"], RMSNORM_PRESET["hidden"]]
    tensors = [
        tolerance_check("y", shape, arm=2.1e-3 if parity_passed else 9.5e-2, ref=1.9e-3),
        tolerance_check("dx", shape, arm=3.0e-3, ref=2.8e-3),
        tolerance_check("dw", [shape[1]], arm=1.2e-4, ref=1.1e-4),
    ]
    parity = ParityResult(
        mode="tolerance", passed=all(t.passed for t in tensors), tensors=tensors,
        inputs_unchanged=True, deterministic=True, recheck_after_timing=True,
        failures=[p for t in tensors for p in t.problems],
    )
    saboteurs = [SaboteurResult(
        name="fp32_accumulate_skipped", description="accumulates the sum of squares in bf16",
        expected_check=Check.PARITY, caught=saboteur_caught,
        failures=[Failure(check=Check.PARITY, message="y: relative error 4.1e-02 > limit 3.8e-03")]
        if saboteur_caught else [],
    )]
    if benches is None:
        benches = [
            make_bench("fwd", reference_ms=0.9, arm_ms=0.0675, seed=10),
            make_bench("fwd", reference_ms=0.95, arm_ms=0.0712, mode="eager", seed=15),
            make_bench("fwd+bwd", reference_ms=2.9, arm_ms=0.31, nbytes=10 * 16384 * 4096, seed=20,
                       peers={"torch_compile": 0.35, "liger": "liger-kernel is not installed"}),
        ]
    ok = parity.passed and all(s.caught for s in saboteurs) and all(b.passed for b in benches)
    ambiguous = any(b.ambiguous for b in benches)
    return GateResult(
        gate=gate, arm="suite.arms.rmsnorm.rms_norm", preset=preset,
        preset_params=dict(RMSNORM_PRESET), device="cuda:0",
        status="passed" if ok else ("ambiguous" if ambiguous and parity.passed else "failed"),
        parity=parity, saboteurs=saboteurs, bench=benches,
        buffers=BufferProvenance(source="fresh", seed=0), duration_s=42.5,
    )


def make_bitwise_result(
    gate: str = "muon", preset: str = "small", *, parity_passed: bool = True,
    benches: list[BenchResult] | None = None,
) -> GateResult:
    """A bitwise (optimizer-step) gate result with a host-bound bench."""
    if parity_passed:
        tensor = TensorCheck(name="params", shape=[1024, 1024], dtype="torch.float32", mode="bitwise",
                             passed=True, differing=0, max_ulp=0)
    else:
        tensor = TensorCheck(
            name="params", shape=[1024, 1024], dtype="torch.float32", mode="bitwise", passed=False,
            differing=17, first_index=[3, 511], max_ulp=4,
            problems=[Failure(check=Check.PARITY, message="step 2, params differs at [3, 511] by 4 ULP (17 elements)")],
        )
    parity = ParityResult(
        mode="bitwise", passed=parity_passed, tensors=[tensor], inputs_unchanged=True,
        deterministic=True, recheck_after_timing=True,
        failures=[] if parity_passed else list(tensor.problems),
    )
    if benches is None:
        benches = [make_bench("step", description="Muon step, 168 matrices", reference_ms=81.9,
                              arm_ms=42.7, nbytes=403_000_000 * 12, host_bound=True, peers={},
                              seed=30)]
    ok = parity_passed and all(b.passed for b in benches)
    return GateResult(
        gate=gate, arm="suite.arms.muon.MuonGraphed", preset=preset,
        preset_params={"layers": 24, "d": 1024}, device="cuda:0",
        status="passed" if ok else "failed", parity=parity, bench=benches,
        buffers=BufferProvenance(source="loaded", seed=0, directory="buffers/muon/small",
                                 sha256={"params.safetensors": "ab" * 32}),
        duration_s=18.25,
    )


def make_could_not_run_result(gate: str = "moe", preset: str = "medium",
                              reason: str = "CUDA out of memory: needs 21.0 GiB, 12.3 GiB free") -> GateResult:
    return GateResult(
        gate=gate, arm="suite.arms.moe.grouped_experts", preset=preset,
        preset_params={"d": 2048, "f": 768, "experts": 128, "k": 8}, device="cuda:0",
        status="could_not_run", reason=reason, duration_s=1.5,
    )


def make_report(
    *,
    results: list[GateResult] | None = None,
    skipped: list[SkippedGate] | None = None,
    fingerprint: Fingerprint | None = None,
    run_id: str = "20261130T120000Z-ab12cd",
    what: str = "run",
    ceilings: Ceilings | None = None,
) -> RunReport:
    """A whole run; the exit code follows from the results as the runner computes it."""
    if results is None:
        results = [make_tolerance_result(), make_bitwise_result(), make_could_not_run_result()]
    if skipped is None:
        skipped = [SkippedGate(gate="graph", reason="needs CUDA graphs; --gates excluded it")]
    return RunReport(
        run_id=run_id, what=what, command=f"suite {what}",
        started_utc="2026-11-30T12:00:00+00:00", finished_utc="2026-11-30T12:01:03+00:00",
        fingerprint=fingerprint or make_fingerprint(),
        ceilings=ceilings or Ceilings(copy_gbps=COPY_GBPS, copy_bytes=2 * 2**30,
                                      gemm_bf16_tflops=GEMM_TFLOPS, gemm_n=8192),
        results=results, skipped=skipped,
        exit_code=int(combine([r.status for r in results])),
    )
