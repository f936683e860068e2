"""Which GPU the suite sizes its kernels for.

The user trains on an RTX 50-series card (compute capability 12.0), whose blocks get far less
shared memory than a Hopper's. Benchmarks run on whatever GPU is at hand, so the `rtx` profile
lets a bigger GPU compile and check exactly the configurations the RTX card would get.

SUITE_PROFILE=rtx|none forces a profile; unset or "auto" picks `rtx` on a capability-12 device.
"""

from __future__ import annotations

import functools
import os
from typing import Literal

import torch

# Shared memory one block may use on a compute-capability-12.0 card (99 KiB).
RTX_SMEM_BYTES = 101376

Profile = Literal["rtx", "none"]


def _cuda_device(device) -> torch.device | None:
    """The CUDA device meant by `device` (None: the current one), or None if it is no CUDA device."""
    if device is None:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else None
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return device if device.index is not None else torch.device("cuda", torch.cuda.current_device())


@functools.lru_cache(maxsize=None)
def _capability_major(index: int) -> int:
    return torch.cuda.get_device_capability(index)[0]


@functools.lru_cache(maxsize=None)
def _max_shared_mem(index: int) -> int:
    import triton  # only here: importing triton fixes whether it interprets

    return int(triton.runtime.driver.active.utils.get_device_properties(index)["max_shared_mem"])


def forget() -> None:
    """Drop the device facts kept per process (tests and the cross-compiler swap cards)."""
    _capability_major.cache_clear()
    _max_shared_mem.cache_clear()


def active_profile(device=None) -> Profile:
    choice = os.environ.get("SUITE_PROFILE", "auto").strip().lower()
    if choice in ("rtx", "none"):
        return choice  # type: ignore[return-value]
    if choice not in ("", "auto"):
        raise ValueError(f"SUITE_PROFILE must be rtx, none or auto, not {choice!r}")
    cuda = _cuda_device(device)
    if cuda is None:
        return "none"
    return "rtx" if _capability_major(cuda.index) == 12 else "none"


def smem_limit(device=None) -> int:
    """Shared-memory bytes one block may use: the RTX card's under its profile, else the device's."""
    if active_profile(device) == "rtx":
        return RTX_SMEM_BYTES
    cuda = _cuda_device(device)
    if cuda is None:  # CPU / interpreter: size for the user's card
        return RTX_SMEM_BYTES
    return _max_shared_mem(cuda.index)
