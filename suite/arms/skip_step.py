"""Skip-step: a loss or gradient-norm spike skips its optimizer step, decided on the device.

A spike that is not NaN still takes its step in a plain loop, and a non-finite value that slips
past is found only at the next logged loss. OLMo-core's answer (a step factor from a rolling
window of the loss and the gradient norm, mean + 6 sigma over 128 steps) is kept here, with the
flaws of its version fixed:

- The window is a fixed-size float64 ring on the device (values, and a count of values ever
  accepted), updated in place: no Python list of tensors, no stack per step, no host sync, so a
  step including the decision can be captured in a CUDA graph.
- A non-finite loss or gradient norm is skipped and never enters the window (one NaN there would
  make every z-score NaN for the next `rolling_interval_length` steps).
- A skipped step's values do not enter the window either: a spike must not widen the band that
  judges the next one. The price: a genuine level shift beyond sigma_factor standard deviations
  is skipped for as long as it lasts; `StabilityMonitor` reports consecutive skips, so a run
  that stalls says so at the next log.
- A zero standard deviation (a constant loss) does not skip a value equal to the mean; any other
  value against it has an infinite z-score and is skipped.
- z uses the unbiased standard deviation (Bessel's correction), as `torch.std_mean` does.
- Fewer than `min_history` values in the window: only a non-finite value is skipped.
- A value not set for a step is not judged (a loop that sets only the loss, or neither, steps as
  without the wrapper), and it does not enter the window: each row counts its own values. A loop
  that sets neither for `min_history` steps in a row is warned once: it has forgotten the setters.

The step decides (`decide`, and on a GPU the same decision and ring update as one Triton launch,
tested against it); `StabilityMonitor` reads the same ring and what the step recorded of its
decision, so the monitor cannot drift from what the step did.

How a skipped step leaves params and state with their bits, per inner optimizer:

- torch AdamW/Adam with fused=True: its kernel's own `found_inf` (GradScaler's protocol) skips the
  update and undoes the step count, at no cost.
- suite's Muon: its `found_inf` keeps every tensor's bits (suite.arms.muon, "Skipping a step").
- torch AdamW/Adam with capturable=True (foreach or for-loop): a copy of each parameter and state
  tensor before the step, put back where the step is skipped (more memory traffic: prefer fused).
  A non-capturable torch Adam keeps its step count on the host, which no device decision can undo:
  refused, naming the fix.
- A CapturedOptimizer around one of these: the same, set before its capture, so every replay
  reads the live decision.

finite_guard=True adds a `torch._assert_async` that every momentum (Muon) / exp_avg (Adam) is
finite after the step: no host sync, off by default. With the skip on, a non-finite step is
skipped before the guard sees it; without a skip the guard aborts the process at that step.
"""

from __future__ import annotations

import math
import warnings
from collections import OrderedDict
from typing import Any, Callable, NamedTuple

import torch
import triton
import triton.language as tl

from suite.arms.graph import CapturedOptimizer, OptimizerWrapper
from suite.arms.muon import Muon
from suite.triton_support import launch_kept, next_pow2

LOSS, GRAD_NORM = 0, 1  # rows of the window
_WINDOW_KEYS = ("values", "count", "skipped", "nonfinite", "consecutive")
# the last decision, saved so a resumed monitor reports what the last step did; optional on
# load, as checkpoints written before it lack them
_DECISION_KEYS = {"factor": "_factor", "last_z": "last_z"}


class Decision(NamedTuple):
    """One step's decision, all on the device: factor (fp32, 1 to step, 0 to skip), skip (bool),
    finite (both latest values finite), the z-scores of (loss, grad norm) against the window, and
    the window's mean and std."""

    factor: torch.Tensor
    skip: torch.Tensor
    finite: torch.Tensor
    z: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def window_stats(values: torch.Tensor, count: torch.Tensor,
                 correction: int = 1) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(n, mean, std) per row of a ring `values` [2, L] filled min(count, L) slots deep; a NaN
    slot is a step whose value was not set for that row and does not count. The std divides by
    n - correction (1: unbiased, as torch.std_mean)."""
    length = values.shape[1]
    filled = torch.arange(length, device=values.device) < count.clamp(max=length)
    valid = filled & ~values.isnan()
    n = valid.sum(dim=1)
    n64 = n.to(torch.float64)
    mean = torch.where(valid, values, 0).sum(dim=1) / n64.clamp(min=1)
    deviation = torch.where(valid, values - mean[:, None], 0)
    std = (deviation.square().sum(dim=1) / (n64 - correction).clamp(min=1)).sqrt()
    return n, mean, std


def decide(values: torch.Tensor, count: torch.Tensor, latest: torch.Tensor, sigma_factor: float,
           min_history: int, correction: int = 1, judged: torch.Tensor | None = None) -> Decision:
    """Skip when a judged latest value is not finite, or, for a row with at least min_history
    values in the window, when its |z| > sigma_factor; a zero std gives z = 0 for a value equal
    to the mean and an infinite z otherwise. `judged` [2] bool: the rows set for this step (None:
    both); a row not judged has z 0 and never skips."""
    n, mean, std = window_stats(values, count, correction)
    judged = torch.ones(2, dtype=torch.bool, device=values.device) if judged is None else judged
    diff = latest - mean
    z = torch.where(std > 0, diff / std, torch.where(diff == 0, 0.0, diff.sign() * torch.inf))
    z = torch.where(judged, z, 0.0)
    finite = (torch.isfinite(latest) | ~judged).all()
    spike = ((z.abs() > sigma_factor) & (n >= min_history)).any()
    skip = spike | ~finite
    return Decision(factor=(~skip).to(torch.float32), skip=skip, finite=finite, z=z, mean=mean, std=std)


@triton.jit
def _decide_and_remember_kernel(values_ptr, count_ptr, latest_ptr, judged_ptr, factor_ptr, found_inf_ptr, z_ptr,
                                skipped_ptr, nonfinite_ptr, consecutive_ptr, length, sigma_factor, min_history,
                                CORRECTION: tl.constexpr, BLOCK: tl.constexpr):
    """`decide` and `SkipStepOptimizer._remember` in one program: each row of the window
    reduced in float64 over its own values (a NaN slot is a value not set), the decision
    written where the step reads it, the ring and counters updated."""
    INF: tl.constexpr = float("inf")
    NAN: tl.constexpr = float("nan")
    count = tl.load(count_ptr)
    filled = tl.minimum(count, length)
    offsets = tl.arange(0, BLOCK)
    loss_sum = tl.zeros((BLOCK,), tl.float64)
    grad_sum = tl.zeros((BLOCK,), tl.float64)
    loss_seen = tl.zeros((BLOCK,), tl.int64)
    grad_seen = tl.zeros((BLOCK,), tl.int64)
    for start in range(0, length, BLOCK):
        in_ring = start + offsets < filled
        loss_v = tl.load(values_ptr + start + offsets, mask=in_ring, other=0.0)
        grad_v = tl.load(values_ptr + length + start + offsets, mask=in_ring, other=0.0)
        loss_ok = in_ring & (loss_v == loss_v)
        grad_ok = in_ring & (grad_v == grad_v)
        loss_sum += tl.where(loss_ok, loss_v, 0.0)
        grad_sum += tl.where(grad_ok, grad_v, 0.0)
        loss_seen += loss_ok.to(tl.int64)
        grad_seen += grad_ok.to(tl.int64)
    loss_n = tl.sum(loss_seen, 0)
    grad_n = tl.sum(grad_seen, 0)
    loss_mean = tl.sum(loss_sum, 0) / tl.maximum(loss_n.to(tl.float64), 1.0)
    grad_mean = tl.sum(grad_sum, 0) / tl.maximum(grad_n.to(tl.float64), 1.0)
    loss_sq = tl.zeros((BLOCK,), tl.float64)
    grad_sq = tl.zeros((BLOCK,), tl.float64)
    for start in range(0, length, BLOCK):
        in_ring = start + offsets < filled
        loss_v = tl.load(values_ptr + start + offsets, mask=in_ring, other=0.0)
        grad_v = tl.load(values_ptr + length + start + offsets, mask=in_ring, other=0.0)
        loss_dev = tl.where(in_ring & (loss_v == loss_v), loss_v - loss_mean, 0.0)
        grad_dev = tl.where(in_ring & (grad_v == grad_v), grad_v - grad_mean, 0.0)
        loss_sq += loss_dev * loss_dev
        grad_sq += grad_dev * grad_dev
    loss_std = tl.sqrt(tl.sum(loss_sq, 0) / tl.maximum(loss_n.to(tl.float64) - CORRECTION, 1.0))
    grad_std = tl.sqrt(tl.sum(grad_sq, 0) / tl.maximum(grad_n.to(tl.float64) - CORRECTION, 1.0))
    loss = tl.load(latest_ptr)
    grad = tl.load(latest_ptr + 1)
    loss_judged = tl.load(judged_ptr) != 0
    grad_judged = tl.load(judged_ptr + 1) != 0
    loss_diff = loss - loss_mean
    grad_diff = grad - grad_mean
    # a zero std: z is 0 for a value at the mean, signed infinity off it (NaN stays NaN)
    loss_z = tl.where(loss_std > 0, loss_diff / tl.where(loss_std > 0, loss_std, 1.0),
                      tl.where(loss_diff > 0, INF, tl.where(loss_diff < 0, -INF, loss_diff)))
    grad_z = tl.where(grad_std > 0, grad_diff / tl.where(grad_std > 0, grad_std, 1.0),
                      tl.where(grad_diff > 0, INF, tl.where(grad_diff < 0, -INF, grad_diff)))
    loss_z = tl.where(loss_judged, loss_z, 0.0)
    grad_z = tl.where(grad_judged, grad_z, 0.0)
    finite = ((tl.abs(loss) < INF) | (loss_judged == 0)) & ((tl.abs(grad) < INF) | (grad_judged == 0))
    spike = ((tl.abs(loss_z) > sigma_factor) & (loss_n >= min_history)) | \
        ((tl.abs(grad_z) > sigma_factor) & (grad_n >= min_history))
    skip = tl.where(spike | (finite == 0), 1, 0)
    tl.store(factor_ptr, (1 - skip).to(tl.float32))
    tl.store(found_inf_ptr, skip.to(tl.float32))
    tl.store(z_ptr, loss_z)
    tl.store(z_ptr + 1, grad_z)
    slot = count % length
    taken = skip == 0
    tl.store(values_ptr + slot, tl.where(loss_judged, loss, NAN), mask=taken)
    tl.store(values_ptr + length + slot, tl.where(grad_judged, grad, NAN), mask=taken)
    tl.store(count_ptr, count + (1 - skip))
    tl.store(skipped_ptr, tl.load(skipped_ptr) + skip)
    tl.store(nonfinite_ptr, tl.load(nonfinite_ptr) + tl.where(finite, 0, 1))
    tl.store(consecutive_ptr, tl.where(taken, 0, tl.load(consecutive_ptr) + 1))


def _set(target: torch.Tensor, value: torch.Tensor | float, name: str) -> None:
    """A python number is filled in as a kernel argument (no host-to-device copy that would wait
    for the stream); a tensor converts where it lives (no host read)."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1 or value.is_complex() or value.dtype == torch.bool:
            raise ValueError(f"SkipStepOptimizer: {name} must be one real number (a 0-d or one-element tensor), "
                             f"got a {value.dtype} tensor of shape {tuple(value.shape)}; pass loss.detach() of "
                             f"the step's mean loss")
        target.copy_(value.detach().reshape(()))
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        target.fill_(float(value))
    else:
        raise TypeError(f"SkipStepOptimizer: {name} must be a tensor or a real number, got {type(value).__name__}")


def _innermost(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    return optimizer.optimizer if isinstance(optimizer, CapturedOptimizer) else optimizer


def _how_to_skip(optimizer: torch.optim.Optimizer) -> str:
    """"found_inf" (the optimizer skips itself) or "restore" (copies put back); raises for an
    optimizer whose skip would need the host."""
    name = type(optimizer).__name__
    if isinstance(optimizer, Muon):
        return "found_inf"
    if isinstance(optimizer, torch.optim.Adam) or isinstance(optimizer, torch.optim.AdamW):
        groups = optimizer.param_groups
        if all(g.get("fused") for g in groups):
            return "found_inf"
        if all(g.get("capturable") for g in groups):
            return "restore"
        raise ValueError(f"SkipStepOptimizer: {name} keeps its step count on the host unless fused=True or "
                         f"capturable=True, so a skip decided on the device cannot undo it; construct "
                         f"{name}(..., fused=True) (or capturable=True)")
    raise TypeError(f"SkipStepOptimizer: cannot skip steps of {name}: supported are suite's Muon and torch's "
                    f"Adam/AdamW (fused, or capturable), or a CapturedOptimizer around one")


def _momenta(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [state[key] for state in optimizer.state.values() for key in ("momentum_buffer", "exp_avg")
            if key in state]


class SkipStepOptimizer(OptimizerWrapper):
    """Wraps an optimizer: set `latest_loss` and `latest_grad_norm` (device tensors) before each
    `step()`; the step then runs, or is skipped with params and state keeping their bits, by a
    decision made on the device. `step_factor()` is this step's (0-d fp32, 1 or 0) once decided.

    The wrapper's param_groups, state and defaults are the inner optimizer's, so schedulers attach
    to it (a scheduler still advances on a skipped step, as a loop calls it). Its state_dict holds
    the inner optimizer's and the window, so a resumed run decides as if it had not stopped.
    """

    # the step's decision as one Triton launch on a GPU; decide() and _remember() on the CPU (where
    # Triton's interpreter would cost milliseconds a step) and in the gate's saboteurs
    fused_decision = True

    def __init__(self, optimizer: torch.optim.Optimizer, rolling_interval_length: int = 128,
                 sigma_factor: float = 6.0, min_history: int = 20, finite_guard: bool = False) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"SkipStepOptimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        if not (isinstance(rolling_interval_length, int) and not isinstance(rolling_interval_length, bool)
                and rolling_interval_length >= 2):
            raise ValueError(f"SkipStepOptimizer: rolling_interval_length must be an int >= 2, "
                             f"not {rolling_interval_length!r}")
        if not (isinstance(min_history, int) and not isinstance(min_history, bool)
                and 2 <= min_history <= rolling_interval_length):
            raise ValueError(f"SkipStepOptimizer: min_history must be an int in [2, rolling_interval_length], "
                             f"not {min_history!r}")
        if not isinstance(sigma_factor, (int, float)) or isinstance(sigma_factor, bool):
            raise TypeError(f"SkipStepOptimizer: sigma_factor must be a number, got {type(sigma_factor).__name__} "
                            f"{sigma_factor!r}")
        if not (math.isfinite(sigma_factor) and sigma_factor > 0):
            raise ValueError(f"SkipStepOptimizer: sigma_factor must be a finite number > 0, not {sigma_factor!r}")
        if not isinstance(finite_guard, bool):
            raise TypeError(f"SkipStepOptimizer: finite_guard must be True or False, got {finite_guard!r}")
        self.optimizer = optimizer
        self.rolling_interval_length = rolling_interval_length
        self.sigma_factor = float(sigma_factor)
        self.min_history = min_history
        self.finite_guard = finite_guard
        if isinstance(optimizer, CapturedOptimizer) and optimizer.captured:
            raise ValueError("SkipStepOptimizer: the CapturedOptimizer has captured its step already, so its replays "
                             "would never read the skip decision; wrap it before its first step()")
        inner = _innermost(optimizer)
        self._how = _how_to_skip(inner)
        device = next(p.device for g in inner.param_groups for p in g["params"])
        self.values = torch.zeros(2, rolling_interval_length, dtype=torch.float64, device=device)
        self.count = torch.zeros((), dtype=torch.int64, device=device)  # values ever accepted
        self.skipped = torch.zeros((), dtype=torch.int64, device=device)  # steps skipped in all
        self.nonfinite = torch.zeros((), dtype=torch.int64, device=device)  # of those, for a NaN or Inf
        self.consecutive = torch.zeros((), dtype=torch.int64, device=device)  # skipped since the last step taken
        self._latest = torch.full((2,), torch.nan, dtype=torch.float64, device=device)
        self._judged = torch.zeros(2, dtype=torch.bool, device=device)  # the rows set for this step
        self._factor = torch.ones((), dtype=torch.float32, device=device)
        self.last_z = torch.zeros(2, dtype=torch.float64, device=device)  # the last decision's (loss, grad norm)
        # the inner optimizer reads this tensor (captures included): refilled in place each step
        self._found_inf = torch.zeros((), dtype=torch.float32, device=device)
        if self._how == "found_inf":
            inner.found_inf = self._found_inf
        # on the host, where the setters run: whether either was called since the last step, and
        # for how many steps in a row neither was (no device read needed to tell)
        self._set_since_step = False
        self._steps_unset = 0
        self._warned_unset = False
        # torch.optim.Optimizer.__init__ would build groups and state of its own: only its step hooks
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._patch_step_function()

    # ---- the optimizer's interface ----

    @property
    def latest_loss(self) -> torch.Tensor:
        return self._latest[LOSS]

    @latest_loss.setter
    def latest_loss(self, value: torch.Tensor | float) -> None:
        _set(self._latest[LOSS], value, "latest_loss")
        self._judged[LOSS].fill_(True)
        self._set_since_step = True

    @property
    def latest_grad_norm(self) -> torch.Tensor:
        return self._latest[GRAD_NORM]

    @latest_grad_norm.setter
    def latest_grad_norm(self, value: torch.Tensor | float) -> None:
        _set(self._latest[GRAD_NORM], value, "latest_grad_norm")
        self._judged[GRAD_NORM].fill_(True)
        self._set_since_step = True

    def decision(self) -> Decision:
        """What the next step() will decide, from the window and the latest values."""
        return decide(self.values, self.count, self._latest, self.sigma_factor, self.min_history, judged=self._judged)

    def step_factor(self) -> torch.Tensor:
        """The last step's factor: 0-d fp32 on the device, 1.0 stepped, 0.0 skipped."""
        return self._factor

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
            if loss is not None:  # the step's loss is the closure's
                self.latest_loss = loss
        self._count_unset_steps()
        # the window is updated before the inner step: only the next decision reads it
        if self.fused_decision and self.values.is_cuda:
            self._decide_and_remember_fused()
        else:
            decision = self.decision()
            self._factor.copy_(decision.factor)
            self.last_z.copy_(decision.z)
            self._found_inf.copy_(decision.skip.to(torch.float32))
            self._remember(decision)
        self._judged.zero_()  # the next step judges what is set for it
        if self._how == "restore":
            self._step_restoring(self._found_inf != 0)
        else:
            self.optimizer.step()
        if self.finite_guard:
            momenta = _momenta(_innermost(self.optimizer))
            if momenta:
                finite = torch.stack([torch.isfinite(m).all() for m in momenta]).all()
                torch._assert_async(finite, "SkipStepOptimizer: a momentum holds NaN or Inf after the step")
        return loss

    def _count_unset_steps(self) -> None:
        """Warn once when min_history steps in a row ran with neither value set: by then a loop
        that sets them is judged, and one that forgot steps with no protection at all."""
        self._steps_unset = 0 if self._set_since_step else self._steps_unset + 1
        self._set_since_step = False
        if self._steps_unset == self.min_history and not self._warned_unset:
            self._warned_unset = True
            # stacklevel: this method, step(), torch's no_grad and step-hook wrappers, then the loop's call
            warnings.warn(f"SkipStepOptimizer: {self._steps_unset} steps in a row with neither latest_loss nor "
                          "latest_grad_norm set, so none was judged and none can be skipped; before each step() "
                          "set opt.latest_loss = loss.detach() (and opt.latest_grad_norm = the norm "
                          "clip_grad_norm_ returns)", stacklevel=5)

    def _step_restoring(self, skip: torch.Tensor) -> None:
        """The inner step, then every parameter and state tensor put back where skip is set;
        state the step created is reset to zeros (what a first step starts from)."""
        inner = _innermost(self.optimizer)
        params = [p for g in inner.param_groups for p in g["params"] if p.grad is not None]
        before = {id(p): {key: t.clone() for key, t in inner.state[p].items() if isinstance(t, torch.Tensor)}
                  for p in params if p in inner.state}
        saved = [p.detach().clone() for p in params]
        self.optimizer.step()
        for p, old in zip(params, saved):
            p.detach().copy_(torch.where(skip, old, p.detach()))
            for key, t in inner.state[p].items():
                if isinstance(t, torch.Tensor):
                    previous = before.get(id(p), {}).get(key, torch.zeros_like(t))
                    t.copy_(torch.where(skip, previous, t))

    def _decide_and_remember_fused(self) -> None:
        """decide() and _remember() as one launch (the pair is some thirty small kernels apart)."""
        length = self.rolling_interval_length
        launch_kept(_decide_and_remember_kernel, (1,), self.values, self.count, self._latest, self._judged, self._factor,
                    self._found_inf, self.last_z, self.skipped, self.nonfinite, self.consecutive, length,
                    self.sigma_factor, self.min_history, CORRECTION=1, BLOCK=min(next_pow2(length), 1024))

    def _remember(self, decision: Decision) -> None:
        """The latest values into the ring where the step was taken (never a skipped or
        non-finite one), and the counts, in place."""
        skip = decision.skip
        taken = ~skip
        self.nonfinite.add_((~decision.finite).to(torch.int64))
        slot = (self.count % self.rolling_interval_length).reshape(1)
        current = self.values.index_select(1, slot)
        latest = torch.where(self._judged, self._latest, torch.nan)  # a row not set: a slot that does not count
        self.values.index_copy_(1, slot, torch.where(taken, latest[:, None], current))
        self.count.add_(taken.to(torch.int64))
        self.skipped.add_(skip.to(torch.int64))
        self.consecutive.mul_(skip.to(torch.int64)).add_(skip.to(torch.int64))

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)

    # ---- checkpoints ----

    def window_state(self) -> dict[str, torch.Tensor]:
        return {key: getattr(self, attr).clone() for key, attr in (*zip(_WINDOW_KEYS, _WINDOW_KEYS),
                                                                   *_DECISION_KEYS.items())}

    def _check_window_state(self, state: Any) -> None:
        if not isinstance(state, dict) or any(key not in state for key in _WINDOW_KEYS):
            have = sorted(state) if isinstance(state, dict) else type(state).__name__
            raise ValueError(f"SkipStepOptimizer: a window state holds {list(_WINDOW_KEYS)}, this one {have}; "
                             "pass what window_state() (or state_dict()['skip_step']) returned")
        for key, attr in (*zip(_WINDOW_KEYS, _WINDOW_KEYS), *_DECISION_KEYS.items()):
            if key not in state:
                continue
            mine, saved = getattr(self, attr), state[key]
            if not isinstance(saved, torch.Tensor) or tuple(saved.shape) != tuple(mine.shape):
                shape = tuple(saved.shape) if isinstance(saved, torch.Tensor) else type(saved).__name__
                more = "; resume with the same rolling_interval_length" if key == "values" else ""
                raise ValueError(f"SkipStepOptimizer: the saved window's {key} holds {shape}, this one "
                                 f"{tuple(mine.shape)}{more}")

    def load_window_state(self, state: dict[str, torch.Tensor]) -> None:
        self._check_window_state(state)
        for key, attr in (*zip(_WINDOW_KEYS, _WINDOW_KEYS), *_DECISION_KEYS.items()):
            if key in state:
                getattr(self, attr).copy_(state[key])

    def state_dict(self) -> dict:
        return {"optimizer": self.optimizer.state_dict(), "skip_step": self.window_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        """The inner optimizer's state and the window; both are checked before either is loaded."""
        if not isinstance(state_dict, dict) or not {"optimizer", "skip_step"} <= state_dict.keys():
            have = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"SkipStepOptimizer.load_state_dict: expected the keys ['optimizer', 'skip_step'] "
                             f"that SkipStepOptimizer.state_dict() writes, got {have}")
        self._check_window_state(state_dict["skip_step"])
        self.optimizer.load_state_dict(state_dict["optimizer"])
        self.load_window_state(state_dict["skip_step"])
        if self._how == "found_inf":
            _innermost(self.optimizer).found_inf = self._found_inf


class StabilityMonitor:
    """What the skip-step window says, read at log cadence (one host read per `report()`, never
    inside a step): the last decision (taken or not, its z-scores), the window's mean and std,
    and the skips. It reads the optimizer's own ring, counters and last decision, written by the
    step from `decide`, so it reports what the step decided and cannot keep a threshold of its own.
    A row no value has entered yet reports None for its mean and std."""

    def __init__(self, optimizer: SkipStepOptimizer) -> None:
        if not isinstance(optimizer, SkipStepOptimizer):
            raise TypeError(f"StabilityMonitor reads a SkipStepOptimizer's window, got {type(optimizer).__name__}; "
                            "wrap the optimizer first: StabilityMonitor(SkipStepOptimizer(optimizer))")
        self.optimizer = optimizer
        self._skipped_reported = 0

    def report(self) -> dict[str, Any]:
        opt = self.optimizer
        n, mean, std = window_stats(opt.values, opt.count)
        # one transfer for everything: a single host sync
        counts = torch.cat([n, torch.stack([opt.skipped, opt.nonfinite, opt.consecutive])]).double()
        packed = torch.cat([mean, std, counts, opt.step_factor().reshape(1).double(), opt.last_z]).tolist()
        (loss_mean, grad_mean, loss_std, grad_std, loss_n, grad_n, skipped, nonfinite, consecutive, factor, z_loss,
         z_grad) = packed
        # a row no value has entered yet has no mean or std (window_stats' 0.0 there is a placeholder)
        if not loss_n:
            loss_mean = loss_std = None
        if not grad_n:
            grad_mean = grad_std = None
        new_skips = int(skipped) - self._skipped_reported
        self._skipped_reported = int(skipped)
        return {"window": int(max(loss_n, grad_n)), "sigma_factor": opt.sigma_factor, "loss_mean": loss_mean,
                "loss_std": loss_std, "grad_norm_mean": grad_mean,
                "grad_norm_std": grad_std, "skipped": int(skipped), "spikes": int(skipped - nonfinite),
                "nonfinite": int(nonfinite), "skipped_since_last_report": new_skips,
                "consecutive_skips": int(consecutive), "last_step_taken": factor == 1.0,
                "last_z_loss": z_loss, "last_z_grad_norm": z_grad}

    def state_dict(self) -> dict:
        return {"skipped_reported": self._skipped_reported}

    def load_state_dict(self, state: dict) -> None:
        self._skipped_reported = int(state["skipped_reported"])
