"""suite.integrations.transformers where a user's model is not the one it was written for
(issue 61): experts stored [E, in, out] under Muon, a float64 model, a norm whose instance
overrides its own code, a model with no norm it takes. Tiny models, random init, on the CPU."""

from __future__ import annotations

import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

from transformers.models.gemma.modeling_gemma import GemmaRMSNorm  # noqa: E402

from bitwise import assert_bitwise  # noqa: E402
from hfmodels import tiny  # noqa: E402
from suite.arms import moe, rmsnorm  # noqa: E402
from suite.arms.muon import Muon  # noqa: E402
from suite.integrations import transformers as hf  # noqa: E402


def loss_of(model, ids):
    return model(input_ids=ids, labels=ids).loss.detach()


IDS = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))


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


# ---- apply_rms_norm and the dtypes its kernels take ----


def test_auto_leaves_a_float64_models_norms_to_the_model(monkeypatch):
    """A float64 model is a debugging step: impl="auto" patches it and runs the model's own
    norms, before a cast and after one; float32 takes the kernels again (every forward had
    raised "x must be bfloat16, float16 or float32")."""
    stock = loss_of(tiny("llama").double(), IDS)
    model = tiny("llama").double()
    assert hf.apply_rms_norm(model) == 5
    assert torch.equal(loss_of(model, IDS), stock)
    cast_after = tiny("llama")
    assert hf.apply_rms_norm(cast_after) == 5
    assert torch.equal(loss_of(cast_after.double(), IDS), stock)
    calls = []
    monkeypatch.setattr(rmsnorm, "rms_norm", lambda x, *args, **kwargs: calls.append(x.dtype) or x)
    cast_after.float().model.norm(torch.randn(3, 32))
    assert calls == [torch.float32]


def test_fused_refuses_a_float64_model_and_leaves_it_as_it_was():
    model = tiny("llama").double()
    with pytest.raises(hf.IntegrationError, match=r"apply_rms_norm\(impl='fused'\): model\.layers\.0\.input_layernorm "
                                                  r"\(LlamaRMSNorm\) is torch\.float64.*impl='auto'.*left unchanged"):
        hf.apply_rms_norm(model, impl="fused")
    assert not any(hasattr(m, "_suite_rms_norm") for m in model.modules())
    cast_after = tiny("llama")
    hf.apply_rms_norm(cast_after, impl="fused")
    with pytest.raises(hf.IntegrationError, match=r"LlamaRMSNorm got torch\.float64.*impl='auto'"):
        loss_of(cast_after.double(), IDS)


# ---- apply_rms_norm and a norm's instance ----


class ShadowedRMSNorm(GemmaRMSNorm):
    """Gemma's norm, word for word, whose instance holds a _norm of its own: forward calls that."""

    def __init__(self, hidden_size: int, eps: float = 1e-6):
        super().__init__(hidden_size, eps)
        self._norm = lambda x: x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 0.5)


@pytest.mark.parametrize("attribute", ["_norm", "forward"])
def test_a_norm_whose_instance_overrides_its_code_is_refused(attribute):
    """The norm is known by its class's code, but the instance runs its own _norm (or forward,
    as accelerate's hooks set it): patched, it computed the class's code instead, without a
    word. Refused, naming the module and the attribute; nothing is patched."""
    model = tiny("gemma")
    if attribute == "_norm":
        model.model.layers[1].post_attention_layernorm = ShadowedRMSNorm(32)
    else:
        norm = model.model.layers[1].post_attention_layernorm
        norm.forward = lambda x: type(norm).forward(norm, x) * 2
    stock = loss_of(model, IDS)
    with pytest.raises(hf.IntegrationError, match=rf"apply_rms_norm: model\.layers\.1\.post_attention_layernorm "
                                                  rf"\(\w+RMSNorm\) holds its own {attribute}.*left unchanged"):
        hf.apply_rms_norm(model, impl="fused")
    assert not any(hasattr(m, "_suite_rms_norm") for m in model.modules())
    assert hf.rms_norm_rule(model.model.layers[1].post_attention_layernorm) is None  # capture passes it over too
    assert torch.equal(loss_of(model, IDS), stock)


def test_applying_twice_is_not_an_override():
    model = tiny("gemma")
    assert hf.apply_rms_norm(model, impl="fused") == hf.apply_rms_norm(model) == 5
    assert hf.restore_rms_norm(model) == 5


# ---- apply_rms_norm on a model with no norm it takes ----


def test_a_model_without_a_norm_it_takes_is_told_so():
    """Cohere's norm is a layer norm (it subtracts the mean): 0 norms patched, and a warning
    that names the norm classes seen and why each was not taken (it had returned 0 without a
    word); a class named RMSNorm whose code is none (HY-V4's rstd alone) is named too."""
    config = transformers.CohereConfig(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                       num_key_value_heads=2, intermediate_size=48, bos_token_id=1, eos_token_id=2)
    cohere = transformers.CohereForCausalLM(config)
    with pytest.warns(UserWarning, match=r"apply_rms_norm: CohereForCausalLM has no norm it takes, and was left as "
                                         r"it was: CohereLayerNorm is not named \*RMSNorm"):
        assert hf.apply_rms_norm(cohere) == 0
    hy_v4 = pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4")
    with pytest.warns(UserWarning, match=r"HYV4UnweightedRMSNorm's code is none of a norm's"):
        assert hf.apply_rms_norm(torch.nn.Sequential(hy_v4.HYV4UnweightedRMSNorm(eps=1e-6))) == 0
    with pytest.warns(UserWarning, match=r"Linear has no norm module"):
        assert hf.apply_rms_norm(torch.nn.Linear(2, 2)) == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert hf.apply_rms_norm(tiny("llama")) == 5
