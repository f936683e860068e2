"""scripts/hf_step_probe.py on the CPU: it needs a GPU and says so; each model's switch turns on
the integration it names."""

from __future__ import annotations

import pytest
import torch

from scriptload import load_script

pytest.importorskip("transformers", minversion="5")

from hfmodels import tiny  # noqa: E402


def test_the_probe_needs_a_gpu_and_says_so(capsys, monkeypatch):
    probe = load_script("hf_step_probe")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert probe.main(["--model", "llama", "--steps", "6"]) == 3
    assert "needs a CUDA GPU" in capsys.readouterr().out


def test_switch_on_turns_on_the_models_integration():
    probe = load_script("hf_step_probe")
    olmoe, llama = tiny("olmoe"), tiny("llama")
    probe.switch_on(olmoe, "olmoe")
    probe.switch_on(llama, "llama")
    assert olmoe.config._experts_implementation == "suite"
    assert all(hasattr(m, "_suite_rms_norm") for m in llama.modules() if type(m).__name__ == "LlamaRMSNorm")
