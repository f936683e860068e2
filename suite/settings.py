"""The process settings every command shares: the device, whether Triton interprets, the profile.

They are decided once, before any gate (and so Triton) is imported, from the command line and
the environment: an explicit `--profile` wins over SUITE_PROFILE, which wins over auto. The
decision is written back to SUITE_PROFILE, which is what the arms read (suite.device_profile),
so a run and everything it launches agree on one profile.
"""

from __future__ import annotations

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


def configure(device: str = "auto", profile: str | None = None) -> Settings:
    """Decide the settings for this process; call before importing a gate."""
    choice = resolve_profile(profile)
    resolved = resolve_device(device)
    os.environ["SUITE_PROFILE"] = choice
    return Settings(device=resolved, profile_choice=choice, interpret=_choose_triton_mode(resolved))
