"""The MoE experts' launch paths, forced whatever a layer's size (the rules keep our pointer
kernels at test sizes), and what each launched, counted so a test can tell the path ran rather
than fell back."""

from __future__ import annotations

import torch

from suite import triton_support
from suite.arms.moe import config
from suite.arms.moe.kernels import rows_tma_kernel, up_tma_kernel

# the layer's paths: our pointer-fed kernels alone; the row GEMMs (up, down, d_a, dx) through
# TMA descriptors (`tma_gemms`); and those with d_a and the weight gradients through
# torch._grouped_mm (`vendor_gemms`: the H200 at the model presets) -> (TMA launches of a
# forward, of a backward; grouped_mm calls of a backward: one fewer for a model's fused
# gate_up, whose gradient is one GEMM)
PATHS = {"kernels": (0, 0, 0), "tma": (2, 2, 0), "tma+grads": (2, 1, 4)}


class PathCounts:
    """What a forced path launched: the TMA kernels and torch._grouped_mm's calls."""

    def __init__(self):
        self.tma, self.grouped_mm = [], []

    def times(self, path: str, forwards: int = 1, backwards: int | None = None, fused: bool = False) -> bool:
        """Whether the counts are the path's for that many forwards and backwards (as many);
        fused: the weights a model's gate_up and down."""
        backwards = forwards if backwards is None else backwards
        tma_forward, tma_backward, grouped_mm = PATHS[path]
        grouped_mm -= bool(fused and grouped_mm)
        return (len(self.tma), len(self.grouped_mm)) == (
            forwards * tma_forward + backwards * tma_backward, backwards * grouped_mm)


def force_path(monkeypatch, path: str) -> PathCounts:
    """Forces the path for the calls after it (kept plans dropped) and counts its launches."""
    counts = PathCounts()
    grouped_mm = getattr(torch, "_grouped_mm", None)
    if grouped_mm is not None:  # counted on every path: the kernels' must make no call
        monkeypatch.setattr(torch, "_grouped_mm",
                            lambda *a, **kw: counts.grouped_mm.append(a[0].shape) or grouped_mm(*a, **kw))
    launch = triton_support.Launcher.__call__

    def counted(self, grid, *args):
        if self.kernel in (up_tma_kernel, rows_tma_kernel):
            counts.tma.append(self.kernel)
        return launch(self, grid, *args)

    monkeypatch.setattr(triton_support.Launcher, "__call__", counted)
    monkeypatch.setattr(config, "tma_gemms", lambda *args: path != "kernels")
    monkeypatch.setattr(config, "vendor_gemms", lambda *args: "grads" in path)
    config.forget()  # plans kept per call shape hold the path
    return counts
