"""The RTX card's shared-memory limit, checked on whatever GPU runs the tests: the kernels an
arm compiles under the rtx profile, recorded as they launch. Their builds for the card's own
sm_120: tests/scripts/test_cross_compile.py."""

from __future__ import annotations

from typing import Any

from suite import triton_support
from suite.device_profile import RTX_SMEM_BYTES


class _Recorder(dict):
    """compiled_kernels that keeps every kernel recorded, variants of one kernel included."""

    def __init__(self, into):
        super().__init__()
        self.into = into

    def __setitem__(self, name, compiled):
        self.into.append((name, compiled))


def record_compiled(monkeypatch, profile: str = "rtx") -> list[tuple[str, Any]]:
    """Under `profile`, every kernel launched from now on, as (name, compiled kernel)."""
    monkeypatch.setenv("SUITE_PROFILE", profile)
    recorded: list[tuple[str, Any]] = []
    monkeypatch.setattr(triton_support, "RECORD_COMPILED", True)
    monkeypatch.setattr(triton_support, "compiled_kernels", _Recorder(recorded))
    return recorded


def assert_fit_rtx(kernels: list[tuple[str, Any]]) -> None:
    for name, compiled in kernels:
        assert compiled.metadata.shared <= RTX_SMEM_BYTES, (name, compiled.metadata.shared)
