"""Gate `train-step`: whole training steps of Hugging Face models (random init from a config, no
download) with the arms switched on through `suite.integrations.transformers`, against the model
as transformers ships it ("stock": its own norms, its default experts, AdamW fused).

A user switches an arm on inside a model, where its verdict can differ from the op's alone, so
this gate judges and times the step a user runs:

- Parity, eager: `steps` AdamW steps of each kernel contender (rms_norm, experts, all arms) give
  each step's per-token losses and first-step gradients within k x stock's own error against the
  same model and steps in float64 (the truth: stock's math with transformers' eager experts); the captured
  optimizers (CUDA) claim bits: CapturedOptimizer(AdamW fused) against stock, and
  CapturedOptimizer(Muon) against eager Muon, losses and final parameters, under
  torch.use_deterministic_algorithms as the parity runs, with eager attention on both sides.
- Bench: one whole step (forward, backward, optimizer step, zero_grad) on the same batch, eager
  and under `torch.compile(model)`; each contender's build runs its first steps (compile,
  capture) and reports their time and the memory it holds apart from the timed steps. The
  report ends in a recommendation table: per model and mode, which arm to switch on (faster
  than its baseline beyond the noise floor) and which to leave off.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from gates.liger import fused_moe_missing, use_liger_experts
from suite.errors import CouldNotRun
from suite.harness.criteria import NotSlowerThan
from suite.harness.gate import (
    BenchCase,
    Bitwise,
    Buffers,
    Contender,
    Gate,
    Outputs,
    Preset,
    Saboteur,
    Tolerance,
)

ADAMW = dict(lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8)
MUON_LR = 0.02  # Muon's matrices; its AdamW groups (embeddings, head, vectors, experts) take ADAMW's lr
WARM_STEPS = 4  # a bench contender's untimed first steps: compile, then the optimizer's capture on step 4
COMPILE_RECOMPILE_LIMIT = 64  # every contender compiles the same classes; each must get its own graphs


def missing() -> str | None:
    try:
        import transformers
    except ImportError:
        return "gate train-step needs transformers >= 5: pip install -e '.[hf]'"
    if int(transformers.__version__.split(".")[0]) < 5:
        return f"gate train-step needs transformers >= 5, not {transformers.__version__}: pip install -U 'transformers>=5'"
    return None


def _transformers():
    reason = missing()
    if reason is not None:
        raise CouldNotRun(reason)
    import transformers

    return transformers


# ---- models ------------------------------------------------------------------------------------


def _config(p: dict):
    transformers = _transformers()
    common = dict(vocab_size=p["vocab"], hidden_size=p["hidden"], num_hidden_layers=p["layers"],
                  num_attention_heads=p["heads"], num_key_value_heads=p["kv_heads"],
                  max_position_embeddings=max(4096, p["seq"]), bos_token_id=0, eos_token_id=0, pad_token_id=0)
    family = p["family"]
    if family == "llama":
        return transformers.LlamaForCausalLM, transformers.LlamaConfig(intermediate_size=p["ffn"], **common)
    if family == "olmoe":
        return transformers.OlmoeForCausalLM, transformers.OlmoeConfig(
            intermediate_size=p["ffn"], num_experts=p["experts"], num_experts_per_tok=p["top_k"], **common)
    if family == "qwen3-moe":
        return transformers.Qwen3MoeForCausalLM, transformers.Qwen3MoeConfig(
            moe_intermediate_size=p["ffn"], intermediate_size=p["ffn"] * 4, num_experts=p["experts"],
            num_experts_per_tok=p["top_k"], norm_topk_prob=True, head_dim=p["hidden"] // p["heads"], **common)
    if family == "mixtral":
        return transformers.MixtralForCausalLM, transformers.MixtralConfig(
            intermediate_size=p["ffn"], num_local_experts=p["experts"], num_experts_per_tok=p["top_k"], **common)
    raise ValueError(f"unknown model family {family!r}")


def build_model(preset: Preset, buffers: Buffers, dtype: torch.dtype, experts: str | None = None) -> torch.nn.Module:
    """The preset's model on the buffers' device in `dtype`, holding the buffers' initial weights;
    `experts` names transformers' experts implementation (None: its default)."""
    cls, config = _config(preset.params)
    device = buffers["ids"].device
    with torch.device(device):
        model = cls(config)
    model.to(dtype)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(buffers[f"param/{name}"])
    if experts is not None:
        model.set_experts_implementation(experts)
    return model.train()


def _dtype(preset: Preset) -> torch.dtype:
    return getattr(torch, preset.params["dtype"])


def make_buffers(preset: Preset, seed: int, device: torch.device) -> Buffers:
    """The model's initial weights (transformers' own init, seeded, rounded to the preset's dtype)
    and one batch of token ids per parity step."""
    cls, config = _config(preset.params)
    torch.manual_seed(seed)
    with torch.device(device):
        model = cls(config)
    buffers = {f"param/{name}": p.detach().to(_dtype(preset)) for name, p in model.named_parameters()}
    p = preset.params
    gen = torch.Generator().manual_seed(seed + 1)
    buffers["ids"] = torch.randint(0, p["vocab"], (p["steps"], p["batch"], p["seq"]), generator=gen).to(device)
    return buffers


def _parity_ids(buffers: Buffers, preset: Preset) -> torch.Tensor:
    """Parity judges numerics, not scale: its steps take the first parity_batch sequences (the
    float64 truth of a 16x1024 OLMoE step would not fit beside the rest)."""
    return buffers["ids"][:, : preset.params.get("parity_batch", buffers["ids"].shape[1])]


def buffer_params(buffers: Buffers) -> dict[str, Any]:
    steps, batch, seq = buffers["ids"].shape
    return dict(steps=steps, batch=batch, seq=seq)


# ---- what a contender switches on ----------------------------------------------------------------


@dataclass(frozen=True)
class Setup:
    """The arms a contender switches on: RMSNorm ("auto" or "fused"), the experts ("suite": the fused
    Triton experts; "liger": Liger's fused MoE, a peer), and the optimizer ("adamw": torch's fused
    AdamW; "muon": suite's Muon over muon_param_groups; either "-captured": in a CapturedOptimizer;
    "muon-experts": Muon with the expert weights in Muon too)."""

    rms_norm: str | None = None
    experts: str | None = None
    optimizer: str = "adamw"
    # kernels switched on where the model has them (all arms on a dense model: no experts)
    where_present: bool = False
    sabotage: Callable[[torch.nn.Module], None] | None = field(default=None, compare=False)


SETUPS = {
    "stock": Setup(),
    "rms_norm": Setup(rms_norm="auto"),
    "rms_norm fused": Setup(rms_norm="fused"),
    "experts": Setup(experts="suite"),
    "adamw captured": Setup(optimizer="adamw-captured"),
    "all arms": Setup(rms_norm="auto", experts="suite", optimizer="adamw-captured", where_present=True),
    "muon": Setup(optimizer="muon"),
    "muon captured": Setup(optimizer="muon-captured"),
    "muon experts": Setup(optimizer="muon-experts"),
    "liger experts": Setup(experts="liger"),
}


def has_experts(model: torch.nn.Module) -> bool:
    from suite.integrations.transformers import is_experts_module

    return any(is_experts_module(m) for m in model.modules())


def prepare(setup: Setup, preset: Preset, buffers: Buffers) -> torch.nn.Module:
    from suite.integrations import transformers as hf

    model = build_model(preset, buffers, _dtype(preset))
    if setup.experts and (has_experts(model) or not setup.where_present):
        # IntegrationError on a dense model: that contender is unavailable
        (use_liger_experts if setup.experts == "liger" else hf.use_suite_experts)(model)
    if setup.rms_norm is not None:
        hf.apply_rms_norm(model, impl=setup.rms_norm)
    if setup.sabotage is not None:
        setup.sabotage(model)
    return model


def make_optimizer(kind: str, model: torch.nn.Module, warmup_steps: int) -> torch.optim.Optimizer:
    from suite.arms.graph import CapturedOptimizer
    from suite.arms.muon import Muon
    from suite.integrations.transformers import muon_param_groups

    captured = kind.endswith("-captured")
    if kind.startswith("muon"):
        experts = "muon" if kind == "muon-experts" else "adamw"
        if experts == "muon" and not has_experts(model):
            raise CouldNotRun("a dense model has no expert weights to give Muon")
        optimizer = Muon(muon_param_groups(model, experts=experts, lr=MUON_LR), lr=ADAMW["lr"], betas=ADAMW["betas"],
                         weight_decay=ADAMW["weight_decay"], capturable=captured)
    else:
        optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, fused=True, capturable=captured)
    return CapturedOptimizer(optimizer, warmup_steps=warmup_steps) if captured else optimizer


def _zero_grad(optimizer: torch.optim.Optimizer) -> None:
    from suite.arms.graph import CapturedOptimizer

    # a captured step reads the grad tensors it saw at capture: zero those in place
    optimizer.zero_grad(set_to_none=not isinstance(optimizer, CapturedOptimizer))


def next_token_losses(model: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
    """Each position's causal LM loss, unreduced, in the logits' own precision where that is
    wider than fp32 (transformers upcasts to fp32, which would round a float64 truth)."""
    logits = model(input_ids=batch).logits[:, :-1]
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1),
                                             reduction="none")


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
          final_params: bool = False) -> dict[str, Any]:
    """One step per batch of ids on the mean of next_token_losses: each step's per-token losses
    [steps, tokens], the first step's gradients (None as zeros) and, with final_params, the
    parameters after the last step. Parity judges the per-token losses, not their means: a few
    means are a few draws of rounding noise, thousands of tokens measure it. Without
    final_params the last batch takes no optimizer step: nothing judged reads it, and a
    one-step run then holds no optimizer state (a float64 truth at a model's real widths)."""
    losses, first_grads = [], {}
    for step, batch in enumerate(ids):
        token_losses = next_token_losses(model, batch)
        token_losses.mean().backward()
        last = step == len(ids) - 1
        if step == 0:  # a copy where a later step would write over the gradients
            first_grads = {name: (p.grad.detach() if last else p.grad.detach().clone()) if p.grad is not None
                           else torch.zeros_like(p) for name, p in model.named_parameters()}
        losses.append(token_losses.detach())
        if last and not final_params:
            break
        optimizer.step()
        _zero_grad(optimizer)
    params = torch.cat([p.detach().reshape(-1) for p in model.parameters()]) if final_params else None
    return {"loss": torch.stack(losses), "grads": first_grads, "params": params}


# ---- parity ----------------------------------------------------------------------------------------

KERNEL_CONTENDERS = ("rms_norm", "experts", "all arms")
# (contender, the reference run it must equal bit for bit): the same optimizer, captured. Both
# runs use transformers' eager attention: SDPA's flash backward accumulates with atomics, so two
# runs of the stock model differ in their last bits, which a bitwise claim cannot absorb
CAPTURED = {"adamw captured": "stock", "muon captured": "muon"}
BITWISE_ATTENTION = "eager"


def _kernel_contenders(preset: Preset, buffers: Buffers) -> list[str]:
    """On a GPU each kernel arm alone and all together; on the CPU, where every kernel runs
    interpreted (seconds a launch), all of them together."""
    if not buffers["ids"].is_cuda:
        return ["all arms"]
    return [name for name in KERNEL_CONTENDERS if name != "experts" or preset.params.get("experts")]


def _captured(buffers: Buffers) -> dict[str, str]:
    """The captured optimizers' bitwise runs: on CUDA, where the steps reach a replay (the
    capture on the second, a replay on the third)."""
    return CAPTURED if buffers["ids"].is_cuda and buffers["ids"].shape[0] >= 3 else {}


def _optimizer_kind(setup: Setup, buffers: Buffers) -> str:
    # a captured step needs CUDA graphs: on the CPU the same optimizer steps itself
    return setup.optimizer if buffers["ids"].is_cuda else setup.optimizer.removesuffix("-captured")


def _run(setup: Setup, buffers: Buffers, preset: Preset, attention: str | None = None,
         final_params: bool = False) -> dict[str, Any]:
    model = prepare(setup, preset, buffers)
    if attention is not None:
        model.set_attn_implementation(attention)
    # warm-up 1: the capture on step 2, replays after it, all within the parity steps
    return train(model, make_optimizer(_optimizer_kind(setup, buffers), model, warmup_steps=1),
                 _parity_ids(buffers, preset), final_params)


def _outputs(name: str, run: dict[str, Any], bitwise: bool) -> Outputs:
    if bitwise:
        return {f"{name}/loss": run["loss"], f"{name}/params": run["params"]}
    return {f"{name}/loss": run["loss"], **{f"{name}/grad/{n}": g for n, g in run["grads"].items()}}


def reference(buffers: Buffers, preset: Preset) -> Outputs:
    """Stock for every contender's outputs (and eager Muon for the captured Muon's)."""
    stock = _run(SETUPS["stock"], buffers, preset)
    outputs: Outputs = {}
    for name in _kernel_contenders(preset, buffers):
        outputs.update(_outputs(name, stock, bitwise=False))
    for name, base in _captured(buffers).items():
        outputs.update(_outputs(name, _run(SETUPS[base], buffers, preset, BITWISE_ATTENTION, final_params=True),
                                bitwise=True))
    return outputs


def truth(buffers: Buffers, preset: Preset) -> Outputs:
    """Stock's math in float64: the same initial weights (the dtype's values, widened), transformers'
    eager experts, AdamW for-loop in float64."""
    experts = "eager" if preset.params.get("experts") else None
    model = build_model(preset, buffers, torch.float64, experts=experts)
    optimizer = torch.optim.AdamW(model.parameters(), **ADAMW, foreach=False)
    run = train(model, optimizer, _parity_ids(buffers, preset))
    outputs: Outputs = {}
    for name in _kernel_contenders(preset, buffers):
        outputs.update(_outputs(name, run, bitwise=False))
    return outputs


def _arm_with(setups: dict[str, Setup]) -> Callable[[Buffers, Preset], Outputs]:
    def arm(buffers: Buffers, preset: Preset) -> Outputs:
        outputs: Outputs = {}
        for name in _kernel_contenders(preset, buffers):
            outputs.update(_outputs(name, _run(setups[name], buffers, preset), bitwise=False))
        for name in _captured(buffers):
            outputs.update(_outputs(name, _run(setups[name], buffers, preset, BITWISE_ATTENTION, final_params=True),
                                    bitwise=True))
        return outputs

    return arm


arm = _arm_with(SETUPS)


def _unweighted_experts(model: torch.nn.Module) -> None:
    """Each expert's output summed without its routing probability."""
    from suite.integrations.transformers import is_experts_module

    for module in model.modules():
        if is_experts_module(module):
            forward = module.forward
            module.forward = lambda h, index, weights, forward=forward: forward(h, index, torch.ones_like(weights))


def _frozen_norm_weights(model: torch.nn.Module) -> None:
    """The fused norms read their weight detached: no gradient reaches it."""
    from suite.arms import rmsnorm

    for module in model.modules():
        if hasattr(module, "_suite_rms_norm"):
            eps = float(getattr(module, "variance_epsilon", getattr(module, "eps", 1e-6)))
            module.forward = lambda x, module=module, eps=eps: rmsnorm.rms_norm(
                x, module.weight.detach(), eps, impl="fused").to(module.weight.dtype)


def _sabotaged(name: str, sabotage: Callable[[torch.nn.Module], None]) -> Callable[[Buffers, Preset], Outputs]:
    setups = dict(SETUPS)
    setups[name] = Setup(**{**SETUPS[name].__dict__, "sabotage": sabotage})
    return _arm_with(setups)


SABOTEURS = (
    Saboteur("experts-unweighted", "the fused experts' outputs summed without the routing probabilities",
             _sabotaged("all arms", _unweighted_experts), applies=lambda preset: bool(preset.params.get("experts"))),
    Saboteur("norm-weight-frozen", "the fused RMSNorm passes no gradient to its weight",
             _sabotaged("all arms", lambda model: (_rms_fused(model), _frozen_norm_weights(model)))),
)


def _rms_fused(model: torch.nn.Module) -> None:
    from suite.integrations.transformers import apply_rms_norm, restore_rms_norm

    restore_rms_norm(model)
    apply_rms_norm(model, impl="fused")


# ---- bench -----------------------------------------------------------------------------------------


class _Step:
    """One training step of a prepared model, its first WARM_STEPS already run (compile, capture)
    by the build, so a timing never includes them; `note` says what the build saw."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, ids: torch.Tensor,
                 compiled: bool) -> None:
        self.model, self.optimizer, self.ids = model, optimizer, ids
        self.forward = torch.compile(model) if compiled else model
        self.note = ""

    def __call__(self) -> torch.Tensor:
        loss = self.forward(input_ids=self.ids, labels=self.ids).loss
        loss.backward()
        self.optimizer.step()
        _zero_grad(self.optimizer)
        return loss


def _build(name: str) -> Callable[[BenchCase, Buffers, Preset], Callable[[], Any]]:
    def build(case: BenchCase, buffers: Buffers, preset: Preset) -> Callable[[], Any]:
        compiled = case.name == "step-compiled"
        setup = SETUPS[name]
        model = prepare(setup, preset, buffers)
        optimizer = make_optimizer(_optimizer_kind(setup, buffers), model, warmup_steps=WARM_STEPS - 1)
        step = _Step(model, optimizer, buffers["ids"][0], compiled)
        counters = torch._dynamo.utils.counters
        breaks_before = sum(counters["graph_break"].values())
        graphs_before = counters["stats"]["unique_graphs"]
        limit = torch._dynamo.config.recompile_limit
        torch._dynamo.config.recompile_limit = max(limit, COMPILE_RECOMPILE_LIMIT)
        try:
            started = time.perf_counter()
            step()  # compile (the compiled case) and the first step's allocations
            if buffers["ids"].is_cuda:
                torch.cuda.synchronize()
            first_s = time.perf_counter() - started
            for _ in range(WARM_STEPS - 1):
                step()
        finally:
            torch._dynamo.config.recompile_limit = limit
        if compiled:
            breaks = sum(counters["graph_break"].values()) - breaks_before
            graphs = counters["stats"]["unique_graphs"] - graphs_before
            # dynamo reuses what an earlier contender with the same graph compiled: then nothing is traced
            traced = f"{graphs} graph(s) traced, {breaks} graph break(s)" if graphs else "graphs reused from an earlier contender"
            step.note = f"first step {first_s:.1f} s: {traced}"
        return step

    return build


def _contender(name: str, role: str, note: str, cases: tuple[str, ...] | None = None,
               baseline: str | None = None, wide: bool = False,
               unavailable: Callable[[torch.device], str | None] = lambda device: None) -> Contender:
    """wide: timed at the wide presets too, where each contender holds a model of several GB."""
    return Contender(name, role, _build(name), note=note, cases=cases, baseline=baseline,
                     skip_presets=() if wide else WIDE, unavailable=unavailable)


EAGER_ONLY = ("step",)
# the models' layers at their real widths: stock, rms_norm (the judged arm) and experts alone,
# each a whole model in memory
WIDE = ("olmoe-wide", "qwen3-moe-wide", "mixtral-wide")
CONTENDERS = (
    _contender("stock", "reference", "the model as transformers ships it: its norms, its default experts "
               "(grouped_mm), torch's AdamW fused", wide=True),
    # the judged claim: RMSNorm's default ("auto") never makes a step slower, in either mode
    _contender("rms_norm", "arm", "apply_rms_norm(model) (impl auto: the model's own norm under compile)", wide=True),
    _contender("all arms", "peer", "apply_rms_norm (auto) + use_suite_experts where the model has experts + "
               "CapturedOptimizer(AdamW fused)"),
    _contender("rms_norm fused", "peer", "apply_rms_norm(model, impl='fused'): the kernels in both modes"),
    _contender("experts", "peer", "use_suite_experts(model): the fused Triton experts", wide=True),
    _contender("adamw captured", "peer", "CapturedOptimizer(AdamW fused, capturable)"),
    _contender("muon", "peer", "suite Muon (eager) over muon_param_groups; AdamW for the rest",
               cases=EAGER_ONLY, baseline="stock"),
    _contender("muon captured", "peer", "CapturedOptimizer(Muon) against eager Muon", cases=EAGER_ONLY,
               baseline="muon"),
    _contender("muon experts", "peer", "suite Muon with each expert's matrices stepped by Muon too "
               "(muon_param_groups(model, experts='muon')) against Muon with AdamW experts", cases=EAGER_ONLY,
               baseline="muon"),
    # not at the wide presets: a fourth model there would pass one 80 GB card (_memory)
    _contender("liger experts", "peer", "Liger-Kernel's fused MoE as the model's experts (LigerExperts.forward, "
               "which Liger's apply_liger_kernel_to_* bind): gates/liger.py", unavailable=fused_moe_missing),
)


def _tokens(preset: Preset) -> int:
    return preset.params["batch"] * preset.params["seq"]


def _step_flops(preset: Preset) -> int:
    """6 x the matmul parameters a token passes through x tokens (attention's score matmuls left
    out): the figure MFU counts, for the share of the GEMM ceiling."""
    p = preset.params
    d, heads, kv, layers = p["hidden"], p["heads"], p["kv_heads"], p["layers"]
    attention = d * d * 2 + 2 * d * (d // heads) * kv
    mlp = 3 * d * p["ffn"] * (p["top_k"] if p.get("experts") else 1) + (d * p["experts"] if p.get("experts") else 0)
    return 6 * _tokens(preset) * (layers * (attention + mlp) + d * p["vocab"])


def _step_bytes(preset: Preset) -> int:
    return 0  # a whole step is judged in time, against its GEMM work: no byte ceiling


BENCHES = tuple(
    BenchCase(name, f"one training step ({what}): forward, backward, optimizer step, zero_grad",
              bytes=_step_bytes, flops=_step_flops, ceiling="gemm", l2="warm", modes=("eager",), window=1,
              # five a round: with three, a whole step's A/A floor was too wide to tell arms apart
              calls_per_round=5, setup=True, recommend=True)
    for name, what in (("step", "eager model"), ("step-compiled", "torch.compile(model)")))


def _preset(name: str, family: str, where: str, *, layers: int, hidden: int, heads: int, kv_heads: int, ffn: int,
            vocab: int, batch: int, seq: int, steps: int, dtype: str, experts: int = 0, top_k: int = 0,
            parity_batch: int = 4, standard: bool = True, note: str = "") -> Preset:
    params = dict(family=family, layers=layers, hidden=hidden, heads=heads, kv_heads=kv_heads, ffn=ffn, vocab=vocab,
                  batch=batch, seq=seq, steps=steps, dtype=dtype, experts=experts, top_k=top_k,
                  parity_batch=min(batch, parity_batch))
    preset = Preset(name, params, where=where, standard=standard, in_all=where == "any", note=note)
    if where == "cuda":
        preset = Preset(**{**preset.__dict__, "memory_bytes": _memory(preset)})
    return preset


def _params(p: dict) -> int:
    return (p["layers"] * (4 * p["hidden"] ** 2 + 3 * p["hidden"] * p["ffn"] * max(1, p["experts"]))
            + 2 * p["vocab"] * p["hidden"])


def _activation_bytes(p: dict, tokens: int, width: int) -> int:
    """One step's saved activations, roughly: a dozen hidden-wide tensors a layer, four (in, gate,
    up, out) per routed copy of a token, and the logits with their fp32 loss."""
    per_token = p["layers"] * (12 * p["hidden"] + 4 * max(1, p["top_k"]) * (p["hidden"] + p["ffn"])) * width
    return tokens * (per_token + p["vocab"] * (width + 8))


def _memory(preset: Preset) -> int:
    """The most a run holds, roughly: in the bench, the weights, gradients and optimizer state of
    every contender timed at the preset at once (about 10 bytes a bf16 parameter) and one step's
    activations; in parity, the float64 truth's weights and gradients (16 bytes a parameter; 16
    more, AdamW's state, when it steps on) and float64
    activations, beside the reference's and arms' first gradients (8 bytes a parameter)."""
    p = preset.params
    timed = sum(preset.name not in c.skip_presets for c in CONTENDERS)
    bench = timed * 10 * _params(p) + _activation_bytes(p, _tokens(preset), 2)
    truth = 32 if p["steps"] > 1 else 16
    parity = (truth + 4 * 2) * _params(p) + _activation_bytes(p, p["parity_batch"] * p["seq"], 8)
    return max(bench, parity) + (2 << 30)


# three steps: on a GPU the captured optimizers capture on the second and replay on the third
_TINY = dict(layers=2, hidden=64, heads=4, kv_heads=2, vocab=128, batch=2, seq=16, steps=3, dtype="float32")
_REAL = dict(layers=8, hidden=1024, heads=16, vocab=50304, seq=1024, steps=3, dtype="bfloat16")
_WIDE = dict(vocab=50304, batch=4, seq=2048, steps=1, dtype="bfloat16", parity_batch=1, standard=False)
PRESETS = (
    _preset("tiny-llama", "llama", "any", ffn=96, **_TINY, note="seconds on the CPU; kernels interpreted"),
    _preset("tiny-olmoe", "olmoe", "any", ffn=32, experts=8, top_k=2, **_TINY),
    _preset("tiny-qwen3-moe", "qwen3-moe", "any", ffn=32, experts=8, top_k=3, **_TINY),
    _preset("llama", "llama", "cuda", kv_heads=4, ffn=2816, batch=4, **_REAL,
            note="8 layers d1024, GQA 16:4, 4x1024 tokens"),
    _preset("olmoe", "olmoe", "cuda", kv_heads=16, ffn=512, experts=64, top_k=8, batch=4, **_REAL,
            note="8 layers d1024, 64 experts top-8, ffn 512, 4x1024 tokens"),
    _preset("olmoe-16k", "olmoe", "cuda", kv_heads=16, ffn=512, experts=64, top_k=8, batch=16, **_REAL,
            note="the same OLMoE at 16x1024 tokens"),
    _preset("qwen3-moe", "qwen3-moe", "cuda", kv_heads=4, ffn=384, experts=128, top_k=8, batch=4, **_REAL,
            note="8 layers d1024, 128 experts top-8, ffn 384, 4x1024 tokens"),
    # the models' layers at their real widths (moe-bwd's olmoe, qwen3-30b-a3b, mixtral presets),
    # on request: one parity step (a float64 truth of the whole model beside its bf16 runs). As
    # many layers as fit one 80 GB card with the three contenders timed there (tests hold it)
    _preset("olmoe-wide", "olmoe", "cuda", layers=4, hidden=2048, heads=16, kv_heads=16, ffn=1024, experts=64,
            top_k=8, **_WIDE, note="4 layers d2048, 64 experts top-8, ffn 1024, 4x2048 tokens"),
    _preset("qwen3-moe-wide", "qwen3-moe", "cuda", layers=3, hidden=2048, heads=32, kv_heads=4, ffn=768,
            experts=128, top_k=8, **_WIDE, note="3 layers d2048, 128 experts top-8, ffn 768, 4x2048 tokens"),
    _preset("mixtral-wide", "mixtral", "cuda", layers=1, hidden=4096, heads=32, kv_heads=8, ffn=14336, experts=8,
            top_k=2, **{**_WIDE, "batch": 2, "vocab": 32000},
            note="1 layer d4096, 8 experts top-2, ffn 14336, 2x2048 tokens"),
)

GATE = Gate(
    name="train-step",
    summary="Whole training steps of transformers models with the arms switched on, eager and compiled",
    arm_name="suite.integrations.transformers",
    needs_cuda=False,
    presets=PRESETS,
    make_buffers=make_buffers,
    buffer_params=buffer_params,
    required_buffers=("ids",),
    reference=reference,
    arm=arm,
    truth=truth,
    parity=Tolerance(k=2.0, floor=1e-6),
    # an expert's weight-gradient row sums over the few tokens routed to it, which can cancel to
    # near zero: such a row is judged against a tenth of the tensor's RMS row norm (row_floor)
    parity_by_output={**{f"{name}/*": Bitwise() for name in CAPTURED},
                      "*/grad/*": Tolerance(k=2.0, floor=1e-6, row_floor=0.1)},
    saboteurs=SABOTEURS,
    contenders=CONTENDERS,
    benches=BENCHES,
    # the other arms' verdicts are the recommendation table's: they are switched on by hand
    criteria=(NotSlowerThan("stock"),),
    nondeterministic="a model's own CUDA ops (embedding and attention backward, grouped_mm) may use atomics",
    missing=missing,
)
