"""scripts/hf_family_probe.py on the CPU (kernels interpreted): a family taken gives its own
numbers and its recording passes the gate, a family refused says why, and an integration or a
gate verdict that is off fails the probe."""

from __future__ import annotations

import json

import pytest
import torch

from scriptload import load_script

transformers = pytest.importorskip("transformers", minversion="5")


def test_each_family_taken_refused_or_without_norms_is_said_and_within_tolerance(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("OUT", str(tmp_path))
    probe = load_script("hf_family_probe")
    # PhiMoE's router draws jitter noise in training: the same draws each step, else no two steps agree
    assert probe.main(["--family", "mixtral", "--family", "gpt_oss", "--family", "phimoe"]) == 0
    rows = {row["family"]: row for row in json.loads((tmp_path / "hf_family_probe.json").read_text())["rows"]}
    assert rows["mixtral"]["experts"] == "taken (2)" and rows["mixtral"]["norms"] == "taken (5)"
    assert rows["gpt_oss"]["experts"] == "refused: GptOssExperts has has_bias=True"
    assert rows["gpt_oss"]["experts_error"] is None and rows["phimoe"]["norms"] == "none in the model"
    assert rows["mixtral"]["gate"] == rows["phimoe"]["gate"] == "passed"
    assert rows["gpt_oss"]["gate"] == "not recorded: GptOssExperts has has_bias=True"
    assert rows["mixtral"]["muon"] == rows["phimoe"]["muon"] == "stepped (4 expert weights)"
    assert rows["gpt_oss"]["muon"] == "stepped (4 expert weights)"  # its gate and up alternate: split so
    for family, part in (("mixtral", "experts"), ("mixtral", "norms"), ("gpt_oss", "norms"), ("phimoe", "experts")):
        assert 0 < rows[family][f"{part}_error"] < probe.TOLERANCE, (family, part)
    assert "3 of 3 families probed; every one within" in capsys.readouterr().out


def test_numbers_off_the_familys_own_or_a_failing_gate_fail_the_probe(capsys, monkeypatch):
    """The experts off by 1% in the model (the integration's call) and in the gate's arm."""
    from gates import moe_bwd
    from suite.integrations import transformers as hf

    probe = load_script("hf_family_probe")
    real = hf.gate_up_experts
    for module in (hf, moe_bwd):
        monkeypatch.setattr(module, "gate_up_experts", lambda *args, **kwargs: real(*args, **kwargs) * 1.01)
    assert probe.main(["--family", "mixtral"]) == 1
    out = capsys.readouterr().out
    assert "OFF their own numbers: ['mixtral']" in out and "the gate failed on the recording of ['mixtral']" in out


def test_a_muon_step_that_leaves_the_experts_to_adamw_fails_the_probe(capsys, monkeypatch):
    from suite.integrations import transformers as hf

    probe = load_script("hf_family_probe")
    real = hf.muon_param_groups
    monkeypatch.setattr(hf, "muon_param_groups", lambda model, experts, **kwargs: real(model, "adamw", **kwargs))
    assert probe.main(["--family", "mixtral"]) == 1
    out = capsys.readouterr().out
    assert "failed: an expert weight is left to AdamW" in out and "the Muon step failed on ['mixtral']" in out


def test_a_family_without_experts_is_a_usage_error(capsys):
    assert load_script("hf_family_probe").main(["--family", "llama"]) == 2
    assert "['llama'] declare no experts class" in capsys.readouterr().out


def test_a_gradient_that_cancelled_is_judged_against_the_largest_not_its_own_size():
    """DeepSeek-V4's router gradient at init is 1e-11 of the model's largest: its bits are the
    rounding of larger terms, and its own relative error says nothing. A gradient of real size
    that is off still fails."""
    probe = load_script("hf_family_probe")
    stock = (torch.tensor(2.0), {"big": torch.ones(100), "cancelled": torch.full((4,), 1e-11)})
    rounded = (torch.tensor(2.0), {"big": torch.ones(100), "cancelled": torch.full((4,), 2e-11)})
    assert probe.worst_error(stock, rounded) < probe.TOLERANCE
    off = (torch.tensor(2.0), {"big": torch.ones(100) * 1.001, "cancelled": torch.full((4,), 1e-11)})
    assert probe.worst_error(stock, off) > probe.TOLERANCE
    assert probe.worst_error(stock, (torch.tensor(2.0), {"big": torch.ones(100)})) == float("inf")


def test_a_family_whose_probe_raises_is_a_failed_row_and_the_others_still_run(capsys, monkeypatch):
    probe = load_script("hf_family_probe")

    def probe_that_raises_on_mixtral(family, device):
        if family == "mixtral":
            raise TypeError("a config field the probe did not expect")
        return dict(family=family, experts="taken (2)", experts_error=1e-7, norms="taken (5)", norms_error=1e-7,
                    gate="passed", own_error=1e-7, muon="stepped (4 expert weights)")

    monkeypatch.setattr(probe, "probe", probe_that_raises_on_mixtral)
    assert probe.main(["--family", "mixtral", "--family", "olmoe"]) == 1
    out = capsys.readouterr().out
    assert "probe failed: TypeError: a config field the probe did not expect" in out
    assert "the gate failed on the recording of ['mixtral']" in out and "olmoe     taken (2)" in out


@pytest.mark.parametrize("family", [
    "qwen3_5_moe",  # a multimodal family: its text model's causal LM
    "gemma4",  # its MoE switched on, its layer kinds cut to two
    "lfm2_moe",  # its layer kinds given
    "mistral4",  # no auto class: its own ForCausalLM
    "qwen3_vl_moe",  # no text causal LM: its text model with a head (TextLM)
    "step3p7",  # its sliding window given
])
def test_the_families_that_need_more_than_the_tiny_shape_are_built_and_step(family):
    """Each builds at the tiny shape with experts and runs its own step; that the integrations
    then take it is the probe's run (docs/arms/moe.md)."""
    if family not in transformers.CONFIG_MAPPING:
        pytest.skip(f"this transformers has no {family}")
    probe = load_script("hf_family_probe")
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))
    model, stock, why = probe.tiny_step(family, torch.device("cpu"), ids)
    assert why is None and sum(p.numel() for p in model.parameters()) < 2_000_000, why
    assert torch.isfinite(stock[0])


def test_a_familys_own_fp32_error_widens_what_it_may_lie_from_its_own_numbers():
    """DeepSeek-V4's hyper-connection gradients in fp32 lie 2e-4 from a float64 run of its own
    step: numbers as far from its fp32 ones are its own rounding, not the integration's."""
    probe = load_script("hf_family_probe")
    stock = (torch.tensor(2.0), {"w": torch.ones(100)})
    truth = (torch.tensor(2.0, dtype=torch.float64), {"w": torch.ones(100, dtype=torch.float64) * (1 + 2e-4)})
    assert probe.worst_error(truth, stock) == pytest.approx(2e-4, rel=1e-3)
    row = dict(own_error=probe.worst_error(truth, stock))
    assert probe.allowed(row) == pytest.approx(probe.TOLERANCE + 4e-4, rel=1e-3)
    assert probe.allowed(dict(own_error=None)) == probe.TOLERANCE  # a family that will not run in float64
