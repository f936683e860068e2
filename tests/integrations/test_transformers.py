"""suite.integrations.transformers: the fused experts inside tiny transformers models (random
init, no download), against the model's own experts, on the CPU (kernels interpreted, fp32)
and on a GPU (bf16, and under torch.compile)."""

from __future__ import annotations

import sys

import pytest
import torch

transformers = pytest.importorskip("transformers", minversion="5")

from hfmodels import tiny  # noqa: E402
from modelparity import float64_truth, off_stocks_error  # noqa: E402
from weightcopies import WeightSizedOps, weight_sized_kernels  # noqa: E402
from suite.arms import moe  # noqa: E402
from suite.integrations import transformers as hf  # noqa: E402
from moepaths import PATHS, force_path  # noqa: E402

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.loss.detach(), {name: p.grad.detach().clone() for name, p in model.named_parameters()}


def rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@pytest.mark.parametrize("family", ["olmoe", "qwen3-moe", "mixtral", "deepseek-v3", "gemma4"])
def test_suite_experts_give_the_models_loss_and_gradients(family):
    model = tiny(family)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    truth = float64_truth(model, ids)
    stock = loss_and_grads(model, ids)
    assert hf.use_suite_experts(model) == 2
    assert model.config._experts_implementation == "suite"
    # the router's gradients too: they flow through the model's top-k
    assert not (problems := off_stocks_error(stock, loss_and_grads(model, ids), truth)), problems


@pytest.mark.parametrize("act", ["gelu_pytorch_tanh", "gelu_new", "torch-gelu-tanh"])
def test_experts_whose_act_fn_is_gelus_tanh_form_run_as_geglu(act):
    """Gemma 4's experts: act_fn(gate) * up with gelu's tanh form, in each form transformers or
    torch gives it; exact gelu is refused (the parametrized refusals above)."""
    from transformers.activations import ACT2FN

    model = tiny("olmoe")
    for layer in model.model.layers:
        layer.mlp.experts.act_fn = torch.nn.GELU(approximate="tanh") if act == "torch-gelu-tanh" else ACT2FN[act]
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    truth = float64_truth(model, ids)
    stock = loss_and_grads(model, ids)
    assert hf.use_suite_experts(model) == 2
    assert hf.glu_of(model.model.layers[0].mlp.experts, hf.GateRule(None, "gate", True)) == moe.GeGLU()
    assert not (problems := off_stocks_error(stock, loss_and_grads(model, ids), truth)), problems


def test_experts_whose_act_fn_is_torchs_silu_function_are_taken():
    """LFM2-MoE's experts hold F.silu itself, not a SiLU module: the same computation."""
    model = tiny("olmoe")
    for layer in model.model.layers:
        del layer.mlp.experts.act_fn  # a function in the SiLU module's place
        layer.mlp.experts.act_fn = torch.nn.functional.silu
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(1))
    truth = float64_truth(model, ids)
    stock = loss_and_grads(model, ids)
    assert hf.use_suite_experts(model) == 2
    assert not (problems := off_stocks_error(stock, loss_and_grads(model, ids), truth)), problems


@pytest.mark.parametrize("family", ["olmoe", "gemma4"])  # gemma4: GeGLU, its act_fn read in the traced call
def test_no_graph_break_under_torch_compile(family):
    model = tiny(family)
    hf.use_suite_experts(model)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(2))
    torch._dynamo.reset()
    try:
        explained = torch._dynamo.explain(model)(input_ids=ids)
    finally:
        torch._dynamo.reset()
    assert explained.graph_break_count == 0, explained.break_reasons


@pytest.mark.parametrize("family", ["olmoe", "qwen3-moe", "mixtral"])
def test_a_training_step_adds_no_weight_sized_work_besides_the_kernels(family, monkeypatch):
    """Through use_suite_experts the experts' gradients reach gate_up_proj and down_proj in
    their own layout: in a whole forward and backward of the model nothing but the kernels
    touches memory the size of an expert weight (the tiny models' other tensors are smaller)."""
    model = tiny(family)
    hf.use_suite_experts(model)
    experts = [m for m in model.modules() if hf.is_experts_module(m)]
    floor = min(p.numel() for m in experts for p in (m.gate_up_proj, m.down_proj))
    assert all(p.numel() < floor for name, p in model.named_parameters() if "experts" not in name)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(7))
    with WeightSizedOps(floor, monkeypatch) as watched:
        model(input_ids=ids, labels=ids).loss.backward()
    assert not watched.found
    for m in experts:
        assert m.gate_up_proj.grad.stride() == m.gate_up_proj.stride()


def _saved_for_backward(model, ids) -> int:
    """Bytes of the distinct storages a forward keeps for the backward, the parameters' aside:
    the activations a training step holds at its peak."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, labels=ids).loss.backward()
    return sum(kept.values())


@pytest.mark.parametrize("family", ["olmoe", "qwen3-moe", "mixtral"])
def test_a_models_step_keeps_no_more_for_its_backward_than_stock(family):
    """Issue 45's memory rule (peak at or below stock's) where it starts: switched on, the model
    keeps fewer activation bytes for its backward than with transformers' grouped_mm experts."""
    model = tiny(family)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(8))
    model.config._experts_implementation = "grouped_mm"
    stock = _saved_for_backward(model, ids)
    hf.use_suite_experts(model)
    assert _saved_for_backward(model, ids) < stock


@pytest.mark.parametrize("transposed", [False, True])
@pytest.mark.parametrize("concatenated", [True, False])
def test_the_weights_are_read_in_every_declared_layout(transposed, concatenated):
    """expert_weights' views against the layout spelled out: gate rows then up rows
    (concatenated) or alternating (interleaved), [E, 2f, d] or transposed [E, d, 2f]."""
    num_experts, d, f = 3, 5, 4
    gate, up = torch.randn(num_experts, f, d), torch.randn(num_experts, f, d)  # [E, out, in]
    rows = torch.cat([gate, up], 1) if concatenated else torch.stack([gate, up], 2).reshape(num_experts, 2 * f, d)
    down = torch.randn(num_experts, d, f)
    module = torch.nn.Module()
    module.is_transposed, module.is_concatenated = transposed, concatenated
    module.gate_up_proj = torch.nn.Parameter(rows.transpose(1, 2).contiguous() if transposed else rows)
    module.down_proj = torch.nn.Parameter(down.transpose(1, 2).contiguous() if transposed else down)
    w_gate, w_up, w_down = hf.expert_weights(module)
    assert torch.equal(w_gate, gate.transpose(1, 2)) and torch.equal(w_up, up.transpose(1, 2))
    assert torch.equal(w_down, down.transpose(1, 2))
    assert w_gate.untyped_storage().data_ptr() == module.gate_up_proj.untyped_storage().data_ptr()  # no copy


@pytest.mark.parametrize("flag, value, named", [
    ("has_bias", True, "has_bias=True"),
    ("has_gate", False, "has_gate=False"),
    ("has_post_expert_norm", True, "has_post_expert_norm=True"),
    ("act_fn", torch.nn.GELU(), "act_fn GELU"),
    ("act_fn", torch.nn.functional.gelu, "act_fn gelu"),
])
def test_an_experts_layout_the_kernels_cannot_take_is_refused_and_nothing_changes(flag, value, named):
    model = tiny("olmoe")
    before = model.config._experts_implementation
    experts = model.model.layers[1].mlp.experts
    if isinstance(getattr(experts, flag, None), torch.nn.Module) and not isinstance(value, torch.nn.Module):
        delattr(experts, flag)  # a function in a submodule's place
    setattr(experts, flag, value)
    with pytest.raises(hf.IntegrationError, match=named) as raised:
        hf.use_suite_experts(model)
    assert "model.layers.1.mlp.experts" in str(raised.value) and "left unchanged" in str(raised.value)
    assert model.config._experts_implementation == before


def test_a_model_without_experts_is_refused():
    with pytest.raises(hf.IntegrationError, match="LlamaForCausalLM has no experts module"):
        hf.use_suite_experts(tiny("llama"))


def test_missing_transformers_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    with pytest.raises(hf.IntegrationError, match=r"pip install 'suite\[hf\]'"):
        hf.register()


def test_register_is_idempotent():
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    hf.register()
    hf.register()
    assert ALL_EXPERTS_FUNCTIONS["suite"] is hf.suite_experts_forward


# ---- RMSNorm ----


@pytest.mark.parametrize("family, norms", [("llama", 5), ("olmoe", 9), ("gemma", 5), ("olmo2", 9), ("qwen3-moe", 9),
                                           ("deepseek-v3", 9), ("helium", 5), ("gemma4", 26)])
def test_apply_rms_norm_gives_the_models_loss_and_gradients_and_restore_its_bits(family, norms):
    """Llama's weight * x.to(dtype), OLMo2's (weight * x).to(dtype), Gemma's x * (1 + w),
    Helium's (weight.float() * x).to(dtype), Gemma 4's (4 of its 26 without a weight): each through the suite's kernels (impl="fused"; interpreted here), then the model's own again.
    DeepSeek-V3's norm is known by its code, a copy of Llama's under its own name."""
    model = tiny(family)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    truth = float64_truth(model, ids)
    stock_loss, stock = loss_and_grads(model, ids)
    assert hf.apply_rms_norm(model, impl="fused") == norms
    assert not (problems := off_stocks_error((stock_loss, stock), loss_and_grads(model, ids), truth)), problems
    assert hf.restore_rms_norm(model) == norms
    again_loss, again = loss_and_grads(model, ids)
    assert torch.equal(again_loss, stock_loss) and all(torch.equal(again[n], g) for n, g in stock.items())


def test_a_norm_of_torchs_own_rms_norm_in_fp32_rounds_once_as_the_kernels_do():
    """Ergo's norm, F.rms_norm on x and its fp32 weight in fp32 and then x's dtype: the kernels
    compute that in fp32 and round once, so bf16 outputs agree to an ulp of bf16."""
    ergo = pytest.importorskip("transformers.models.ergo.modeling_ergo")
    norm = ergo.ErgoRMSNorm(24, eps=1e-6)
    with torch.no_grad():
        norm.weight.copy_(torch.linspace(0.5, 1.5, 24))
    x = torch.randn(7, 24, generator=torch.Generator().manual_seed(2)).bfloat16().requires_grad_()
    want = norm(x)
    (want_dx,) = torch.autograd.grad(want, x, torch.ones_like(want))
    assert hf.rms_norm_rule(norm) is not None
    assert hf.apply_rms_norm(torch.nn.Sequential(norm), impl="fused") == 1
    got = norm(x)
    (got_dx,) = torch.autograd.grad(got, x, torch.ones_like(got))
    assert got.dtype == want.dtype == torch.bfloat16
    torch.testing.assert_close(got, want, rtol=2**-8, atol=0)
    torch.testing.assert_close(got_dx, want_dx, rtol=2**-7, atol=1e-2)


@pytest.mark.parametrize("family, name", [("deepseek_v4", "DeepseekV4UnweightedRMSNorm"),
                                          ("inkling2", "Inkling2UnweightedRMSNorm")])
def test_an_unweighted_norm_runs_at_scale_one_and_records_so(tmp_path, family, name):
    """DeepSeek-V4's and Inkling2's unweighted norms (x * rstd; Gemma 4's with_scale=False is the
    apply_rms_norm test above): the kernels at scale 1, and capture records a weight of ones
    for gate rmsnorm."""
    from suite.files.buffers import load_buffers
    from suite.record import capture

    modeling = pytest.importorskip(f"transformers.models.{family}.modeling_{family}")
    norm = getattr(modeling, name)(eps=1e-6)
    assert hf.rms_norm_rule(norm) is not None
    x = torch.randn(5, 24, requires_grad=True)
    want = norm(x)
    (want_dx,) = torch.autograd.grad(want, x, torch.ones_like(want))
    holder = torch.nn.Sequential(norm)
    assert hf.apply_rms_norm(holder, impl="fused") == 1
    got = norm(x)
    (got_dx,) = torch.autograd.grad(got, x, torch.ones_like(got))
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-4, atol=1e-6)
    with capture(holder, tmp_path / "rec", modules=("rms_norm",)) as recording:
        holder(x).sum().backward()
    buffers, manifest = load_buffers(recording.saved[0], expect_gate="rmsnorm")
    assert torch.equal(buffers["weight"], torch.ones(24)) and manifest.params["offset"] == 0.0


def test_a_class_named_like_a_norm_known_to_be_none_is_left_to_the_model():
    """HY-V4's "unweighted norm" returns rstd alone: apply_rms_norm passes it over (and its
    copies) and patches the norms beside it; the model is not refused for it."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    hy_v4 = pytest.importorskip("transformers.models.hy_v4.modeling_hy_v4")
    rstd_only = hy_v4.HYV4UnweightedRMSNorm(eps=1e-6)
    holder = torch.nn.ModuleList([LlamaRMSNorm(24), rstd_only])
    x = torch.randn(3, 24)
    want = rstd_only(x)
    assert hf.rms_norm_rule(rstd_only) is None and hf.apply_rms_norm(holder, impl="fused") == 1
    assert hasattr(holder[0], "_suite_rms_norm") and not hasattr(rstd_only, "_suite_rms_norm")
    assert torch.equal(rstd_only(x), want) and want.shape == (3, 1)


def test_a_gated_norm_keeps_its_gate_and_its_inner_norm_is_patched():
    """AXK2's gated norm, RMSNorm(x) * sigmoid(gate(RMSNorm(x))): a wrapper of a norm module.
    Its inner norm (Llama's code) runs the kernels; its gate stays the model's; it was refused
    whole, and the model with it."""
    axk2 = pytest.importorskip("transformers.models.axk2.modeling_axk2")
    gated = axk2.AXK2GatedRMSNorm(axk2.AXK2Config(hidden_size=24, gated_norm_rank=4))
    x = torch.randn(5, 24, requires_grad=True)
    want = gated(x)
    (want_dx,) = torch.autograd.grad(want.square().sum(), x)
    assert hf.apply_rms_norm(torch.nn.Sequential(gated), impl="fused") == 1
    assert hasattr(gated.norm, "_suite_rms_norm") and not hasattr(gated, "_suite_rms_norm")
    got = gated(x)
    (got_dx,) = torch.autograd.grad(got.square().sum(), x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_dx, want_dx, rtol=1e-5, atol=1e-6)


def test_a_patched_model_deepcopies_pickles_and_restores_like_a_stock_one(tmp_path):
    """An EMA or reference model is a deepcopy: its norms must use its own weights and send
    their gradients to its own parameters; torch.save and pickle must take the patched model;
    its state_dict is the stock one's; restore_rms_norm works on the copy and the reloaded one."""
    import copy
    import io

    model = tiny("llama")
    hf.apply_rms_norm(model, impl="fused")
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin.model.norm.weight.mul_(3.0)
    norm, twin_norm, x = model.model.norm, twin.model.norm, torch.randn(3, 32)
    torch.testing.assert_close(twin_norm(x), type(twin_norm).forward(twin_norm, x), rtol=1e-5, atol=1e-6)
    assert not torch.allclose(twin_norm(x), norm(x))  # the copy's weight, not the original's
    twin(input_ids=ids, labels=ids).loss.backward()
    assert twin.model.norm.weight.grad is not None and model.model.norm.weight.grad is None
    assert twin.state_dict().keys() == tiny("llama").state_dict().keys()

    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    with torch.no_grad():
        loaded.model.norm.weight.add_(1.0)
    loaded_norm = loaded.model.norm
    torch.testing.assert_close(loaded_norm(x), type(loaded_norm).forward(loaded_norm, x), rtol=1e-5, atol=1e-6)
    assert hf.restore_rms_norm(twin) == 5 and hf.restore_rms_norm(loaded) == 5
    assert "forward" not in vars(twin.model.norm) and "forward" not in vars(loaded.model.norm)
    assert hf.restore_rms_norm(model) == 5


def test_auto_leaves_the_norm_to_the_model_where_the_kernels_cannot_run_or_inductor_fuses_it(monkeypatch):
    from suite import triton_support
    from suite.arms import rmsnorm

    model = tiny("llama")
    norm = model.model.norm
    x = torch.randn(3, 32)
    hf.apply_rms_norm(model)  # impl="auto"
    calls = []
    monkeypatch.setattr(rmsnorm, "rms_norm", lambda *args, **kwargs: calls.append(kwargs) or args[0])
    norm(x)
    assert calls == [{"impl": "auto"}]
    monkeypatch.setattr(triton_support, "runs_on", lambda t: False)  # a CPU without Triton's interpreter
    assert torch.equal(norm(x), type(norm).forward(norm, x)) and len(calls) == 1
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: True)
    monkeypatch.setattr(triton_support, "runs_on", lambda t: True)
    assert torch.equal(norm(x), type(norm).forward(norm, x)) and len(calls) == 1


def _norm_class(tmp_path, name: str, edit=lambda source: source, header: str = ""):
    """LlamaRMSNorm's own source, written again as class `name` (after `edit`) into a module of
    its own beside modeling_llama's imports (then `header`): a copy another model might ship."""
    import importlib.util
    import inspect

    from transformers.models.llama import modeling_llama

    source = inspect.getsource(modeling_llama.LlamaRMSNorm).replace("class LlamaRMSNorm", f"class {name}")
    path = tmp_path / f"{name.lower()}.py"
    path.write_text("import torch\nfrom torch import nn\n"
                    "from transformers.models.llama.modeling_llama import use_kernel_forward_from_hub\n"
                    f"{header}\n\n{edit(source)}")
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, name)


def test_a_norm_is_known_by_its_code_not_its_name(tmp_path):
    """A class is known when forward and the methods it calls are a known class's code (names,
    docstrings, annotations aside) reading the same globals; one changed token, a global that
    is something else, or an overridden helper leaves it unknown, and the model unchanged."""
    import transformers.models.gemma.modeling_gemma as gemma

    norm = _norm_class(tmp_path, "CopiedRMSNorm")(32, eps=1e-5)
    assert hf.rms_norm_rule(norm) == hf.NormRule("variance_epsilon", 0.0, True)

    class GemmaChildRMSNorm(gemma.GemmaRMSNorm):  # inherits every method it runs
        pass

    class GemmaOwnNormRMSNorm(gemma.GemmaRMSNorm):
        def _norm(self, x):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 2 * self.eps)

    assert hf.rms_norm_rule(GemmaChildRMSNorm(32)) == hf.NormRule("eps", 1.0, False)
    twice_eps = _norm_class(tmp_path, "TwiceEpsRMSNorm",
                            lambda source: source.replace("+ self.variance_epsilon", "+ 2 * self.variance_epsilon"))
    other_torch = _norm_class(tmp_path, "OtherTorchRMSNorm", header="import types\ntorch = types.SimpleNamespace("
                              "float32=torch.float32, rsqrt=torch.rsqrt, Tensor=torch.Tensor, ones=torch.ones)")
    for unknown in (twice_eps(32), other_torch(32), GemmaOwnNormRMSNorm(32)):
        assert hf.rms_norm_rule(unknown) is None, type(unknown).__name__
    model = tiny("llama")
    model.model.layers[0].input_layernorm, model.model.norm = norm, twice_eps(32)
    with pytest.raises(hf.IntegrationError, match="TwiceEpsRMSNorm is not a norm this knows.*left unchanged"):
        hf.apply_rms_norm(model)
    assert not any(hasattr(m, "_suite_rms_norm") for m in model.modules())
    model.model.norm = _norm_class(tmp_path, "AnotherCopyRMSNorm")(32)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(4))
    truth = float64_truth(model, ids)
    stock = loss_and_grads(model, ids)
    assert hf.apply_rms_norm(model, impl="fused") == 5
    assert not (problems := off_stocks_error(stock, loss_and_grads(model, ids), truth)), problems


def test_an_exemplar_whose_code_is_an_earlier_ones_keeps_that_ones_rule(monkeypatch):
    """A model's norm can change between transformers versions (Nemotron-H's is Llama's in 5.17
    and Helium's in 5.25): an exemplar listed later whose code is an earlier one's computes the
    earlier one's rule, whatever rule it is listed with."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    llama = hf._EXEMPLARS[("llama", "LlamaRMSNorm")]
    monkeypatch.setattr(hf, "_EXEMPLARS", {**hf._EXEMPLARS,  # DeepSeek-V3's norm is a copy of Llama's
                                           ("deepseek_v3", "DeepseekV3RMSNorm"): hf.NormRule("eps", 1.0, False)})
    hf._exemplar_codes.cache_clear()
    try:
        assert hf.rms_norm_rule(LlamaRMSNorm(32)) == llama
    finally:
        hf._exemplar_codes.cache_clear()


def test_an_unknown_rms_norm_is_refused_and_nothing_is_patched():
    model = tiny("llama")

    class CustomRMSNorm(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(32))

        def forward(self, x):
            return x

    model.model.layers[1].input_layernorm = CustomRMSNorm()
    with pytest.raises(hf.IntegrationError, match="CustomRMSNorm is not a norm this knows.*left unchanged"):
        hf.apply_rms_norm(model)
    assert not any(hasattr(m, "_suite_rms_norm") for m in model.modules())
    with pytest.raises(ValueError, match="impl must be one of"):
        hf.apply_rms_norm(model, impl="eager")


# ---- Muon param groups ----


def test_muon_param_groups_route_as_olmo_core_and_split_fused_weights():
    from suite.arms.muon import Muon

    model = tiny("phi3")
    groups = hf.muon_param_groups(model, lr=0.02)
    by_kind = {(g["use_muon"], g.get("split_sizes"), g.get("weight_decay")): g["param_names"] for g in groups}
    assert by_kind[(False, None, 0.0)] == ["model.embed_tokens.weight"]
    assert by_kind[(True, (32, 16, 16), None)] == [f"model.layers.{i}.self_attn.qkv_proj.weight" for i in (0, 1)]
    assert by_kind[(True, (48, 48), None)] == [f"model.layers.{i}.mlp.gate_up_proj.weight" for i in (0, 1)]
    assert "lm_head.weight" in by_kind[(False, None, None)]
    assert all(g["lr"] == 0.02 for g in groups if g["use_muon"])
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())  # each once
    optimizer = Muon(groups, lr=3e-4)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()


def test_muon_param_groups_send_expert_weights_and_tied_embeddings_to_adamw():
    model = tiny("olmoe")
    groups = hf.muon_param_groups(model)
    adamw = next(g for g in groups if not g["use_muon"] and g.get("weight_decay") is None)
    assert "model.layers.0.mlp.experts.gate_up_proj" in adamw["param_names"]
    muon = [n for g in groups if g["use_muon"] for n in g["param_names"]]
    assert "model.layers.0.mlp.gate.weight" in muon and "model.layers.0.self_attn.q_proj.weight" in muon


def test_muon_param_groups_give_each_expert_its_own_muon_step_on_request():
    """experts="muon": each 3-D expert weight in a Muon group, gate_up_proj split into gate and
    up along each expert's rows ([E, 2f, d]); a step runs and every param is in one group."""
    from suite.arms.muon import Muon

    model = tiny("olmoe")
    groups = hf.muon_param_groups(model, experts="muon", lr=0.02)
    experts = {g["param_names"][0].rsplit(".", 1)[-1]: g for g in groups if g["use_muon"] and g["params"][0].dim() == 3}
    assert (experts["gate_up_proj"]["split_sizes"], experts["gate_up_proj"]["split_dim"]) == ((24, 24), 0)
    assert experts["gate_up_proj"]["param_names"] == [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in (0, 1)]
    assert experts["down_proj"].get("split_sizes") is None and experts["down_proj"]["lr"] == 0.02
    names = [n for g in groups for n in g["param_names"]]
    assert sorted(names) == sorted(n for n, _ in model.named_parameters())
    optimizer = Muon(groups, lr=3e-4)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, labels=ids).loss.backward()
    before = model.model.layers[0].mlp.experts.gate_up_proj.detach().clone()
    optimizer.step()
    assert "momentum_buffer" in optimizer.state[model.model.layers[0].mlp.experts.gate_up_proj]
    assert not torch.equal(before, model.model.layers[0].mlp.experts.gate_up_proj.detach())
    with pytest.raises(ValueError, match=r"experts must be one of \('adamw', 'muon'\), not 'Muon'"):
        hf.muon_param_groups(model, experts="Muon")


def test_muon_param_groups_take_the_suites_own_moe_layer_too():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), moe.MoEExperts(8, 16, 4, 2))
    groups = hf.muon_param_groups(model, experts="muon")
    stacks = next(g for g in groups if g["use_muon"] and g["params"][0].dim() == 3)
    assert stacks["param_names"] == ["1.w_gate", "1.w_up", "1.w_down"] and stacks.get("split_sizes") is None
    adamw = [n for g in hf.muon_param_groups(model) if not g["use_muon"] for n in g["param_names"]]
    assert {"1.w_gate", "1.w_up", "1.w_down"} <= set(adamw)


def test_muon_param_groups_split_a_transposed_gate_up_along_each_experts_columns():
    from transformers.integrations.moe import use_experts_implementation

    @use_experts_implementation(is_transposed=True)
    class TransposedExperts(torch.nn.Module):  # Aria's layout: gate_up [E, d, 2f], down [E, f, d]
        def __init__(self, config):
            super().__init__()
            self.config, self.num_experts = config, 3
            self.gate_up_proj = torch.nn.Parameter(torch.zeros(3, 8, 12))
            self.down_proj = torch.nn.Parameter(torch.zeros(3, 6, 8))

    experts = TransposedExperts(transformers.PretrainedConfig())
    groups = hf.muon_param_groups(torch.nn.ModuleDict({"experts": experts}), experts="muon")
    gate_up = next(g for g in groups if g["param_names"] == ["experts.gate_up_proj"])
    assert (gate_up["split_sizes"], gate_up["split_dim"]) == ((6, 6), 1)


def test_muon_param_groups_leave_expert_biases_to_adamw_and_split_an_interleaved_gate_up():
    """gpt-oss's expert biases are 2-D ([E, 2f]): AdamW's, never Muon's (they had been routed as
    hidden matrices); its gate_up [E, d, 2f] alternates gate and up columns, split so."""
    from suite.arms.muon import Muon

    config = transformers.GptOssConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                       num_key_value_heads=2, head_dim=8, intermediate_size=24, num_local_experts=4,
                                       num_experts_per_tok=2)
    model = transformers.GptOssForCausalLM(config)
    groups = hf.muon_param_groups(model)
    adamw = [n for g in groups if not g["use_muon"] for n in g["param_names"]]
    assert {"model.layers.0.mlp.experts.gate_up_proj_bias", "model.layers.0.mlp.experts.down_proj_bias"} <= set(adamw)
    groups = hf.muon_param_groups(model, experts="muon")
    gate_up = next(g for g in groups if g["param_names"] == ["model.layers.0.mlp.experts.gate_up_proj"])
    assert (gate_up["split_sizes"], gate_up["split_dim"], gate_up["split_interleaved"]) == ((24, 24), 1, True)
    optimizer = Muon(groups, lr=3e-4)
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(5))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    assert all(p.isfinite().all() for p in model.parameters())


# ---- on the GPU ----


def experts_outputs(module, implementation, dtype, x, top_k_index, top_k_weights, grad_out):
    """One experts module's output and gradients (x, the top-k weights, its two weights) in
    float64, on fixed inputs and a fixed top-k choice."""
    module.config._experts_implementation = implementation
    module.to(dtype)
    module.zero_grad(set_to_none=True)
    x, top_k_weights = x.to(dtype).requires_grad_(), top_k_weights.to(dtype).requires_grad_()
    out = module(x, top_k_index, top_k_weights)
    out.backward(grad_out.to(dtype))
    return [v.double() for v in (out.detach(), x.grad, top_k_weights.grad, module.gate_up_proj.grad,
                                 module.down_proj.grad)]


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("family", ["olmoe", "qwen3-moe", "gemma4"])
def test_on_the_gpu_bf16_within_stocks_error_and_compiled(family):
    """bf16 on a GPU, judged as the gates judge: one experts module on fixed inputs against its
    float64 self, each output's error at most twice transformers' grouped_mm's plus a floor.
    (Whole models are compared by loss alone: a bf16 rounding upstream can flip a token's
    top-k choice, and then its expert's gradient moves for either implementation.) Then the
    model under torch.compile(fullgraph=True), its loss beside eager's."""
    hf.register()
    model = tiny(family).cuda()
    module = next(m for m in model.modules() if hf.is_experts_module(m))
    top_k = getattr(model.config, "num_experts_per_tok", None) or model.config.top_k_experts  # Gemma 4's name
    gen = torch.Generator(device="cuda").manual_seed(3)
    num_tokens, d = 133, model.config.hidden_size
    x = torch.randn(num_tokens, d, generator=gen, device="cuda")
    top_k_weights, top_k_index = torch.topk(
        torch.softmax(torch.randn(num_tokens, module.num_experts, generator=gen, device="cuda"), -1), top_k)
    grad_out = torch.randn(num_tokens, d, generator=gen, device="cuda") * 1e-2
    inputs = (x, top_k_index, top_k_weights, grad_out)
    truth = experts_outputs(module, "eager", torch.float64, *inputs)
    stock = experts_outputs(module, "grouped_mm", torch.bfloat16, *inputs)
    suite = experts_outputs(module, "suite", torch.bfloat16, *inputs)
    for name, got, want, theirs in zip(("out", "dx", "dweights", "dgate_up", "ddown"), suite, truth, stock):
        assert rel(got, want) <= 2 * rel(theirs, want) + 1e-3, name

    model = model.bfloat16()
    ids = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(3)).cuda()
    model.set_experts_implementation("grouped_mm")
    stock_loss, _ = loss_and_grads(model, ids)
    hf.use_suite_experts(model)
    loss, _ = loss_and_grads(model, ids)
    torch._dynamo.reset()
    try:
        compiled_loss, _ = loss_and_grads(torch.compile(model, fullgraph=True), ids)
    finally:
        torch._dynamo.reset()
    torch.testing.assert_close(loss, stock_loss, rtol=1e-2, atol=0)
    torch.testing.assert_close(compiled_loss, loss, rtol=1e-2, atol=0)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("path", PATHS)
def test_on_the_gpu_a_blocks_backward_launches_no_elementwise_kernel_over_a_weight(path, monkeypatch):
    """OLMoE's own MoE block on the experts "suite" (bf16, each launch path): a profile of its
    forward and backward shows no aten op launching a kernel over a weight-sized tensor (a
    zero-fill, copy or add building gate_up_proj's gradient), GEMMs aside. The same block with
    its experts on the views of the weights (`experts`) is caught: the profile's teeth."""
    if path != "kernels" and torch.cuda.get_device_capability()[0] != 9:
        pytest.skip("TMA and grouped_mm's paths are taken on sm90 alone")
    from transformers.models.olmoe import modeling_olmoe

    hf.register()
    config = transformers.OlmoeConfig(hidden_size=512, intermediate_size=256, num_experts=16, num_experts_per_tok=4)
    config._experts_implementation = "suite"
    block = modeling_olmoe.OlmoeSparseMoeBlock(config).cuda().bfloat16().train()
    x = torch.randn(1, 512, 512, device="cuda", dtype=torch.bfloat16)
    floor = min(block.experts.gate_up_proj.numel(), block.experts.down_proj.numel())
    force_path(monkeypatch, path)

    def profiled() -> list[str]:
        for _ in range(2):  # the first compiles the kernels
            block.zero_grad(set_to_none=True)
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU,
                                                    torch.profiler.ProfilerActivity.CUDA], record_shapes=True) as prof:
                block(x.requires_grad_()).float().square().mean().backward()
                torch.cuda.synchronize()
        return weight_sized_kernels(prof, floor)

    assert profiled() == []
    assert block.experts.gate_up_proj.grad.stride() == block.experts.gate_up_proj.stride()

    def through_views(self, hidden_states, top_k_index, top_k_weights):
        routing = moe.routing_from_topk(top_k_index, top_k_weights, self.num_experts)
        return moe.experts(hidden_states, routing, *hf.expert_weights(self))

    monkeypatch.setattr(type(block.experts), "forward", through_views)
    assert profiled()


@pytest.mark.cuda
@needs_cuda
def test_rms_norm_on_the_gpu_eager_and_under_compile():
    """bf16 Llama: impl="auto" eager within bf16's rounding of stock; under torch.compile "auto"
    hands the norm back to the model, so the compiled step is stock's, bit for bit."""
    model = tiny("llama").cuda().bfloat16()
    ids = torch.randint(0, 64, (4, 33), generator=torch.Generator().manual_seed(6)).cuda()
    stock_loss, stock = loss_and_grads(model, ids)

    def compiled_loss():
        torch._dynamo.reset()
        try:
            model.zero_grad(set_to_none=True)
            out = torch.compile(model, fullgraph=True)(input_ids=ids, labels=ids)
            out.loss.backward()
            return out.loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        finally:
            torch._dynamo.reset()

    stock_compiled = compiled_loss()
    hf.apply_rms_norm(model)
    loss, grads = loss_and_grads(model, ids)
    torch.testing.assert_close(loss, stock_loss, rtol=2e-2, atol=0)
    for name, grad in stock.items():
        assert rel(grads[name], grad) < 3e-2, name
    auto_loss, auto_grads = compiled_loss()
    assert torch.equal(auto_loss, stock_compiled[0])
    assert all(torch.equal(auto_grads[n], g) for n, g in stock_compiled[1].items())


# ---- clamped SwiGLU experts ----


def _tiny_with_experts(probe, family):
    """The probe's tiny build of `family` that holds experts modules, or a skip."""
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"transformers {transformers.__version__} has no {family}")
    for last_layers in (False, True):
        model, _ = probe.build(family, last_layers)
        if model is not None and any(hf.is_experts_module(m) for m in model.modules()):
            return model
    pytest.skip(f"no tiny {family} with experts")


@pytest.mark.parametrize("family, limit_attr", [("deepseek_v4", "limit"), ("hy_v4", "swiglu_limit"),
                                                ("bailing_hybrid", "limit")])
def test_a_clamped_swiglu_gives_the_models_loss_and_gradients(family, limit_attr):
    """DeepSeek-V4's and HY-V4's gate clamped before silu, Bailing's (Step-3's code) after it, at a
    limit that bites at init (the tiny models' pre-activations reach 0.4)."""
    from scriptload import load_script

    probe = load_script("hf_family_probe")
    model = _tiny_with_experts(probe, family)
    experts = [m for m in model.modules() if hf.is_experts_module(m)]
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model.set_experts_implementation("eager")
    unclamped = probe.loss_and_grads(model, ids)
    for module in experts:
        setattr(module, limit_attr, 0.02)
    truth = float64_truth(model, ids)
    stock = probe.loss_and_grads(model, ids)
    assert probe.worst_error(unclamped, stock) > 1e-3  # the clamp changes the model's numbers
    assert hf.use_suite_experts(model) == len(experts)
    assert {hf.glu_of(m, m._suite_gate_rule).limit for m in experts} == {0.02}
    assert not (problems := off_stocks_error(stock, probe.loss_and_grads(model, ids), truth)), problems


def test_a_gate_is_known_by_its_code_and_a_changed_one_refused():
    deepseek_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")

    class CopiedExperts(deepseek_v4.DeepseekV4Experts):
        def _apply_gate(self, gate_up: torch.Tensor) -> torch.Tensor:
            """Another model's copy, its comments and docstring its own."""
            gate, up = gate_up.chunk(2, dim=-1)
            gate = gate.clamp(max=self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return self.act_fn(gate) * up

    class TwiceLimitExperts(deepseek_v4.DeepseekV4Experts):
        def _apply_gate(self, gate_up):
            gate, up = gate_up.chunk(2, dim=-1)
            gate = gate.clamp(max=2 * self.limit)
            up = up.clamp(min=-self.limit, max=self.limit)
            return self.act_fn(gate) * up

    hf.register()
    config = deepseek_v4.DeepseekV4Config(hidden_size=16, intermediate_size=8, num_local_experts=2)
    assert hf.gate_rule(CopiedExperts(config)) == hf.GateRule("limit", "gate", True)
    assert hf.gate_rule(TwiceLimitExperts(config)) is None
    assert "its code is none this knows" in hf.experts_unsupported(TwiceLimitExperts(config))
    module = CopiedExperts(config)
    module.limit = -1.0
    assert "limit is -1.0: SwiGLU: limit must be finite and > 0" in hf.experts_unsupported(module)
    module.limit, module.act_fn = 7.0, torch.nn.GELU(approximate="tanh")
    assert "limit is 7.0: a clamped GeGLU is none the suite's experts compute" in hf.experts_unsupported(module)
