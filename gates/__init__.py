"""The gate registry: one module per gate, listed here so discovery is explicit.

Modules import lazily: importing a gate imports its arm, and with it Triton, which must not
happen before the CLI has decided whether Triton runs interpreted (on the CPU).
"""

from __future__ import annotations

import difflib
import importlib

from suite.errors import UsageError
from suite.harness.gate import Gate

GATE_MODULES = {
    "rmsnorm": "gates.rmsnorm",
    "graph-capture": "gates.graph_capture",
    "moe-bwd": "gates.moe_bwd",
    "split-muon": "gates.split_muon",
    "skip-step": "gates.skip_step",
    "checkpoint": "gates.checkpoint",
    "train-step": "gates.train_step",
}


def names() -> list[str]:
    return list(GATE_MODULES)


def get(name: str) -> Gate:
    if name not in GATE_MODULES:
        close = difflib.get_close_matches(name, GATE_MODULES, n=1)
        hint = f" Did you mean {close[0]!r}?" if close else ""
        raise UsageError(f"no gate named {name!r}; the gates are: {', '.join(GATE_MODULES)}.{hint} (see `suite list`)")
    return importlib.import_module(GATE_MODULES[name]).GATE


def select(name: str) -> list[Gate]:
    """`all` or one gate's name."""
    return [get(n) for n in GATE_MODULES] if name == "all" else [get(name)]
