"""One run: for each gate and preset get buffers once, judge parity, prove the saboteurs are
caught, then (bench) time against the noise floor and re-check parity. The report is built
from these results only and written atomically.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from suite.device_profile import active_profile
from suite.errors import BadBuffers, CouldNotRun, UsageError, combine
from suite.harness import parity
from suite.harness.buffers import load_buffers
from suite.harness.fingerprint import fingerprint
from suite.harness.gate import Buffers, Gate, Preset
from suite.harness.report import (
    BufferProvenance,
    Ceilings,
    GateResult,
    RunReport,
    SaboteurResult,
    SkippedGate,
)
from suite.harness.timing import CudaTimer, TimingPolicy, measure_bench, measure_ceilings

GIB = 1 << 30


def resolve_device(choice: str) -> torch.device:
    """auto: CUDA when present, else the CPU. Asking for CUDA without one cannot run."""
    if choice not in ("auto", "cuda", "cpu"):
        raise UsageError(f"--device must be auto, cuda or cpu, not {choice!r}")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise CouldNotRun(
            "--device cuda: this machine has no usable CUDA device (torch.cuda.is_available() is False, "
            f"torch {torch.__version__}); run on a GPU machine or use --device cpu"
        )
    return torch.device(choice)


def prepare_triton(device: torch.device) -> None:
    """Triton kernels run on the CPU only through its interpreter, chosen before import."""
    if device.type != "cpu":
        return
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise CouldNotRun("triton was imported before the CPU interpreter could be chosen; set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"


def set_profile(profile: str) -> None:
    """--profile: rtx holds Triton configs to the RTX 50-series' 99 KB of shared memory."""
    if profile not in ("auto", "rtx", "none"):
        raise UsageError(f"--profile must be auto, rtx or none, not {profile!r}")
    os.environ["SUITE_PROFILE"] = profile


class Progress:
    """What the runner tells the CLI while it works; the default says nothing."""

    def begin(self, total: int) -> None: ...

    def status(self, text: str) -> None: ...

    def advance(self) -> None: ...


@dataclass
class RunOptions:
    device: torch.device
    presets: list[str] | None = None
    buffers_dir: Path | None = None
    seed: int = 0
    profile: str = "auto"
    bench: bool = False
    sabotage: bool = True
    explicit: bool = True  # the gate was named (not "all"): what it cannot run is an error
    strict: bool = False  # skipped gates count as could-not-run
    policy: TimingPolicy = field(default_factory=TimingPolicy)


def _mib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


class Runner:
    def __init__(self, options: RunOptions, progress: Progress | None = None):
        self.options = options
        self.progress = progress or Progress()
        self._ceilings: Ceilings | None = None

    # ---- planning ----

    def _presets(self, gate: Gate) -> list[Preset]:
        opts = self.options
        if opts.buffers_dir is not None:
            # the real preset is built from the manifest once the buffers are loaded
            return [Preset("recorded", {}, where="any")]
        if opts.presets:
            if opts.explicit:
                return [gate.preset(name) for name in opts.presets]  # an unknown name is a UsageError
            known = {p.name for p in gate.presets}
            return [gate.preset(name) for name in opts.presets if name in known]
        return gate.default_presets(opts.device)

    def plan(self, gates: list[Gate]) -> tuple[list[tuple[Gate, Preset]], list[SkippedGate], list[GateResult]]:
        """Which (gate, preset) pairs run; what is skipped (all) or cannot run (named)."""
        device = self.options.device
        if self.options.presets:
            known = {p.name for gate in gates for p in gate.presets}
            unknown = [name for name in self.options.presets if name not in known]
            if unknown:
                raise UsageError(
                    f"no gate of this run has the preset(s) {unknown}; the presets are: {', '.join(sorted(known))}"
                )
        units, skipped, refused = [], [], []
        for gate in gates:
            reason = None
            if gate.needs_cuda and device.type != "cuda":
                reason = f"gate {gate.name} needs CUDA; this run's device is {device.type}"
            presets = [] if reason else self._presets(gate)
            if presets and device.type == "cuda" and not self.options.presets:
                # a default preset larger than the card's free memory is listed, not attempted
                free, _ = torch.cuda.mem_get_info(device)
                for preset in [p for p in presets if p.memory_bytes > free]:
                    skipped.append(SkippedGate(gate=gate.name, reason=(
                        f"preset {preset.name} needs about {_mib(preset.memory_bytes)}, more than the "
                        f"{_mib(free)} free on this GPU")))
                presets = [p for p in presets if p.memory_bytes <= free]
            if not reason and not presets:
                reason = f"gate {gate.name} has none of the presets {self.options.presets}"
            if reason is None:
                units.extend((gate, preset) for preset in presets)
            elif self.options.explicit:
                refused.append(self._could_not_run(gate, Preset("-", {}), reason))
            else:
                skipped.append(SkippedGate(gate=gate.name, reason=reason))
        return units, skipped, refused

    # ---- running ----

    def run(self, gates: list[Gate], what: str, command: str | None = None) -> RunReport:
        started = datetime.now(timezone.utc)
        units, skipped, results = self.plan(gates)
        self.progress.begin(len(units))
        for gate, preset in units:
            self.progress.status(f"{gate.name} [{preset.name}]")
            results.append(self._run_unit(gate, preset))
            self.progress.advance()
        statuses = [r.status for r in results] + (["could_not_run"] * len(skipped) if self.options.strict else [])
        return RunReport(
            run_id=started.strftime("%Y%m%dT%H%M%S%fZ"),
            what=what,
            command=command or shlex.join(["suite", *sys.argv[1:]]),
            started_utc=started.isoformat(timespec="seconds"),
            finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            fingerprint=fingerprint(self.options.device, active_profile(self.options.device)),
            ceilings=self._ceilings,
            results=results,
            skipped=skipped,
            exit_code=int(combine(statuses)),
        )

    def _could_not_run(self, gate: Gate, preset: Preset, reason: str) -> GateResult:
        return GateResult(
            gate=gate.name,
            arm=gate.arm_name,
            preset=preset.name,
            preset_params=dict(preset.params),
            device=str(self.options.device),
            status="could_not_run",
            reason=reason,
        )

    def _run_unit(self, gate: Gate, preset: Preset) -> GateResult:
        device = self.options.device
        start = time.perf_counter()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            if preset.where == "cuda" and device.type != "cuda":
                raise CouldNotRun(f"preset {preset.name} of gate {gate.name} needs CUDA; use --preset tiny on the CPU")
            if device.type == "cuda" and preset.memory_bytes:
                free, _ = torch.cuda.mem_get_info(device)
                if preset.memory_bytes > free:
                    raise CouldNotRun(
                        f"preset {preset.name} of gate {gate.name} needs about {_mib(preset.memory_bytes)} of GPU memory "
                        f"and {_mib(free)} is free on {torch.cuda.get_device_name(device)}; pick a smaller preset (suite list)"
                    )
            result = self._judge_and_time(gate, preset)
        except UsageError:
            raise  # the command line was wrong: exit 2, not a result
        except (CouldNotRun, torch.OutOfMemoryError) as exc:
            result = self._could_not_run(gate, preset, _first_line(exc))
        except Exception as exc:  # an arm that raises (compile error, launch failure) could not run
            detail = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            result = self._could_not_run(gate, preset, f"{type(exc).__name__} while running: {detail}")
        if device.type == "cuda":
            result.peak_memory_bytes = torch.cuda.max_memory_allocated(device)
            torch.cuda.empty_cache()
        result.duration_s = time.perf_counter() - start
        return result

    def _buffers(self, gate: Gate, preset: Preset) -> tuple[Buffers, Preset, BufferProvenance]:
        opts = self.options
        if opts.buffers_dir is None:
            buffers = gate.make_buffers(preset, opts.seed, opts.device)
            return buffers, preset, BufferProvenance(source="fresh", seed=opts.seed)
        buffers, manifest = load_buffers(
            opts.buffers_dir, opts.device, expect_gate=gate.name, required=gate.required_buffers
        )
        if opts.presets and manifest.preset and manifest.preset not in opts.presets:
            raise UsageError(
                f"--buffers {opts.buffers_dir} was recorded for preset {manifest.preset!r}; "
                f"drop --preset or pass --preset {manifest.preset}"
            )
        known = {p.name: p for p in gate.presets}
        base = known.get(manifest.preset) if manifest.preset else None
        params = {**(base.params if base else {}), **manifest.params, **gate.buffer_params(buffers)}
        needed = set().union(*(p.params for p in gate.presets))
        missing = sorted(needed - set(params))
        if missing:
            raise BadBuffers(
                f"{opts.buffers_dir}: gate {gate.name} needs the params {missing}; "
                "pass them to save_buffers(..., params={...})"
            )
        loaded = Preset(manifest.preset or "recorded", params, where="any", note=f"loaded from {opts.buffers_dir}")
        provenance = BufferProvenance(
            source="loaded", seed=manifest.seed or 0, directory=str(opts.buffers_dir), sha256=manifest.sha256
        )
        return buffers, loaded, provenance

    def _judge_and_time(self, gate: Gate, preset: Preset) -> GateResult:
        opts = self.options
        buffers, preset, provenance = self._buffers(gate, preset)
        self.progress.status(f"{gate.name} [{preset.name}] parity")
        expected = parity.expected_outputs(gate, preset, buffers)
        verdict, arm_outputs = parity.judge_arm(gate, preset, buffers, expected, nondeterministic=gate.nondeterministic)
        saboteurs = []
        if opts.sabotage:
            for saboteur in (s for s in gate.saboteurs if s.applies(preset)):
                self.progress.status(f"{gate.name} [{preset.name}] saboteur {saboteur.name}")
                saboteurs.append(self._sabotage(gate, preset, buffers, expected, saboteur))
        digests = expected.input_digests
        del expected  # the reference and float64 truth are not needed while timing
        result = GateResult(
            gate=gate.name,
            arm=gate.arm_name,
            preset=preset.name,
            preset_params=dict(preset.params),
            device=str(opts.device),
            status="passed",
            parity=verdict,
            saboteurs=saboteurs,
            buffers=provenance,
        )
        if opts.bench:
            self._bench(gate, preset, buffers, result)
            if result.bench:
                failures = parity.recheck(gate, preset, buffers, digests, arm_outputs)
                verdict.recheck_after_timing = not failures
                verdict.failures.extend(failures)
                verdict.passed = verdict.passed and not failures
        result.status, result.reason = _status(result)
        return result

    def _sabotage(self, gate, preset, buffers, expected, saboteur) -> SaboteurResult:
        # one that writes into its inputs gets copies, so the real buffers stay intact
        writes_inputs = saboteur.caught_by == "inputs"
        given = {name: t.clone() for name, t in buffers.items()} if writes_inputs else buffers
        verdict, _ = parity.judge_arm(gate, preset, given, expected, arm=saboteur.fn)
        if not writes_inputs and not verdict.inputs_unchanged:
            raise CouldNotRun(
                f"saboteur {saboteur.name} of gate {gate.name} modified the input buffers; declare it "
                "caught_by='inputs' so it runs on copies"
            )
        return SaboteurResult(
            name=saboteur.name,
            description=saboteur.description,
            expected_check=saboteur.caught_by,
            # caught by the check it is meant to trip: failing for another reason would mean
            # the gate's defence against this fault is untested
            caught=any(f.startswith(saboteur.caught_by) for f in verdict.failures),
            failures=verdict.failures,
        )

    def _bench(self, gate: Gate, preset: Preset, buffers: Buffers, result: GateResult) -> None:
        device = self.options.device
        if not gate.benches:
            result.bench_skipped = f"gate {gate.name} declares no bench"
            return
        if device.type != "cuda":
            result.bench_skipped = "timing needs CUDA"
            return
        if not result.parity.passed:
            result.bench_skipped = "parity failed: an arm that fails parity is not timed"
            return
        if self._ceilings is None:
            self.progress.status("measuring ceilings (copy bandwidth, bf16 GEMM)")
            self._ceilings = measure_ceilings(device)
        timer = CudaTimer(device)
        for case in gate.benches:
            contenders = [
                ("reference", "reference", gate.bench_callable(case, "reference", buffers, preset), None),
                ("arm", "arm", gate.bench_callable(case, "arm", buffers, preset), None),
            ]
            for peer in gate.peers:
                if case.peers is None or peer.name in case.peers:
                    contenders.append(_peer_contender(gate, case, peer, buffers, preset, device))
            self.progress.status(f"{gate.name} [{preset.name}] bench {case.name}")
            policy = self.options.policy
            if case.calls_per_round:
                policy = dataclasses.replace(policy, calls_per_round=case.calls_per_round)
            result.bench.append(
                measure_bench(
                    case,
                    contenders,
                    preset,
                    gate.perf,
                    self._ceilings,
                    policy,
                    timer,
                    progress=lambda text: self.progress.status(f"{gate.name} [{preset.name}] {case.name}: {text}"),
                )
            )


def _peer_contender(gate, case, peer, buffers, preset, device):
    reason = peer.unavailable(device)
    if reason:
        return (peer.name, "peer", None, reason)
    try:
        return (peer.name, "peer", gate.bench_callable(case, peer.name, buffers, preset), None)
    except Exception as exc:  # a peer that cannot be built here is reported, not fatal
        return (peer.name, "peer", None, f"{type(exc).__name__}: {_first_line(exc)}")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]


def _status(result: GateResult) -> tuple[str, str | None]:
    reasons = []
    if not result.parity.passed:
        reasons.append("parity: " + "; ".join(result.parity.failures))
    missed = [s.name for s in result.saboteurs if not s.caught]
    if missed:
        reasons.append(f"saboteurs not caught (the gate has no teeth for them): {missed}")
    # a criterion that failed outright outranks another that stayed ambiguous
    slow = [
        f"{b.case}: {c.detail}" for b in result.bench for c in b.criteria if not c.passed and not c.ambiguous
    ]
    if slow:
        reasons.append("performance: " + "; ".join(slow))
    if reasons:
        return "failed", " | ".join(reasons)
    ambiguous = [b.case for b in result.bench if b.ambiguous]
    if ambiguous:
        return "ambiguous", f"timing stayed ambiguous against the noise floor for {ambiguous}"
    return "passed", result.bench_skipped
