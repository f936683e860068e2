"""moe-bwd's presets: the models' layers in bf16 on the GPU, which of them `suite bench moe-bwd`
and `suite run` take, and each one's stated memory against the peaks measured on the H200."""

from __future__ import annotations

import pytest
import torch

import gates.moe_presets as moe_presets
from gates.moe_bwd import GATE


def test_gpu_presets_are_the_models_layers_in_bf16():
    shapes = {p.name: (p.params["hidden"], p.params["ffn"], p.params["experts"], p.params["top_k"])
              for p in GATE.presets if p.where == "cuda" and p.standard}
    assert shapes == {"olmoe": (2048, 1024, 64, 8), "qwen3-30b-a3b": (2048, 768, 128, 8),
                      "mixtral": (4096, 14336, 8, 2), "top2-small": (1024, 2816, 16, 2)}
    for p in GATE.presets:
        if p.where == "cuda":
            assert p.params["dtype"] == "bfloat16" and 0 < p.memory_bytes < 100 * 2**30, p.name
    # `suite bench moe-bwd` runs every model; `suite run` (every gate) the small one alone
    cuda = torch.device("cuda")
    assert [p.name for p in GATE.default_presets(cuda)] == list(shapes)
    assert [p.name for p in GATE.default_presets(cuda, all_gates=True)] == ["top2-small"]


# torch.cuda.max_memory_allocated over gate and bench on the H200 (the runs: `git log --grep
# "H200_PEAKS runs"`), GiB, of a gate that judged the experts alone: what experts_bytes states
# (memory_bytes adds the block's part and a model layout's copies)
H200_PEAKS = {"olmoe": 10.47, "qwen3-30b-a3b": 13.96, "mixtral": 32.13, "top2-small": 4.72, "gpu-top1": 1.05,
              "gpu-top8": 3.31, "gpu-empty-expert": 1.05, "gpu-one-expert": 1.08, "gpu-capacity": 1.05}


@pytest.mark.parametrize("name", sorted(H200_PEAKS))
def test_a_presets_stated_need_covers_its_measured_peak_without_doubling_it(name):
    need = moe_presets.experts_bytes(GATE.preset(name).params) / 2**30
    assert H200_PEAKS[name] <= need <= 1.5 * H200_PEAKS[name]
    assert GATE.preset(name).memory_bytes == moe_presets.memory_bytes(GATE.preset(name).params)
