#!/usr/bin/env python3
"""Which transformers model families the integrations take, and whether they then give the
family's own numbers. For each model type whose modeling file has an experts class under
`@use_experts_implementation`: a tiny causal LM from its config (random init, fp32, no
download), its loss and every gradient with its own experts ("eager") against
`use_suite_experts`, and with its own norms against `apply_rms_norm(impl="fused")`, each
switched on alone; then its first experts module recorded by `suite.record.capture` and judged
by `suite gate moe-bwd --buffers`; and one Muon step over `muon_param_groups(model,
experts="muon")`, which must hold every parameter once, each expert weight in a Muon group, and
leave every parameter finite. Rerun it when transformers moves; docs/arms/moe.md says what
it found.

    TRITON_INTERPRET=1 python scripts/hf_family_probe.py [--family mixtral --family gpt_oss ...]

On a CPU the kernels run interpreted (minutes for every family). A multimodal family is
probed through its text model's causal LM, or its text model with a head (`TextLM`). A family
whose tiny model cannot be built from its config's defaults (and FAMILY_TINY), has no causal LM
or no experts at this size, is listed with why; one whose probe raises is listed as failed, and
the others still run. Writes
$OUT/hf_family_probe.json when OUT is set and prints a table last; exits 1 when a family the
integrations take gives numbers off its own (relative error over TOLERANCE plus twice the
family's own fp32 error against a float64 run), the gate fails on its recording, or the Muon
step fails.
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import os
import re
import tempfile
import types
from pathlib import Path

import torch
from tabulate import tabulate

# fp32: the kernels' sums run in another order than the family's own; beyond this, twice the
# family's own fp32 error against a float64 run of its step is allowed: where its own numbers
# are that far from float64, ours may be as far from its own
TOLERANCE = 1e-4
# One small shape for every family: each field is set where the family's config has it.
TINY = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
            head_dim=8, max_position_embeddings=64, intermediate_size=48, moe_intermediate_size=16, num_experts=4,
            n_routed_experts=4, num_local_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
            first_k_dense_replace=0, n_shared_experts=1, shared_expert_intermediate_size=16, decoder_sparse_step=1,
            mlp_only_layers=[], kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8,
            v_head_dim=8, pad_token_id=0)
# Where a family's defaults do not build at TINY's shape: fields its config's __init__ derives
# (set after it), a per-layer list or a switch its defaults leave unset or off.
FAMILY_TINY = {
    "diffusion_gemma": dict(enable_moe_block=True, top_k_experts=2, layer_types=["sliding_attention", "full_attention"]),
    "gemma4": dict(enable_moe_block=True, top_k_experts=2, layer_types=["sliding_attention", "full_attention"],
                   vocab_size_per_layer_input=64),  # Gemma 4's MoE (26B-A4B), its layer kinds cut to two
    "glm4v_moe": dict(rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.5,
                                           mrope_section=[1, 1, 0])),  # its rotary half of head_dim 8, in sections
    "granitemoehybrid": dict(mamba_n_heads=4, mamba_d_head=16, mamba_d_state=16, mamba_chunk_size=16),
    "lfm2_moe": dict(layer_types=["conv", "full_attention"], num_dense_layers=0),
    "longcat_flash": dict(num_layers=2, qk_head_dim=16, ffn_hidden_size=48, expert_ffn_hidden_size=16,
                          zero_expert_num=2, moe_topk=2),
    "mimo_v2_flash": dict(num_key_value_heads=2),  # its sliding layers double the kv heads
    "mistral4": dict(head_dim=16, qk_head_dim=16),  # its rope takes half of head_dim: qk_rope_head_dim
    "step3p7": dict(sliding_window=16),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--family", action="append", default=[],
                        help="a model type (e.g. mixtral, deepseek_v3); every one with experts when not given")
    return parser.parse_args(argv)


def families_with_experts() -> list[str]:
    """The model types whose modeling file declares an experts class for the experts interface."""
    import transformers

    models = Path(transformers.__file__).parent / "models"
    return sorted(path.parent.name for path in models.glob("*/modeling_*.py")
                  if re.search(r"^@use_experts_implementation", path.read_text(), re.M))


def build(family: str, last_layers: bool):
    """A tiny causal LM of `family` (seeded), or why there is none. last_layers: a per-layer
    list of the config (attention kinds, dense or sparse MLPs) cut to its last layers, every MLP
    sparse: for families whose first layers are dense, or whose lists must match the depth."""
    import transformers

    if family not in transformers.CONFIG_MAPPING:
        return None, "this transformers has no config for it"
    config = transformers.CONFIG_MAPPING[family]()
    config = getattr(config, "text_config", None) or config  # a multimodal family: its text model's
    depth, layers = getattr(config, "num_hidden_layers", None), TINY["num_hidden_layers"]
    for key, value in vars(config).copy().items():
        if last_layers and isinstance(value, list) and len(value) == depth:
            setattr(config, key, ["sparse"] * layers if key == "mlp_layer_types" else value[-layers:])
    for key, value in {**TINY, **FAMILY_TINY.get(family, {})}.items():
        try:
            if not hasattr(config, key):
                continue
            current = getattr(config, key)
            # a field that holds one value per kind (ERNIE-VL's experts' widths) takes it for each
            setattr(config, key, [value] * len(current) if isinstance(current, list) and not isinstance(value, list)
                    else value)
        except RuntimeError:  # a per-layer field of a heterogeneous config (Gemma 4's head_dim): as it is
            pass
    causal_lm = causal_lm_class(family, config)
    if causal_lm is None:
        return None, "no causal LM of its text model" if config.model_type != family else "no causal LM in the family"
    torch.manual_seed(0)
    try:
        return causal_lm(config).float(), None
    except Exception as error:  # noqa: BLE001 - a config whose defaults do not shrink: reported, not fatal
        return None, f"no tiny model from its config: {type(error).__name__}: {str(error)[:80]}"


def causal_lm_class(family: str, config):
    """The family's causal LM class: the one AutoModelForCausalLM maps its config to, else the
    one its modeling module defines (transformers' auto map lacks some, Mistral 4's), else a
    multimodal family's text model with a head (`TextLM`), else None."""
    import importlib

    import transformers

    mapping = transformers.MODEL_FOR_CAUSAL_LM_MAPPING
    if type(config) in mapping:
        return mapping[type(config)]
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    of_config = [(name, cls) for name, cls in vars(module).items()
                 if isinstance(cls, type) and getattr(cls, "config_class", None) is type(config)]
    causal_lm = next((cls for name, cls in of_config if name.endswith("ForCausalLM")), None)
    text_model = next((cls for name, cls in of_config if name.endswith("TextModel")), None)
    return causal_lm or (functools.partial(TextLM, text_model) if text_model is not None else None)


class TextLM(torch.nn.Module):
    """A multimodal family's text model with a linear head, where the family has no text causal
    LM (Qwen3-VL-MoE, GLM-4.5V, ...): next-token cross-entropy, as a causal LM's loss."""

    def __init__(self, text_model, config):
        super().__init__()
        self.config = config
        self.model = text_model(config)
        self.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def set_experts_implementation(self, name: str) -> None:
        self.model.set_experts_implementation(name)

    def forward(self, input_ids, labels, use_cache=False):
        logits = self.lm_head(self.model(input_ids=input_ids, use_cache=use_cache).last_hidden_state).float()
        loss = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten())
        return types.SimpleNamespace(loss=loss, logits=logits)


def tiny_step(family: str, device: torch.device, ids):
    """(model, its own loss and gradients, None) of the first tiny build that holds experts and
    whose own step runs, or (None, None, why not)."""
    from suite.integrations import transformers as hf

    why = None
    for last_layers in (False, True):
        model, reason = build(family, last_layers)
        if model is None or not any(hf.is_experts_module(m) for m in model.modules()):
            why = why or reason or "no experts module at this size"
            continue
        model = model.to(device)
        model.set_experts_implementation("eager")
        try:
            return model, loss_and_grads(model, ids), None
        except Exception as error:  # noqa: BLE001 - as build(): the family's own step fails at this size
            why = f"its own tiny step fails: {type(error).__name__}: {str(error)[:80]}"
    return None, None, why


def loss_and_grads(model, ids) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(0)  # the same draws each step where a family's router is noisy in training (PhiMoE's jitter)
    loss = model(input_ids=ids, labels=ids, use_cache=False).loss
    loss.backward()
    return loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters() if p.grad is not None}


# A gradient whose norm cancelled to below this fraction of the model's largest (DeepSeek-V4's
# router at init) is judged against that floor: its bits are the rounding of larger terms.
CANCELLED = 1e-6


def worst_error(stock, switched) -> float:
    """The largest relative error of the loss or any gradient (a cancelled one's against
    CANCELLED of the largest gradient); inf where a gradient went missing."""
    (stock_loss, stock_grads), (loss, grads) = stock, switched
    if grads.keys() != stock_grads.keys():
        return float("inf")
    norms = {n: g.double().norm() for n, g in stock_grads.items()}
    floor = CANCELLED * max(norms.values(), default=torch.tensor(0.0)).item()
    errors = [((loss - stock_loss).abs() / stock_loss.abs()).item()]
    errors += [((grads[n].double() - g.double()).norm() / norms[n].clamp_min(max(floor, 1e-30))).item()
               for n, g in stock_grads.items()]
    return max(errors)


def recorded_and_judged(model, ids, device: torch.device) -> str:
    """Gate moe-bwd's verdict on capture's recording of the model's first experts module (its
    own experts running), or why nothing was recorded."""
    from typer.testing import CliRunner

    from cli import app
    from suite.record import capture

    with tempfile.TemporaryDirectory() as tmp:
        with capture(model, f"{tmp}/rec", modules=("experts",)) as recording:
            loss_and_grads(model, ids)
        if not recording.saved:
            return next(iter(recording.skipped.values()), "not recorded: no experts module ran").split("; ")[0]
        result = CliRunner().invoke(app, ["gate", "moe-bwd", "--device", device.type, "--buffers",
                                          str(recording.saved[0]), "--no-sabotage", "--reports", f"{tmp}/reports"])
    return "passed" if result.exit_code == 0 else f"exit {result.exit_code}: {result.output.strip()[-100:]}"


def own_error(model, ids, stock) -> float | None:
    """The family's own fp32 step against a float64 run of it (worst_error's measure); None
    where the model does not run in float64."""
    try:
        truth = loss_and_grads(copy.deepcopy(model).double(), ids)
    except Exception:  # noqa: BLE001 - a family that will not run in float64: no allowance beyond TOLERANCE
        return None
    return worst_error(truth, stock)


def muon_stepped(model, ids) -> str:
    """One Muon step of a copy of the model over muon_param_groups(experts="muon"): "stepped (n
    expert weights)", or "failed: ..." where a parameter is missing, doubled, an expert weight is
    left to AdamW or a parameter turns non-finite."""
    from suite.arms.muon import Muon
    from suite.integrations import transformers as hf

    model = copy.deepcopy(model)
    groups = hf.muon_param_groups(model, experts="muon", lr=0.02)
    names = sorted(n for g in groups for n in g["param_names"])
    if names != sorted(n for n, p in model.named_parameters() if p.requires_grad):
        return "failed: the groups do not hold every trainable parameter once"
    experts = {id(p) for m in model.modules() if hf.is_experts_module(m) for p in m.parameters(recurse=False)
               if p.dim() == 3}
    in_muon = {id(p) for g in groups if g["use_muon"] for p in g["params"]}
    if not experts <= in_muon:
        return "failed: an expert weight is left to AdamW"
    optimizer = Muon(groups, lr=3e-4)
    loss_and_grads(model, ids)
    optimizer.step()
    if not all(p.isfinite().all() for p in model.parameters()):
        return "failed: a parameter turned non-finite"
    return f"stepped ({len(experts)} expert weights)"


def _row(family: str) -> dict:
    """A family's row before anything is known of it."""
    return dict(family=family, experts="", experts_error=None, norms="", norms_error=None, gate="", own_error=None,
                muon="")


def probe(family: str, device: torch.device) -> dict:
    """One family: each integration switched on alone, then off again, against the stock step."""
    from suite.integrations import transformers as hf

    row = _row(family)
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1)).to(device)
    model, stock, why = tiny_step(family, device, ids)
    if model is None:
        row["experts"] = why
        return row
    row["own_error"] = own_error(model, ids, stock)
    switches = (("experts", hf.use_suite_experts, lambda m: m.set_experts_implementation("eager")),
                ("norms", lambda m: hf.apply_rms_norm(m, impl="fused"), hf.restore_rms_norm))
    for part, switch_on, switch_off in switches:
        try:
            taken = switch_on(model)
        except hf.IntegrationError as refusal:  # its first clause, the module path or call left out
            reason = re.sub(r"^[\w.]+: ", "", str(refusal)).split("; ")[0]
            row[part] = "refused: " + reason.split(": its code")[0].split(" that ")[0]
            continue
        if not taken:
            row[part] = "none in the model"
            continue
        row[part] = f"taken ({taken})"
        row[f"{part}_error"] = worst_error(stock, loss_and_grads(model, ids))
        switch_off(model)
    row["gate"] = recorded_and_judged(model, ids, device)
    row["muon"] = muon_stepped(model, ids)
    return row


def probe_or_why(family: str, device: torch.device) -> dict:
    """probe(), or the family listed with the error that stopped it: one family's surprise
    never costs the run the others' rows."""
    try:
        return probe(family, device)
    except Exception as error:  # noqa: BLE001 - reported in the family's row, which counts as failed
        return {**_row(family), "experts": f"probe failed: {type(error).__name__}: {str(error)[:80]}",
                "gate": "exit -: the probe failed"}


def allowed(row: dict) -> float:
    """How far a family's numbers may lie from its own: TOLERANCE, plus twice its own error."""
    return TOLERANCE + 2 * (row["own_error"] or 0.0)


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    known = families_with_experts()
    unknown = sorted(set(args.family) - set(known))
    if unknown:
        print(f"hf_family_probe: {unknown} declare no experts class in this transformers; choose from {known}")
        return 2
    import transformers
    import transformers.utils.logging

    transformers.utils.logging.set_verbosity_error()
    rows = [probe_or_why(family, device) for family in args.family or known]
    errors = {row["family"]: [row[f"{part}_error"] for part in ("experts", "norms") if row[f"{part}_error"] is not None]
              for row in rows}
    off = [row["family"] for row in rows if any(error > allowed(row) for error in errors[row["family"]])]
    failed = [row["family"] for row in rows if row["gate"].startswith("exit")]
    muon_failed = [row["family"] for row in rows if row["muon"].startswith("failed")]
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], "hf_family_probe.json"), "w") as fh:
            json.dump(dict(transformers=transformers.__version__, torch=torch.__version__, device=str(device),
                           tolerance=TOLERANCE, rows=rows), fh, indent=2)
    print(f"transformers {transformers.__version__}, torch {torch.__version__}, fp32 on {device}; "
          f"error: the largest relative error of the loss or a gradient against the family's own; "
          f"own: the family's own against a float64 run")
    shown = lambda error: "" if error is None else f"{error:.1e}"  # noqa: E731
    print(tabulate([[r["family"], r["experts"], shown(r["experts_error"]), r["norms"], shown(r["norms_error"]),
                     shown(r["own_error"]), r["gate"], r["muon"]] for r in rows],
                   headers=["family", "use_suite_experts", "error", "apply_rms_norm", "error", "own",
                            "capture -> moe-bwd", "Muon on the experts"]))
    taken = sum(1 for found in errors.values() if found)
    print(f"{taken} of {len(rows)} families probed; " + (f"OFF their own numbers: {off}" if off else
                                                          f"every one within {TOLERANCE:g} + twice its own error")
          + (f"; the gate failed on the recording of {failed}" if failed else "")
          + (f"; the Muon step failed on {muon_failed}" if muon_failed else ""))
    return 1 if off or failed or muon_failed else 0


if __name__ == "__main__":
    raise SystemExit(main())
