"""The process settings every command shares: the device, whether Triton interprets, the
profile, and the GPU memory the process may use.

They are decided once, before any gate (and so Triton) is imported, from the command line and
the environment: an explicit `--profile` wins over SUITE_PROFILE, which wins over auto, and
`--gpu-memory` over SUITE_GPU_MEMORY. The decisions are written back to those variables, which
is what the arms and the runner read (suite.device_profile, `gpu_memory_cap`), so a run and
every worker it launches agree on them.
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass

import torch

from suite.device_profile import active_profile
from suite.errors import CouldNotRun, UsageError

DEVICES = ("auto", "cuda", "cpu")
PROFILES = ("auto", "rtx", "none")


@dataclass(frozen=True)
class Settings:
    device: torch.device
    profile_choice: str  # what was asked for: auto, rtx or none
    interpret: bool  # Triton kernels run under its CPU interpreter

    @property
    def profile(self) -> str:
        """The profile in effect: rtx or none (auto resolved on this device)."""
        return active_profile(self.device)


def resolve_device(choice: str) -> torch.device:
    """auto: CUDA when present, else the CPU. Asking for CUDA without one cannot run."""
    if choice not in DEVICES:
        raise UsageError(f"--device must be auto, cuda or cpu, not {choice!r}")
    if choice == "auto":
        choice = "cuda" if torch.cuda.is_available() else "cpu"
    if choice == "cuda" and not torch.cuda.is_available():
        raise CouldNotRun(
            "--device cuda: this machine has no usable CUDA device (torch.cuda.is_available() is False, "
            f"torch {torch.__version__}); run on a GPU machine or use --device cpu"
        )
    return torch.device(choice)


def resolve_profile(option: str | None) -> str:
    """--profile if given, else SUITE_PROFILE, else auto; anything else is a usage error."""
    if option is not None:
        source, value = "--profile", option
    else:
        source, value = "SUITE_PROFILE", os.environ.get("SUITE_PROFILE", "auto")
    choice = value.strip().lower() or "auto"
    if choice not in PROFILES:
        raise UsageError(f"{source} must be auto, rtx or none, not {value!r}")
    return choice


def _choose_triton_mode(device: torch.device) -> bool:
    """Triton kernels run on the CPU only through its interpreter, chosen before import."""
    if device.type != "cpu":
        return os.environ.get("TRITON_INTERPRET") == "1"
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise CouldNotRun("triton was imported before the CPU interpreter could be chosen; set TRITON_INTERPRET=1")
    os.environ["TRITON_INTERPRET"] = "1"
    return True


def resolve_gpu_memory(option: str | None) -> float | None:
    """--gpu-memory if given, else SUITE_GPU_MEMORY: GiB the process may allocate on the GPU
    (the RTX card's 16, say), or None for the whole card ("", "none" or "0")."""
    source, value = ("--gpu-memory", option) if option is not None else (
        "SUITE_GPU_MEMORY", os.environ.get("SUITE_GPU_MEMORY", ""))
    text = value.strip().lower()
    if text in ("", "none", "0"):
        return None
    try:
        gib = float(text)
    except ValueError:
        gib = math.nan
    if not math.isfinite(gib) or gib <= 0:
        raise UsageError(f"{source} must be a number of GiB above 0 (16 for the RTX card) or none, not {value!r}")
    return gib


def _cap_gpu_memory(gib: float | None, device: torch.device) -> None:
    """Hold this process's CUDA allocations to `gib` (torch's per-process fraction: past it an
    allocation raises OutOfMemoryError, as on a card of that size)."""
    if gib is None or device.type != "cuda":
        return
    total = torch.cuda.get_device_properties(device).total_memory
    cap = int(gib * 2**30)
    if cap > total:
        raise UsageError(f"--gpu-memory {gib:g} GiB is more than this GPU's {total / 2**30:.1f} GiB; "
                         "give at most that, or none for the whole card")
    index = device.index if device.index is not None else torch.cuda.current_device()  # it takes no bare "cuda"
    torch.cuda.set_per_process_memory_fraction(cap / total, index)


def gpu_memory_cap(device: torch.device) -> int | None:
    """The cap `configure` set for this process (bytes), or None."""
    gib = resolve_gpu_memory(None)
    return None if gib is None or device.type != "cuda" else int(gib * 2**30)


def configure(device: str = "auto", profile: str | None = None, gpu_memory: str | None = None) -> Settings:
    """Decide the settings for this process; call before importing a gate."""
    choice = resolve_profile(profile)
    gib = resolve_gpu_memory(gpu_memory)
    resolved = resolve_device(device)
    _cap_gpu_memory(gib, resolved)
    os.environ["SUITE_PROFILE"] = choice
    os.environ["SUITE_GPU_MEMORY"] = "" if gib is None else f"{gib:g}"
    return Settings(device=resolved, profile_choice=choice, interpret=_choose_triton_mode(resolved))
