"""CapturedOptimizer: an optimizer step captured once in a CUDA graph and replayed, made safe.

On a training step bound by host dispatch, the optimizer's hundreds of small kernel launches are
the cost; one CUDA graph replays them all with a single launch. The danger is silent: a graph
replays the kernels, pointers and scalars it recorded, so

- a hyperparameter the step read as a python number (lr as a float) keeps its capture value;
- a parameter whose grad was None at capture was skipped, and is never updated again;
- a grad tensor replaced after capture (zero_grad(set_to_none=True), then backward) is invisible:
  the graph keeps reading the old storage;
- optimizer state created during the capture would be re-initialised by every replay.

What this wrapper does about each:

- Live hyperparameters are device tensors refreshed in place before every replay: Muon's lr,
  weight_decay, momentum and betas through its sync_hyperparameters(); for torch.optim.Adam / AdamW
  the wrapper turns each group's lr into a 0-d device tensor (torch LR schedulers fill a tensor lr
  in place). Every other group value (eps, torch AdamW's betas and weight_decay, ...) is recorded
  at capture, and a change raises before the replay, naming the group, the key and both values.
  torch's Adam/AdamW cannot have live betas: every implementation (for-loop, foreach, fused) reads
  a tensor beta back to the host with item() (torch 2.11 to 2.13), which a capture cannot contain,
  so tensor betas are refused up front.
- A capture is refused while a requires_grad parameter has no grad, or a parameter with a grad
  has no optimizer state (the warm-up steps create it).
- Before each replay, every parameter's storage and grad storage is checked against the capture
  (a pointer comparison on the host); the captured grad tensors are held, so their memory cannot
  be reused while the graph reads it. zero_grad(set_to_none=True) zeroes in place once captured.

Recipe (torch's whole-network capture): warmup_steps eager steps on a side stream, then one step
captured on that stream and replayed at once (a capture only records); every later step() is a
replay. release(), add_param_group and load_state_dict drop the graph and warm up again.

The wrapper is a torch.optim.Optimizer whose param_groups, state and defaults are the inner
optimizer's own objects, so LR schedulers (and anything else that takes an optimizer) attach to it.

The saboteurs a gate must catch are built from public pieces: live_lr=False (lr read at capture
and never refreshed nor checked), check_grads=False (a swapped grad tensor goes unnoticed), and
exclude=[params] (those params are left out of the captured step).
"""

from __future__ import annotations

import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

from suite.arms.muon import param_label
from suite.errors import CouldNotRun

# Group keys a step never reads: LR schedulers' bookkeeping (initial_lr; OneCycleLR's max_lr, min_lr,
# max_momentum, base_momentum; SWALR's swa_lr), named-parameter optimizers' param_names.
_NOT_READ_BY_STEP = frozenset({"params", "param_names", "initial_lr", "max_lr", "min_lr", "max_momentum",
                               "base_momentum", "swa_lr"})
# Why a host-read value cannot be live, where the reason is not plain.
_WHY_NOT_LIVE = {
    "betas": "torch's Adam/AdamW pass betas to their kernels as host numbers (a tensor beta is read back "
             "with item()): OneCycleLR and CyclicLR change betas[0] every step unless cycle_momentum=False; "
             "Muon's AdamW groups keep betas live.",
}


class CaptureError(RuntimeError):
    """A step cannot be captured, or replayed, safely; the message names what and the fix."""


class _Absent:
    def __repr__(self) -> str:
        return "<absent>"


_ABSENT = _Absent()


def _where(groups: list[dict], group_index: int, position: int) -> str:
    return f"{param_label(groups[group_index], position)} of param group {group_index}"


def _snapshot(value):
    """An unchangeable copy of a group value; tensors are kept by identity (changed in place, they are live)."""
    if isinstance(value, (tuple, list)):
        return tuple(map(_snapshot, value))
    return value


def _same(recorded, value) -> bool:
    if isinstance(recorded, torch.Tensor) or isinstance(value, torch.Tensor):
        return recorded is value
    if isinstance(recorded, tuple):
        return (isinstance(value, (tuple, list)) and len(recorded) == len(value)
                and all(map(_same, recorded, value)))
    return recorded is value or recorded == value


@dataclass
class _Capture:
    """What the capture saw, which every replay is checked against."""

    slots: list[tuple[int, int, torch.Tensor]]  # (group index, position, param) for every param
    param_ptrs: list[int]
    # The grad each param's captured update reads, held so its memory is not reused; None: not in the graph.
    grads: list[torch.Tensor | None]
    state_ptrs: list[dict[str, int]]  # each param's optimizer-state tensors the graph reads and writes
    frozen: list[dict[str, Any]]  # each group's values that the graph read as host numbers
    # torch Adam/AdamW with a live lr: the tensor each group's step reads (None for an empty group).
    lr_tensors: list[torch.Tensor | None] | None
    graph: torch.cuda.CUDAGraph | None = None


class OptimizerWrapper(torch.optim.Optimizer):
    """An optimizer around another (`self.optimizer`) whose param_groups, state and defaults are
    the inner one's own objects, so LR schedulers, and anything else that takes an optimizer,
    attach to the wrapper. A subclass sets self.optimizer and does not call
    torch.optim.Optimizer.__init__ (which would build groups and state of its own)."""

    optimizer: torch.optim.Optimizer

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    @property
    def state(self):
        return self.optimizer.state

    @property
    def defaults(self) -> dict:
        return self.optimizer.defaults


class CapturedOptimizer(OptimizerWrapper):
    """Steps `optimizer` eagerly warmup_steps times, then as replays of one captured CUDA graph.

    optimizer: Muon(capturable=True) (or any optimizer with live_hyperparameters and
    sync_hyperparameters(keys)), or torch.optim.Adam / AdamW(capturable=True) with float betas.

    An optimizer itself, sharing the inner one's param_groups, state and defaults, so LR schedulers
    attach to it (or to captured.optimizer):

        captured = CapturedOptimizer(Muon(groups, lr=0.02, capturable=True))
        scheduler = torch.optim.lr_scheduler.OneCycleLR(captured, max_lr=[0.02, 3e-4], total_steps=steps)
        for batch in data:
            loss(batch).backward()
            captured.step()
            captured.zero_grad()      # in place once captured
            scheduler.step()          # the new lr and betas reach the next replay

    Build the scheduler after the wrapper (it turns an Adam lr into a device tensor), and load
    checkpoints through the wrapper (its load_state_dict re-captures). step(closure) evaluates the
    closure eagerly first (a graph cannot contain it; its backward must accumulate into the grads
    the graph reads, so zero them in place) and returns its loss.

    Saboteurs (known-bad variants, for gates): live_lr=False, check_grads=False, exclude=[params].
    """

    def __init__(self, optimizer: torch.optim.Optimizer, warmup_steps: int = 3, *, live_lr: bool = True,
                 check_grads: bool = True, exclude: Iterable[torch.Tensor] = ()):
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"CapturedOptimizer: expected a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self._syncs_itself = (callable(getattr(optimizer, "sync_hyperparameters", None))
                              and hasattr(optimizer, "live_hyperparameters"))
        if not (self._syncs_itself or isinstance(optimizer, torch.optim.Adam)):
            raise TypeError(
                f"CapturedOptimizer: cannot capture {type(optimizer).__name__}: supported are optimizers that "
                f"keep live hyperparameters on the device (live_hyperparameters and sync_hyperparameters(keys), "
                f"like suite.arms.muon.Muon) and torch.optim.Adam / AdamW"
            )
        if not (isinstance(warmup_steps, int) and not isinstance(warmup_steps, bool) and warmup_steps >= 1):
            raise ValueError(
                f"CapturedOptimizer: warmup_steps must be an int >= 1, not {warmup_steps!r}: the optimizer "
                f"state must exist before capture, or every replay would re-initialise it"
            )
        self.optimizer = optimizer
        for name, flag in (("live_lr", live_lr), ("check_grads", check_grads)):
            if not isinstance(flag, bool):  # a string such as "no" would read as on
                raise TypeError(f"CapturedOptimizer: {name} must be True or False, not {flag!r}")
        self.warmup_steps = warmup_steps
        self.live_lr = live_lr
        self.check_grads = check_grads
        self._require_capturable()
        ours = {id(p) for group in optimizer.param_groups for p in group["params"]}
        exclude = list(exclude)
        if any(id(p) not in ours for p in exclude):
            raise ValueError("CapturedOptimizer: exclude holds a tensor that is not a parameter of the optimizer")
        self._excluded = {id(p) for p in exclude}
        live = set(optimizer.live_hyperparameters) if self._syncs_itself else {"lr"}
        # lr stays out of the check even when not live: the baked-lr saboteur must go unnoticed here.
        self._unchecked_keys = _NOT_READ_BY_STEP | live
        self._synced_keys = tuple(sorted(live - ({"lr"} if not live_lr else set())))
        self._make_lr_live()
        self._stream: torch.cuda.Stream | None = None
        self._captured: _Capture | None = None
        self._eager_steps_left = warmup_steps
        self._warned_set_to_none = False
        # torch.optim.Optimizer.__init__ would build groups and state of its own; the wrapper's are the
        # inner optimizer's (OptimizerWrapper's properties), so only the base class's step hooks are set up.
        self._optimizer_step_pre_hooks = OrderedDict()
        self._optimizer_step_post_hooks = OrderedDict()
        self._patch_step_function()

    # ----------------------------------------------------------------------------------------
    # The optimizer's interface
    # ----------------------------------------------------------------------------------------

    @property
    def captured(self) -> bool:
        """Whether step() now replays a graph."""
        return self._captured is not None

    def step(self, closure: Callable[[], Any] | None = None):
        """An eager warm-up step, the capture (recorded, then replayed once), or a replay; after the
        closure, if given, whose loss it returns."""
        if self._captured is None:
            self._require_cuda()  # before the closure's forward and backward
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self._captured is not None:
            self._check_replay(self._captured)
            self._sync_live_values(self._captured)
            self._captured.graph.replay()
        elif self._eager_steps_left > 0:
            self._eager_step()
            self._eager_steps_left -= 1
        else:
            self._capture()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """The optimizer's zero_grad before capture; in place once captured."""
        if self._captured is None:
            self.optimizer.zero_grad(set_to_none=set_to_none)
            return
        if set_to_none and not self._warned_set_to_none:
            warnings.warn(
                "CapturedOptimizer.zero_grad: zeroing the grads in place instead of setting them to None: "
                "the captured step reads the grad tensors it saw at capture, so a fresh grad tensor would be "
                "invisible to it. Pass set_to_none=False to silence this.",
                stacklevel=2,
            )
            self._warned_set_to_none = True
        self.optimizer.zero_grad(set_to_none=False)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """Load into the inner optimizer; the graph is released (it points at the old state)."""
        self.optimizer.load_state_dict(state_dict)
        self._require_capturable()
        self._make_lr_live()
        self.release()

    def add_param_group(self, param_group: dict) -> None:
        self.optimizer.add_param_group(param_group)
        self._require_capturable()
        self._make_lr_live()
        self.release()

    # state_dict and load_state_dict are the inner optimizer's, so their hooks live there.

    def register_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_pre_hook(hook, prepend)

    def register_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_state_dict_post_hook(hook, prepend)

    def register_load_state_dict_pre_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_pre_hook(hook, prepend)

    def register_load_state_dict_post_hook(self, hook, prepend: bool = False):
        return self.optimizer.register_load_state_dict_post_hook(hook, prepend)

    def __getstate__(self):
        raise TypeError(
            "CapturedOptimizer cannot be pickled or copied: it holds a CUDA graph of its optimizer's tensors; "
            "save and load state_dict() instead"
        )

    def release(self) -> None:
        """Drop the graph (and its memory pool); the next warmup_steps steps run eagerly, then a fresh capture."""
        self._captured = None
        self._eager_steps_left = self.warmup_steps

    # ----------------------------------------------------------------------------------------
    # Host-side checks (no CUDA call: testable on the CPU)
    # ----------------------------------------------------------------------------------------

    def _require_capturable(self) -> None:
        groups = self.optimizer.param_groups
        not_capturable = [index for index, group in enumerate(groups) if not group.get("capturable")]
        if not_capturable:
            raise ValueError(
                f"CapturedOptimizer: {type(self.optimizer).__name__} param groups {not_capturable} have "
                f"capturable=False: their step reads hyperparameters or the step count on the host, which a graph "
                f"would freeze at capture; construct the optimizer with capturable=True"
            )
        if self._syncs_itself:
            return
        tensor_betas = [index for index, group in enumerate(groups)
                        if any(isinstance(beta, torch.Tensor) for beta in group["betas"])]
        if tensor_betas:
            raise ValueError(
                f"CapturedOptimizer: {type(self.optimizer).__name__} param groups {tensor_betas} have tensor betas, "
                f"which its step reads back to the host with item() (a sync that a CUDA graph cannot capture); "
                f"pass float betas (they are then fixed at capture: a change raises before the replay)"
            )

    def _require_cuda(self) -> None:
        devices = {p.device.type for group in self.optimizer.param_groups for p in group["params"]}
        if devices != {"cuda"}:
            raise CouldNotRun(
                f"CapturedOptimizer: CUDA graphs need every parameter on a CUDA device, found {sorted(devices)}; "
                f"on the CPU, step the optimizer itself"
            )

    def _make_lr_live(self) -> None:
        """torch Adam/AdamW: each group's lr as a 0-d fp32 tensor on its params' device."""
        if self._syncs_itself or not self.live_lr:
            return
        for group in self.optimizer.param_groups:
            if not group["params"]:
                continue
            device = group["params"][0].device
            lr = group["lr"]
            if not isinstance(lr, torch.Tensor):
                group["lr"] = torch.full((), lr, dtype=torch.float32, device=device)
            elif lr.device != device:
                group["lr"] = lr.to(device=device)

    def _prepare_capture(self) -> _Capture:
        """Refuse an unsafe capture, else record what the replays are checked against."""
        groups = self.optimizer.param_groups
        slots = [(g, i, p) for g, group in enumerate(groups) for i, p in enumerate(group["params"])]
        stepped = [(g, i, p) for g, i, p in slots if id(p) not in self._excluded]
        no_grad = [_where(groups, g, i) for g, i, p in stepped if p.requires_grad and p.grad is None]
        if no_grad:
            raise CaptureError(
                f"CapturedOptimizer: refusing to capture: {', '.join(no_grad)} require grad but have none, so the "
                f"captured step would skip them on every replay. Run the capture step after a backward that "
                f"reaches them, or freeze them (requires_grad=False)"
            )
        no_state = [_where(groups, g, i) for g, i, p in stepped
                    if p.grad is not None and not self.optimizer.state.get(p)]
        if no_state:
            raise CaptureError(
                f"CapturedOptimizer: refusing to capture: {', '.join(no_state)} have no optimizer state yet (no "
                f"grad during the warm-up), so every replay would re-initialise it. Call release() and step "
                f"again: the next {self.warmup_steps} steps run eagerly and create it"
            )
        self._make_lr_live()
        return _Capture(
            slots=slots,
            param_ptrs=[p.data_ptr() for _, _, p in slots],
            grads=[None if id(p) in self._excluded else p.grad for _, _, p in slots],
            state_ptrs=[self._state_ptrs(p) for _, _, p in slots],
            frozen=[{key: _snapshot(value) for key, value in group.items() if key not in self._unchecked_keys}
                    for group in groups],
            lr_tensors=(None if self._syncs_itself or not self.live_lr
                        else [group["lr"] if group["params"] else None for group in groups]),
        )

    def _state_ptrs(self, p: torch.Tensor) -> dict[str, int]:
        return {key: value.data_ptr() for key, value in self.optimizer.state.get(p, {}).items() if torch.is_tensor(value)}

    def _check_replay(self, record: _Capture) -> None:
        """Raise if the graph would now read or write anything other than what the step would."""
        groups = self.optimizer.param_groups
        if len(groups) != len(record.frozen):
            raise CaptureError(
                f"CapturedOptimizer: the optimizer has {len(groups)} param groups, the capture saw "
                f"{len(record.frozen)}; add groups through CapturedOptimizer.add_param_group (it re-captures)"
            )
        for index, (group, frozen) in enumerate(zip(groups, record.frozen)):
            current = {key: value for key, value in group.items() if key not in self._unchecked_keys}
            if current.keys() != frozen.keys() or not all(_same(frozen[key], current[key]) for key in frozen):
                self._raise_frozen_change(index, frozen, current)
        for (g, i, p), param_ptr, grad, state_ptrs in zip(record.slots, record.param_ptrs, record.grads,
                                                           record.state_ptrs):
            if self._state_ptrs(p) != state_ptrs:
                raise CaptureError(
                    f"CapturedOptimizer: the optimizer state of {_where(groups, g, i)} was replaced after capture "
                    f"(a load_state_dict on the inner optimizer?), but the graph reads and writes the old "
                    f"tensors; load through CapturedOptimizer.load_state_dict (it re-captures) or call release()"
                )
            if p.data_ptr() != param_ptr:
                raise CaptureError(
                    f"CapturedOptimizer: parameter {_where(groups, g, i)} was given new storage "
                    f"after capture, but the graph writes the old one; update parameters in place (copy_) or "
                    f"call release() to re-capture"
                )
            if grad is None:
                if p.grad is not None and id(p) not in self._excluded:
                    raise CaptureError(
                        f"CapturedOptimizer: parameter {_where(groups, g, i)} has a grad now but "
                        f"had none at capture, so the graph never updates it; call release() to re-capture"
                    )
            elif self.check_grads and (p.grad is None or p.grad.data_ptr() != grad.data_ptr()):
                raise CaptureError(
                    f"CapturedOptimizer: the grad of {_where(groups, g, i)} is a new tensor "
                    f"since capture, but the graph reads the old one; zero grads in place "
                    f"(zero_grad(set_to_none=False), or CapturedOptimizer.zero_grad) so backward accumulates "
                    f"into the same tensor"
                )

    def _raise_frozen_change(self, index: int, frozen: dict, current: dict) -> None:
        for key in sorted(frozen.keys() | current.keys()):
            old, new = frozen.get(key, _ABSENT), current.get(key, _ABSENT)
            if not _same(old, new):
                live = ", ".join(repr(key) for key in self._synced_keys) or "none"
                why = f" {_WHY_NOT_LIVE[key]}" if key in _WHY_NOT_LIVE else ""
                raise CaptureError(
                    f"CapturedOptimizer: param group {index}: {key!r} changed from {old!r} to {new!r} after "
                    f"capture, but the captured step read it as a host number, so it cannot be live (live: "
                    f"{live}); call release() to re-capture with the new value.{why}"
                )

    # ----------------------------------------------------------------------------------------
    # CUDA
    # ----------------------------------------------------------------------------------------

    def _side_stream(self) -> torch.cuda.Stream:
        if self._stream is None:
            self._stream = torch.cuda.Stream()
        return self._stream

    def _eager_step(self) -> None:
        # Warm up on the stream the capture will use (its cuBLAS workspace, lazy allocations).
        stream = self._side_stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.optimizer.step()
        torch.cuda.current_stream().wait_stream(stream)

    def _sync_live_values(self, record: _Capture) -> None:
        """Copy the host values of live hyperparameters into the tensors the graph reads."""
        if self._syncs_itself:
            self.optimizer.sync_hyperparameters(self._synced_keys)
        elif record.lr_tensors is not None:
            for group, lr in zip(self.optimizer.param_groups, record.lr_tensors):
                value = group["lr"]
                if lr is not None and value is not lr:
                    # A float (or another tensor) was assigned: the graph still reads `lr`.
                    if isinstance(value, torch.Tensor):
                        lr.copy_(value)
                    else:
                        lr.fill_(value)
                    group["lr"] = lr

    def _capture(self) -> None:
        record = self._prepare_capture()
        if self._syncs_itself:
            # Every live value at its current setting, lr included: a baked lr is the capture's.
            self.optimizer.sync_hyperparameters()
        excluded = [p for _, _, p in record.slots if id(p) in self._excluded]
        hidden_grads = [p.grad for p in excluded]
        graph = torch.cuda.CUDAGraph()
        try:
            for p in excluded:
                p.grad = None  # the optimizer skips a param without grad
            with torch.cuda.graph(graph, stream=self._side_stream()):
                self.optimizer.step()
        finally:
            for p, grad in zip(excluded, hidden_grads):
                p.grad = grad
        record.graph = graph
        self._captured = record
        graph.replay()  # the capture only recorded this step
