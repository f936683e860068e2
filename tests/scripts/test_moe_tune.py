"""scripts/moe_tune.py on the CPU: its config lists, and one run of a tiny preset with the CUDA
timer stood in for (the kernels run under Triton's interpreter), so a typo cannot wait for the
GPU machine to show."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from scriptload import load_script
from suite import triton_support
from suite.device_profile import RTX_SMEM_BYTES


@pytest.fixture(scope="module")
def tune():
    return load_script("moe_tune")


def test_the_kernels_add_up_to_the_layers_flops(tune):
    assert sum(per_rdf for name, _, per_rdf in tune.KERNELS if name not in tune.EXPERIMENTS) == 18


@pytest.mark.parametrize("n_a, n_b", [(1, 1), (1, 2), (2, 2)])
def test_every_swept_gemm_config_fits_the_rtx_card(tune, n_a, n_b):
    configs = tune.gemm_candidates(n_a, n_b, 2, RTX_SMEM_BYTES)
    assert configs and all(c.smem_bytes <= RTX_SMEM_BYTES and c.n_a == n_a and c.n_b == n_b for c in configs)
    assert len(configs) < len(tune.GEMM_CANDIDATES) or n_b == 1  # two B tiles rule some out


def test_kernel_selects_what_runs(tune):
    ceilings = SimpleNamespace(gemm_bf16_tflops=1.0, copy_gbps=1.0)
    args = tune.parse_args(["--kernel", "dw_down"])
    figures = tune.tune_preset("tiny-top2", args, _InlineTimer(), ceilings, torch.device("cpu"))
    assert [e["kernel"] for e in figures["kernels"]] == ["dw_down"]


@pytest.mark.parametrize("argv, named", [
    (["--kernel", "dw_up"], "invalid choice: 'dw_up'"),
    (["--profile", "rtx5090"], "invalid choice: 'rtx5090'"),
    (["--replays", "0"], "needs a whole number >= 1"),
])
def test_bad_arguments_exit_2_with_one_line(tune, capsys, argv, named):
    with pytest.raises(SystemExit) as exit_:
        tune.parse_args(argv)
    assert exit_.value.code == 2 and named in capsys.readouterr().err


def test_an_unknown_preset_exits_2_naming_the_presets(tune, capsys):
    assert tune.main(["--preset", "olmo"]) == 2
    err = capsys.readouterr().err
    assert "no preset 'olmo'" in err and "olmoe" in err and "Traceback" not in err


def test_tma_always_on_a_card_without_tma_exits_2_naming_it(tune, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert tune.main(["--preset", "tiny-top2", "--tma", "always"]) == 2
    err = capsys.readouterr().err
    assert "--tma always needs a card with TMA" in err and "sm_80" in err and "Traceback" not in err


def test_a_config_that_writes_nan_is_not_a_match(tune):
    want = torch.ones(4, 3)
    assert tune.rel_diff([want + 1e-3], [want]) == pytest.approx(1e-3, rel=1e-3)
    assert tune.rel_diff([torch.full((4, 3), float("nan"))], [want]) == float("inf")


def _tma_launches(monkeypatch) -> list:
    """-> the TMA kernels launched, as they launch."""
    from suite.arms.moe.kernels import rows_tma_kernel, up_tma_kernel

    tma_launches = []
    launch = triton_support.Launcher.__call__

    def counted(self, grid, *args):
        if self.kernel in (up_tma_kernel, rows_tma_kernel):
            tma_launches.append(self.kernel)
        return launch(self, grid, *args)

    monkeypatch.setattr(triton_support.Launcher, "__call__", counted)
    return tma_launches


class _InlineTimer:
    """Runs the call instead of capturing it; every timing is 1 ms."""

    def capture(self, fn):
        fn()
        return fn

    def time_calls(self, fn, n, *, flush_l2, window):
        fn()
        return [1.0] * n


def test_a_tiny_preset_runs_every_kernel_and_the_sweep(tune, monkeypatch, capsys):
    from suite.arms.moe import config, kernels
    from suite.arms.moe.config import CombineConfig, GemmConfig

    # the row GEMMs through TMA descriptors, as on an H200 at the model presets: the pointer
    # kernels' experiments then check the TMA kernels' bits
    tma_launches = _tma_launches(monkeypatch)
    monkeypatch.setattr(tune, "gemm_candidates",
                        lambda n_a, n_b, item, limit: [GemmConfig(16, 16, 16, 4, 1, n_a, n_b, item, 2)])
    monkeypatch.setattr(tune, "COMBINE_CANDIDATES", ((4, 16, 4),))
    ceilings = SimpleNamespace(gemm_bf16_tflops=1.0, copy_gbps=1.0)
    args = tune.parse_args(["--preset", "tiny-top2", "--sweep", "--replays", "2", "--tma", "always"])
    figures = tune.tune_preset("tiny-top2", args, _InlineTimer(), ceilings, torch.device("cpu"))
    assert [e["kernel"] for e in figures["kernels"]] == [k for k, _, _ in tune.KERNELS] + ["combine_backward"]
    for entry in figures["kernels"][:-1]:  # the default, then group_m 8 and 16, then the list's one
        if entry["default"] is None:  # torch._grouped_mm's take: one timing, the kernel's values
            [timing] = entry["timings"]
            assert timing["config"] is None and timing["rel_diff"] < 1e-5, entry
            continue
        # (where the list's one is the interpreter's default itself, it is timed once)
        default = entry["default"]
        listed = {**default, "block_m": 16, "block_n": 16, "block_k": 16, "num_warps": 4, "num_stages": 1,
                  "group_m": 2}
        expected = [dict(default, group_m=g) for g in dict.fromkeys([default["group_m"], 8, 16])]
        expected += [listed] if listed not in expected else []
        assert all("ms" in t for t in entry["timings"]), entry
        assert [t["config"] for t in entry["timings"]] == expected
        diffs = [t["rel_diff"] for t in entry["timings"]]
        regrouped = len([c for c in expected if c != listed])
        assert all(d == 0.0 for d in diffs[:regrouped]), entry  # the same tiles in another order
        assert all(d < 1e-6 for d in diffs[regrouped:]), entry  # other tiles: fp32 dots of other widths
    combine = figures["kernels"][-1]["timings"]
    assert len(combine) == 2 and combine[1]["config"] == CombineConfig(4, 16, 4).__dict__
    assert combine[1]["rel_diff"] < 1e-6  # fp32, other column chunks for the dot
    assert {kernels.up_tma_kernel, kernels.rows_tma_kernel} <= set(tma_launches)
    assert config.tma_gemms(1, 1, 1, 1, torch.float32, torch.device("cpu")) is False  # the rule back after it
    tune.print_table(figures)
    assert "sum of kernels" in capsys.readouterr().out


def test_out_in_weights_run_the_tma_kernels_with_the_pointer_kernels_bits(tune, monkeypatch):
    """--layout out_in: the weights as transposed views of [E, out, in] storage, which the TMA
    kernels read in their stored order, checked against the pointer kernels on the same views."""
    from suite.arms.moe.kernels import rows_tma_kernel, up_tma_kernel

    tma_launches = _tma_launches(monkeypatch)
    ceilings = SimpleNamespace(gemm_bf16_tflops=1.0, copy_gbps=1.0)
    kernels = ["expert_up", "expert_down", "dx_rows", "expert_up_pointers", "expert_down_pointers", "dx_rows_pointers"]
    args = tune.parse_args(["--layout", "out_in", "--tma", "always", "--replays", "2",
                            *(f"--kernel={k}" for k in kernels)])
    figures = tune.tune_preset("tiny-top2", args, _InlineTimer(), ceilings, torch.device("cpu"))
    assert figures["layout"] == "out_in" and [e["kernel"] for e in figures["kernels"]] == kernels
    for entry in figures["kernels"][3:]:
        assert [t["rel_diff"] for t in entry["timings"]] == [0.0], entry
    assert {up_tma_kernel, rows_tma_kernel} <= set(tma_launches)


def test_the_tma_rule_holds_unless_told_always(tune, monkeypatch):
    """--tma rule (the default) leaves a layer below `tma_gemms`'s size on the pointer kernels."""
    tma_launches = _tma_launches(monkeypatch)
    ceilings = SimpleNamespace(gemm_bf16_tflops=1.0, copy_gbps=1.0)
    args = tune.parse_args(["--replays", "2", "--kernel=expert_up", "--kernel=dx_rows"])
    figures = tune.tune_preset("tiny-top2", args, _InlineTimer(), ceilings, torch.device("cpu"))
    assert figures["tma"] == "rule" and tma_launches == []
