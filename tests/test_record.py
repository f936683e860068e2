"""suite.record.capture: a tiny transformers model's real tensors recorded as gate buffers, and
the gates passing on them (the CPU: kernels interpreted)."""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

pytest.importorskip("transformers", minversion="5")

from cli import app  # noqa: E402
from suite.files.buffers import load_buffers  # noqa: E402
from suite.record import capture  # noqa: E402
from hfmodels import tiny  # noqa: E402


def step(model, seed=0):
    ids = torch.randint(0, 64, (2, 9), generator=torch.Generator().manual_seed(seed))
    model(input_ids=ids, labels=ids).loss.backward()


def test_capture_records_each_norm_and_experts_module_and_the_gates_pass_on_them(tmp_path):
    model = tiny("olmoe")
    with capture(model, tmp_path / "rec") as recording:
        step(model)
    names = sorted(p.name for p in recording.saved)
    norms = [n for n, m in model.named_modules() if type(m).__name__ == "OlmoeRMSNorm"]
    assert names == sorted(norms + ["model.layers.0.mlp.experts", "model.layers.1.mlp.experts"])
    assert recording.skipped == {}
    experts, manifest = load_buffers(tmp_path / "rec" / "model.layers.1.mlp.experts", expect_gate="moe-bwd")
    assert manifest.params == {"capacity_factor": None, "skew": "none", "top_k": 2, "weights": "model"}
    assert experts["w_gate"].shape == (6, 32, 24) and experts["top_k_index"].shape == (18, 2)
    assert "logits" not in experts  # the model's own routing, not its router's logits
    for gate, name in (("rmsnorm", "model.layers.1.post_attention_layernorm"), ("moe-bwd", "model.layers.0.mlp.experts")):
        result = CliRunner().invoke(app, ["gate", gate, "--device", "cpu", "--buffers", str(tmp_path / "rec" / name),
                                          "--reports", str(tmp_path / "reports"), "--no-sabotage"],
                                    catch_exceptions=False)
        assert result.exit_code == 0, result.output


def test_a_recording_carries_the_models_own_routing_and_the_gate_replays_it(tmp_path):
    """DeepSeek-V3 routes by sigmoid scores with a bias, in groups, scaled by 2.5: the gate's own
    top-k of its logits would pick other experts with other weights. Its recording holds the
    model's top-k, and the gate's arm gives the experts' own output from it; the gate passes on
    it, judging the layout and dprobs but no dlogits or z-loss."""
    import json

    from gates import moe_bwd
    from suite.harness.gate import Preset

    model = tiny("deepseek-v3")
    experts = model.model.layers[1].mlp.experts
    seen = []
    experts.register_forward_hook(lambda module, args, out: seen.append((args, out.detach().clone())))
    with capture(model, tmp_path / "rec", modules=("experts",)) as recording:
        step(model)
    assert len(recording.saved) == 2 and recording.skipped == {}
    buffers, _ = load_buffers(tmp_path / "rec" / "model.layers.1.mlp.experts", expect_gate="moe-bwd")
    (x, top_k_index, top_k_weights), out = seen[0]
    assert torch.equal(buffers["top_k_index"], top_k_index) and torch.equal(buffers["top_k_weights"], top_k_weights)
    assert not torch.allclose(top_k_weights.sum(-1), torch.ones(18))  # no softmax of the logits gives these
    params = moe_bwd.GATE.buffer_params(buffers)
    assert params["routing"] == "model" and params["top_k"] == 2
    preset = Preset("recorded", {"capacity_factor": None, "skew": "none", **params}, where="any")
    judged = moe_bwd.arm(buffers, preset)
    torch.testing.assert_close(judged["out"], out, rtol=1e-5, atol=1e-6)
    assert "dlogits" not in judged and "z_loss" not in judged  # the router is the model's, not the gate's
    # --no-sabotage: the saboteurs would run on the gate's own tiny preset, which tests/gates covers
    result = CliRunner().invoke(app, ["gate", "moe-bwd", "--device", "cpu", "--buffers",
                                      str(tmp_path / "rec" / "model.layers.1.mlp.experts"),
                                      "--reports", str(tmp_path / "reports"), "--no-sabotage"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    (report,) = (tmp_path / "reports").glob("*/report.json")
    (unit,) = [u for u in json.loads(report.read_text())["results"] if u["preset"] == "recorded"]
    judged_names = [t["name"] for t in unit["parity"]["tensors"]]
    assert unit["status"] == "passed" and unit["preset_params"]["routing"] == "model"
    assert {"dprobs", "row_id_map", "dw_down"} <= set(judged_names) and "dlogits" not in judged_names


def test_a_recording_carries_a_clamped_swiglu_and_the_gate_judges_the_clamp(tmp_path):
    """DeepSeek-V4 clamps its gate before silu: the recording holds the limit and what it clamps,
    the gate passes on it; judged as plain SwiGLU instead, its own output is not the module's."""
    from scriptload import load_script

    from gates import moe_bwd
    from suite.harness.gate import Preset

    if "deepseek_v4" not in __import__("transformers").CONFIG_MAPPING:
        pytest.skip("this transformers has no DeepSeek-V4")
    model, _ = load_script("hf_family_probe").build("deepseek_v4", False)
    experts = model.model.layers[0].mlp.experts
    experts.limit = 0.02  # bites at init: the tiny model's pre-activations reach 0.4
    seen = []
    experts.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    with capture(model, tmp_path / "rec", modules=("experts",)) as recording:
        step(model)
    path = tmp_path / "rec" / "model.layers.0.mlp.experts"
    assert path in recording.saved
    buffers, _ = load_buffers(path, expect_gate="moe-bwd")
    assert buffers["swiglu_limit"].item() == 0.02 and not buffers["swiglu_clamps_silu"].item()
    params = moe_bwd.GATE.buffer_params(buffers)
    assert (params["swiglu_limit"], params["swiglu_clamp"]) == (0.02, "gate")
    preset = Preset("recorded", {"capacity_factor": None, "skew": "none", **params}, where="any")
    torch.testing.assert_close(moe_bwd.arm(buffers, preset)["out"], seen[0], rtol=1e-5, atol=1e-6)
    plain = Preset("recorded", {k: v for k, v in preset.params.items() if not k.startswith("swiglu")}, where="any")
    assert not torch.allclose(moe_bwd.arm(buffers, plain)["out"], seen[0], rtol=1e-3, atol=1e-4)
    result = CliRunner().invoke(app, ["gate", "moe-bwd", "--device", "cpu", "--buffers", str(path), "--reports",
                                      str(tmp_path / "reports"), "--no-sabotage"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_a_recording_carries_geglu_experts_and_the_gate_judges_them_so(tmp_path):
    """Gemma 4's experts are GeGLU: the recording says so, the gate passes on it; judged as
    SwiGLU instead, its own output is not the module's."""
    from gates import moe_bwd
    from suite.harness.gate import Preset

    model = tiny("gemma4")
    seen = []
    model.model.layers[0].experts.register_forward_hook(lambda module, args, out: seen.append(out.detach().clone()))
    with capture(model, tmp_path / "rec", modules=("experts",)) as recording:
        step(model)
    path = tmp_path / "rec" / "model.layers.0.experts"
    assert path in recording.saved
    buffers, _ = load_buffers(path, expect_gate="moe-bwd")
    assert buffers["geglu"].item() and "swiglu_limit" not in buffers
    params = moe_bwd.GATE.buffer_params(buffers)
    assert params["glu"] == "geglu"
    preset = Preset("recorded", {"capacity_factor": None, "skew": "none", **params}, where="any")
    torch.testing.assert_close(moe_bwd.arm(buffers, preset)["out"], seen[0], rtol=1e-5, atol=1e-6)
    swiglu = Preset("recorded", {k: v for k, v in preset.params.items() if k != "glu"}, where="any")
    off = moe_bwd.arm(buffers, swiglu)["out"] - seen[0]
    assert off.norm() > 0.01 * seen[0].norm()  # small pre-activations: silu and gelu are close, not equal
    result = CliRunner().invoke(app, ["gate", "moe-bwd", "--device", "cpu", "--buffers", str(path), "--reports",
                                      str(tmp_path / "reports"), "--no-sabotage"], catch_exceptions=False)
    assert result.exit_code == 0, result.output


def test_an_experts_module_the_kernels_cannot_take_is_named_and_the_step_runs(tmp_path):
    """A GELU experts module (as a has_gate=False or biased one) is skipped with its reason; the
    model's forward and backward run as without capture, and the other layer is recorded."""
    model = tiny("olmoe")
    model.model.layers[1].mlp.experts.act_fn = torch.nn.GELU()
    with capture(model, tmp_path / "rec", modules=("experts",)) as recording:
        step(model)
    assert [p.name for p in recording.saved] == ["model.layers.0.mlp.experts"]
    assert "act_fn GELU" in recording.skipped["model.layers.1.mlp.experts"]


def test_capture_takes_the_step_asked_for_and_names_what_did_not_run(tmp_path):
    model = tiny("llama")
    seen = []
    model.model.norm.register_forward_hook(lambda module, args, out: seen.append(args[0].detach().clone()))
    with capture(model, tmp_path / "rec", modules=("rms_norm",), step=1) as recording:
        step(model, seed=1)
        step(model, seed=2)
        with torch.no_grad():
            model.model.layers[0].input_layernorm(torch.randn(3, 32))  # a third call: not the one asked for
    recorded, _ = load_buffers(tmp_path / "rec" / "model.norm", expect_gate="rmsnorm")
    assert torch.equal(recorded["x"], seen[1])

    with capture(model, tmp_path / "again", modules=("rms_norm",)) as recording:
        with torch.no_grad():
            model(input_ids=torch.zeros(1, 4, dtype=torch.long))
    assert recording.saved == []
    assert "ran no backward" in recording.skipped["model.norm"]


@pytest.mark.parametrize("bad, message", [(dict(modules=("attention",)), "modules must be among"),
                                          (dict(step=-1), "step must be an int")])
def test_bad_arguments_are_named(tmp_path, bad, message):
    with pytest.raises(ValueError, match=message):
        with capture(tiny("llama"), tmp_path, **bad):
            pass


def test_a_capture_onto_a_recording_is_refused_before_the_step_runs(tmp_path):
    model = tiny("llama")
    with capture(model, tmp_path / "rec", modules=("rms_norm",)):
        step(model)
    before = {p: p.stat().st_mtime_ns for p in (tmp_path / "rec").rglob("*")}
    ran = []
    with pytest.raises(ValueError, match=r"capture: .* already holds a recording; pass capture\(\.\.\., overwrite=True\)"):
        with capture(model, tmp_path / "rec", modules=("rms_norm",)):
            ran.append(step(model))  # a training step the refusal must not waste
    assert ran == [] and before == {p: p.stat().st_mtime_ns for p in (tmp_path / "rec").rglob("*")}
    with capture(model, tmp_path / "rec", modules=("rms_norm",), overwrite=True) as recording:
        step(model, seed=3)
    assert len(recording.saved) == len(before) // 3  # a directory and its two files a module
