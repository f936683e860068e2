"""How a model stores its experts' weights, and the views the kernels read them through.

transformers keeps each expert's gate and up projections in one tensor, `gate_up_proj`, and
down in `down_proj`, in one of the layouts its experts classes declare: [E, 2f, d] and
[E, d, f] (nn.Linear's [out, in]; is_transposed=False) or [E, d, 2f] and [E, f, d]
(is_transposed=True), gate's f rows before up's (is_concatenated=True) or the two alternating.
`GateUpLayout` names one of them. The experts read such weights in place, and return their
gradients in the same layout, written there by the kernels: a gradient that came back as two
[E, d, f] halves would cost autograd a zero-fill and three copies of weight-sized memory to
build the fused parameter's gradient (the slice and transpose backwards).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GateUpLayout:
    """transposed: gate_up [E, d, 2f] and down [E, f, d] ([in, out]), else [E, 2f, d] and
    [E, d, f] ([out, in]); concatenated: gate's f then up's along 2f, else alternating."""

    transposed: bool = False
    concatenated: bool = True

    def sizes(self, gate_up: torch.Tensor, down: torch.Tensor, fn: str) -> tuple[int, int, int]:
        """(E, d, f) of a gate_up and down in this layout; ValueError naming the shapes if not."""
        for name, t in (("gate_up_proj", gate_up), ("down_proj", down)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{fn}: {name} must be a tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise ValueError(f"{fn}: {name} must be 3-D [experts, ...], got shape {tuple(t.shape)}")
        num_experts = gate_up.shape[0]
        d, two_f = (gate_up.shape[1], gate_up.shape[2]) if self.transposed else (gate_up.shape[2], gate_up.shape[1])
        f = two_f // 2
        want_down = (num_experts, f, d) if self.transposed else (num_experts, d, f)
        if two_f % 2 or tuple(down.shape) != want_down:
            spelled = ("gate_up_proj [E, d, 2f] and down_proj [E, f, d]" if self.transposed
                       else "gate_up_proj [E, 2f, d] and down_proj [E, d, f]")
            raise ValueError(f"{fn}: transposed={self.transposed} takes {spelled}, got {tuple(gate_up.shape)} and "
                             f"{tuple(down.shape)}")
        return num_experts, d, f

    def dims(self, gate_up: torch.Tensor) -> tuple[int, int, int]:
        """(E, d, f) of a gate_up in this layout, unchecked (`sizes` checks)."""
        num_experts, a, b = gate_up.shape
        return (num_experts, a, b // 2) if self.transposed else (num_experts, b, a // 2)

    def halves(self, pair: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The gate and up halves of a [..., 2f] tensor laid out along its last dim as this
        layout's 2f are."""
        f = pair.shape[-1] // 2
        return (pair[..., :f], pair[..., f:]) if self.concatenated else (pair[..., 0::2], pair[..., 1::2])

    def gate_up_views(self, gate_up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_gate, w_up), each [E, d, f], as views of gate_up."""
        return self.halves(gate_up if self.transposed else gate_up.transpose(1, 2))

    def down_view(self, down: torch.Tensor) -> torch.Tensor:
        """w_down [E, f, d] as a view of down."""
        return down if self.transposed else down.transpose(1, 2)

    def views(self, gate_up: torch.Tensor, down: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(w_gate [E, d, f], w_up [E, d, f], w_down [E, f, d]) as views of gate_up and down, no
        copy: what `experts` and the reference take, gradients flowing back through the views."""
        return (*self.gate_up_views(gate_up), self.down_view(down))

    def rows_strides(self, gate_up: torch.Tensor) -> tuple[int, int, int]:
        """gate_up's (expert, row, column) strides read as [E, 2f, d], each expert's 2f rows
        against d: dx's weight, against dg and du side by side in gate_up's order."""
        s_e, s_1, s_2 = gate_up.stride()
        return (s_e, s_2, s_1) if self.transposed else (s_e, s_1, s_2)
