"""One run: for each gate and preset get buffers once, judge parity, prove the saboteurs are
caught, then (bench) time against the noise floor in every mode the case declares and run the
arm once more: the determinism run, which after timing is the parity recheck too (one run of a
multi-second arm instead of two). The report is built from these results only.

Saboteurs prove the gate's checks have teeth, which does not depend on the size of the data:
each runs once per run, at the smallest preset of its gate (on this device) where it can show,
unless `thorough` runs every saboteur at every preset. They never run on a user's recorded
buffers, where a sabotage that cannot show would prove nothing about the arm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import shlex
import sys
import time
import traceback
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Iterator

import torch

from suite.device_profile import active_profile
from suite.errors import BadBuffers, CouldNotRun, SuiteError, UsageError
from suite.harness import parity
from suite.files.buffers import load_buffers, read_manifest
from suite.harness.fingerprint import fingerprint
from suite.harness.gate import BenchCase, Buffers, Contender, Gate, Preset, Saboteur
from suite.harness.results import (
    BenchResult,
    BufferProvenance,
    CaseError,
    Ceilings,
    Check,
    GateResult,
    RunReport,
    SaboteurResult,
    SkippedGate,
    run_exit_code,
    status_of,
)
from suite.harness.timers import CudaTimer, WallTimer, memory_held
from suite.harness.timing import (
    Rotation,
    Timed,
    TimingPolicy,
    measure_bench,
    measure_ceilings,
)
from suite.settings import gpu_memory_cap, resolve_gpu_memory

GIB = 1 << 30
MAX_ROTATION = 16  # input sets an eager bench cycles through at most


class Progress:
    """What the runner tells the CLI while it works; the default says nothing.

    `phase` starts a phase of one gate and preset (a log line off a terminal); `detail` is
    the step inside it (a progress bar only: rounds would flood a log)."""

    def begin(self, total: int) -> None: ...

    def phase(self, gate: str, preset: str, phase: str) -> None: ...

    def detail(self, text: str) -> None: ...

    def advance(self) -> None: ...


@dataclass
class RunOptions:
    device: torch.device
    presets: list[str] | None = None
    buffers_dir: Path | None = None
    seed: int = 0
    bench: bool = False
    sabotage: bool = True
    thorough: bool = False  # every saboteur at every preset, not once at the smallest
    explicit: bool = True  # the gate was named (not "all"): what it cannot run is an error
    strict: bool = False  # skipped gates count as could-not-run
    # a default preset too large for the free GPU memory is skipped at planning; off for pytest
    # workers, which must plan alike (the unit then finds it when it starts)
    plan_memory: bool = True
    policy: TimingPolicy = field(default_factory=TimingPolicy)


@dataclass
class Unit:
    """One gate at one preset, and what to do there."""

    gate: Gate
    preset: Preset
    saboteurs: list[Saboteur] = field(default_factory=list)
    saboteurs_note: str | None = None
    bench: bool = False
    recorded: bool = False  # buffers come from --buffers, not make_buffers


@dataclass
class UnitRun:
    """A unit between its steps (`Runner.start`, `time`, `finish`): its result so far, and what
    the steps share. The buffers are held until it finishes."""

    unit: Unit
    result: GateResult
    phases: dict[str, float]
    started: float
    preset: Preset | None = None  # the preset the buffers were made for (a recording's own)
    buffers: Buffers | None = None
    digests: Any = None
    arm_outputs: Any = None
    timed: dict[tuple[str, str], BenchResult] = field(default_factory=dict)
    raised: tuple[str, str | None] | None = None  # a step raised: why it could not run, and where
    finished: bool = False  # `Runner.finish` made its result

    @property
    def timeable(self) -> bool:
        return self.raised is None and self.buffers is not None and self.result.parity.passed


def _capped() -> str:
    gib = resolve_gpu_memory(None)
    return "" if gib is None else f" within --gpu-memory {gib:g} GiB"


def _mib(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.0f} MiB"


def check_presets(gates: list[Gate], presets: list[str] | None) -> None:
    """A preset named on the command line must belong to one of the run's gates."""
    known = {p.name for gate in gates for p in gate.presets}
    unknown = [name for name in presets or [] if name not in known]
    if unknown:
        raise UsageError(f"no gate of this run has the preset(s) {unknown}; the presets are: {', '.join(sorted(known))}")


def rotation_sets(set_bytes: int, l2_bytes: int) -> int:
    """Input sets that back-to-back calls must cycle through to miss an L2 of l2_bytes: enough
    to hold twice the L2, at most MAX_ROTATION."""
    if set_bytes <= 0 or l2_bytes <= 0:
        return 1
    return max(1, min(MAX_ROTATION, math.ceil(2 * l2_bytes / set_bytes)))


class Runner:
    def __init__(self, options: RunOptions, progress: Progress | None = None):
        self.options = options
        self.progress = progress or Progress()
        self._ceilings: Ceilings | None = None
        self._host_us: dict[tuple[str, str, str], float | None] = {}
        self._unit_peak = 0

    # ---- planning ----

    def _selected(self, gate: Gate) -> list[Preset]:
        opts = self.options
        if opts.buffers_dir is not None:
            # the real preset is built from the manifest once the buffers are loaded
            return [Preset("recorded", {}, where="any")]
        if opts.presets:
            named = list(dict.fromkeys(opts.presets))  # a preset named twice runs once
            if opts.explicit:
                return [gate.preset(name) for name in named]  # an unknown name is a UsageError
            known = {p.name for p in gate.presets}
            return [gate.preset(name) for name in named if name in known]
        return gate.default_presets(opts.device, all_gates=not opts.explicit)

    @property
    def ceilings(self) -> Ceilings | None:
        """The card's ceilings, once a bench of this run measured them."""
        return self._ceilings

    def too_large(self, preset: Preset, free: int | None = None) -> str | None:
        """Why a default preset is skipped here (more than the GPU's free memory), or None: it
        fits, or the run names its presets (a named one too large could not run)."""
        free = self._free_memory() if free is None else free
        if free is None or self.options.presets or preset.memory_bytes <= free:
            return None
        return (f"preset {preset.name} needs about {_mib(preset.memory_bytes)}, more than the {_mib(free)} free on "
                f"this GPU{_capped()}")

    def _free_memory(self, planning: bool = False) -> int | None:
        """Free GPU memory, within the process's --gpu-memory cap where one is set (what a
        smaller card would have free)."""
        device = self.options.device
        if device.type != "cuda" or (planning and not self.options.plan_memory):
            return None
        free = torch.cuda.mem_get_info(device)[0]
        cap = gpu_memory_cap(device)
        return free if cap is None else max(0, min(free, cap - torch.cuda.memory_reserved(device)))

    def _place_saboteurs(self, gate: Gate, units: list[Unit]) -> list[Unit]:
        """Give each saboteur its unit: the smallest preset of the gate where it can show,
        added when the run does not hold it already. `thorough` runs each at every preset of the
        run where it can show, and one that can show at none of them (a float32-only sabotage in
        a run of bf16 presets) still at its smallest, so it is never a subset of the default."""
        opts = self.options
        own = [u for u in units if not u.recorded]
        if opts.thorough:
            for unit in own:
                unit.saboteurs = [s for s in gate.saboteurs if s.applies(unit.preset)]
        free = self._free_memory(planning=True)
        runnable = [p for p in gate.runnable_presets(opts.device) if free is None or p.memory_bytes <= free]
        extra: dict[str, Unit] = {}
        for saboteur in gate.saboteurs:
            if opts.thorough and any(saboteur in u.saboteurs for u in own):
                continue
            where = next((p for p in runnable if saboteur.applies(p)), None)
            if where is None:
                continue
            unit = next((u for u in own if u.preset.name == where.name), None) or extra.setdefault(
                where.name, Unit(gate, where))
            unit.saboteurs.append(saboteur)
        placed = {s.name: u.preset.name for u in [*extra.values(), *own] for s in u.saboteurs}
        unplaced = [s.name for s in gate.saboteurs if s.name not in placed]
        for unit in units:
            if unit.saboteurs:
                continue
            elsewhere = sorted(set(placed.values()) - {unit.preset.name})
            if unit.recorded:
                unit.saboteurs_note = (
                    "not applicable on recorded buffers (a sabotage that cannot show there proves nothing "
                    "about the arm)" + (f"; run on the gate's own preset {', '.join(elsewhere)}" if elsewhere else ""))
            elif elsewhere:
                unit.saboteurs_note = (f"run at preset {', '.join(elsewhere)}, the smallest where each can show "
                                       "(--thorough runs them at every preset)")
            if unplaced:
                note = f"{unplaced} apply to no preset this device can run"
                unit.saboteurs_note = f"{unit.saboteurs_note}; {note}" if unit.saboteurs_note else note
        return [*extra.values(), *units]

    def plan(self, gates: list[Gate]) -> tuple[list[Unit], list[SkippedGate], list[GateResult]]:
        """Which units run; what is skipped (all) or cannot run (named)."""
        opts = self.options
        device = opts.device
        check_presets(gates, opts.presets)
        if opts.buffers_dir is not None:
            read_manifest(opts.buffers_dir)  # a recording that is not there: refused now, not after the saboteurs' unit
        units, skipped, refused = [], [], []
        for gate in gates:
            reason = None
            if gate.needs_cuda and device.type != "cuda":
                reason = f"gate {gate.name} needs CUDA; this run's device is {device.type}"
            reason = reason or gate.missing()
            presets = [] if reason else self._selected(gate)
            free = self._free_memory(planning=True)
            too_large = []
            if presets and free is not None and not opts.presets:
                # a default preset larger than the card's free memory is listed, not attempted
                too_large = [p for p in presets if p.memory_bytes > free]
                skipped += [SkippedGate(gate=gate.name, reason=self.too_large(p, free)) for p in too_large]
                presets = [p for p in presets if p.memory_bytes <= free]
            if not reason and not presets:
                if too_large:
                    if not opts.explicit:
                        continue  # listed above, one line per preset
                    reason = (f"every default preset of gate {gate.name} needs more than the {_mib(free)} free on "
                              "this GPU; pick a smaller one with --preset (suite list)")
                elif opts.presets:
                    reason = f"gate {gate.name} has none of the presets {opts.presets}"
                elif not opts.explicit:
                    reason = (f"no preset of gate {gate.name} on {device.type} is in a run of every gate: "
                              f"suite bench {gate.name} runs them")
                else:
                    reason = (f"gate {gate.name} has no default preset on {device.type}; name one with --preset "
                              "(suite list)")
            if reason is not None:
                if opts.explicit:
                    refused.append(self.could_not_run(gate, Preset("-", {}), reason))
                else:
                    skipped.append(SkippedGate(gate=gate.name, reason=reason))
                continue
            gate_units = [Unit(gate, p, bench=opts.bench, recorded=opts.buffers_dir is not None) for p in presets]
            units.extend(self._place_saboteurs(gate, gate_units) if opts.sabotage else gate_units)
        return units, skipped, refused

    # ---- running ----

    def run(self, gates: list[Gate], what: str, command: str | None = None) -> RunReport:
        started = datetime.now(timezone.utc)
        clock = time.perf_counter()
        units, skipped, results = self.plan(gates)
        self.progress.begin(len(units))
        for unit in units:
            results.append(self._run_unit(unit))
            self.progress.advance()
        return self.report(results, skipped, what, command or shlex.join(["suite", *sys.argv[1:]]), started,
                           time.perf_counter() - clock)

    def report(self, results: list[GateResult], skipped: list[SkippedGate], what: str, command: str,
               started: datetime, duration_s: float, ceilings: Ceilings | None = None) -> RunReport:
        """A run's report from its results: this run's, or (pytest --suite -n) its workers' merged,
        whose ceilings and fingerprints came with them."""
        own = next((r.fingerprint for r in results if r.fingerprint), None)
        return RunReport(
            run_id=started.strftime("%Y%m%dT%H%M%S%fZ"),
            what=what,
            command=command,
            started_utc=started.isoformat(timespec="seconds"),
            finished_utc=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            fingerprint=own or fingerprint(self.options.device, active_profile(self.options.device)),
            ceilings=ceilings or self._ceilings,
            results=results,
            skipped=skipped,
            exit_code=run_exit_code(results, skipped, self.options.strict),
            duration_s=duration_s,
        )

    def could_not_run(self, gate: Gate, preset: Preset, reason: str) -> GateResult:
        return GateResult(
            gate=gate.name,
            arm=gate.arm_name,
            preset=preset.name,
            preset_params=dict(preset.params),
            device=str(self.options.device),
            status="could_not_run",
            reason=reason,
        )

    def _run_unit(self, unit: Unit) -> GateResult:
        run = self.start(unit)
        for case, mode in self.bench_plan(unit)[0]:
            self.time(run, case, mode)
        return self.finish(run)

    # ---- a unit's steps: judge it, time each (case, mode), finish it (the pytest items' too) ----

    def bench_plan(self, unit: Unit) -> tuple[list[tuple[BenchCase, str]], str | None]:
        """The (case, mode) pairs a unit times, each case's graph replays before its eager calls
        (an eager-over-graph bound is judged against them), or why it times none."""
        gate, preset, device = unit.gate, unit.preset, self.options.device
        if not unit.bench:
            return [], None
        if not gate.benches:
            return [], f"gate {gate.name} declares no bench"
        cases = [c for c in gate.benches if c.presets is None or preset.name in c.presets]
        if not cases:
            return [], f"gate {gate.name} times no bench case at preset {preset.name}"
        cases = [c for c in cases if device.type == "cuda" or c.modes == ("wall",)]
        if not cases:
            return [], "timing needs CUDA"
        return [(case, mode) for case in cases
                for mode in sorted((m for m in case.modes if device.type == "cuda" or m == "wall"),
                                   key=lambda m: m != "graph")], None

    def start(self, unit: Unit) -> UnitRun:
        """Buffers, reference, parity and the saboteurs of one unit."""
        gate, preset, device = unit.gate, unit.preset, self.options.device
        self._unit_peak = 0  # peaks seen before a contender's setup reset the counter
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        # it could not run until finish() judges it: a result holds no verdict yet
        run = UnitRun(unit, GateResult(gate=gate.name, arm=gate.arm_name, preset=preset.name,
                                       preset_params=dict(preset.params), device=str(device), status="could_not_run"),
                      {}, time.perf_counter())
        with self._step(run):
            if preset.where == "cuda" and device.type != "cuda":
                raise CouldNotRun(f"preset {preset.name} of gate {gate.name} needs CUDA; use --preset tiny on the CPU")
            free = self._free_memory()
            if free is not None and preset.memory_bytes > free:
                raise CouldNotRun(
                    f"preset {preset.name} of gate {gate.name} needs about {_mib(preset.memory_bytes)} of GPU memory "
                    f"and {_mib(free)} is free on {torch.cuda.get_device_name(device)}{_capped()}; pick a smaller preset "
                    "(suite list)"
                )
            self._judge(run)
            run.result.bench_skipped = self.bench_plan(unit)[1]
            if unit.bench and not run.result.parity.passed:
                run.result.bench_skipped = "parity failed: an arm that fails parity is not timed"
        return run

    def time(self, run: UnitRun, case: BenchCase, mode: str) -> BenchResult | None:
        """One case in one mode, appended to the unit's result; None where the unit is not timed
        (it could not run, or its parity failed) or the case cannot be here (its reference or its
        arm is unavailable on this device: said in the result's bench_skipped)."""
        if not run.timeable:
            return None
        unit, gate, device = run.unit, run.unit.gate, self.options.device
        lacking = [f"{c.name}: {why}" for c in gate.contenders_for(case, run.preset)
                   if c.role != "peer" and (why := c.unavailable(device)) is not None]
        if lacking:
            note = f"case {case.name} not timed ({'; '.join(lacking)})"
            if note not in (run.result.bench_skipped or ""):
                run.result.bench_skipped = "; ".join(filter(None, (run.result.bench_skipped, note)))
            return None
        with self._case_step(run, case, mode):
            if device.type == "cuda" and self._ceilings is None:
                # once a run, in the phases of the first preset that benches (every second is named)
                with self._phase(run.phases, unit, "ceilings"):
                    self.progress.detail("measuring ceilings (copy bandwidth, bf16 GEMM)")
                    self._ceilings = measure_ceilings(device)
            contenders = gate.contenders_for(case, run.preset)
            eager = device.type == "cuda" and "eager" in case.modes
            host_us = self._host_times(unit, case, contenders, run.phases) if eager else {}
            with self._phase(run.phases, unit, f"bench {case.name} {mode}"):
                timed = self._time_case(gate, case, mode, contenders, run.buffers, run.preset, host_us,
                                        graph=run.timed.get((case.name, "graph")))
            run.timed[(case.name, mode)] = timed
            run.result.bench.append(timed)
            return timed
        return None

    def finish(self, run: UnitRun) -> GateResult:
        """The determinism run where a bench delayed it (after timing, the parity recheck too),
        the status, the peak."""
        unit, device = run.unit, self.options.device
        if unit.bench and run.raised is None and run.buffers is not None:
            with self._step(run):
                timed = bool(run.result.bench)
                with self._phase(run.phases, unit, "recheck" if timed else "determinism"):
                    parity.second_run(unit.gate, run.preset, run.buffers, run.digests, run.arm_outputs,
                                      run.result.parity, after_timing=timed)
        run.buffers = run.arm_outputs = None
        run.finished = True
        if run.raised is not None:
            result = self.could_not_run(unit.gate, unit.preset, run.raised[0])
            result.traceback = run.raised[1]
        else:
            result = run.result
            result.status, result.reason = status_of(result)
            if self.options.strict and unit.bench and result.status == "passed" and result.bench_skipped:
                # nothing was timed: under --strict that is a bench this device could not run
                result.status, result.reason = "could_not_run", f"bench skipped under --strict: {result.bench_skipped}"
        if device.type == "cuda":
            result.peak_memory_bytes = max(self._unit_peak, torch.cuda.max_memory_allocated(device))
            torch.cuda.empty_cache()
        result.phases = run.phases
        result.duration_s = time.perf_counter() - run.started
        return result

    @contextlib.contextmanager
    def _step(self, run: UnitRun) -> Iterator[None]:
        """A step of the unit: what it raises makes the unit one that could not run."""
        try:
            yield
        except UsageError:
            raise  # the command line was wrong: exit 2, not a result
        except (CouldNotRun, torch.OutOfMemoryError) as exc:
            run.raised = (_first_line(exc), None)
        except Exception as exc:  # an arm that raises (compile error, launch failure) could not run
            # one line is enough for a known failure, not for a bug: keep where it was raised
            run.raised = (f"{type(exc).__name__} while running: {_first_line(exc)}", traceback.format_exc())

    @contextlib.contextmanager
    def _case_step(self, run: UnitRun, case: BenchCase, mode: str) -> Iterator[None]:
        """One bench case: what it raises is that case's error in the result, and the unit's
        other cases are still timed and kept."""
        try:
            yield
        except UsageError:
            raise
        except Exception as exc:
            known = isinstance(exc, (CouldNotRun, torch.OutOfMemoryError))
            message = _first_line(exc) if known else f"{type(exc).__name__} while running: {_first_line(exc)}"
            run.result.bench_errors.append(CaseError(case=case.name, mode=mode, message=message,
                                                     traceback=None if known else traceback.format_exc()))
            if self.options.device.type == "cuda":
                torch.cuda.empty_cache()  # the case's half-built contenders are gone: free their memory

    @contextlib.contextmanager
    def _phase(self, phases: dict[str, float], unit: Unit, name: str) -> Iterator[None]:
        self.progress.phase(unit.gate.name, unit.preset.name, name)
        start = time.perf_counter()
        try:
            yield
        finally:
            phases[name] = phases.get(name, 0.0) + time.perf_counter() - start

    def _buffers(self, gate: Gate, preset: Preset, recorded: bool) -> tuple[Buffers, Preset, BufferProvenance]:
        opts = self.options
        if not recorded:
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
        # what every preset declares; a param only some presets set is optional to the gate
        needed = set.intersection(*(set(p.params) for p in gate.presets))
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

    def _judge(self, run: UnitRun) -> None:
        opts, unit, phases = self.options, run.unit, run.phases
        gate = unit.gate
        with self._phase(phases, unit, "buffers"):
            buffers, preset, provenance = self._buffers(gate, unit.preset, unit.recorded)
        with self._phase(phases, unit, "reference"):
            try:
                expected = parity.expected_outputs(gate, preset, buffers)
            except (RuntimeError, ValueError, IndexError, KeyError, TypeError) as exc:
                if not unit.recorded or isinstance(exc, SuiteError):
                    raise
                # on the gate's own buffers this is a bug; on a recording, a layout the gate cannot run
                raise BadBuffers(f"{opts.buffers_dir}: gate {gate.name}'s reference cannot run on these buffers "
                                 f"({type(exc).__name__}: {_first_line(exc)}); their shapes or dtypes do not fit "
                                 f"the gate: record them again with `suite record {gate.name} --out DIR`") from exc
        with self._phase(phases, unit, "parity"):
            # with a bench to come, the determinism run waits until after it and rechecks it too
            verdict, arm_outputs = parity.judge_arm(gate, preset, buffers, expected,
                                                    nondeterministic=gate.nondeterministic, second_run=not unit.bench)
        saboteurs = []
        for saboteur in unit.saboteurs:
            with self._phase(phases, unit, f"saboteur {saboteur.name}"):
                saboteurs.append(self._sabotage(gate, preset, buffers, expected, saboteur))
        run.digests = expected.input_digests
        del expected  # the reference and float64 truth are not needed while timing
        run.preset, run.buffers, run.arm_outputs = preset, buffers, arm_outputs
        result = run.result
        result.preset, result.preset_params = preset.name, dict(preset.params)
        result.parity, result.saboteurs, result.saboteurs_note, result.buffers = (
            verdict, saboteurs, unit.saboteurs_note, provenance)

    def _sabotage(self, gate, preset, buffers, expected, saboteur: Saboteur) -> SaboteurResult:
        # one that writes into its inputs gets copies, so the real buffers stay intact
        writes_inputs = saboteur.caught_by == Check.INPUTS
        given = {name: t.clone() for name, t in buffers.items()} if writes_inputs else buffers
        # its determinism run only where that is the check it must trip: a second run of every
        # saboteur doubled their share of a run for nothing they are there to show
        verdict, _ = parity.judge_arm(gate, preset, given, expected, arm=saboteur.fn,
                                      second_run=saboteur.caught_by == Check.DETERMINISM)
        if not writes_inputs and not verdict.inputs_unchanged:
            raise CouldNotRun(
                f"saboteur {saboteur.name} of gate {gate.name} modified the input buffers; declare it "
                "caught_by=Check.INPUTS so it runs on copies"
            )
        return SaboteurResult(
            name=saboteur.name,
            description=saboteur.description,
            expected_check=saboteur.caught_by,
            # caught by the check it is meant to trip: failing for another reason would mean
            # the gate's defence against this fault is untested
            caught=saboteur.caught_by in verdict.checks_failed(),
            failures=verdict.failures,
        )

    # ---- benches ----

    def _time_case(self, gate: Gate, case: BenchCase, mode: str, contenders: list[Contender], buffers: Buffers,
                   preset: Preset, host_us: dict[str, float | None], graph: BenchResult | None = None) -> BenchResult:
        device = self.options.device
        sets = [buffers]
        if mode == "eager" and case.l2 == "cold":
            l2 = torch.cuda.get_device_properties(device).L2_cache_size
            count = rotation_sets(sum(t.nbytes for t in buffers.values()), l2)
            sets += [{n: t.clone() for n, t in buffers.items()} for _ in range(count - 1)]
        with case_stream(case, device):
            return self._build_and_time(gate, case, mode, contenders, sets, preset, host_us, graph)

    def _build_and_time(self, gate: Gate, case: BenchCase, mode: str, contenders: list[Contender], sets: list[Buffers],
                        preset: Preset, host_us: dict[str, float | None], graph: BenchResult | None) -> BenchResult:
        device = self.options.device
        timed = []
        for contender in contenders:
            reason = contender.unavailable(device)
            call, setup = None, {}
            if reason is None:
                try:
                    with self._setup_measured(device, setup if case.setup else None):
                        calls = [contender.build(case, s, preset) for s in sets]
                    call = calls[0] if len(calls) == 1 else Rotation(calls)
                except Exception as exc:  # a peer that cannot be built here is reported, not fatal
                    if contender.role != "peer":
                        raise
                    reason = f"{type(exc).__name__}: {_first_line(exc)}"
            timed.append(Timed(contender.name, contender.role, call, reason, host_us.get(contender.name),
                               baseline=contender.baseline, note=getattr(call, "note", "") or "", **setup))
        policy = self.options.policy
        if case.calls_per_round:  # the case's count, whatever the round budget would allow
            policy = dataclasses.replace(policy, calls_per_round=case.calls_per_round,
                                         min_calls_per_round=case.calls_per_round)
        if case.max_rounds:
            policy = dataclasses.replace(policy, max_rounds=case.max_rounds,
                                         min_rounds=min(policy.min_rounds, case.max_rounds))
        timer = WallTimer(device) if mode == "wall" else CudaTimer(device)
        try:
            return measure_bench(
                case, mode, timed, preset, gate.criteria, self._ceilings, policy, timer,
                progress=self.progress.detail, rotation=len(sets),
                host_probe=self._probe_name(gate) if host_us else None, graph=graph if mode == "eager" else None,
            )
        finally:  # a call's memory is measured from a reset counter: the peak before it stays the gate's
            self._unit_peak = max(self._unit_peak, getattr(timer, "peak_before_reset", 0))

    @contextlib.contextmanager
    def _setup_measured(self, device: torch.device, into: dict | None) -> Iterator[None]:
        """Into `into` (when given): the seconds of what runs inside, and on CUDA the most device
        memory it held above what was allocated when it began (what that contender keeps and its
        first calls' peak; the other contenders' memory left out)."""
        if into is None:
            yield
            return
        if device.type != "cuda":
            started = time.perf_counter()
            yield
            into["setup_s"] = time.perf_counter() - started
            return
        with memory_held(device) as found:
            self._unit_peak = max(self._unit_peak, found.prior_peak)
            started = time.perf_counter()
            yield
        into["setup_s"], into["setup_peak_bytes"] = time.perf_counter() - started, found.held

    def _probe_name(self, gate: Gate) -> str:
        probe = gate.preset(gate.host_probe)
        return f"preset {probe.name}" + (f" ({probe.note})" if probe.note else "")

    def _host_times(self, unit: Unit, case: BenchCase, contenders: list[Contender],
                    phases: dict[str, float]) -> dict[str, float | None]:
        """Host time per call of every contender on the gate's host-probe shape, once a run (a
        phase of the first preset that needs it)."""
        device, gate = self.options.device, unit.gate
        if device.type != "cuda" or not host_probed(gate, case):
            return {}
        missing = [c for c in contenders if (gate.name, case.name, c.name) not in self._host_us]
        if missing:
            with self._phase(phases, unit, f"host probe {case.name}"):
                self._probe_host_times(gate, case, missing)
        return {c.name: self._host_us[(gate.name, case.name, c.name)] for c in contenders}

    def _probe_host_times(self, gate: Gate, case: BenchCase, missing: list[Contender]) -> None:
        device = self.options.device
        self.progress.detail(f"host time per call on {gate.host_probe}")
        probe = gate.preset(gate.host_probe)
        buffers = gate.make_buffers(probe, self.options.seed, device)
        timer = CudaTimer(device)
        for contender in missing:
            us = None
            if contender.unavailable(device) is None:
                try:
                    with case_stream(case, device):  # the calls the bench times, on the stream it times them
                        us = timer.host_us(contender.build(case, buffers, probe))
                except Exception:  # a peer that cannot run on the probe shape has no figure
                    if contender.role != "peer":
                        raise
            self._host_us[(gate.name, case.name, contender.name)] = us


@contextlib.contextmanager
def case_stream(case: BenchCase, device: torch.device) -> Iterator[None]:
    """A case's builds and calls on a stream of its own where it asks for one (see
    BenchCase.own_stream), after what the caller's stream has queued (its buffers); the caller's
    stream waits for it in turn, however the case ends."""
    if not (case.own_stream and device.type == "cuda"):
        yield
        return
    caller = torch.cuda.current_stream(device)
    own = torch.cuda.Stream(device)
    own.wait_stream(caller)
    try:
        with torch.cuda.stream(own):
            yield
    finally:
        caller.wait_stream(own)


def host_probed(gate: Gate, case: BenchCase) -> bool:
    """Whether a case's host time per call is measured on the gate's host-probe shape: not for a
    case timed only at some presets (compiled peers), which is never built at that shape."""
    return gate.host_probe is not None and (case.presets is None or gate.host_probe in case.presets)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0]
