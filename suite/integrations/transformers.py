"""The arms inside Hugging Face transformers models (transformers >= 5, the extra `[hf]`).

Experts: transformers 5 dispatches each experts module's forward (classes under its
`@use_experts_implementation`: OLMoE, Qwen3-MoE, Mixtral, ...) through an experts interface keyed
by `config._experts_implementation`. `register()` adds the fused Triton experts there under the
name "suite"; `use_suite_experts(model)` checks every experts module of a model and then
switches it over. The model keeps its own router and top-k (router gradients flow through its
router, via `routing_from_topk`), and its own weights: the kernels read `gate_up_proj` and
`down_proj` in place, in each of the layouts transformers declares (concatenated or interleaved
gate and up, transposed or not), and write their gradients in that same layout: no copy either
way (`gate_up_experts`). An experts class whose `_apply_gate` is a clamped SwiGLU that
transformers ships (DeepSeek-V4's, HY-V4's, Step-3's and their copies) runs the kernels' clamp.

    from suite.integrations.transformers import use_suite_experts
    use_suite_experts(model)   # -> how many experts modules now run the suite's kernels
"""

from __future__ import annotations

import ast
import builtins
import functools
import inspect
import textwrap
import warnings
from typing import Callable, NamedTuple

import torch
from torch import nn

from suite import triton_support
from suite.arms import rmsnorm
from suite.arms.moe import GateUpLayout, GeGLU, MoEExperts, SwiGLU, gate_up_experts, routing_from_topk
from suite.arms.muon import Muon
from suite.errors import CouldNotRun
from suite.triton_support import FLOAT_DTYPES

EXPERTS_IMPLEMENTATION = "suite"
_EXPERTS_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


class IntegrationError(CouldNotRun):
    """A model, or an installation, an integration cannot take; nothing of the model was changed."""


def _transformers():
    try:
        import transformers
    except ImportError:
        raise IntegrationError("transformers is not installed: pip install 'suite[hf]' (transformers >= 5)") from None
    if int(transformers.__version__.split(".")[0]) < 5:
        raise IntegrationError(f"transformers {transformers.__version__} has no experts interface: "
                               "pip install -U 'transformers>=5'")
    return transformers


# transformers' own gate, silu(gate) * up; a class that overrides it is known by its code
# (`gate_rule`). Read at register(), not in the forward: dynamo cannot trace an import of
# transformers' lazy modules.
_default_apply_gate = None


class GateRule(NamedTuple):
    """What an experts class's `_apply_gate` computes, in `SwiGLU`'s terms: the attribute
    holding its limit (None: never clamped; the attribute may hold None: not clamped), what the
    limit clamps, and whether its silu is the module's act_fn (which must then be SiLU)."""

    limit_attr: str | None
    clamp: str
    act_fn: bool


_PLAIN_GATE = GateRule(None, "gate", True)
# One class of each gate this knows besides transformers' own; a class whose _apply_gate is
# one of theirs, word for word, is known too (transformers copies them into other models).
_GATE_EXEMPLARS = {
    ("beam", "BeamExperts"): _PLAIN_GATE,                                   # act_fn(g) * u in fp32
    ("deepseek_v4", "DeepseekV4Experts"): GateRule("limit", "gate", True),  # act_fn(min(g, L)) * clamp(u)
    ("hy_v4", "HYV4Experts"): GateRule("swiglu_limit", "gate", False),      # F.silu(min(g, L)) * clamp(u)
    ("step3p7", "Step3p7Experts"): GateRule("limit", "silu", True),         # min(act_fn(g), L) * clamp(u)
}


def _act_kind(act) -> str | None:
    """What an experts module's act_fn computes: "silu" (a SiLU module, torch's or transformers',
    or torch's function itself, as LFM2-MoE holds), "gelu_tanh" (gelu's tanh form: transformers'
    "gelu_pytorch_tanh" and "gelu_new", torch's GELU(approximate="tanh")), else None."""
    if act is torch.nn.functional.silu or type(act).__name__ in ("SiLU", "SiLUActivation"):
        return "silu"
    if type(act).__name__ in ("GELUTanh", "NewGELUActivation") or (
            isinstance(act, nn.GELU) and act.approximate == "tanh"):
        return "gelu_tanh"
    return None


def register() -> None:
    """Register the fused experts as transformers' experts implementation "suite" (idempotent):
    then `model.set_experts_implementation("suite")` switches a model's experts over, or
    `use_suite_experts(model)`, which checks the model first."""
    global _default_apply_gate
    _transformers()
    from transformers.integrations import moe as hf_moe

    _default_apply_gate = getattr(hf_moe, "_default_apply_gate", None)
    hf_moe.ExpertsInterface.register(EXPERTS_IMPLEMENTATION, suite_experts_forward)


def is_experts_module(module: nn.Module) -> bool:
    """A module transformers' experts interface dispatches: its class went through
    `@use_experts_implementation` (which sets these flags) and holds 3-D expert weights."""
    return hasattr(module, "has_gate") and hasattr(module, "is_transposed") and hasattr(module, "down_proj")


def experts_unsupported(module: nn.Module) -> str | None:
    """Why the suite's kernels cannot run this experts module, naming the flag; None if they can
    (after `register()`)."""
    name = type(module).__name__
    if not module.has_gate:
        return f"{name} has has_gate=False (no gate projection); the suite's experts are SwiGLU"
    if getattr(module, "has_bias", False):
        return f"{name} has has_bias=True; the suite's experts take no biases"
    if getattr(module, "has_post_expert_norm", False):
        return f"{name} has has_post_expert_norm=True; the suite's experts have no norm after each expert"
    if getattr(module, "_is_expert_parallel", False):
        return f"{name} is expert-parallel (_is_expert_parallel=True); the suite's experts hold every expert"
    rule = gate_rule(module)
    if rule is None:
        return (f"{name} defines its own _apply_gate, and its code is none this knows; the suite's experts "
                "compute silu(gate) * up, or its clamped form (suite.arms.moe.SwiGLU)")
    act = getattr(module, "act_fn", None)
    if rule.act_fn and _act_kind(act) is None:
        shown = getattr(act, "__name__", None) if inspect.isroutine(act) else type(act).__name__
        return (f"{name} has act_fn {shown}; the suite's experts compute silu(gate) * up or gelu's tanh form "
                "(GeGLU) in silu's place")
    try:
        glu_of(module, rule)
    except (TypeError, ValueError) as error:
        return f"{name}'s {rule.limit_attr} is {getattr(module, rule.limit_attr, None)!r}: {error}"
    gate_up, down = getattr(module, "gate_up_proj", None), module.down_proj
    if not isinstance(gate_up, torch.Tensor) or gate_up.dim() != 3 or down.dim() != 3:
        return f"{name} has no 3-D gate_up_proj and down_proj"
    if gate_up.dtype not in _EXPERTS_DTYPES or down.dtype != gate_up.dtype:
        return f"{name}'s weights are {gate_up.dtype} / {down.dtype}; the suite's experts take one of bf16, fp16, fp32"
    return None


def gate_rule(module: nn.Module) -> GateRule | None:
    """How the suite's experts compute this experts module's `_apply_gate`: transformers' own
    gate, or the rule of the known class whose `_apply_gate` its class has, word for word
    (names, docstrings and annotations aside); None for any other (after `register()`)."""
    apply_gate = getattr(type(module), "_apply_gate", None)
    if apply_gate is None or apply_gate is _default_apply_gate:
        return _PLAIN_GATE
    code = _code_of(type(module), "_apply_gate")
    return None if code is None else _exemplar_codes("_apply_gate").get(code)


def glu_of(module: nn.Module, rule: GateRule) -> SwiGLU | GeGLU:
    """The activation the module's gate computes under `rule`: its SwiGLU, the limit read from
    the module now, or GeGLU where its act_fn is gelu's tanh form (never clamped)."""
    limit = None if rule.limit_attr is None else getattr(module, rule.limit_attr)
    if rule.act_fn and _act_kind(getattr(module, "act_fn", None)) == "gelu_tanh":
        if limit is not None:
            raise ValueError("a clamped GeGLU is none the suite's experts compute")
        return GeGLU()
    return SwiGLU(limit, rule.clamp)


def layout_of(module: nn.Module) -> GateUpLayout:
    """How the experts module stores gate_up_proj and down_proj, from its flags."""
    return GateUpLayout(transposed=bool(module.is_transposed), concatenated=bool(module.is_concatenated))


def expert_weights(module: nn.Module) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d]) as views of the module's own
    gate_up_proj and down_proj, in the layout its flags declare: gradients reach the
    parameters through the views."""
    return layout_of(module).views(module.gate_up_proj, module.down_proj)


def suite_experts_forward(self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                          top_k_weights: torch.Tensor) -> torch.Tensor:
    """transformers' experts forward signature, on the suite's kernels: the model's own top-k
    choice laid out by `routing_from_topk`, gate_up_proj and down_proj read in place and their
    gradients written in their own layout (`gate_up_experts`)."""
    rule = getattr(self, "_suite_gate_rule", None)  # use_suite_experts found it: compile never traces the code
    if rule is None:
        reason = experts_unsupported(self)
        if reason is not None:
            raise IntegrationError(f"experts implementation 'suite': {reason}; use another experts_implementation")
        rule = self._suite_gate_rule = gate_rule(self)
    layout = layout_of(self)
    gate_up, down = self.gate_up_proj, self.down_proj
    routing = routing_from_topk(top_k_index, top_k_weights, self.num_experts)
    out = gate_up_experts(hidden_states.to(gate_up.dtype), routing, gate_up, down, transposed=layout.transposed,
                          concatenated=layout.concatenated, activation=glu_of(self, rule))
    return out.to(hidden_states.dtype)


def _require_module(fn: str, model: object) -> None:
    if not isinstance(model, nn.Module):
        raise TypeError(f"{fn}: model must be a torch.nn.Module (a transformers model), got {type(model).__name__}")


def checked_experts_modules(model: nn.Module,
                            unsupported: Callable[[nn.Module], str | None]) -> list[tuple[str, nn.Module]]:
    """Every experts module of `model` (named), each one `unsupported` finds no reason against: a
    model with none, or with one it refuses, raises IntegrationError naming the module."""
    found = [(name, module) for name, module in model.named_modules() if is_experts_module(module)]
    if not found:
        raise IntegrationError(f"{type(model).__name__} has no experts module that transformers' experts interface "
                               "dispatches (a class under @use_experts_implementation)")
    for name, module in found:
        reason = unsupported(module)
        if reason is not None:
            raise IntegrationError(f"{name}: {reason}; the model was left unchanged")
    return found


def use_suite_experts(model: nn.Module) -> int:
    """Switch every experts module of `model` to the suite's kernels and return how many. Each
    is checked first: a model with none, or one the kernels cannot take, raises
    IntegrationError naming the module and the flag, and the model is left as it was. On a
    machine without CUDA the kernels run only under Triton's interpreter: without it, refused."""
    _require_module("use_suite_experts", model)
    register()
    found = checked_experts_modules(model, experts_unsupported)
    weights = found[0][1].gate_up_proj
    if not torch.cuda.is_available() and not triton_support.runs_on(weights):
        raise IntegrationError("use_suite_experts: this machine has no CUDA GPU, and the suite's Triton kernels run "
                               "on a CPU only under Triton's interpreter: set TRITON_INTERPRET=1 before triton is "
                               "imported (tests, tiny models), or leave the model's experts as they are; the model "
                               "was left unchanged")
    for _, module in found:
        module._suite_gate_rule = gate_rule(module)
    if hasattr(model, "set_experts_implementation"):
        model.set_experts_implementation(EXPERTS_IMPLEMENTATION)
    else:
        model.config._experts_implementation = EXPERTS_IMPLEMENTATION
    return len(found)


# ---- RMSNorm ---------------------------------------------------------------------------------

class NormRule(NamedTuple):
    """What a norm computes, in `rms_norm`'s terms: the attribute holding its eps (of several
    names, the one the module has: a class's own code names it, and it was renamed between
    versions), its offset (the scale is offset + weight; 1 where the module has no weight), and
    whether its output takes the weight's dtype by promotion, as Llama's
    `weight * x.to(input_dtype)` does."""

    eps_attr: str | tuple[str, ...]
    offset: float
    promotes: bool


def norm_eps(module: nn.Module, rule: NormRule) -> float:
    """The norm's eps, read from the attribute its rule names."""
    names = (rule.eps_attr,) if isinstance(rule.eps_attr, str) else rule.eps_attr
    return float(getattr(module, next((name for name in names if hasattr(module, name)), names[0])))


# One class of each computation this knows; any RMSNorm class whose code is one of theirs is
# known too (transformers copies these into most of its models under their own names).
_EXEMPLARS = {
    ("llama", "LlamaRMSNorm"): NormRule("variance_epsilon", 0.0, True),   # weight * x.to(dtype)
    ("olmo2", "Olmo2RMSNorm"): NormRule("variance_epsilon", 0.0, False),  # (weight * x).to(dtype)
    ("gemma", "GemmaRMSNorm"): NormRule("eps", 1.0, False),               # x * (1 + weight), fp32
    ("helium", "HeliumRMSNorm"): NormRule("variance_epsilon", 0.0, False),  # (weight.float() * x).to(dtype)
    ("ergo", "ErgoRMSNorm"): NormRule("eps", 0.0, False),  # F.rms_norm in fp32, weight too, one rounding
    # Gemma 4's: x * (mean + eps)^-0.5, times the weight in fp32 where it has one (with_scale)
    ("gemma4", "Gemma4RMSNorm"): NormRule(("variance_epsilon", "eps"), 0.0, False),
    # DeepSeek-V4's, no weight: x * rstd, its rstd rounded to x's dtype first (ours applies it in fp32)
    ("deepseek_v4", "DeepseekV4UnweightedRMSNorm"): NormRule(("variance_epsilon", "eps"), 0.0, False),
    ("inkling2", "Inkling2UnweightedRMSNorm"): NormRule("variance_epsilon", 0.0, False),  # x * rstd in fp32, no weight
}
# Classes named like a norm that are none: one whose code is theirs is left to the model (HY-V4's
# "unweighted norm" returns rstd alone, for the model to multiply by later; AXK2's gated norm
# wraps a norm module, patched on its own, and multiplies it by a gate of its own).
_NOT_NORMS = (("hy_v4", "HYV4UnweightedRMSNorm"), ("axk2", "AXK2GatedRMSNorm"))
RMS_NORM_IMPLS = ("auto", "fused")


def _is_rms_norm(module: nn.Module) -> bool:
    """Named like an RMSNorm, and not a class known by its code to be none."""
    return type(module).__name__.endswith("RMSNorm") and _code_of(type(module)) not in _exemplar_codes(not_norms=True)


def _method(cls: type, name: str):
    value = inspect.getattr_static(cls, name, None)
    value = getattr(value, "__func__", value)  # a staticmethod's or classmethod's function
    return value if inspect.isfunction(value) else None


def _method_code(fn, cls: type) -> tuple[tuple, list[str]]:
    """A method as code: its syntax without docstring, annotations or the class's own name, and
    what each global name it reads is (the same text in another module may call other things);
    with the names of the class's methods it calls on self."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    reads, calls = set(), []
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.returns = None
            if node.body and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant) \
                    and isinstance(node.body[0].value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
        elif isinstance(node, ast.arg):
            node.annotation = None
        elif isinstance(node, ast.Name):
            if node.id == cls.__name__:
                node.id = "<class>"
            elif isinstance(node.ctx, ast.Load) and node.id not in fn.__code__.co_varnames:
                reads.add((node.id, id(fn.__globals__.get(node.id, getattr(builtins, node.id, None)))))
        elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
            if _method(cls, node.attr) is not None:
                calls.append(node.attr)
            elif hasattr(cls, node.attr):  # a value the class holds, not the instance
                reads.add((node.attr, repr(getattr(cls, node.attr))))
    tree.body[0].name = "<method>"
    return (ast.dump(tree, annotate_fields=False), tuple(sorted(reads))), calls


@functools.cache
def _code_of(cls: type, root: str = "forward") -> tuple | None:
    """What a module class computes, as code: its method `root` and every method of the class
    it calls, wherever its bases define them. None where a source cannot be read."""
    if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
        return None
    code, todo = {}, [root]
    try:
        while todo:
            name = todo.pop()
            if name not in code:
                if (fn := _method(cls, name)) is None:
                    return None
                code[name], calls = _method_code(fn, cls)
                todo += calls
    except (OSError, TypeError, SyntaxError):
        return None
    return tuple(sorted(code.items()))


@functools.cache
def _exemplar_codes(root: str = "forward", not_norms: bool = False) -> dict[tuple, NormRule | GateRule | None]:
    """The code of each exemplar this transformers has -> its rule: the norms' forward, or
    the experts' _apply_gate; not_norms: the forward of each class known to be no norm -> None."""
    import importlib

    codes = {}
    table = dict.fromkeys(_NOT_NORMS) if not_norms else _EXEMPLARS if root == "forward" else _GATE_EXEMPLARS
    for (package, name), rule in table.items():
        try:
            cls = getattr(importlib.import_module(f"transformers.models.{package}.modeling_{package}"), name)
        except (ImportError, AttributeError):
            continue
        if (code := _code_of(cls, root)) is not None:
            codes.setdefault(code, rule)  # an exemplar whose code is an earlier one's computes that
    return codes


def _overridden(module: nn.Module) -> str | None:
    """A method of the norm's code (its forward, or one forward calls) that the module holds an
    instance attribute for (`self._norm = ...` in its __init__, accelerate's hooked forward):
    that attribute runs, not the code the class is known by. apply_rms_norm's own forward aside."""
    own = vars(module)
    return next((name for name, _ in _code_of(type(module)) or ()
                 if name in own and getattr(own[name], "func", None) is not _rms_norm_forward), None)


def rms_norm_rule(module: nn.Module) -> NormRule | None:
    """How `apply_rms_norm` computes this norm: the rule of the known class whose code its class
    has, word for word (names, docstrings and annotations aside); None for any other module,
    and for one whose instance overrides that code (`_overridden`)."""
    if not _is_rms_norm(module) or _overridden(module) is not None:
        return None
    code = _code_of(type(module))
    return None if code is None else _exemplar_codes().get(code)


def apply_rms_norm(model: nn.Module, impl: str = "auto") -> int:
    """Swap the forward of every RMSNorm module of `model` for the suite's `rms_norm` and return
    how many. impl="auto": the suite's kernels in eager calls (`rms_norm`'s own "auto", which
    leaves small CUDA tensors to torch's native kernel), the module's own forward on a CPU
    (without Triton's interpreter), under torch.compile, so inductor fuses the norm into its
    neighbours as it would without us (our custom op would stop it, docs/arms/rmsnorm.md), and
    in a dtype the kernels do not take (a float64 model, cast before or after). impl="fused":
    the suite's kernels everywhere; a norm in another dtype than bf16, fp16 or fp32 is refused.
    A norm is known by its code (`rms_norm_rule`): Llama's, OLMo2's, Gemma's,
    Helium's, Ergo's, Gemma 4's, or DeepSeek-V4's or Inkling2's unweighted one, or a copy of one under
    another name, as most of transformers' models carry; a class its code shows is no norm
    (`_NOT_NORMS`) is left as it is. Every
    RMSNorm module is checked first: a class this does not know, or a module whose instance
    overrides its class's code (`self._norm = ...`), raises IntegrationError naming it, and
    nothing of the model is patched. A model with no norm it takes gets 0 and a warning naming
    each norm class it holds and why it was passed over. `restore_rms_norm` undoes it."""
    _require_module("apply_rms_norm", model)
    if impl not in RMS_NORM_IMPLS:
        raise ValueError(f"apply_rms_norm: impl must be one of {RMS_NORM_IMPLS}, not {impl!r}")
    norms = [(name, module) for name, module in model.named_modules() if _is_rms_norm(module)]
    if not norms:  # say so: 0 alone reads as success (Cohere's models hold layer norms)
        warnings.warn(f"apply_rms_norm: {type(model).__name__} {_no_norm_taken(model)}", stacklevel=2)
    for name, module in norms:
        if (attribute := _overridden(module)) is not None:
            raise IntegrationError(f"apply_rms_norm: {name or 'the model'} ({type(module).__name__}) holds its own "
                                   f"{attribute}, an instance attribute that runs in place of its class's: the code "
                                   "the norm is known by is not the code that runs; the model was left unchanged")
    unknown = sorted({type(module).__name__ for _, module in norms if rms_norm_rule(module) is None})
    if unknown:
        known = ", ".join(name for _, name in _EXEMPLARS)
        raise IntegrationError(f"apply_rms_norm: {', '.join(unknown)} is not a norm this knows: its code is none of "
                               f"{known}'s, nor a copy of one; the model was left unchanged")
    if impl == "fused":
        for name, module in norms:
            weight = getattr(module, "weight", None)
            if weight is not None and weight.dtype not in FLOAT_DTYPES:
                raise IntegrationError(
                    f"apply_rms_norm(impl='fused'): {name} ({type(module).__name__}) is {weight.dtype}, and the suite's "
                    f"kernels take bfloat16, float16 or float32: pass impl='auto', which leaves other dtypes to the "
                    f"model's own norm, or cast the model; the model was left unchanged")
    for _, module in norms:
        # a partial of a module-level function, not a closure: a deepcopy (an EMA or reference
        # model) rebinds it to the copy, and pickle and torch.save can name it
        module.forward = functools.partial(_rms_norm_forward, module)
        module._suite_rms_norm = impl
        module._suite_norm_rule = rms_norm_rule(module)  # found once: torch.compile reads it, never the code
    return len(norms)


def _no_norm_taken(model: nn.Module) -> str:
    """Why apply_rms_norm takes no module of `model`: each norm class it holds, passed over."""
    seen = sorted({type(module).__name__ for module in model.modules() if "Norm" in type(module).__name__})
    if not seen:
        return "has no norm module; nothing was patched"
    # a class named *RMSNorm gets here only when its code is one of _NOT_NORMS'
    why = [f"{name}'s code is none of a norm's (it computes something else under the name)" if name.endswith("RMSNorm")
           else f"{name} is not named *RMSNorm (a layer norm, or another the suite's kernels do not compute)"
           for name in seen]
    return f"has no norm it takes, and was left as it was: {'; '.join(why)}"


def _rms_norm_forward(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A patched norm's forward: the suite's `rms_norm` with the module's own weight and eps."""
    impl = module._suite_rms_norm
    rule = module._suite_norm_rule
    weight = getattr(module, "weight", None)
    if x.dtype not in FLOAT_DTYPES or (weight is not None and weight.dtype not in FLOAT_DTYPES):
        if impl == "fused":  # a model cast after apply_rms_norm, which refuses such a model
            dtype = x.dtype if x.dtype not in FLOAT_DTYPES else weight.dtype
            raise IntegrationError(f"apply_rms_norm(impl='fused'): {type(module).__name__} got {dtype}, and the "
                                   "suite's kernels take bfloat16, float16 or float32: apply_rms_norm(model, "
                                   "impl='auto') leaves other dtypes to the model's own norm")
        return type(module).forward(module, x)  # float64, a debugging model's truth: the model's own
    if impl == "auto" and (torch.compiler.is_compiling() or not triton_support.runs_on(x)):
        return type(module).forward(module, x)
    if weight is None:  # an unweighted norm (Gemma 4's with_scale=False, DeepSeek-V4's): scale 1
        return rmsnorm.rms_norm(x, x.new_ones(x.shape[-1]), norm_eps(module, rule), 0.0, impl=impl)
    y = rmsnorm.rms_norm(x, weight, norm_eps(module, rule), rule.offset, impl=impl)
    return y.to(torch.promote_types(x.dtype, weight.dtype)) if rule.promotes else y


def restore_rms_norm(model: nn.Module) -> int:
    """Undo `apply_rms_norm`: every patched module's own forward again; returns how many."""
    _require_module("restore_rms_norm", model)
    restored = 0
    for module in model.modules():
        if hasattr(module, "_suite_rms_norm"):
            del module.forward, module._suite_rms_norm, module._suite_norm_rule
            restored += 1
    return restored


# ---- Muon param groups -----------------------------------------------------------------------


def _fused_split(name: str, module: nn.Module, config) -> tuple[int, ...] | None:
    """The blocks of a fused projection's rows, where the module's name and the config say so:
    qkv_proj (q, k, v heads) and a 2-D gate_up_proj (gate, up); None for any other weight."""
    rows = module.weight.shape[0]
    leaf = name.rsplit(".", 1)[-1]
    if leaf == "qkv_proj" and config is not None:
        heads, kv_heads = config.num_attention_heads, getattr(config, "num_key_value_heads", None)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        sizes = (heads * head_dim, (kv_heads or heads) * head_dim, (kv_heads or heads) * head_dim)
        return sizes if sum(sizes) == rows else None
    if leaf == "gate_up_proj" and rows % 2 == 0:
        return (rows // 2, rows // 2)
    return None


EXPERTS_OPTIMIZERS = ("adamw", "muon")


def _expert_weight_options(module: nn.Module, param: torch.Tensor) -> dict | None:
    """A Muon group's options for a 3-D expert weight (each expert's matrix stepped on its own
    as the layer's [out, in], gate_up_proj split into gate and up, halves or alternating as the
    module stores them); None for an expert bias, which AdamW takes."""
    if param.dim() != 3:
        return None
    # stored [in, out] (is_transposed; MoEExperts always): Muon's scale must read it transposed
    transposed = isinstance(module, MoEExperts) or bool(module.is_transposed)
    if param is not getattr(module, "gate_up_proj", None):  # down_proj, a gateless up_proj, MoEExperts' three
        return {"transposed": transposed}
    dim = 1 if transposed else 0  # each expert's matrix: [d, 2f] transposed, else [2f, d]
    half = param.shape[1 + dim] // 2
    return {"split_sizes": (half, half), "split_dim": dim, "split_interleaved": not module.is_concatenated,
            "transposed": transposed}


def muon_param_groups(model: nn.Module, experts: str = "adamw", **muon_kwargs) -> list[dict]:
    """Param groups for `suite.arms.muon.Muon`, routed as OLMo-core routes them: the 2-D hidden
    matrices to Muon (muon_kwargs, e.g. lr, go into each Muon group); the embeddings (no weight
    decay), the output head, vectors (norms, biases, expert biases) and the 3-D expert weights
    to AdamW, with the optimizer's defaults. experts="muon" gives the expert weights (of the
    experts modules transformers' experts interface dispatches, and of `suite.arms.moe.MoEExperts`)
    to Muon instead, each expert's matrix stepped on its own as the layer's [out, in] whatever
    the storage (transposed=True where the module stores [in, out]) and gate_up_proj split into
    gate and up (alternating ones too, gpt-oss's). A fused qkv_proj or gate_up_proj Linear gets
    split_sizes, so each block is orthogonalised on its own. Every group carries param_names;
    empty groups are left out.

        optimizer = Muon(muon_param_groups(model, lr=0.02), lr=3e-4)   # lr=3e-4: the AdamW groups'
    """
    _require_module("muon_param_groups", model)
    if experts not in EXPERTS_OPTIMIZERS:
        raise ValueError(f"muon_param_groups: experts must be one of {EXPERTS_OPTIMIZERS}, not {experts!r}")
    unknown = sorted(set(muon_kwargs) - set(Muon.group_options))
    if unknown:  # a misspelt option would otherwise ride along in the groups, unread
        raise TypeError(f"muon_param_groups: unknown Muon option(s) {unknown}; a Muon group takes "
                        f"{', '.join(Muon.group_options)} (how each weight splits is set here)")
    config = getattr(model, "config", None)
    embeddings = {id(m.weight) for m in model.modules() if isinstance(m, nn.Embedding)}
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    head_ids = {id(head.weight)} if head is not None and isinstance(getattr(head, "weight", None), torch.Tensor) else set()
    split_of = {id(m.weight): _fused_split(name, m, config) for name, m in model.named_modules()
                if isinstance(m, nn.Linear)}
    # an experts module's own parameters: its 3-D weights and any biases (2-D, one row an expert)
    expert_params = {id(p): (m, p) for m in model.modules() if is_experts_module(m) or isinstance(m, MoEExperts)
                     for p in m.parameters(recurse=False)}
    groups: dict[tuple, dict] = {}

    def put(key: tuple, name: str, param: nn.Parameter, **options) -> None:
        group = groups.setdefault(key, {"params": [], "param_names": [], **options})
        group["params"].append(param)
        group["param_names"].append(name)

    for name, param in model.named_parameters():  # tied weights come once
        if not param.requires_grad:
            continue
        if id(param) in embeddings:
            put(("embeddings",), name, param, use_muon=False, weight_decay=0.0)
        elif id(param) in expert_params:
            options = _expert_weight_options(*expert_params[id(param)]) if experts == "muon" else None
            if options is None:
                put(("adamw",), name, param, use_muon=False)
            else:
                put(("experts", *options.values()), name, param, use_muon=True, **options, **muon_kwargs)
        elif id(param) in head_ids or param.dim() != 2:
            put(("adamw",), name, param, use_muon=False)
        else:
            sizes = split_of.get(id(param))
            if sizes is None:
                put(("muon",), name, param, use_muon=True, **muon_kwargs)
            else:
                put(("muon", sizes), name, param, use_muon=True, split_sizes=sizes, split_dim=0, **muon_kwargs)
    return list(groups.values())
