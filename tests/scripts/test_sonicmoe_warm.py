"""scripts/sonicmoe_warm.py on the CPU, SonicMoE's build stood in for: it builds and runs each
preset named, in order, until its budget is spent, and says why it cannot run where SonicMoE
cannot."""

from __future__ import annotations

import pytest

from scriptload import load_script


@pytest.fixture
def warm(monkeypatch):
    module = load_script("sonicmoe_warm")
    built = []

    def build(case, buffers, preset):
        built.append(preset.name)
        return lambda: buffers["x"].sum()

    monkeypatch.setattr(module, "sonicmoe_missing", lambda device: None)
    monkeypatch.setattr(module, "build_sonicmoe", build)
    module.built = built
    return module


def test_each_preset_is_built_and_run_in_order(warm, capsys):
    warm.main(["tiny-top2", "tiny", "--device", "cpu"])
    assert warm.built == ["tiny-top2", "tiny"]
    assert "tiny: SonicMoE built and ran in" in capsys.readouterr().out


def test_no_preset_starts_once_the_budget_is_spent(warm, capsys):
    warm.main(["tiny-top2", "tiny", "--budget", "0", "--device", "cpu"])
    assert warm.built == ["tiny-top2"]
    assert "tiny: not started, the budget of 0 s is spent" in capsys.readouterr().out


def test_where_sonicmoe_cannot_run_it_says_why():
    module = load_script("sonicmoe_warm")
    with pytest.raises(SystemExit, match="SonicMoE runs on CUDA devices only"):
        module.main(["tiny", "--device", "cpu"])
