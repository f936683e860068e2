"""Toy gates that tests register beside the real ones.

- GATE: the arm is wrong by construction (exit code 1).
- CUDA_GATE: right, but declared CUDA-only.
- CRASH_GATE: its arm ends the process, as a device fault or the kernel's OOM killer would.
- BENCH_GATE: a whole gate written against the contract alone (no harness file knows it): an
  exact integer output beside a tolerance-judged float one, a saboteur, three contenders and a
  wall-clock bench, so it gates and benches on the CPU.
"""

import dataclasses
import os

import torch

from suite.harness.criteria import NotSlowerThan
from suite.harness.gate import (
    BenchCase,
    Bitwise,
    Contender,
    Gate,
    Preset,
    Saboteur,
    Tolerance,
)
from suite.harness.results import Check

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

CRASH_GATE = dataclasses.replace(
    GATE, name="toy-crash", summary="its arm ends the process", arm_name="toygate.crash", arm=lambda b, p: os._exit(9),
)


# ---- a gate with a bench, written against the contract alone ----


def row_sums_loop(x: torch.Tensor) -> torch.Tensor:
    """The reference: one row at a time."""
    return torch.stack([row.sum() for row in x])


def row_sums(x: torch.Tensor) -> torch.Tensor:
    """The arm: one reduction."""
    return x.sum(dim=1)


def _outputs(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    return {"sums": sums, "largest": sums.argmax().reshape(1)}


def _build(fn):
    def build(case, buffers, preset):
        x = buffers["x"]
        return lambda: fn(x)

    return build


BENCH_GATE = Gate(
    name="toy-bench",
    summary="Row sums: one reduction vs a loop over rows",
    arm_name="toygate.row_sums",
    needs_cuda=False,
    presets=(Preset("tiny", {"n": 64}, where="any"), Preset("wide", {"n": 4096}, where="any", standard=False)),
    make_buffers=lambda preset, seed, device: {
        "x": torch.randn(64, preset.params["n"], generator=torch.Generator().manual_seed(seed)).to(device)},
    reference=lambda b, p: _outputs(row_sums_loop(b["x"])),
    arm=lambda b, p: _outputs(row_sums(b["x"])),
    truth=lambda b, p: _outputs(b["x"].double().sum(dim=1)),
    parity=Tolerance(k=2.0),
    parity_by_output={"largest": Bitwise()},  # which row is largest must be exact
    saboteurs=(
        Saboteur("drops-last-column", "sums all but the last column",
                 lambda b, p: _outputs(b["x"][:, :-1].sum(dim=1)), caught_by=Check.PARITY),
    ),
    contenders=(
        Contender("reference", "reference", _build(row_sums_loop)),
        Contender("arm", "arm", _build(row_sums)),
        Contender("einsum", "peer", _build(lambda x: torch.einsum("ij->i", x))),
        Contender("absent", "peer", _build(row_sums), unavailable=lambda device: "not installed here"),
    ),
    benches=(BenchCase("sum", "row sums of a 64-row matrix", bytes=lambda p: 64 * p.params["n"] * 4,
                       ceiling="none", modes=("wall",), window=5, calls_per_round=3, setup=True,
                       recommend=True),),
    criteria=(NotSlowerThan(),),
)
