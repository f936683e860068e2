"""suite.integrations.transformers where a user's model is not the one it was written for
(issue 61): experts stored [E, in, out] under Muon. Tiny models, random init, on the CPU."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

from bitwise import assert_bitwise  # noqa: E402
from hfmodels import tiny  # noqa: E402
from suite.arms import moe  # noqa: E402
from suite.arms.muon import Muon  # noqa: E402
from suite.integrations import transformers as hf  # noqa: E402


# ---- Muon on experts, whatever their storage ----


def tiny_experts(family: str) -> tuple[torch.nn.Module, tuple[str, ...]]:
    """One experts module and the names of its 3-D weights: gpt-oss's [E, d, 2f] alternating and
    [E, f, d] (is_transposed), OLMoE's [E, 2f, d] and [E, d, f], the suite's MoEExperts [E, in, out]."""
    if family == "gpt-oss":
        config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           num_key_value_heads=2, head_dim=8, intermediate_size=24,
                                           num_local_experts=4, num_experts_per_tok=2)
        torch.manual_seed(0)
        return transformers.GptOssForCausalLM(config).model.layers[0].mlp.experts, ("gate_up_proj", "down_proj")
    if family == "olmoe":
        return tiny("olmoe").model.layers[0].mlp.experts, ("gate_up_proj", "down_proj")
    torch.manual_seed(0)
    return moe.MoEExperts(8, 16, 4, 2), ("w_gate", "w_up", "w_down")


def as_linears(module: torch.nn.Module, weights: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """Each expert's matrices as torch.nn.Linear weights [out, in], grouped and ordered as
    muon_param_groups groups the stacks: gate and up of each expert in turn, then the downs
    (the suite's MoEExperts: its three stacks in one group)."""
    if isinstance(module, moe.MoEExperts):
        return [[m.mT.contiguous() for stack in weights for m in stack.unbind(0)]]
    gate, up, down = hf.layout_of(module).views(*weights)  # each [E, in, out]
    return [[m.mT.contiguous() for pair in zip(gate, up) for m in pair], [m.mT.contiguous() for m in down]]


@pytest.mark.parametrize("family", ["gpt-oss", "olmoe", "suite"])
def test_muon_steps_each_expert_as_a_separate_linear_whatever_the_storage(family):
    """experts="muon": a step of the stacks is, bit for bit, Muon's step of each expert's gate,
    up and down given as separate [out, in] matrices. Stored [E, in, out] (gpt-oss, MoEExperts),
    the spectral scale had read the storage's rows: off by sqrt(in / out)."""
    experts, names = tiny_experts(family)
    stacks = [getattr(experts, name) for name in names]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) for p in stacks]
    linears = [[m.requires_grad_() for m in group] for group in as_linears(experts, [p.detach() for p in stacks])]
    for group, group_grads in zip(linears, as_linears(experts, grads)):
        for m, grad in zip(group, group_grads):
            m.grad = grad
    for p, grad in zip(stacks, grads):
        p.grad = grad.clone()
    Muon(hf.muon_param_groups(torch.nn.ModuleDict({"experts": experts}), experts="muon", lr=0.02), lr=3e-4).step()
    Muon([{"params": group} for group in linears], lr=0.02).step()
    for got, want in zip(as_linears(experts, [p.detach() for p in stacks]), linears):
        for i, (g, w) in enumerate(zip(got, want)):
            assert_bitwise(g, w.detach(), f"{family}: matrix {i}")
