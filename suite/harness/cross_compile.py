"""Every Triton kernel an arm launches, compiled for a GPU that is not here.

The arm's own code runs on fake tensors (torch's FakeTensorMode) on a "cuda" device, so its
checks, tile choices and launch plans run as they would on the target card; each launch then
compiles its kernel for the target instead of running it, and the build is recorded: shared
memory against the card's limit, registers and spills (ptxas's own count), or the compiler's
error. Targets: the H200 (sm_90) and the user's RTX 50-series card (sm_120, under the rtx
profile, whose tiles it must hold to 99 KiB); a B200 (sm_100) on request.

Kernel outputs stay unwritten and every pointer reads as 16-byte aligned (the case every real
buffer of the arms is). No GPU or driver is needed, but torch must be a CUDA build: the fake
tensors go through its device guards, which a CPU build lacks. Autograd's engine needs a real
device, so an arm's backward is driven through its public launch plans, not through .backward().
"""

from __future__ import annotations

import contextlib
import io
import os
import re
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from typing import Iterator
from unittest import mock

import torch

from suite import device_profile, triton_support
from suite.errors import CouldNotRun


@dataclass(frozen=True)
class Target:
    name: str
    arch: int  # compute capability, major * 10 + minor
    profile: str  # SUITE_PROFILE the suite's configs are chosen under
    smem_bytes: int  # shared memory one block may take
    sm_count: int


TARGETS = {
    "sm90": Target("sm90", 90, "none", 232448, 132),  # the H200
    # an RTX 5080's SMs; the shared memory is every 12.0 card's
    "sm120": Target("sm120", 120, "rtx", device_profile.RTX_SMEM_BYTES, 84),
    "sm100": Target("sm100", 100, "none", 232448, 148),  # a B200: on request, no card of ours
}


@dataclass
class Build:
    """One kernel specialization compiled for a target, or the error that stopped it."""

    kernel: str
    meta: dict
    signature: str
    target: str
    limit: int
    shared: int | None = None
    registers: int | None = None
    spill_bytes: int | None = None  # spill stores plus loads, per thread
    seconds: float = 0.0
    error: str | None = None
    cases: list[str] = field(default_factory=list)

    @property
    def key(self) -> tuple:
        return self.kernel, self.signature, tuple(sorted(self.meta.items())), self.target

    @property
    def fits(self) -> bool:
        return self.error is None and self.shared is not None and self.shared <= self.limit


class _FakeDriver:
    """What Triton, and the suite through it, asks the driver while it binds and compiles: a
    device, a stream, a target, the shared memory. The device number is the arch, so each
    target keeps its own compiled kernels."""

    def __init__(self, target: Target):
        from triton.backends.compiler import GPUTarget

        self.arch, self.target = target.arch, GPUTarget("cuda", target.arch, 32)
        smem = target.smem_bytes
        self.utils = type("Utils", (), {"get_device_properties": staticmethod(lambda index: {"max_shared_mem": smem})})

    def get_current_device(self) -> int:
        return self.arch

    def get_current_stream(self, device=None) -> int:
        return 0

    def get_current_target(self):
        return self.target


def require_cross_compiling() -> None:
    """CouldNotRun, naming the fix, where this process cannot compile for a fake card: torch
    cannot make fake CUDA tensors, or Triton interprets its kernels."""
    if not torch.backends.cuda.is_built():
        raise CouldNotRun("compiling for a GPU that is not here needs a CUDA build of torch (its device guards "
                          f"run on the fake tensors); this torch, {torch.__version__}, is a CPU build: install "
                          "the default Linux wheel of torch in another environment")
    if triton_support.interpreted():
        raise CouldNotRun("compiling for a GPU: unset TRITON_INTERPRET (the interpreter compiles nothing)")


_PTXAS_USAGE = re.compile(r"Used (\d+) registers")
_PTXAS_SPILLS = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")


def ptxas_usage(ptx: str, arch: int) -> tuple[int | None, int | None]:
    """(registers, spill bytes) of a kernel's PTX, as ptxas reports them for its target."""
    from triton.backends.nvidia.compiler import get_ptxas

    gpu = re.search(r"^\.target\s+(\w+)", ptx, re.M)
    with tempfile.TemporaryDirectory() as folder:
        source = os.path.join(folder, "kernel.ptx")
        with open(source, "w") as f:
            f.write(ptx)
        done = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name={gpu.group(1) if gpu else f'sm_{arch}'}",
                               source, "-o", os.path.join(folder, "kernel.cubin")],
                              capture_output=True, text=True, check=False)
    log = done.stdout + done.stderr
    registers = _PTXAS_USAGE.search(log)
    spills = _PTXAS_SPILLS.search(log)
    return (int(registers.group(1)) if registers else None,
            sum(map(int, spills.groups())) if spills else None)


def _mock_argument(arg):
    """A launch argument as Triton's warm-up takes it: a tensor by its dtype alone (a
    MockTensor, 16-byte aligned), a TensorDescriptor over such a base, anything else as is."""
    from triton.runtime.jit import MockTensor
    from triton.tools.tensor_descriptor import TensorDescriptor

    if isinstance(arg, torch.Tensor):
        return MockTensor(arg.dtype)
    if isinstance(arg, TensorDescriptor):
        return TensorDescriptor(MockTensor(arg.base.dtype), arg.shape, arg.strides, arg.block_shape)
    return arg


def _signature(args) -> str:
    """What a build was specialised on, readably: dtypes, descriptor blocks, integer classes."""
    parts = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            parts.append(str(arg.dtype).removeprefix("torch."))
        elif hasattr(arg, "block_shape"):
            parts.append(f"desc{list(arg.block_shape)}")
        else:
            parts.append(str(triton_support.specialization_key((arg,))[0]))
    return ",".join(parts)


@contextlib.contextmanager
def compiling_for(target: Target, usage: bool = True) -> Iterator[list[Build]]:
    """Inside, tensors made on device "cuda" are fake, and every launch of a suite kernel
    compiles for `target` instead of running; the builds land in the list yielded, one per
    launch (callers dedupe by Build.key). usage: ask ptxas for registers and spills (a second
    ptxas run a build)."""
    import triton
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    require_cross_compiling()
    builds: list[Build] = []

    def compile_only(bound: triton_support.Launcher, grid, *args):
        build = Build(bound.kernel.fn.__name__, dict(bound.meta), _signature(args), target.name, target.smem_bytes)
        start = time.perf_counter()
        try:
            # Triton prints some compile errors' context before raising: keep it with the error
            with contextlib.redirect_stderr(io.StringIO()) as said:
                compiled = bound.kernel.warmup(*map(_mock_argument, args), grid=grid, **bound.meta)
            build.shared = compiled.metadata.shared
            if usage:
                build.registers, build.spill_bytes = ptxas_usage(compiled.asm["ptx"], target.arch)
        except Exception as error:  # noqa: BLE001 - a compile error is the finding, recorded
            build.error = f"{type(error).__name__}: {error}".strip() + said.getvalue()[-2000:]
        build.seconds = time.perf_counter() - start
        builds.append(build)

    def planned(self, *tensors):
        self.bound(self.grid, *tensors, *self.scalars)

    def kept(self, bound, grid, varying, tensors, scalars):
        bound(grid, *tensors, *scalars)

    def descriptor_ready(t):  # every fake pointer is aligned: the strides decide
        return all(t.shape) and triton_support.descriptor_strides(t.stride(), t.element_size())

    properties = type("Properties", (), {"multi_processor_count": target.sm_count})
    patches = [
        mock.patch.object(triton_support.Launcher, "__call__", compile_only),
        mock.patch.object(triton_support.PlannedLaunch, "__call__", planned),
        mock.patch.object(triton_support.KeptLaunches, "__call__", kept),
        mock.patch.object(triton_support, "descriptor_ready", descriptor_ready),
        mock.patch.object(torch.cuda, "current_device", lambda: 0),
        mock.patch.object(torch.cuda, "get_device_capability", lambda device=None: divmod(target.arch, 10)),
        mock.patch.object(torch.cuda, "get_device_properties", lambda device=None: properties),
        mock.patch.object(torch._C, "_cuda_getDevice", lambda: 0, create=True),
        mock.patch.object(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, create=True),
        mock.patch.object(FakeTensor, "data_ptr", lambda self: 0, create=True),
        mock.patch.dict(os.environ, {"SUITE_PROFILE": target.profile}),
    ]
    driver = triton.runtime.driver
    with contextlib.ExitStack() as stack:
        for patch in patches:
            stack.enter_context(patch)
        # the real driver, if any, comes back as it was (on a CPU there is none to make)
        stack.enter_context(mock.patch.object(driver, "_active", _FakeDriver(target)))
        _forget_device_choices()
        stack.callback(_forget_device_choices)  # what was chosen for the fake card dies with it
        stack.enter_context(FakeTensorMode(allow_non_fake_inputs=True))
        stack.enter_context(torch.no_grad())
        yield builds


def _forget_device_choices() -> None:
    """Drop what the suite keeps per device: its capability and shared memory, and the arms'
    tiles, plans and workspaces chosen from them."""
    from suite.arms import rmsnorm
    from suite.arms.moe import config

    device_profile.forget()
    config.forget()
    rmsnorm.forget()
