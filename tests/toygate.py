"""A gate whose arm is wrong by construction, registered by tests to prove exit code 1."""

import dataclasses

import torch

from suite.harness.gate import Gate, Preset, Tolerance

PRESET = Preset("tiny", {"n": 32}, where="any")


def make_buffers(preset, seed, device):
    return {"x": torch.randn(4, preset.params["n"], generator=torch.Generator().manual_seed(seed)).to(device)}


GATE = Gate(
    name="toy-wrong",
    summary="y = 2x, but the arm computes 2.1x",
    arm_name="toygate.wrong",
    needs_cuda=False,
    presets=(PRESET,),
    make_buffers=make_buffers,
    reference=lambda b, p: {"y": b["x"] * 2},
    arm=lambda b, p: {"y": b["x"] * 2.1},
    truth=lambda b, p: {"y": b["x"].double() * 2},
    parity=Tolerance(),
)

# the same toy, right this time, but declared CUDA-only
CUDA_GATE = dataclasses.replace(
    GATE, name="toy-cuda", summary="needs a GPU", arm_name="toygate.cuda", needs_cuda=True,
    arm=lambda b, p: {"y": b["x"] * 2},
)
