"""Gate train-step on the CPU: whole training steps of tiny transformers models (Triton kernels
interpreted, fp32) with the arms switched on, against stock; its saboteurs; the bench's build of
a step. On a GPU: the compiled steps without graph breaks, and the captured optimizers' bits."""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

import gates.train_step as ts  # noqa: E402
from gatecheck import judge_setup, sabotaged_result  # noqa: E402
from suite.harness import parity  # noqa: E402
from suite.harness.gate import BenchCase  # noqa: E402

GATE = ts.GATE


def arm_result(gate, judged):
    """The arm judged once, as the runner judges this gate (declared nondeterministic on CUDA:
    no second run)."""
    preset, buffers, expected = judged
    result, outputs = parity.judge_arm(gate, preset, buffers, expected, nondeterministic=gate.nondeterministic)
    assert result.passed, result.failures
    assert result.inputs_unchanged
    return result, outputs


def _saboteur(name: str):
    return next(s for s in GATE.saboteurs if s.name == name)


@pytest.fixture(scope="module")
def olmoe():
    return judge_setup(GATE, "tiny-olmoe")


def test_dense_model_passes_and_a_norm_without_weight_gradient_is_caught():
    judged = judge_setup(GATE, "tiny-llama")
    result, outputs = arm_result(GATE, judged)
    assert {name.split("/")[0] for name in outputs} == {"all arms"}  # the CPU: every kernel arm together
    assert outputs["all arms/loss"].shape == (3, 2 * 15)  # per step, each token's loss (batch 2, seq 16)
    sabotaged_result(GATE, judged, _saboteur("norm-weight-frozen"))


def test_moe_model_passes_and_experts_without_their_weights_are_caught(olmoe):
    result, outputs = arm_result(GATE, olmoe)
    assert "all arms/grad/model.layers.1.mlp.experts.gate_up_proj" in outputs
    # the model's own router still learns: its weight gets a gradient through routing_from_topk
    assert outputs["all arms/grad/model.layers.0.mlp.gate.weight"].abs().sum() > 0
    sabotaged_result(GATE, olmoe, _saboteur("experts-unweighted"))


def test_qwen3_moe_with_renormalised_top_k_passes():
    arm_result(GATE, judge_setup(GATE, "tiny-qwen3-moe"))


def test_the_truth_is_stock_in_float64_with_eager_experts(olmoe):
    preset, buffers, expected = olmoe
    model = ts.build_model(preset, buffers, torch.float64, experts="eager")
    assert model.config._experts_implementation == "eager"
    assert all(p.dtype == torch.float64 for p in model.parameters())
    # the reference's and the truth's first losses agree to fp32 rounding: same weights, same batch
    ref, truth = expected.reference["all arms/loss"], expected.truth["all arms/loss"]
    assert truth.dtype == torch.float64 and torch.allclose(ref.double(), truth, rtol=1e-5)


def test_the_truths_loss_is_transformers_loss_in_the_models_precision(olmoe):
    preset, buffers, _ = olmoe
    model = ts.build_model(preset, buffers, torch.float32)
    batch = buffers["ids"][0]
    assert torch.allclose(ts.next_token_losses(model, batch).mean(), model(input_ids=batch, labels=batch).loss,
                          rtol=1e-6)
    wide = ts.build_model(preset, buffers, torch.float64, experts="eager")
    assert ts.next_token_losses(wide, batch).dtype == torch.float64


def test_a_bench_build_runs_its_warm_steps_and_each_call_is_one_step():
    # tiny-olmoe's model on one short sequence: five interpreted steps, each as few rows as will do
    tiny = GATE.preset("tiny-olmoe")
    preset = dataclasses.replace(tiny, params={**tiny.params, "batch": 1, "seq": 8})
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    case = BenchCase("step", "one step", bytes=lambda p: 0)
    step = ts._build("all arms")(case, buffers, preset)
    model = step.model
    assert model.config._experts_implementation == "suite"
    norms = [m for m in model.modules() if type(m).__name__.endswith("RMSNorm")]
    assert len(norms) == 2 * 4 + 1 and all(hasattr(m, "_suite_rms_norm") for m in norms)  # q, k, attn, mlp; final
    before = [p.detach().clone() for p in model.parameters()]
    loss = step()
    assert torch.isfinite(loss)
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))  # the optimizer stepped
    assert step.note == ""  # eager: nothing compiled


def test_experts_on_a_dense_model_say_so():
    preset = GATE.preset("tiny-llama")
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    case = BenchCase("step", "one step", bytes=lambda p: 0)
    with pytest.raises(Exception, match="no experts module"):
        ts._build("experts")(case, buffers, preset)


def test_the_muon_experts_peer_steps_each_expert_by_muon_and_a_dense_model_has_none():
    tiny = GATE.preset("tiny-olmoe")
    preset = dataclasses.replace(tiny, params={**tiny.params, "batch": 1, "seq": 8})
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    case = BenchCase("step", "one step", bytes=lambda p: 0)
    step = ts._build("muon experts")(case, buffers, preset)  # its warm steps ran
    experts = [p for m in step.model.modules() if type(m).__name__.endswith("Experts") for p in m.parameters()]
    assert experts and all("momentum_buffer" in step.optimizer.state[p] for p in experts)
    dense = GATE.preset("tiny-llama")
    with pytest.raises(Exception, match="a dense model has no expert weights to give Muon"):
        ts._build("muon experts")(case, GATE.make_buffers(dense, 0, torch.device("cpu")), dense)


def test_presets_declare_what_the_issue_names():
    names = {p.name: p for p in GATE.presets}
    assert {"llama", "olmoe", "olmoe-16k", "qwen3-moe"} <= set(names)
    assert names["olmoe-16k"].params["batch"] * names["olmoe-16k"].params["seq"] == 16 * 1024
    assert names["qwen3-moe"].params["experts"] == 128 and names["qwen3-moe"].params["ffn"] == 384
    # the real models run by `suite bench train-step`, not by `suite run` (minutes of compiling)
    assert all(not p.in_all for p in GATE.presets if p.where == "cuda")
    assert {c.name for c in GATE.contenders} == set(ts.SETUPS)


def test_the_wide_presets_are_the_moe_bwd_layers_and_fit_beside_their_three_contenders():
    """olmoe-wide, qwen3-moe-wide and mixtral-wide run moe-bwd's model layers (d, f, E, k) as whole
    models: on request, one parity step, stock, rms_norm and experts timed; their stated need
    within an H100's 80 GB (79.2 GiB free on a fresh one; mixtral-wide once asked 96 GiB) and above
    the three models' weights, gradients and AdamW state."""
    import gates

    moe = gates.get("moe-bwd")
    step = next(case for case in GATE.benches if case.name == "step")
    for name, layer in (("olmoe-wide", "olmoe"), ("qwen3-moe-wide", "qwen3-30b-a3b"), ("mixtral-wide", "mixtral")):
        p, q = GATE.preset(name).params, moe.preset(layer).params
        assert (p["hidden"], p["ffn"], p["experts"], p["top_k"]) == (q["hidden"], q["ffn"], q["experts"], q["top_k"])
        assert p["steps"] == 1 and not GATE.preset(name).standard
        assert [c.name for c in GATE.contenders_for(step, GATE.preset(name))] == ["stock", "rms_norm", "experts"]
        assert 3 * 8 * ts._params(p) < GATE.preset(name).memory_bytes < 79 * 2**30, name
    assert len(GATE.contenders_for(step, GATE.preset("olmoe"))) == len(GATE.contenders)


def test_a_mixtral_step_runs_with_its_experts_switched_on():
    """The mixtral family builds from a preset's params (transformers' Mixtral) and its experts
    take the suite's kernels, with gradients in the parameters' own layout."""
    tiny = dict(ts._TINY, family="mixtral", ffn=32, experts=4, top_k=2, parity_batch=1)
    preset = ts.Preset("tiny-mixtral", tiny, where="any")
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    model = ts.prepare(ts.SETUPS["experts"], preset, buffers)
    assert type(model).__name__ == "MixtralForCausalLM" and model.config._experts_implementation == "suite"
    run = ts.train(model, torch.optim.SGD(model.parameters(), lr=0.0), buffers["ids"][:1, :1])
    assert torch.isfinite(run["loss"]).all() and run["params"] is None
    experts = model.model.layers[0].mlp.experts
    assert run["grads"]["model.layers.0.mlp.experts.gate_up_proj"].stride() == experts.gate_up_proj.stride()


def test_a_run_without_final_params_takes_no_step_after_its_last_batch():
    """One step's loss and gradients need no optimizer step: a one-step truth then holds no
    AdamW state (the wide presets' float64 model); with final_params every batch steps."""
    preset = GATE.preset("tiny-llama")
    buffers = GATE.make_buffers(preset, 0, torch.device("cpu"))
    calls = []
    for batches, final_params, steps in ((1, False, 0), (1, True, 1), (3, False, 2), (3, True, 3)):
        model = ts.build_model(preset, buffers, torch.float32)
        optimizer = torch.optim.AdamW(model.parameters())
        optimizer.register_step_post_hook(lambda *args: calls.append(1))
        calls.clear()
        run = ts.train(model, optimizer, buffers["ids"][:batches, :1], final_params)
        assert len(calls) == steps and run["loss"].shape[0] == batches
        assert (run["params"] is not None) == final_params
        assert bool(optimizer.state) == bool(steps)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_compiled_steps_have_no_graph_break_and_captured_optimizers_keep_bits():
    preset = GATE.preset("tiny-olmoe")
    buffers = GATE.make_buffers(preset, 0, torch.device("cuda"))
    case = BenchCase("step-compiled", "one step", bytes=lambda p: 0)
    torch._dynamo.reset()
    for name in ("stock", "rms_norm", "experts", "all arms"):
        step = ts._build(name)(case, buffers, preset)
        assert "0 graph break(s)" in step.note or "reused" in step.note, (name, step.note)
        assert torch.isfinite(step())
    judged = judge_setup(GATE, "tiny-olmoe", device="cuda")
    preset, buffers, expected = judged
    from suite.harness import parity

    result, outputs = parity.judge_arm(GATE, preset, buffers, expected, nondeterministic=GATE.nondeterministic)
    assert result.passed, result.failures
    assert {"adamw captured/params", "muon captured/params"} <= set(outputs)


# ---- Liger-Kernel's fused MoE as the model's experts: a peer (the extra [peers]) ----


def test_the_liger_peer_is_timed_beside_stock_and_says_why_it_cannot_run(monkeypatch):
    import importlib.util

    peer = next(c for c in GATE.contenders if c.name == "liger experts")
    assert peer.role == "peer" and set(ts.WIDE) <= set(peer.skip_presets)  # a fourth wide model would not fit
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else found(name, *a))
    assert peer.unavailable(torch.device("cpu")) == "liger-kernel is not installed (pip install 'suite[peers]')"


def test_liger_experts_take_no_dense_model_nor_a_layout_they_cannot_read():
    from gates.liger import use_liger_experts
    from suite.integrations.transformers import IntegrationError

    case = BenchCase("step", "one step", bytes=lambda p: 0)
    dense = GATE.preset("tiny-llama")
    with pytest.raises(IntegrationError, match="no experts module"):
        ts._build("liger experts")(case, GATE.make_buffers(dense, 0, torch.device("cpu")), dense)
    preset = GATE.preset("tiny-olmoe")
    model = ts.build_model(preset, GATE.make_buffers(preset, 0, torch.device("cpu")), torch.float32)
    model.model.layers[1].mlp.experts.is_transposed = True  # LigerExperts reads [E, 2f, d] alone
    with pytest.raises(IntegrationError, match=r"layers\.1\.mlp\.experts: .*is_transposed=True"):
        use_liger_experts(model)
    assert model.config._experts_implementation != "liger"


def test_a_step_with_liger_experts_passes_the_gates_tolerance_rule(olmoe):
    """Where Liger runs (here interpreted, its autotuning pinned: gates/liger.py), the model with
    its experts on Liger's fused MoE gives each step's per-token losses and the first gradients
    within k x stock's own error against the float64 truth: judged as "all arms" is on the CPU."""
    pytest.importorskip("liger_kernel")
    preset, buffers, expected = olmoe
    setup = ts.SETUPS["liger experts"]
    assert ts.prepare(setup, preset, buffers).config._experts_implementation == "liger"

    def liger(buffers, preset):
        return ts._outputs("all arms", ts._run(setup, buffers, preset), bitwise=False)

    result, outputs = parity.judge_arm(GATE, preset, buffers, expected, arm=liger, nondeterministic="atomics")
    assert result.passed, result.failures
    assert outputs["all arms/grad/model.layers.0.mlp.gate.weight"].abs().sum() > 0  # the router learns through it
