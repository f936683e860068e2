"""Record a real model's tensors as gate buffers: `capture` hooks the modules an arm replaces,
keeps what one forward and backward of each passes through it, and writes one buffer recording
per module (the format `suite gate NAME --buffers DIR` reads), named by its module path:

    with capture(model, "recorded") as recording:
        loss = model(**batch).loss
        loss.backward()
    # recorded/model.layers.3.post_attention_layernorm -> suite gate rmsnorm --buffers ...
    print(recording.saved)

RMSNorm modules (transformers' RMSNorm classes that `apply_rms_norm` knows, and the suite's
`RMSNorm`) give gate `rmsnorm` x, weight, dy with their eps and offset; transformers experts
modules (see `suite.integrations.transformers`) that the suite's kernels take give gate
`moe-bwd` x, the model's own top-k choice and weights (which the gate routes with, whatever the
model's router computes), the expert weights in the gate's layout and grad_out. Works on any
device; the tensors are copied to the host when written.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch
from torch import nn

from suite.errors import UsageError
from suite.files.buffers import check_destination, save_buffers

MODULE_KINDS = ("rms_norm", "experts")


@dataclass
class _Watched:
    path: str
    module: nn.Module
    gate: str
    params: dict
    step: int = 0
    calls: int = 0
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class Recording:
    """What `capture` wrote (`saved`, one directory per module) and what it could not, with why
    (`skipped`: module path -> reason)."""

    out_dir: Path
    saved: list[Path] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)


def _rms_norm_params(module: nn.Module) -> dict | None:
    from suite.arms.rmsnorm import RMSNorm
    from suite.integrations.transformers import norm_eps, rms_norm_rule

    if isinstance(module, RMSNorm):
        return dict(eps=float(module.eps), offset=float(module.offset))
    rule = rms_norm_rule(module)
    if rule is None:
        return None
    return dict(eps=norm_eps(module, rule), offset=rule.offset)


def _watch(model: nn.Module, modules: tuple[str, ...], step: int, recording: Recording) -> list[_Watched]:
    """The modules to record; an experts module the suite's kernels cannot take (no gate
    projection, biases, its own activation) goes to `recording.skipped` with the reason."""
    from suite.integrations import transformers as hf

    watched = []
    for path, module in model.named_modules():
        if "rms_norm" in modules:
            params = _rms_norm_params(module)
            if params is not None:
                watched.append(_Watched(path, module, "rmsnorm", params, step))
                continue
        if "experts" in modules and hf.is_experts_module(module):
            hf.register()  # experts_unsupported compares against transformers' own gate
            reason = hf.experts_unsupported(module)
            if reason is None:
                watched.append(_Watched(path, module, "moe-bwd", dict(capacity_factor=None, skew="none"), step))
            else:
                recording.skipped[path] = f"not recorded: {reason}"
    return watched


@contextlib.contextmanager
def capture(model: nn.Module, out_dir: str | os.PathLike, modules: tuple[str, ...] = MODULE_KINDS, step: int = 0,
            overwrite: bool = False) -> Iterator[Recording]:
    """Record the `step`-th forward (0: the first) of each eligible module inside the block, and
    its backward, then write each module's recording under out_dir/<module path> on exit. A
    module whose forward or backward did not run inside the block is listed in `skipped`, as is an
    experts module the suite's kernels cannot take (with the flag that rules it out)."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"capture: model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(modules, str) or not isinstance(modules, (tuple, list, set, frozenset)):
        raise TypeError(f"capture: modules must be a tuple of kinds from {MODULE_KINDS}, e.g. ('rms_norm',), "
                        f"got {type(modules).__name__} {modules!r}")
    unknown = sorted(set(modules) - set(MODULE_KINDS))
    if unknown:
        raise ValueError(f"capture: modules must be among {MODULE_KINDS}, not {unknown}")
    if not isinstance(step, int) or isinstance(step, bool) or step < 0:
        raise ValueError(f"capture: step must be an int >= 0, got {step!r}")
    recording = Recording(Path(out_dir))
    watched = _watch(model, modules, step, recording)
    for w in watched:  # before the step runs: a refusal after it would waste the step
        try:
            check_destination(recording.out_dir / w.path, overwrite, "capture(..., overwrite=True)")
        except UsageError as exc:
            raise UsageError(f"capture: {exc}") from None
    handles = [w.module.register_forward_hook(_recorder(w), with_kwargs=True) for w in watched]
    try:
        yield recording
    finally:
        for handle in handles:
            handle.remove()
    for w in watched:
        missing = [n for n in (("x", "weight", "dy") if w.gate == "rmsnorm" else
                               ("x", "top_k_index", "top_k_weights", "w_gate", "w_up", "w_down", "grad_out"))
                   if n not in w.tensors]
        if missing:
            recording.skipped[w.path] = (f"its call {step} ran no {'forward' if w.calls <= step else 'backward'} "
                                         f"inside the block (missing {missing})")
            continue
        recording.saved.append(save_buffers(w.tensors, recording.out_dir / w.path, gate=w.gate, params=w.params,
                                            overwrite=overwrite))


def _keep_grad(w: _Watched, name: str, output) -> None:
    if isinstance(output, torch.Tensor) and output.requires_grad:
        output.register_hook(lambda grad: w.tensors.__setitem__(name, grad.detach().clone()))


def _glu_buffers(module: nn.Module) -> dict[str, torch.Tensor]:
    """GeGLU experts' mark, or a clamped SwiGLU's limit and what it clamps, as gate moe-bwd
    reads them; none for a plain SwiGLU."""
    from suite.arms.moe import GeGLU
    from suite.integrations.transformers import gate_rule, glu_of

    activation = glu_of(module, gate_rule(module))
    if activation == GeGLU():
        return dict(geglu=torch.tensor(True))
    if activation.limit is None:
        return {}
    return dict(swiglu_limit=torch.tensor(activation.limit, dtype=torch.float64),
                swiglu_clamps_silu=torch.tensor(activation.clamp == "silu"))


def _recorder(w: _Watched):
    """The forward hook of a watched module: its inputs and weights at call `w.step`, and a hook
    on its output for the gradient that reaches it."""

    def hook(module, args, kwargs, output):
        call, w.calls = w.calls, w.calls + 1
        if call != w.step:
            return
        if w.gate == "rmsnorm":  # a norm takes one tensor, by position or by its name
            x = args[0] if args else next(iter(kwargs.values()))
            weight = getattr(module, "weight", None)  # an unweighted norm's scale: 1
            weight = x.new_ones(x.shape[-1]) if weight is None else weight.detach().clone()
            w.tensors.update(x=x.detach().clone(), weight=weight)
            _keep_grad(w, "dy", output)
            return
        from suite.integrations.transformers import expert_weights

        # transformers' experts forward, its arguments by position or by name
        given = {**dict(zip(("hidden_states", "top_k_index", "top_k_weights"), args)), **kwargs}
        hidden_states, top_k_index, top_k_weights = given["hidden_states"], given["top_k_index"], given["top_k_weights"]
        # the experts as the model holds them and its own routing: the gate judges the arm on
        # the path use_suite_experts runs, whatever the model's router computes
        w.params.update(top_k=top_k_index.shape[-1], weights="model")
        w_gate, w_up, w_down = (t.detach().contiguous() for t in expert_weights(module))
        w.tensors.update(x=hidden_states.detach().clone(), w_gate=w_gate, w_up=w_up, w_down=w_down,
                         top_k_index=top_k_index.detach().clone(), top_k_weights=top_k_weights.detach().clone(),
                         **_glu_buffers(module))
        _keep_grad(w, "grad_out", output)

    return hook
