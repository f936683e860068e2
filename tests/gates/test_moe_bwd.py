"""Gate `moe-bwd` on the CPU (kernels interpreted, fp32): the arm passes every tiny preset,
every saboteur is caught by the check it is meant to trip, and the closed-form truth is the
float64 autograd of the reference."""

import dataclasses

import pytest
import torch

import gatecheck
import gates
import gates.moe_block as moe_block
import gates.moe_bwd as moe_bwd
from suite.arms import moe
from suite.harness.runner import host_probed

GATE = gates.get("moe-bwd")
TINY = [p for p in GATE.presets if p.where == "any"]
CPU = torch.device("cpu")


@pytest.fixture(scope="module", params=[p.name for p in TINY])
def judged(request):
    return gatecheck.judge_setup(GATE, request.param)


def test_arm_passes(judged):
    result, _ = gatecheck.arm_result(GATE, judged)
    assert {t.name for t in result.tensors} == {
        "out", "dx", "dw_gate", "dw_up", "dw_down", "dprobs", "dlogits", "z_loss", "expert_ids", "offsets",
        "row_id_map", "source_of_row", "token_of_row", "routed_counts",
        *(moe_block.BLOCK_OUTPUTS if moe_block.block_judged(judged[0]) else ())}


def test_each_preset_is_the_case_it_names(judged):
    preset, buffers, _ = judged
    p = preset.params
    routing = moe.route(buffers["logits"], p["top_k"], capacity_factor=p["capacity_factor"])
    counts = routing.offsets.diff()
    if p["skew"] == "empty-expert":
        assert counts[1] == 0
    if p["skew"] == "one-expert":
        assert counts[0] == p["tokens"]
    assert bool(routing.num_dropped > 0) == (p["capacity_factor"] is not None)


@pytest.fixture(scope="module")
def judged_default():
    preset, = GATE.default_presets(CPU)
    return gatecheck.judge_setup(GATE, preset.name)


# on the default preset alone, where `suite run` places them all (the interpreter is slow)
@pytest.mark.parametrize("saboteur", GATE.saboteurs, ids=lambda s: s.name)
def test_every_saboteur_fails_the_gate(judged_default, saboteur):
    gatecheck.sabotaged_result(GATE, judged_default, saboteur)


def test_every_saboteur_shows_on_the_default_cpu_preset_the_smallest():
    default, = GATE.default_presets(CPU)
    assert all(s.applies(default) for s in GATE.saboteurs)
    assert GATE.runnable_presets(CPU)[0] is default


@pytest.mark.parametrize("name", ["tiny", "tiny-top8"])
def test_closed_form_truth_matches_float64_autograd(name):
    preset = GATE.preset(name)
    buffers = GATE.make_buffers(preset, 3, CPU)
    got = GATE.truth(buffers, preset)
    p = preset.params
    logits = buffers["logits"].double().requires_grad_()
    routing = moe.route(buffers["logits"], p["top_k"], capacity_factor=p["capacity_factor"])
    probs = torch.softmax(logits, -1).gather(1, routing.expert_ids.long())
    probs = probs / probs.sum(-1, keepdim=True)
    leaves = [buffers[n].double().requires_grad_() for n in ("x", "w_gate", "w_up", "w_down")]
    out = moe.experts_reference(leaves[0], dataclasses.replace(routing, probs=probs), *leaves[1:])
    z_loss = torch.logsumexp(logits, -1).square().mean()
    grads = torch.autograd.grad((out, z_loss), (*leaves, probs, logits),
                                (buffers["grad_out"].double(), torch.tensor(moe_bwd.Z_WEIGHT, dtype=torch.float64)))
    want = dict(zip(("dx", "dw_gate", "dw_up", "dw_down", "dprobs", "dlogits"), grads), out=out, z_loss=z_loss)
    assert set(got) == set(want) | (set(moe_block.BLOCK_OUTPUTS) if moe_block.block_judged(preset) else set())
    for key, value in want.items():  # the block's truth: tests/gates/test_moe_block.py
        torch.testing.assert_close(got[key], value, rtol=1e-10, atol=1e-14, msg=key)


# ---- the bench's contenders compute what the reference does (on the CPU, fp32) ----


def _assert_all_close(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def _in_reference_layout(got):
    """A gate|up contender's gradients (x, gate_up [E, 2f, d], down [E, d, f], probs) as the
    reference's (x, w_gate, w_up, w_down, probs)."""
    if len(got) != 4:
        return got
    dx, d_gate_up, d_down, dprobs = got
    f = d_gate_up.shape[1] // 2
    return dx, d_gate_up[:, :f].transpose(1, 2), d_gate_up[:, f:].transpose(1, 2), d_down.transpose(1, 2), dprobs


@pytest.fixture
def compiled_on_the_cpu(monkeypatch):
    """The compiled peers at the tiny presets, on aot_eager: inductor's CPU code is not what is
    timed, the peers' maths is."""
    from functools import partial

    from gates import moe_peers

    monkeypatch.setattr(moe_peers, "COMPILED_AT", tuple(p.name for p in GATE.presets))
    monkeypatch.setattr(torch, "compile", partial(torch.compile, backend="aot_eager"))


# tiny-model-layout where its arm differs: the cases that time the arm on the model's layout
@pytest.mark.parametrize("preset_name, case", [
    *((name, c.name) for name in ("tiny", "tiny-top2") for c in GATE.benches),
    *(("tiny-model-layout", case) for case in ("fwd+bwd", "bwd", "layer"))])
def test_every_contender_matches_the_reference_in_every_case(case, preset_name, compiled_on_the_cpu):
    bench = next(c for c in GATE.benches if c.name == case)
    # tiny: capacity drops (dropped slots and padding rows must give nothing); tiny-top2: none,
    # which transformers' experts need; tiny-model-layout: the arm on a model's gate_up and down
    preset = GATE.preset(preset_name)
    buffers = GATE.make_buffers(preset, 1, CPU)
    contenders = {c.name: c for c in GATE.contenders_for(bench)}
    (reference,) = [name for name, c in contenders.items() if c.role == "reference"]
    block = case.startswith("block")  # a transformers block and its gradients: (x, router, gate_up, down)
    if block and preset.params["capacity_factor"] is not None:
        for contender in contenders.values():
            with pytest.raises(ValueError, match="drops no slot"):
                contender.build(bench, buffers, preset)
        return
    want = contenders.pop(reference).build(bench, buffers, preset)()
    checked = set()
    for name, contender in contenders.items():
        if contender.unavailable(CPU):
            continue
        if name in ("transformers grouped_mm", "liger fused_moe") and preset.params["capacity_factor"] is not None:
            with pytest.raises(ValueError, match="takes? no capacity factor"):
                contender.build(bench, buffers, preset)
            continue
        got = contender.build(bench, buffers, preset)()
        checked.add(name)
        if name == "copy":  # a yardstick, not an implementation: it moves the combine's bytes
            assert 2 * got.numel() * got.element_size() == bench.bytes(preset)
            continue
        if case == "combine-bwd":  # rows past R are never read
            rows = int(moe.route(buffers["logits"], 3, capacity_factor=1.0).num_rows)
            got, want = (got[0][:rows], got[1]), (want[0][:rows], want[1])
        _assert_all_close(got if block else _in_reference_layout(got), want)
    if case == "fwd+bwd":
        assert "arm compiled" in checked
    if block:
        assert len(want) == 4 and want[1].abs().sum() > 0  # the router's weight learns through the top-k
        # Liger's block where Liger runs here (eager: its compiled one breaks the graph, gates/liger.py)
        liger = {"block liger"} if case == "block" and not moe_block.block_liger_missing(CPU) else set()
        assert checked == {"block suite" if case == "block" else "block suite compiled"} | liger


def _gate_up_grads(layer, buffers, preset, dtype=torch.float32):
    buffers = {n: t.to(dtype) if n != "logits" else t for n, t in buffers.items()}
    x, weights, routing = moe_bwd._leaves(buffers, preset)
    gate_up, down = moe_bwd.gate_up_layout(weights)
    out = layer(x, routing, gate_up, down)
    return torch.autograd.grad(out, (x, gate_up, down, routing.probs), buffers["grad_out"]), (x, weights, routing)


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no torch._grouped_mm")
def test_the_gate_up_peer_computes_the_experts():
    """transformers 5's layout and one grouped_mm for gate and up: the reference's output and
    gradients, once its weights' gradients are mapped back (timed on CUDA only; checked here
    where torch runs grouped_mm on the CPU), and the same under torch.compile (bf16: the only
    dtype grouped_mm compiles for)."""
    preset = GATE.preset("tiny-top2")
    buffers = GATE.make_buffers(preset, 1, CPU)
    got, (x, weights, routing) = _gate_up_grads(moe_bwd.grouped_mm_gate_up, buffers, preset)
    want = torch.autograd.grad(moe.experts_reference(x, routing, *weights), (x, *weights, routing.probs),
                               buffers["grad_out"])
    _assert_all_close(_in_reference_layout(got), want)
    eager, _ = _gate_up_grads(moe_bwd.grouped_mm_gate_up, buffers, preset, torch.bfloat16)
    layer = torch.compile(moe_bwd.grouped_mm_gate_up, backend="aot_eager", fullgraph=True)
    for g, e in zip(_gate_up_grads(layer, buffers, preset, torch.bfloat16)[0], eager):
        torch.testing.assert_close(g, e)


def test_compiled_peers_are_timed_at_the_model_presets_alone():
    bench = next(c for c in GATE.benches if c.name == "fwd+bwd")
    peer = next(c for c in GATE.contenders_for(bench) if c.name == "arm compiled")
    preset = GATE.preset("tiny")
    with pytest.raises(ValueError, match="compiled peers are timed at olmoe, qwen3-30b-a3b, mixtral, olmoe-4k"):
        peer.build(bench, GATE.make_buffers(preset, 1, CPU), preset)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", ["fwd+bwd", "bwd"])
def test_every_contenders_timed_call_can_be_captured_and_replayed(case):
    """The graph mode's premise: each build's call captures (the bwd case's forward ran at build
    time, on a side stream) and its replay computes what an eager call does; but Liger's forward,
    which reads its tile count on the host: the runner drops it from graph mode (eager alone)."""
    from suite.harness.timers import CudaTimer

    cuda = torch.device("cuda")
    bench = next(c for c in GATE.benches if c.name == case)
    # a bench preset: torch._grouped_mm refuses the tiny ones' strides (not multiples of 16 B)
    preset = GATE.preset("top2-small")
    buffers = GATE.make_buffers(preset, 1, cuda)
    timer = CudaTimer(cuda)
    for contender in GATE.contenders_for(bench):
        if contender.unavailable(cuda):
            continue
        try:
            call = contender.build(bench, buffers, preset)
        except ValueError as exc:  # the compiled peers, at the model presets alone
            assert "compiled peers are timed at" in str(exc)
            continue
        want = [t.clone() for t in call()]
        if case == "fwd+bwd" and contender.name == "liger fused_moe":
            with pytest.raises(RuntimeError):
                timer.capture(call)
            continue
        outputs = []
        replay = timer.capture(lambda: outputs.append(call()))
        replay()
        torch.cuda.synchronize()
        for got, expected in zip(outputs[-1], want):  # the eager peers' index_add_ sums by atomics
            torch.testing.assert_close(got, expected, msg=contender.name)
        del call, outputs, replay


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_bwd_case_built_on_a_stream_of_its_own_keeps_its_forward_there_and_captures():
    """The bwd case asks for a stream of its own (the bench and scripts/moe_peer_profile.py build
    and time it there): built on a non-default stream, its forward runs on that stream (no side
    stream of its own), eager backwards cross no streams, and the call still captures and
    replays what an eager call computes."""
    from suite.harness.timers import CudaTimer

    cuda = torch.device("cuda")
    own = torch.cuda.Stream(cuda)
    assert moe_bwd._on_side_stream(torch.cuda.current_stream, cuda) != torch.cuda.current_stream(cuda)
    bench = next(c for c in GATE.benches if c.name == "bwd")
    assert bench.own_stream
    with torch.cuda.stream(own):
        assert moe_bwd._on_side_stream(torch.cuda.current_stream, cuda) == own
        preset = GATE.preset("top2-small")
        arm = next(c for c in GATE.contenders if c.name == "arm")
        call = arm.build(bench, GATE.make_buffers(preset, 1, cuda), preset)
        want = [t.clone() for t in call()]
        outputs = []
        replay = CudaTimer(cuda).capture(lambda: outputs.append(call()))
        replay()
        own.synchronize()
    for got, expected in zip(outputs[-1], want):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_grouped_mm_peer_computes_the_experts():
    from gates.moe_bwd import grouped_mm_experts

    preset = GATE.preset("tiny-top2")
    buffers = GATE.make_buffers(preset, 2, CPU)
    routing = moe.route(buffers["logits"], 2)
    weights = [buffers[n] for n in ("w_gate", "w_up", "w_down")]
    torch.testing.assert_close(grouped_mm_experts(buffers["x"], routing, *weights),
                               moe.experts_reference(buffers["x"], routing, *weights), rtol=1e-4, atol=1e-6)
    assert "CUDA" in GATE.contenders[3].unavailable(CPU)


@pytest.mark.parametrize("profile, unavailable", [("none", False), ("rtx", True)])
def test_grouped_mm_is_no_peer_under_the_rtx_profile(monkeypatch, profile, unavailable):
    """On an SM90 device grouped_mm runs, except where the rtx profile stands in for the RTX
    card, which cannot run it: the peers there are the card's."""
    monkeypatch.setattr(torch, "_grouped_mm", getattr(torch, "_grouped_mm", None), raising=False)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setenv("SUITE_PROFILE", profile)
    why = GATE.contenders[3].unavailable(torch.device("cuda", 0))
    assert (why is not None) is unavailable
    assert not unavailable or "rtx profile" in why


def test_bench_counts():
    olmoe = GATE.preset("olmoe")
    fwd_bwd, bwd = GATE.benches[:2]
    assert fwd_bwd.flops(olmoe) == 18 * 8192 * 8 * 2048 * 1024
    assert bwd.flops(olmoe) == 12 * 8192 * 8 * 2048 * 1024


def _sonicmoe_in_torch(gate_rows: slice = slice(0, None, 2), up_rows: slice = slice(1, None, 2)):
    """SonicMoE's layer as its module's torch path computes it (gate at c_fc's even rows, up at
    its odd ones: its _swiglu), differentiable: sonicmoe_experts' stand-in on the CPU."""
    import torch.nn.functional as F

    def experts_for(routing):
        def run(x, routing, c_fc, c_proj):
            rows = []
            for t in range(x.shape[0]):
                row = 0
                for s in range(routing.k):
                    e = int(routing.expert_ids[t, s])
                    both = x[t] @ c_fc[e].T
                    row = row + routing.probs[t, s] * ((F.silu(both[gate_rows]) * both[up_rows]) @ c_proj[e].T)
                rows.append(row)
            return torch.stack(rows)
        return run

    return experts_for


def test_sonicmoe_layout_interleaves_gate_and_up_as_its_swiglu_reads_them():
    """SonicMoE's MoE reads c_fc's rows as gate at 2i and up at 2i + 1 (its torch path's
    _swiglu, and QuACK's gated epilogue); the same layer computed that way from
    sonicmoe_layout's weights is the reference's."""
    preset = GATE.preset("tiny-top2")
    buffers = GATE.make_buffers(preset, 1, CPU)
    x, weights, routing = moe_bwd._leaves(buffers, preset)
    c_fc, c_proj = moe_bwd.sonicmoe_layout(weights)
    assert c_fc.shape == (weights[0].shape[0], 2 * weights[0].shape[2], weights[0].shape[1])
    out = _sonicmoe_in_torch()(routing)(x, routing, c_fc, c_proj)
    want = moe.experts_reference(x, routing, *weights)
    torch.testing.assert_close(out, want.float(), rtol=1e-5, atol=1e-6)


def test_the_sonicmoe_build_refuses_a_layer_that_is_not_the_arms(monkeypatch):
    """The build's check, with the torch stand-in: the right layout builds a timed call; gate and
    up swapped (a layout mistaken) is refused with the output's error named."""
    preset = GATE.preset("tiny-top2")
    buffers = GATE.make_buffers(preset, 1, CPU)
    case = next(c for c in GATE.benches if c.name == "fwd+bwd")
    monkeypatch.setattr(moe_bwd, "sonicmoe_experts", _sonicmoe_in_torch())
    grads = moe_bwd.build_sonicmoe(case, buffers, preset)()
    assert len(grads) == 4 and grads[1].shape == moe_bwd.sonicmoe_layout([buffers[n] for n in
                                                                          ("w_gate", "w_up", "w_down")])[0].shape
    monkeypatch.setattr(moe_bwd, "sonicmoe_experts", _sonicmoe_in_torch(slice(1, None, 2), slice(0, None, 2)))
    with pytest.raises(ValueError, match="SonicMoE's output differs from the arm's by relative L2"):
        moe_bwd.build_sonicmoe(case, buffers, preset)


def test_sonicmoe_says_why_it_cannot_run_here():
    assert moe_bwd.sonicmoe_missing(CPU) == "SonicMoE runs on CUDA devices only"
    assert "sonicmoe" in moe_bwd.STRONGEST_PEERS


def test_the_host_probe_builds_only_the_cases_timed_at_its_shape():
    """The block cases are timed at the model presets alone: probing them on host-probe raised
    "compiled peers are timed at ..." and `suite bench moe-bwd --preset olmoe` lost every case."""
    probed = {case.name: host_probed(GATE, case) for case in GATE.benches}
    assert probed == {"fwd+bwd": True, "bwd": True, "combine-bwd": True, "layer": True, "block": False,
                      "block-compiled": False}


# ---- Liger-Kernel's fused MoE (the extra [peers]): a peer, its output held to the gate's rule ----

LIGER = ("liger fused_moe", "block liger", "block liger compiled")


def test_liger_says_why_it_cannot_run_here(monkeypatch):
    import importlib.util

    from gates import liger

    contenders = {c.name: c for c in GATE.contenders}
    assert all(contenders[name].role == "peer" for name in LIGER)
    found = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "liger_kernel" else found(name, *a))
    for name in LIGER:
        assert contenders[name].unavailable(CPU) == "liger-kernel is not installed (pip install 'suite[peers]')"
    monkeypatch.setattr(importlib.util, "find_spec", found)
    if found("liger_kernel") is None:
        return
    # autotuning on (read as liger_kernel was imported): the interpreter cannot time configs
    monkeypatch.setattr(liger, "_autotune_pinned", lambda: False)
    assert "LIGER_FUSED_MOE_AUTOTUNE=0" in contenders["liger fused_moe"].unavailable(CPU)
    monkeypatch.undo()
    assert "fullgraph=True" in contenders["block liger compiled"].unavailable(CPU)
    # the rtx profile on a Hopper card would time configs the RTX card cannot run; on the card itself, Liger runs
    for capability, unavailable in (((9, 0), True), ((12, 0), False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, c=capability: c)
        monkeypatch.setenv("SUITE_PROFILE", "rtx")
        why = liger.fused_moe_missing(torch.device("cuda", 0))
        assert (why is not None and "rtx profile" in why) is unavailable, why


def _liger_arm(buffers, preset):
    """Liger's experts on the arm's routing and weights in a model's layout, and its block: the
    outputs the gate judges of the arm."""
    def layer(x, routing, gate_up, down, activation):
        assert activation == moe.SwiGLU()
        return moe_bwd.liger_experts(routing)(x, routing, gate_up, down)

    return {**moe_bwd._forward_backward(layer, moe.route, buffers, preset, lambda logits, routing: routing.z_loss,
                                        in_model_layout=True),
            **moe_block.block_outputs(buffers, preset, "liger")}


def test_liger_fused_moe_and_its_block_pass_the_gates_tolerance_rule():
    """Where Liger runs (here interpreted, its autotuning pinned: gates/liger.py), its experts and
    its block are judged as the arm is: every output and gradient within k x the reference's own
    error against the float64 truth (its dprobs sums by atomics: no determinism claim)."""
    pytest.importorskip("liger_kernel")
    from suite.harness import parity

    assert all(c.unavailable(CPU) is None for c in GATE.contenders if c.name in LIGER[:2])
    preset, buffers, expected = gatecheck.judge_setup(GATE, "tiny-model-layout")
    result, outputs = parity.judge_arm(GATE, preset, buffers, expected, arm=_liger_arm, nondeterministic="atomics")
    assert result.passed, result.failures
    assert {"out", "dx", "dw_gate", "dprobs", "dlogits", *moe_block.BLOCK_OUTPUTS} <= {t.name for t in result.tensors}
    assert outputs["block_drouter"].abs().sum() > 0  # the router learns through Liger's experts


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_liger_computes_the_arms_layer_and_its_block_breaks_a_fullgraph_compile():
    """At a model preset in bf16: Liger's output, dx and dprobs within 2% (relative L2) of the
    arm's on the same routing and weights, as SonicMoE's build holds it; and the block with its
    experts refused by torch.compile(fullgraph=True), the reason its compiled contender gives."""
    pytest.importorskip("liger_kernel")
    cuda = torch.device("cuda")
    preset = GATE.preset("olmoe")
    buffers = GATE.make_buffers(preset, 1, cuda)
    x, weights, routing = moe_bwd._leaves(buffers, preset)
    theirs = moe_bwd.liger_experts(routing)(x, routing, *moe_bwd.gate_up_layout(weights))
    ours = moe.experts(x, routing, *weights)
    for name, a, b in (("out", theirs, ours), *zip(("dx", "dprobs"),
                       torch.autograd.grad(theirs, (x, routing.probs), buffers["grad_out"]),
                       torch.autograd.grad(ours, (x, routing.probs), buffers["grad_out"]))):
        assert float((a.float() - b.float()).norm() / b.float().norm()) <= 0.02, name
    block = moe_block.make_block(preset, buffers, "liger")
    with pytest.raises(Exception):
        torch.compile(block, fullgraph=True)(buffers["x"].unsqueeze(0))
