"""Where a run happened: the machine and software a figure belongs to.

Nothing here may fail a run: a missing nvidia-smi, git or triton leaves its fields empty.
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import re
import subprocess
from pathlib import Path

import torch

from suite.harness.results import Fingerprint, slugify
from suite.settings import gpu_memory_cap

# suite/harness/fingerprint.py -> the project root, where git answers for this checkout
PROJECT_ROOT = Path(__file__).resolve().parents[2]
_COMMAND_TIMEOUT_S = 5
_SMI_FIELDS = ("uuid", "driver_version", "clocks.sm", "clocks.mem", "clocks.max.sm")
_CLOCK_NAMES = {"clocks.sm": "sm", "clocks.mem": "mem", "clocks.max.sm": "max_sm"}


def device_slug(name: str) -> str:
    """"NVIDIA H200" -> "nvidia-h200": the directory name of a device's baselines."""
    return slugify(name)


def _run(args: list[str], cwd: Path | None = None) -> str | None:
    """stdout of a short command, or None when it is missing, fails or hangs."""
    try:
        done = subprocess.run(
            args, cwd=cwd, capture_output=True, text=True, timeout=_COMMAND_TIMEOUT_S, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout if done.returncode == 0 else None


def _nvidia_smi(uuid: str | None) -> tuple[str | None, dict[str, int]]:
    """(driver version, clocks in MHz) for the GPU with this UUID.

    Rows are matched by UUID because nvidia-smi numbers GPUs its own way, not as
    CUDA_VISIBLE_DEVICES does; without a match only the driver (the same for all) is kept.
    """
    out = _run(["nvidia-smi", f"--query-gpu={','.join(_SMI_FIELDS)}",
                "--format=csv,noheader,nounits"])
    if not out:
        return None, {}
    rows = [dict(zip(_SMI_FIELDS, (v.strip() for v in line.split(","))))
            for line in out.splitlines() if line.strip()]
    if not rows:
        return None, {}
    row = next((r for r in rows if uuid and r.get("uuid") == uuid), None)
    if row is None:
        return rows[0].get("driver_version") or None, {}
    clocks = {name: int(row[field]) for field, name in _CLOCK_NAMES.items()
              if row.get(field, "").isdigit()}  # "[N/A]" where a clock cannot be read
    return row.get("driver_version") or None, clocks


def _package_version(*names: str) -> str | None:
    # importlib.metadata, not `import triton`: importing triton would fix TRITON_INTERPRET
    # for the whole process before the runner sets it.
    for name in names:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _git(root: Path) -> tuple[str | None, bool | None]:
    # A copy of a checkout taken elsewhere (the GPU machine's) may carry a git of another
    # commit, its tree then "dirty"; whoever copied it names the commit it was copied at.
    copied_at = os.environ.get("SUITE_GIT_SHA", "").strip()
    if copied_at:
        return copied_at, None
    sha = _run(["git", "rev-parse", "HEAD"], cwd=root) if (root / ".git").exists() else None
    if sha is None:
        # a copy of the tree without its history (the GPU machine's): the sha it was copied
        # at, when whoever copied it wrote one; otherwise no sha to claim
        stamp = root / ".git-sha"
        return (stamp.read_text().strip() or None, None) if stamp.is_file() else (None, None)
    status = _run(["git", "status", "--porcelain"], cwd=root)
    return sha.strip(), None if status is None else bool(status.strip())


def fingerprint(device: torch.device, profile: str) -> Fingerprint:
    device = torch.device(device)
    git_sha, git_dirty = _git(PROJECT_ROOT)
    fields: dict = dict(
        device_slug=device.type,
        cuda=torch.version.cuda,
        torch=torch.__version__,
        triton=_package_version("triton", "pytorch-triton"),
        python=platform.python_version(),
        platform=platform.platform(),
        git_sha=git_sha,
        git_dirty=git_dirty,
        profile=profile,
    )
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        uuid = getattr(props, "uuid", None)
        driver, clocks = _nvidia_smi(None if uuid is None else f"GPU-{uuid}")
        fields.update(
            device_slug=device_slug(props.name),
            gpu_name=props.name,
            compute_capability=f"{props.major}.{props.minor}",
            gpu_memory_bytes=props.total_memory,
            sm_count=props.multi_processor_count,
            driver=driver,
            clocks=clocks,
            gpu_memory_cap_bytes=gpu_memory_cap(device),
        )
    return Fingerprint(**fields)


def _major_minor(version: str | None) -> str | None:
    """"2.13.0+cu130" -> "2.13"; None stays None."""
    if version is None:
        return None
    match = re.match(r"(\d+)\.(\d+)", version)
    return f"{match[1]}.{match[2]}" if match else version


def fingerprint_class(fp: Fingerprint) -> dict[str, str | None]:
    """What must match for two runs' timings to be comparable. Patch versions, driver,
    clocks and git sha are left out: comparing across them is the point of a baseline."""
    return {
        "device_slug": fp.device_slug,
        "compute_capability": fp.compute_capability,
        "torch": _major_minor(fp.torch),
        "triton": _major_minor(fp.triton),
        "profile": _profile_in_effect(fp),
    }


def imitates_rtx(fp: Fingerprint) -> bool:
    """A run held to the rtx profile's shared memory on a card that is not the RTX 50-series
    (compute capability 12.x): another class of machine than that card's own runs."""
    return _profile_in_effect(fp) == "rtx" and not (fp.compute_capability or "").startswith("12.")


def _profile_in_effect(fp: Fingerprint) -> str:
    # "auto" (as reports before the runner recorded the resolved profile say) means rtx on a
    # compute-capability-12 card and none elsewhere
    if fp.profile != "auto":
        return fp.profile
    return "rtx" if (fp.compute_capability or "").startswith("12.") else "none"
