"""moe-bwd's block (gates/moe_block.py) on the CPU: parity judges the block a user runs beside the
experts, its float64 truth is transformers' own block in float64 on the choices stock made, and
a router that no longer scores as that truth assumes is refused rather than judged against."""

import pytest
import torch

pytest.importorskip("transformers", minversion="5")

import gatecheck  # noqa: E402
import gates  # noqa: E402
import gates.moe_block as moe_block  # noqa: E402

GATE = gates.get("moe-bwd")


@pytest.fixture(scope="module")
def judged():
    return gatecheck.judge_setup(GATE, "tiny-model-layout")


def test_parity_judges_the_blocks_output_and_every_gradient_router_included(judged):
    result, outputs = gatecheck.arm_result(GATE, judged)
    checks = {t.name: t for t in result.tensors}
    for name in moe_block.BLOCK_OUTPUTS:
        assert checks[name].mode == "tolerance" and checks[name].passed
    preset, buffers, _ = judged
    p = preset.params
    assert outputs["block_drouter"].shape == (p["experts"], p["hidden"])
    assert outputs["block_dgate_up"].shape == (p["experts"], 2 * p["ffn"], p["hidden"])
    assert outputs["block_ddown"].shape == (p["experts"], p["hidden"], p["ffn"])
    assert outputs["block_drouter"].abs().sum() > 0  # the router learns through the experts


def _block_in_float64(preset, buffers, norm_topk_prob=None):
    """transformers' block itself in float64 with its eager experts: BLOCK_OUTPUTS by autograd."""
    wide = [torch.nn.Parameter(p.detach().double()) for p in moe_block._parameters(buffers, preset)]
    block = moe_block.make_block(preset, buffers, "eager", parameters=wide)
    if norm_topk_prob is not None:
        block.gate.norm_topk_prob = norm_topk_prob
    return moe_block._forward_backward(block, buffers["x"].double(), buffers["grad_out"].double())


@pytest.mark.parametrize("renormalised", [False, True])
def test_the_truth_is_transformers_block_in_float64(judged, monkeypatch, renormalised):
    preset, buffers, _ = judged
    if renormalised:  # Qwen3's and Mixtral's routers renormalise the top-k probabilities
        make = moe_block.make_block

        def renormalising(*args, **kwargs):
            block = make(*args, **kwargs)
            block.gate.norm_topk_prob = True
            return block

        monkeypatch.setattr(moe_block, "make_block", renormalising)
    truth = moe_block.block_truth(buffers, preset)
    # transformers' router takes its softmax in fp32 even in a float64 model; the truth's is float64
    softmax = torch.nn.functional.softmax
    monkeypatch.setattr(torch.nn.functional, "softmax", lambda t, dim=None, dtype=None: softmax(t, dim=dim))
    autograd = _block_in_float64(preset, buffers, norm_topk_prob=renormalised)
    for name in moe_block.BLOCK_OUTPUTS:
        assert truth[name].dtype == torch.float64
        torch.testing.assert_close(truth[name], autograd[name], rtol=1e-10, atol=1e-13)


def _router_in_float64(judged):
    """(x, a stand-in for the block's router with its weight in float64, OLMoE's scoring, its logits)."""
    preset, buffers, _ = judged
    router = torch.nn.Module()
    router.weight = torch.nn.Parameter(moe_block.make_block(preset, buffers, "grouped_mm").gate.weight.detach().double())
    router.norm_topk_prob = False
    x = buffers["x"].double()
    return x, router, x @ router.weight.T


def test_the_truth_keeps_the_experts_stock_chose(judged):
    # a near-tie the working dtype broke the other way: the truth scores stock's choice, in float64
    preset = judged[0]
    x, router, logits = _router_in_float64(judged)
    own = torch.topk(torch.softmax(logits, -1), preset.params["top_k"], dim=-1).indices
    chosen = own.clone()
    chosen[0] = own[0].flip(0)  # the same experts in the other order: scores must follow
    chosen[1, 0] = next(e for e in range(preset.params["experts"]) if e not in own[1])
    _, scores, indices = moe_block._choosing(chosen, router, (x,), (logits, torch.softmax(logits, -1).gather(1, own), own))
    assert torch.equal(indices, chosen)
    torch.testing.assert_close(scores, torch.softmax(logits, -1).gather(1, chosen))


def test_a_router_that_scores_otherwise_is_refused(judged):
    x, router, logits = _router_in_float64(judged)
    top = torch.topk(torch.softmax(logits, -1), judged[0].params["top_k"], dim=-1)
    with pytest.raises(RuntimeError, match="no longer scores its top-k as softmax probabilities"):
        moe_block._choosing(top.indices, router, (x,), (logits, torch.sigmoid(top.values), top.indices))


def test_a_router_cut_off_from_the_experts_is_caught(judged):
    saboteur = next(s for s in GATE.saboteurs if s.name == "block-router-detached")
    result, outputs = gatecheck.sabotaged_result(GATE, judged, saboteur)
    assert not outputs["block_drouter"].any()
    assert any(f.message.startswith("block_drouter") for f in result.failures)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["tiny", "tiny-model-layout"])
def test_on_the_gpu_the_block_is_judged_in_fp32_where_the_tiny_presets_run(name):
    # torch documents its grouped GEMM for bf16: stock's block must still take the tiny presets'
    # fp32 there (the saboteurs' preset on a GPU), or the gate could not judge the block at all
    judged = gatecheck.judge_setup(GATE, name, device="cuda")
    result, _ = gatecheck.arm_result(GATE, judged)
    assert set(moe_block.BLOCK_OUTPUTS) <= {t.name for t in result.tensors}
