"""Watching a forward and backward for work on weight-sized memory besides the kernels' own:
the zero-fills, copies and adds autograd makes when a gradient comes back in another layout
than its parameter's (slice and transpose backwards), which a bench that times the kernels
alone never sees."""

from __future__ import annotations

import math

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from suite import triton_support

aten = torch.ops.aten
# allocations and GEMMs: a GEMM's output is the gradient itself, not a pass over it
_ALLOWED = {aten.empty.memory_format, aten.empty_strided.default, aten.new_empty.default,
            aten.new_empty_strided.default, aten._grouped_mm.default, aten.mm.default, aten.bmm.default}
GEMM_EVENTS = {"aten::_grouped_mm", "aten::mm", "aten::bmm", "aten::addmm", "aten::matmul", "aten::linear"}


class WeightSizedOps(TorchDispatchMode):
    """Records each aten op that reads or writes a tensor of at least `floor` elements and is
    neither a view, an allocation nor a GEMM. The suite's Triton launches are not watched: under
    the interpreter they copy their arguments around, which a GPU launch does not."""

    def __init__(self, floor: int, monkeypatch):
        super().__init__()
        self.floor, self.found, self._inside_launch = floor, [], 0
        launch = triton_support.Launcher.__call__

        def unwatched(launcher, grid, *args):
            self._inside_launch += 1
            try:
                return launch(launcher, grid, *args)
            finally:
                self._inside_launch -= 1

        monkeypatch.setattr(triton_support.Launcher, "__call__", unwatched)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not self._inside_launch and not func.is_view and func not in _ALLOWED:
            big = [tuple(t.shape) for t in tree_leaves((args, kwargs, out))
                   if isinstance(t, torch.Tensor) and t.numel() >= self.floor]
            if big:
                self.found.append(f"{func} on {big}")
        return out


def weight_sized_kernels(prof, floor: int) -> list[str]:
    """From a torch.profiler run with record_shapes: each aten op, GEMMs aside, that launched a
    GPU kernel with an input of at least `floor` elements (a fill, copy or add over a weight)."""
    return [f"{e.name} {e.input_shapes} -> {[k.name for k in e.kernels]}" for e in prof.events()
            if e.kernels and e.name.startswith("aten::") and e.name not in GEMM_EVENTS
            and any(_elements(shape) >= floor for shape in e.input_shapes)]


def _elements(shape) -> int:
    """A tensor input's elements; 0 for any other argument (a scalar's [], a list's nested one)."""
    if not shape or not all(isinstance(n, int) for n in shape):
        return 0
    return math.prod(shape)
