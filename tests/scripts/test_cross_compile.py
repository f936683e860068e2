"""scripts/cross_compile.py: its cases on the CPU, and, with a CUDA build of torch (no GPU
needed), every kernel of the MoE arm at a model preset compiled for the H200 and the RTX card
(no error, within each card's shared memory, no GEMM spilling on the RTX card), and RMSNorm's
for the RTX card at every GPU preset's width. On the H200 itself: the fake sm_90 card builds
what the real one launches."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rtxcheck import record_compiled
from scriptload import SCRIPTS, load_script

needs_cuda_build = pytest.mark.skipif(not torch.backends.cuda.is_built(),
                                      reason="compiling for a GPU needs a CUDA build of torch")
GEMMS = ("up_kernel", "up_tma_kernel", "rows_gemm_kernel", "rows_tma_kernel", "weight_grad_kernel")


@pytest.fixture(scope="module")
def script():
    return load_script("cross_compile")


def test_every_model_preset_is_compiled_in_every_activation_and_layout(script):
    cases = dict(script.moe_cases([]))
    for preset in script.MODEL_PRESETS:
        assert cases[preset]["layout"] == "model" and cases[preset]["activation"] == "swiglu"
        assert {cases[f"{preset} {a}"]["activation"] for a in ("clamped", "geglu")} == {"clamped", "geglu"}
        assert {cases[f"{preset} {layout}"]["layout"] for layout in ("transposed", "interleaved", "apart")} == {
            "transposed", "interleaved", "apart"}
    assert {cases[f"top2-small {dtype}"]["dtype"] for dtype in ("fp16", "fp32")} == {"fp16", "fp32"}
    assert all(not name.startswith("tiny") for name in cases)  # the GPU presets alone


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build of torch can fake a card")
def test_a_cpu_build_of_torch_gets_one_line_and_exit_2(tmp_path):
    done = subprocess.run([sys.executable, str(SCRIPTS / "cross_compile.py"), "--arm", "optimizers"],
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.startswith("error: compiling for a GPU that is not here needs a CUDA build")
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("args, says", [
    (["--preset", "nope"], "--preset nope: not a GPU preset of moe-bwd; choose from "),
    (["--preset", "tiny"], "--preset tiny: not a GPU preset of moe-bwd"),  # a CPU preset compiles nothing
    (["--preset", "olmoe", "--arm", "rmsnorm"], "--preset picks moe-bwd presets: add --arm moe"),
    (["--json", "{tmp}/missing/builds.json"], "its directory {tmp}/missing does not exist"),
])
def test_an_argument_that_would_compile_nothing_or_lose_the_builds_is_refused_first(script, tmp_path, capsys,
                                                                                      args, says):
    with pytest.raises(SystemExit) as exited:
        script.main([a.format(tmp=tmp_path) for a in args])
    assert exited.value.code == 2 and says.format(tmp=tmp_path) in capsys.readouterr().err


def _compile(tmp_path, *args) -> list[dict]:
    out = tmp_path / "builds.json"
    env = {**os.environ, "TRITON_INTERPRET": "0"}  # the interpreter compiles nothing
    done = subprocess.run([sys.executable, str(SCRIPTS / "cross_compile.py"), *args, "--json", str(out)], env=env,
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.cuda
@needs_cuda_build
def test_the_moe_arm_compiles_for_both_cards_within_their_shared_memory(tmp_path):
    builds = _compile(tmp_path, "--arm", "moe", "--preset", "olmoe")
    made = {(b["target"], b["kernel"]) for b in builds}
    assert {("sm90", k) for k in ("up_tma_kernel", "rows_tma_kernel", "gather_rows_kernel")} <= made  # the H200's paths
    assert {("sm120", k) for k in ("up_kernel", "rows_gemm_kernel", "weight_grad_kernel")} <= made  # the RTX card's
    assert all(b["error"] is None and b["shared"] <= b["limit"] for b in builds)


@pytest.mark.cuda
@needs_cuda_build
def test_no_gemm_spills_on_the_rtx_card_in_bf16(tmp_path):
    builds = _compile(tmp_path, "--arm", "moe", "--target", "sm120", "--preset", "qwen3-30b-a3b", "--preset", "mixtral")
    gemms = [b for b in builds if b["kernel"] in GEMMS and b["signature"].startswith("bfloat16")]
    assert {b["kernel"] for b in gemms} == {"up_kernel", "rows_gemm_kernel", "weight_grad_kernel"}
    assert not [(b["kernel"], b["meta"], b["spill_bytes"]) for b in gemms if b["spill_bytes"] != 0]


@pytest.mark.cuda
@needs_cuda_build
def test_rmsnorm_compiles_for_the_rtx_card_unspilled_within_its_shared_memory(tmp_path):
    """Every GPU preset's width, bf16 x with an fp32 and a bf16 weight: the forward with and
    without stats, the folded and the two-stage backward, the looped row dot past 16384."""
    builds = _compile(tmp_path, "--arm", "rmsnorm", "--target", "sm120")
    assert {b["kernel"] for b in builds} == {"rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "rms_norm_bwd_row_dot_kernel",
                                              "reduce_dw_partials_kernel"}
    assert {b["meta"]["REDUCE_DW"] for b in builds if b["kernel"] == "rms_norm_bwd_kernel"} == {True, False}
    assert {b["meta"]["STORE_STATS"] for b in builds if b["kernel"] == "rms_norm_fwd_kernel"} == {True, False}
    assert all(b["error"] is None and b["shared"] <= b["limit"] and b["spill_bytes"] == 0 for b in builds)


@pytest.mark.cuda
@pytest.mark.skipif(not (torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 9),
                    reason="needs an sm_90 GPU (the H200)")
def test_the_fake_h200_builds_what_the_h200_launches(tmp_path, monkeypatch, script):
    """The cross-compiler's stand-in card chooses every tile and path the real one does: one
    model preset's layer, forward and backward, launched on the H200 and compiled for the fake
    sm_90, gives the same kernels at the same shared memory and warps (a device query the
    stand-in does not answer as the card would shows here)."""
    recorded = record_compiled(monkeypatch, profile="none")
    (params,) = [dict(p) for name, p in script.moe_cases(["olmoe"]) if name == "olmoe"]
    script.run_moe(params)
    torch.cuda.synchronize()
    launched = {(name, c.metadata.shared, c.metadata.num_warps) for name, c in recorded}
    builds = _compile(tmp_path, "--arm", "moe", "--target", "sm90", "--preset", "olmoe", "--no-usage")
    compiled = {(b["kernel"], b["shared"], b["meta"].get("num_warps", 4)) for b in builds if "olmoe" in b["cases"]}
    assert compiled == launched
