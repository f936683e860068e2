"""Gate `skip-step`: SkipStepOptimizer (suite.arms.skip_step) against the obvious eager code: a
float64 loop on the host that reads every value with `.item()`, decides, and steps the plain
optimizer only on the steps it keeps.

Per optimizer (Muon + AdamW; torch AdamW fused; on CUDA torch AdamW foreach, capturable), per
mode (eager; on CUDA at the small and medium presets also inside a CapturedOptimizer) and per
scenario of `steps` steps, bit for bit: the steps skipped, the final parameters, the monitor's verdict after every step, and the
host reads inside `step()` (none: counted by patching the reads on the CPU, and by CUDA's sync
debug mode on a GPU).

Scenarios: a +100 sigma loss spike; a grad-norm spike alone; a NaN loss; an Inf grad norm; a slow
upward drift that must not be skipped; a constant loss with one step off it; a spike inside the
first min_history steps; a spike whose z is 5.985 with Bessel's correction and 6.008 without it
(what a biased std gets wrong); a state_dict saved mid-window and loaded into a fresh optimizer,
with a spike five steps later that only the restored window can judge.
"""

from __future__ import annotations

import contextlib
import math
import statistics
import warnings
from typing import Any, Callable, Iterator

import torch

from gates.optimizer_runs import flat_params, fresh_params, set_saved_grads
from suite.arms.graph import CapturedOptimizer
from suite.arms.muon import Muon
from suite.arms.skip_step import SkipStepOptimizer, StabilityMonitor, decide
from suite.harness.criteria import SpeedupOver
from suite.harness.gate import (
    BenchCase,
    Bitwise,
    Buffers,
    Contender,
    Gate,
    Outputs,
    Preset,
    Saboteur,
)

SIGMA, MIN_HISTORY, WINDOW = 6.0, 20, 128
SCENARIOS = ("loss-spike", "grad-spike", "nan-loss", "inf-grad", "drift", "constant", "early-spike", "threshold",
             "resume")
MUON_LR, ADAMW_LR, WEIGHT_DECAY = 0.02, 3e-4, 0.01


# ---- the host reference ----------------------------------------------------------------------


def host_skips(history: list[tuple[float, float]], latest: tuple[float, float], correction: int = 1,
               sigma: float = SIGMA, min_history: int = MIN_HISTORY, window: int = WINDOW) -> bool:
    """The obvious eager decision on host floats."""
    if not all(math.isfinite(v) for v in latest):
        return True
    kept = history[-window:]
    if len(kept) < min_history:
        return False
    for column, value in enumerate(latest):
        values = [row[column] for row in kept]
        mean = statistics.fmean(values)
        std = math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - correction))
        if (value != mean) if std == 0 else abs(value - mean) / std > sigma:
            return True
    return False


def host_run(values: list[tuple[float, float]], window: int = WINDOW, min_history: int = MIN_HISTORY) -> list[bool]:
    history, skips = [], []
    for latest in values:
        skip = host_skips(history, latest, min_history=min_history, window=window)
        skips.append(skip)
        if not skip:
            history.append(latest)
    return skips


def scenario_values(kind: str, steps: int, seed: int, window: int = WINDOW,
                    min_history: int = MIN_HISTORY) -> list[tuple[float, float]]:
    """(loss, grad norm) per step: noise of 1% around (2, 1), and the scenario's event."""
    gen = torch.Generator().manual_seed(seed)
    noise = (torch.randn(steps, 2, generator=gen, dtype=torch.float64) * 0.01).tolist()
    values = [(2.0 + a, 1.0 + b) for a, b in noise]
    at = steps // 2
    if kind == "loss-spike":
        values[at] = (values[at][0] + 100 * 0.01, values[at][1])
    elif kind == "grad-spike":
        values[at] = (values[at][0], values[at][1] + 50 * 0.01)
    elif kind == "nan-loss":
        values[at] = (math.nan, values[at][1])
    elif kind == "inf-grad":
        values[at] = (values[at][0], math.inf)
    elif kind == "drift":  # 0.1 sigma a step upward: never beyond the band
        values = [(2.0 + 0.001 * i + a, 1.0 + b) for i, (a, b) in enumerate(noise)]
    elif kind == "constant":
        values = [(2.0, 1.0)] * steps
        values[at] = (2.0 + 1e-3, 1.0)
    elif kind == "resume":  # a spike soon after the restart: only a restored window can judge it
        values[at + 5] = (values[at + 5][0] + 100 * 0.01, values[at + 5][1])
    elif kind == "early-spike":
        values[min_history // 2] = (50.0, values[min_history // 2][1])
    elif kind == "threshold":  # between 6 sigma biased and 6 sigma unbiased: only a wrong std skips it
        kept = [v[0] for v in values[max(0, at - window):at]]
        mean, n = statistics.fmean(kept), len(kept)
        unbiased = math.sqrt(sum((v - mean) ** 2 for v in kept) / (n - 1))
        values[at] = (mean + 5.985 * unbiased, values[at][1])
        assert 6.0 < 5.985 * unbiased / math.sqrt(sum((v - mean) ** 2 for v in kept) / n)
    return values


# ---- buffers -----------------------------------------------------------------------------------


def _shapes(preset: Preset) -> dict[str, tuple[int, ...]]:
    d, layers = preset.params["d"], preset.params["layers"]
    shapes = {}
    for layer in range(layers):
        shapes[f"layers.{layer}.wqkv"] = (3 * d, d)
        shapes[f"layers.{layer}.w_up"] = (4 * d, d)
        shapes[f"layers.{layer}.w_down"] = (d, 4 * d)
        shapes[f"layers.{layer}.norm"] = (d,)
    return shapes


def make_buffers(preset: Preset, seed: int, device: torch.device) -> Buffers:
    """Initial parameters, one gradient set per step (a fixed direction plus noise, shrinking),
    and each scenario's (loss, grad norm) per step."""
    gen = torch.Generator().manual_seed(seed)
    steps, sets = preset.params["steps"], preset.params["grad_sets"]
    buffers: Buffers = {}
    for name, shape in _shapes(preset).items():
        buffers[f"param/{name}"] = (torch.randn(shape, generator=gen) / math.sqrt(shape[-1])
                                    if len(shape) == 2 else torch.ones(shape)).to(device)
        direction = torch.randn(shape, generator=gen)
        noise = torch.randn((sets, *shape), generator=gen)
        buffers[f"grads/{name}"] = ((direction + noise) * 1e-3).to(device)
    for index, kind in enumerate(SCENARIOS):
        buffers[f"values/{kind}"] = torch.tensor(scenario_values(kind, steps, seed + index, *_band(preset)),
                                                 dtype=torch.float64,
                                                 device=device)
    return buffers


def buffer_params(buffers: Buffers) -> dict[str, Any]:
    return dict(steps=buffers["values/drift"].shape[0],
                grad_sets=next(t.shape[0] for k, t in buffers.items() if k.startswith("grads/")))


# ---- runs --------------------------------------------------------------------------------------


def kinds(device: torch.device) -> tuple[str, ...]:
    # torch's non-fused AdamW keeps its step count on the host unless capturable, which needs CUDA
    return ("muon", "adamw-fused", "adamw") if device.type == "cuda" else ("muon", "adamw-fused")


def modes(device: torch.device, preset: Preset) -> tuple[str, ...]:
    captured = device.type == "cuda" and preset.params.get("captured", False)
    return ("eager", "captured") if captured else ("eager",)


def as_captured_steps_it(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The eager twin of a CapturedOptimizer's step: torch AdamW reads its lr as the 0-d fp32
    device tensor the wrapper makes of it (a float lr rounds differently); Muon's own live values
    are read the same either way."""
    if not isinstance(optimizer, Muon):
        for group in optimizer.param_groups:
            group["lr"] = torch.full((), group["lr"], dtype=torch.float32, device=group["params"][0].device)
    return optimizer


def make_optimizer(kind: str, params: dict[str, torch.Tensor]) -> torch.optim.Optimizer:
    matrices = [p for p in params.values() if p.dim() == 2]
    vectors = [p for p in params.values() if p.dim() == 1]
    cuda = matrices[0].is_cuda
    if kind == "muon":
        return Muon([{"params": matrices, "use_muon": True}, {"params": vectors, "use_muon": False, "lr": ADAMW_LR}],
                    lr=MUON_LR, weight_decay=WEIGHT_DECAY, capturable=cuda)
    implementation = dict(fused=True) if kind == "adamw-fused" else dict(foreach=True)
    return torch.optim.AdamW(matrices + vectors, lr=ADAMW_LR, weight_decay=WEIGHT_DECAY, capturable=cuda,
                             **implementation)


def _band(preset: Preset) -> tuple[int, int]:
    """(window, min_history) of the preset: the arm's defaults unless a preset asks for a short
    window (tiny: the ring still wraps, in fewer steps)."""
    return preset.params.get("window", WINDOW), preset.params.get("min_history", MIN_HISTORY)


def _reference_run(kind: str, mode: str, buffers: Buffers, scenario: str, band: tuple[int, int]) -> Outputs:
    values = buffers[f"values/{scenario}"].tolist()
    skips = host_run(values, *band)
    params = fresh_params(buffers)
    optimizer = make_optimizer(kind, params)
    if mode == "captured":
        as_captured_steps_it(optimizer)
    for step, skip in enumerate(skips):
        set_saved_grads(params, buffers, step)
        if not skip:
            optimizer.step()
    spikes = [s and all(math.isfinite(v) for v in values[i]) for i, s in enumerate(skips)]
    taken = torch.tensor([not s for s in skips], dtype=torch.int8)
    return {"skips": torch.tensor(skips, dtype=torch.int8), "params": flat_params(params),
            "monitor_taken": taken, "monitor_spikes": torch.tensor([sum(spikes)]), "host_reads": torch.tensor([0])}


@contextlib.contextmanager
def counted_host_reads(device: torch.device) -> Iterator[list[int]]:
    """Counts what reads a tensor's value into Python inside the block: item(), tolist(), bool,
    int, float (patched on torch.Tensor), and on CUDA every synchronizing call sync debug mode
    reports."""
    count = [0]
    names = ("item", "tolist", "__bool__", "__int__", "__float__")
    originals = {name: getattr(torch.Tensor, name) for name in names}

    def counting(original):
        def read(self, *args, **kwargs):
            count[0] += 1
            return original(self, *args, **kwargs)
        return read

    for name, original in originals.items():
        setattr(torch.Tensor, name, counting(original))
    cuda = device.type == "cuda"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            if cuda:
                torch.cuda.set_sync_debug_mode("warn")
            try:
                yield count
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
        # only sync debug mode's own report: its one-time "prototype feature" notice is no sync
        count[0] += sum("called a synchronizing" in str(w.message) for w in caught)
    finally:
        for name, original in originals.items():
            setattr(torch.Tensor, name, original)


Factory = Callable[..., SkipStepOptimizer]  # (optimizer, rolling_interval_length=, min_history=)


def _arm_run(kind: str, mode: str, buffers: Buffers, scenario: str, wrap: Factory,
             monitor: Callable[[SkipStepOptimizer], StabilityMonitor], band: tuple[int, int]) -> Outputs:
    values = buffers[f"values/{scenario}"]
    steps = values.shape[0]
    params = fresh_params(buffers)
    device = values.device

    def build() -> SkipStepOptimizer:
        inner = make_optimizer(kind, params)
        window, min_history = band
        return wrap(CapturedOptimizer(inner) if mode == "captured" else inner, rolling_interval_length=window,
                    min_history=min_history)

    optimizer = build()
    watcher = monitor(optimizer)
    skips, taken, reads = [], [], 0
    # a CapturedOptimizer's warm-up steps and its capture synchronize (once, before the steps
    # that count): host reads are counted from the first replay on
    settle = optimizer.optimizer.warmup_steps + 1 if mode == "captured" else 0
    built_at = 0
    for step in range(steps):
        if scenario == "resume" and step == steps // 2:
            built_at = step
            saved = _detached(optimizer.state_dict())
            optimizer = build()  # a fresh optimizer (and monitor), as a restarted run builds them
            optimizer.load_state_dict(saved)
            saved_monitor = watcher.state_dict()
            watcher = monitor(optimizer)
            watcher.load_state_dict(saved_monitor)
        set_saved_grads(params, buffers, step)
        optimizer.latest_loss = values[step, 0]
        optimizer.latest_grad_norm = values[step, 1]
        with counted_host_reads(device) as count:
            optimizer.step()
        if step - built_at >= settle:
            reads += count[0]
        skips.append(optimizer.step_factor().clone())
        taken.append(watcher.report()["last_step_taken"])  # the monitor at log cadence: every step here
    skipped = torch.stack(skips).eq(0).to(torch.int8).cpu()
    return {"skips": skipped, "params": flat_params(params), "monitor_taken": torch.tensor(taken, dtype=torch.int8),
            "monitor_spikes": torch.tensor([watcher.report()["spikes"]]), "host_reads": torch.tensor([reads])}


def _detached(state: Any) -> Any:
    """A deep copy of a state_dict's tensors, as a checkpoint holds them (torch's state_dict shares
    the live tensors, which the next steps would change)."""
    if isinstance(state, torch.Tensor):
        return state.detach().clone()
    if isinstance(state, dict):
        return {k: _detached(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_detached(v) for v in state]
    return state


def _outputs(run: Callable[[str, str, str], Outputs], device: torch.device, preset: Preset) -> Outputs:
    outputs: Outputs = {}
    for kind in kinds(device):
        for mode in modes(device, preset):
            for scenario in _scenarios(preset):
                for name, t in run(kind, mode, scenario).items():
                    outputs[f"{kind}/{mode}/{scenario}/{name}"] = t.to(device)
    return outputs


def _scenarios(preset: Preset) -> tuple[str, ...]:
    return tuple(preset.params.get("scenarios", SCENARIOS))


def reference(buffers: Buffers, preset: Preset) -> Outputs:
    device = buffers["values/drift"].device
    return _outputs(lambda kind, mode, scenario: _reference_run(kind, mode, buffers, scenario, _band(preset)), device,
                    preset)


def _arm_with(wrap: Factory = SkipStepOptimizer, monitor=StabilityMonitor) -> Callable[[Buffers, Preset], Outputs]:
    def arm(buffers: Buffers, preset: Preset) -> Outputs:
        device = buffers["values/drift"].device
        band = _band(preset)
        return _outputs(lambda kind, mode, scenario: _arm_run(kind, mode, buffers, scenario, wrap, monitor, band),
                        device, preset)

    return arm


# ---- saboteurs: the arm built wrong, one way each ----------------------------------------------


class _NanEntersWindow(SkipStepOptimizer):
    fused_decision = False

    def _remember(self, decision):
        super()._remember(decision._replace(skip=decision.skip & decision.finite))  # a NaN step "taken" here


class _ParamsButNotState(SkipStepOptimizer):
    """Puts the parameters back on a skip, lets the step run on the state."""

    def __init__(self, optimizer, **kwargs):
        super().__init__(optimizer, **kwargs)
        inner = optimizer.optimizer if isinstance(optimizer, CapturedOptimizer) else optimizer
        inner.found_inf = None
        self._how = "params-only"

    @torch.no_grad()
    def step(self, closure=None):
        decision = self.decision()
        self._factor.copy_(decision.factor)
        params = [p for g in self.param_groups for p in g["params"]]
        saved = [p.detach().clone() for p in params]
        self.optimizer.step()
        for p, old in zip(params, saved):
            p.copy_(torch.where(decision.skip, old, p))
        self._remember(decision)


class _ItemInStep(SkipStepOptimizer):
    def step(self, closure=None):
        if self.decision().skip.item():  # the obvious host read
            pass
        return super().step(closure)


class _WindowNotRestored(SkipStepOptimizer):
    def load_window_state(self, state):
        pass  # a resumed run starts with an empty window


class _BiasedStd(SkipStepOptimizer):
    fused_decision = False

    def decision(self):
        return decide(self.values, self.count, self._latest, self.sigma_factor, self.min_history, correction=0)


class _MonitorWithItsOwnThreshold(StabilityMonitor):
    """Judges the last step by its own copy of the threshold, which has drifted from the step's."""

    sigma_factor = 5.5

    def report(self):
        report = super().report()
        report["last_step_taken"] = bool((self.optimizer.last_z.abs() <= self.sigma_factor).all())
        return report


SABOTEURS = (
    Saboteur("nan-enters-window", "a NaN or Inf step's values enter the window", _arm_with(_NanEntersWindow),
             applies=lambda p: bool({"nan-loss", "inf-grad"} & set(_scenarios(p)))),
    Saboteur("params-not-state", "a skip puts the parameters back but keeps the state's update",
             _arm_with(_ParamsButNotState)),
    Saboteur("item-in-step", "step() reads its decision on the host with .item()", _arm_with(_ItemInStep)),
    Saboteur("window-not-restored", "load_state_dict leaves the window empty", _arm_with(_WindowNotRestored),
             applies=lambda p: "resume" in _scenarios(p)),
    Saboteur("biased-std", "the std without Bessel's correction", _arm_with(_BiasedStd),
             applies=lambda p: "threshold" in _scenarios(p)),
    Saboteur("monitor-own-threshold", "the monitor judges with its own copy of sigma (5.5, drifted)",
             _arm_with(monitor=_MonitorWithItsOwnThreshold)),
)


# ---- bench: the overhead of skip-step on a real optimizer step ----------------------------------


def _step_build(kind: str, skip: bool, captured: bool) -> Callable[[BenchCase, Buffers, Preset], Callable[[], Any]]:
    def build(case: BenchCase, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
        params = fresh_params(buffers)
        set_saved_grads(params, buffers, 0)
        inner = make_optimizer(kind, params)
        stepper = CapturedOptimizer(inner) if captured else inner
        if not skip:
            return stepper.step
        optimizer = SkipStepOptimizer(stepper)
        values = buffers["values/drift"]

        def step():
            optimizer.latest_loss = values[0, 0]
            optimizer.latest_grad_norm = values[0, 1]
            optimizer.step()

        return step

    return build


def _bench_contenders() -> tuple[Contender, ...]:
    rows = []
    for kind in ("muon", "adamw-fused"):
        for captured in (False, True):
            case, label = (f"{kind}-step-captured", f"{kind} captured") if captured else (f"{kind}-step", kind)
            rows += [
                Contender(label, "reference", _step_build(kind, False, captured), cases=(case,),
                          note="CapturedOptimizer, no skip-step" if captured else "the optimizer's eager step"),
                Contender(f"{label} + skip-step", "arm", _step_build(kind, True, captured), cases=(case,),
                          note="SkipStepOptimizer around it: the decision, the ring, the skip"),
            ]
    return tuple(rows)


def _step_bytes(per_param: int) -> Callable[[Preset], int]:
    return lambda preset: per_param * sum(math.prod(s) for s in _shapes(preset).values())


BENCHES = tuple(
    BenchCase(f"{kind}-step{suffix}", f"one {what} step{how}, with and without skip-step", bytes=_step_bytes(per_param),
              l2="warm", modes=("eager",), window=2, calls_per_round=4, cold_calls=4, presets=("medium",))
    for kind, what, per_param in (("muon", "Muon(+AdamW)", 20), ("adamw-fused", "AdamW fused", 28))
    for suffix, how in (("", ""), ("-captured", " replayed by a CapturedOptimizer"))
)

PRESETS = (
    # a window of 32 over 80 steps: every scenario, and the ring wraps, in a quarter of the steps
    Preset("tiny", dict(layers=2, d=16, steps=80, grad_sets=80, window=32, min_history=8, scenarios=list(SCENARIOS)),
           where="any", note="every scenario, 80 steps, window 32, eager"),
    Preset("small", dict(layers=2, d=16, steps=300, grad_sets=300, scenarios=list(SCENARIOS), captured=True),
           where="cuda", in_all=False, memory_bytes=1 << 30,
           note="tiny on a GPU in eager and captured mode, capturable AdamW too, host reads by sync debug mode "
                "(minutes)"),
    Preset("medium", dict(layers=24, d=1024, steps=64, grad_sets=2, scenarios=["loss-spike"], captured=True),
           where="cuda",
           standard=False, memory_bytes=40 << 30,
           note="277 M params (24 layers d1024): the overhead bench"),
)

GATE = Gate(
    name="skip-step",
    summary="Skip-step optimizer: spike and non-finite steps skipped on the device, bits of the state kept",
    arm_name="suite.arms.skip_step.SkipStepOptimizer",
    needs_cuda=False,
    presets=PRESETS,
    make_buffers=make_buffers,
    buffer_params=buffer_params,
    reference=reference,
    arm=_arm_with(),
    parity=Bitwise(),
    saboteurs=SABOTEURS,
    contenders=_bench_contenders(),
    benches=BENCHES,
    # at most 5% over the eager step without it, 3% over the captured one
    criteria=(SpeedupOver(0.95, presets=("medium",), cases=("muon-step", "adamw-fused-step")),
              SpeedupOver(0.97, presets=("medium",), cases=("muon-step-captured", "adamw-fused-step-captured"))),
)
