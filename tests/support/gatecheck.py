"""What every gate's tests do, in one place: judge the arm on a preset's fresh buffers, and
prove a saboteur fails the gate by the check it names."""

from __future__ import annotations

import torch

from suite.harness import parity
from suite.harness.gate import Gate, Saboteur
from suite.harness.results import Check, ParityResult

Judged = tuple  # (preset, buffers, expected outputs)


def judge_setup(gate: Gate, preset_name: str, device: torch.device | str = "cpu", seed: int = 0) -> Judged:
    """A preset's buffers and what the arm is judged against (reference, truth, input digests)."""
    preset = gate.preset(preset_name)
    buffers = gate.make_buffers(preset, seed, torch.device(device))
    return preset, buffers, parity.expected_outputs(gate, preset, buffers)


def arm_result(gate: Gate, judged: Judged) -> tuple[ParityResult, dict]:
    """The arm judged as the runner judges it; asserts it passed, deterministic, inputs intact."""
    preset, buffers, expected = judged
    result, outputs = parity.judge_arm(gate, preset, buffers, expected)
    assert result.passed, result.failures
    assert result.deterministic and result.inputs_unchanged
    return result, outputs


def sabotaged_result(gate: Gate, judged: Judged, saboteur: Saboteur) -> tuple[ParityResult, dict]:
    """The saboteur judged on copies of the buffers; asserts the gate failed it by its check."""
    preset, buffers, expected = judged
    copies = {name: t.clone() for name, t in buffers.items()}
    result, outputs = parity.judge_arm(gate, preset, copies, expected, arm=saboteur.fn,
                                       second_run=saboteur.caught_by == Check.DETERMINISM)
    assert not result.passed
    assert saboteur.caught_by in result.checks_failed(), result.failures
    return result, outputs
