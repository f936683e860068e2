"""The RTX card's shared-memory limit, checked on whatever GPU runs the tests: the kernels an
arm compiles under the rtx profile (recorded as they launch), or compiles, without launching,
for the RTX 50-series' sm_120 (the configs that card really gets)."""

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


def record_compiled(monkeypatch) -> list[tuple[str, Any]]:
    """Under the rtx profile, every kernel compiled from now on, as (name, compiled kernel)."""
    monkeypatch.setenv("SUITE_PROFILE", "rtx")
    recorded: list[tuple[str, Any]] = []
    monkeypatch.setattr(triton_support, "RECORD_COMPILED", True)
    monkeypatch.setattr(triton_support, "compiled_kernels", _Recorder(recorded))
    return recorded


def compile_for_sm120(monkeypatch) -> list[tuple[str, Any]]:
    """Under the rtx profile, every Triton launch compiles for sm_120 instead of running (the
    outputs stay unwritten); returns the (name, compiled kernel) list they fill."""
    import triton
    from triton.backends.compiler import GPUTarget

    driver = triton.runtime.driver.active
    monkeypatch.setenv("SUITE_PROFILE", "rtx")
    monkeypatch.setattr(driver, "get_current_target", lambda: GPUTarget("cuda", 120, 32))
    kernels: list[tuple[str, Any]] = []

    def compile_only(bound: triton_support.Launcher, grid, *args):
        kernel = bound.kernel
        kernel.device_caches.clear()  # forget this GPU's builds: the target is part of the cache
        kernels.append((kernel.fn.__name__, kernel.warmup(*args, grid=grid, **bound.meta)))
        kernel.device_caches.clear()

    monkeypatch.setattr(triton_support.Launcher, "__call__", compile_only)
    # DirectLaunches kept by earlier launches of the same configs step aside, to the Launcher
    monkeypatch.setattr(triton_support, "FAST_LAUNCH", False)
    return kernels


def assert_fit_rtx(kernels: list[tuple[str, Any]], arch: int | None = None) -> None:
    for name, compiled in kernels:
        if arch is not None:
            assert compiled.metadata.target.arch == arch, name
        assert compiled.metadata.shared <= RTX_SMEM_BYTES, (name, compiled.metadata.shared)
