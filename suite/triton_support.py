"""What every Triton arm needs around a launch: the interpreter's bf16 rounding fixed, the
compiled kernels recorded on request (tests check their shared memory against the RTX limit),
and a cached launch that skips Triton's per-call Python.

`kernel[grid](...)` binds the arguments, builds a cache-key string, runs hooks and builds launch
metadata on every call: more host time than a small kernel takes on the GPU
(docs/arms/rmsnorm.md, "Why this way"). A `Launcher` (one per kernel and meta; `launch` finds
it, a launch config keeps it) does that once per specialization: it keeps the `CompiledKernel`
that `kernel[grid]` returned under a key of everything Triton specialises on, and later calls
hand the arguments straight to the kernel's C launcher.
"""

from __future__ import annotations

import contextlib
import functools
import os
from operator import or_

import numpy as np
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction
from triton.tools.tensor_descriptor import TensorDescriptor

from suite.errors import CouldNotRun, UsageError

# Tests set RECORD_COMPILED to collect each kernel's compiled form, keyed by kernel name.
RECORD_COMPILED = False
compiled_kernels: dict[str, object] = {}


def _fast_launch_setting(value: str) -> bool:
    """SUITE_TRITON_FAST_LAUNCH: 0 (or false, off, no) sends every launch through kernel[grid]
    (the probe measures both). Anything else but its on words is refused: `=false` read as on
    would leave a user who turned the cached launches off running them."""
    choice = value.strip().lower()
    if choice in ("0", "false", "off", "no"):
        return False
    if choice in ("", "1", "true", "on", "yes"):
        return True
    raise UsageError(f"SUITE_TRITON_FAST_LAUNCH must be 0 or 1 (false/true, off/on, no/yes), not {value!r}")


FAST_LAUNCH = _fast_launch_setting(os.environ.get("SUITE_TRITON_FAST_LAUNCH", "1"))
# The calling convention used below was read in these releases' source (runtime/jit.py
# JITFunction.run, compiler/compiler.py CompiledKernel, backends/nvidia/driver.py CudaLauncher)
# and is held to Triton's own launch by tests/test_triton_support.py; any other version
# launches through kernel[grid]. torch 2.11 brings 3.6, 2.12 and 2.13 bring 3.7, 2.14 brings 3.8.
FAST_LAUNCH_TRITON_VERSIONS = ("3.6.", "3.7.", "3.8.")
_fast_launch_verified = triton.__version__.startswith(FAST_LAUNCH_TRITON_VERSIONS)
# 3.6 generates a C launcher per kernel that takes the kernel's arguments spread out; 3.7 and
# 3.8 have one C launcher that takes them as a tuple, beside annotations that say which to drop.
_ARGUMENTS_AS_TUPLE = not triton.__version__.startswith("3.6.")


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1). Not triton.next_power_of_2: a constexpr
    function in triton 3.9, about 25 times slower a call on the host."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def interpreting(kernel) -> bool:
    """The env asks for the interpreter and triton honoured it when `kernel` was decorated."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not isinstance(kernel, JITFunction)


@triton.jit
def _decorated():
    """Decorated as every kernel of the suite is: whether triton.jit gave this process the
    interpreter (TRITON_INTERPRET=1 set before triton was imported)."""
    pass


def interpreted() -> bool:
    """Triton's interpreter runs this process's kernels, on the CPU's tensors."""
    return interpreting(_decorated)


def interprets(t: torch.Tensor) -> bool:
    """`t` would go through the interpreter: a CPU tensor in an interpreted process."""
    return t.device.type != "cuda" and interpreted()


def runs_on(t: torch.Tensor) -> bool:
    """Whether the suite's kernels can take t: a CUDA tensor, or any under the interpreter."""
    return t.is_cuda or interpreted()


def require_runnable(t: torch.Tensor, fn: str, advice: str = "", **others: torch.Tensor) -> None:
    """t on a device the kernels run on, and every other tensor on t's device: the launches hand
    Triton addresses, which it no longer checks (see _pointers). `fn` names the call."""
    if not runs_on(t):
        raise CouldNotRun(f"{fn}: the suite's Triton kernels need CUDA tensors (or TRITON_INTERPRET=1 set before "
                          f"triton is imported), got a tensor on {t.device}{advice}")
    for name, other in others.items():
        if other.device != t.device:
            raise ValueError(f"{fn}: {name} is on {other.device} but the input is on {t.device}; move it to "
                             f"{t.device}")


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


FLOAT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # what the kernels load and store


@contextlib.contextmanager
def _interpreter_rounds_bf16_like_gpu():
    """Triton's interpreter (3.9) truncates fp32 -> bf16 where GPUs round to nearest even, which
    would give interpreted bf16 outputs twice the GPU's rounding error."""
    from triton.runtime import interpreter

    truncating = interpreter.InterpreterBuilder.cast_impl

    def rounding(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.array(src.data, dtype=np.float32)).to(torch.bfloat16)
            return interpreter.TensorHandle(rounded.view(torch.int16).numpy().view(np.uint16), tl.bfloat16)
        return truncating(self, src, dst_type)

    interpreter.InterpreterBuilder.cast_impl = rounding
    try:
        yield
    finally:
        interpreter.InterpreterBuilder.cast_impl = truncating


# --------------------------------------------------------------------------------------------
# Specialization key
# --------------------------------------------------------------------------------------------

_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1
_I64_MIN, _I64_MAX = -(2**63), 2**63 - 1
_U64_MAX = 2**64 - 1


class UnsupportedArgument(Exception):
    """An argument of a kind the key does not model: the launch goes through Triton."""


def _int_key(value: int) -> str:
    """Triton (specialize.cc, alike from 3.6 to 3.9) passes 1 as a constexpr, else types an int
    i32 / i64 / u64 by range and marks it divisible by 16 ("D")."""
    if value == 1:
        return "one"
    if _I32_MIN <= value <= _I32_MAX:
        return "i32" if value % 16 else "i32D"
    if _I64_MIN <= value <= _I64_MAX:
        return "i64" if value % 16 else "i64D"
    if 0 <= value <= _U64_MAX:
        return "u64" if value % 16 else "u64D"
    raise UnsupportedArgument(value)  # Triton raises OverflowError: let it


_Tensor = torch.Tensor


def _arg_key(arg):
    # The common kinds first and inline: this runs for every argument of every launch.
    kind = type(arg)
    if kind is _Tensor:
        return arg.dtype, not arg.data_ptr() & 15
    if kind is int:
        if arg == 1:
            return "one"
        if _I32_MIN <= arg <= _I32_MAX:
            return "i32" if arg & 15 else "i32D"
        return _int_key(arg)
    if kind is float:
        return "fp32"
    if kind is bool:
        return "u1"
    if arg is None:
        return "none"
    if isinstance(arg, _Tensor):  # nn.Parameter and other subclasses
        return arg.dtype, not arg.data_ptr() & 15
    raise UnsupportedArgument(arg)


def specialization_key(args, constexpr_positions=frozenset()) -> tuple:
    """What Triton specialises a kernel on, for the positional `args` of one launch; raises
    UnsupportedArgument for an argument of a kind this key does not model.

    A tensor: its dtype and whether its data pointer is 16-byte aligned; an int: see `_int_key`;
    a float: always fp32; a bool: u1, never by value; None and constexpr parameters: by value.
    A key finer than Triton's is safe (one more cache entry), a coarser one is not.
    """
    if not constexpr_positions:
        return tuple(map(_arg_key, args))
    return tuple(
        ("constexpr", type(arg), arg) if position in constexpr_positions else _arg_key(arg)
        for position, arg in enumerate(args)
    )


# --------------------------------------------------------------------------------------------
# Cached launches
# --------------------------------------------------------------------------------------------


class _CachedLaunch:
    __slots__ = ("compiled", "call", "prefix", "tail", "as_tuple")

    def __init__(self, compiled, call, prefix, tail, as_tuple=False):
        self.compiled = compiled
        # call(grid_0, grid_1, grid_2, stream, *prefix, *args, *tail), or with as_tuple
        # call(grid_0, grid_1, grid_2, stream, *prefix, (*args, *tail))
        self.call = call
        self.prefix = prefix
        self.tail = tail  # parameters after the positional ones (constexprs from meta)
        self.as_tuple = as_tuple


_MISSING = object()


def _idle(hook) -> bool:
    # 3.6 to 3.8 keep hooks as HookChain objects, empty unless a profiler registered one.
    return hook is None or not getattr(hook, "calls", True)


def _hooks_idle(kernel: JITFunction) -> bool:
    """No launch hook (a profiler's), no pre-run hook and no stages-inspection hook (3.7's,
    which recompiles with a pipeline of its own): nothing the cached path would skip."""
    runtime = knobs.runtime
    return (_idle(runtime.launch_enter_hook) and _idle(runtime.launch_exit_hook) and not kernel.pre_run_hooks
            and getattr(runtime, "add_stages_inspection_hook", None) is None)


def _tail_params(kernel: JITFunction, n_positional: int, meta: dict) -> tuple | None:
    """Values of the parameters not passed positionally, in signature order, or None when one
    of them is not a constexpr (its value would then be part of every call, not of the key)."""
    tail = []
    for param in kernel.params[n_positional:]:
        if not param.is_constexpr:
            return None
        if param.name in meta:
            tail.append(meta[param.name])
        elif param.has_default:
            tail.append(param.default)
        else:
            return None  # Triton raises the missing-argument error
    return tuple(tail)


def _cached_launch(kernel: JITFunction, compiled, n_positional: int, meta: dict) -> _CachedLaunch | None:
    """How to call `compiled` again without Triton's Python, or None to keep using kernel[grid].

    CompiledKernel.run is a CudaLauncher; JITFunction.run calls it as run(grid_0, grid_1, grid_2,
    stream, function, packed_metadata, launch_metadata, enter_hook, exit_hook, *every parameter
    in signature order, constexprs included), and it forwards to its C `launch` with the
    cooperative-grid and PDL flags and two scratch buffers: in 3.6 before packed_metadata, with
    the parameters spread; in 3.7 and 3.8 after the hooks, then the parameters' annotations and
    signature, then the parameters as one tuple. With idle hooks, passing None for the launch
    metadata and both hooks is what the C launcher skips on.
    """
    tail = _tail_params(kernel, n_positional, meta)
    if tail is None or compiled is None or getattr(compiled, "function", None) is None:
        return None
    launcher = compiled.run
    if (
        getattr(launcher, "global_scratch_size", None) == 0
        and getattr(launcher, "profile_scratch_size", None) == 0
        and not getattr(launcher, "gsan_enabled", False)  # 3.8's sanitizer adds arguments of its own
        and hasattr(launcher, "launch")
    ):
        flags = (compiled.function, launcher.launch_cooperative_grid, launcher.launch_pdl)
        if _ARGUMENTS_AS_TUPLE:
            prefix = (*flags, compiled.packed_metadata, None, None, None, None, None,
                      launcher.arg_annotations, launcher.kernel_signature)
            return _CachedLaunch(compiled, launcher.launch, prefix, tail, as_tuple=True)
        prefix = (*flags, None, None, compiled.packed_metadata, None, None, None)
        return _CachedLaunch(compiled, launcher.launch, prefix, tail)
    # A kernel that needs scratch memory (or 3.8's sanitizer): the Python launcher provides it.
    return _CachedLaunch(compiled, launcher, (compiled.function, compiled.packed_metadata, None, None, None), tail)


def _pointers(args) -> list:
    """args with each CUDA tensor replaced by its data pointer. Triton's C launcher takes an int
    as the address itself, where for a tensor it calls data_ptr() and then asks the driver about
    the address (cuPointerGetAttribute), a cost inside an eager forward+backward that a loop of
    launches alone does not show (docs/arms/rmsnorm.md). That check was also
    what refused a tensor on another device: a CPU tensor is still passed as is (the launcher's
    check names it), but a tensor on another GPU is not caught here, so an arm checks that its
    tensors share one device, made current, before it launches."""
    return [(arg.data_ptr() if arg.is_cuda else arg) if isinstance(arg, _Tensor) else arg for arg in args]


class Launcher:
    """kernel[grid](*args, **meta) with the kernel and its meta bound once: a launch config
    holds one per kernel it launches, so a call costs the specialization key of its arguments
    and one dict lookup before Triton's C launcher. Every call of one kernel with one meta
    goes through the same Launcher (`launcher`), so each specialization compiles once.

    What the cached path skips besides the binding: Triton's check that the globals a kernel
    reads have not changed since it compiled (ours read none but constexprs), its options from
    the environment (debug, instrumentation mode), which a process sets before it launches, and
    the driver's check of each CUDA tensor's address (see `_pointers`). It
    is taken only for a compiled kernel, a Triton version whose calling convention was read
    (see FAST_LAUNCH_TRITON_VERSIONS), a tuple grid and idle hooks; anything else goes
    through kernel[grid].
    """

    __slots__ = ("kernel", "meta", "compiled", "constexpr_positions", "first_constexpr", "entries")

    def __init__(self, kernel, meta: dict):
        self.kernel = kernel
        self.meta = meta
        self.compiled = isinstance(kernel, JITFunction)
        if self.compiled:
            self.constexpr_positions = frozenset(p.num for p in kernel.params if p.is_constexpr)
            self.first_constexpr = min(self.constexpr_positions, default=len(kernel.params))
        # (device, specialization key) -> its cached launch, or None: launch through Triton
        self.entries: dict[tuple, _CachedLaunch | None] = {}

    def __call__(self, grid, *args) -> None:
        if not self.compiled:
            with _interpreter_rounds_bf16_like_gpu():
                self.kernel[grid](*args, **self.meta)
            return
        if not (FAST_LAUNCH and _fast_launch_verified and type(grid) is tuple and _hooks_idle(self.kernel)):
            self._record(self.kernel[grid](*args, **self.meta))
            return
        # Triton compiles for, and launches on, the current device and its current stream.
        device = torch.cuda.current_device()
        try:
            key = self._key(device, args)
            entry = self.entries.get(key, _MISSING)
        except (UnsupportedArgument, TypeError):  # TypeError: an unhashable constexpr value
            self._record(self.kernel[grid](*args, **self.meta))
            return
        if entry is _MISSING:
            compiled = self.kernel[grid](*args, **self.meta)  # compiles if need be, and launches
            self.entries[key] = _cached_launch(self.kernel, compiled, len(args), self.meta)
        elif entry is None:
            compiled = self.kernel[grid](*args, **self.meta)
        else:
            n = len(grid)
            head = (grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1,
                    torch._C._cuda_getCurrentRawStream(device))
            if entry.as_tuple:
                entry.call(*head, *entry.prefix, (*_pointers(args), *entry.tail))
            else:
                entry.call(*head, *entry.prefix, *_pointers(args), *entry.tail)
            compiled = entry.compiled
        self._record(compiled)

    def _key(self, device: int, args) -> tuple:
        positional_constexprs = self.constexpr_positions if len(args) > self.first_constexpr else ()
        return device, specialization_key(args, positional_constexprs)

    def _record(self, compiled) -> None:
        if RECORD_COMPILED:
            compiled_kernels[self.kernel.fn.__name__] = compiled

    def fast_path_open(self) -> bool:
        """Whether a call would take the cached path now (no hook, FAST_LAUNCH on, ...)."""
        return self.compiled and FAST_LAUNCH and _fast_launch_verified and _hooks_idle(self.kernel)

    def direct(self, grid, *args) -> DirectLaunch | None:
        """Launch args, then return their specialization as a DirectLaunch on this grid; None
        where a call would not take the cached path (the interpreter, another Triton,
        SUITE_TRITON_FAST_LAUNCH=0, a launch hook, an argument the key does not model)."""
        self(grid, *args)
        if not (type(grid) is tuple and self.fast_path_open()):
            return None
        try:
            entry = self.entries.get(self._key(torch.cuda.current_device(), args))
        except (UnsupportedArgument, TypeError):
            return None
        if entry is None:
            return None
        return DirectLaunch(self.kernel, (*grid, 1, 1)[:3], entry)


class DirectLaunch:
    """One specialization of a kernel on one grid, called with the stream and the argument
    values alone (CUDA tensors as addresses, see `_pointers`): no key, no lookup. It checks
    nothing, so its caller keeps it under a key of its own that fixes everything Triton
    specializes on (the dtypes, every pointer 16-byte aligned, the integers) and builds that key
    on every call. An arm's hottest launch saves about half its host time this way (the
    RMSNorm backward inside an eager forward+backward: docs/arms/rmsnorm.md)."""

    __slots__ = ("kernel", "head", "prefix", "tail", "call", "compiled", "as_tuple")

    def __init__(self, kernel, grid: tuple, entry: _CachedLaunch):
        self.kernel, self.head, self.compiled = kernel, grid, entry.compiled
        self.call, self.prefix, self.tail, self.as_tuple = entry.call, entry.prefix, entry.tail, entry.as_tuple

    def __call__(self, stream: int, *values) -> bool:
        """Launch; False (nothing launched) while a launch hook is registered, FAST_LAUNCH is off
        or tests record compiled kernels: the caller then goes through its Launcher, which
        honours all three."""
        if not FAST_LAUNCH or RECORD_COMPILED or not _hooks_idle(self.kernel):
            return False
        if self.as_tuple:
            self.call(*self.head, stream, *self.prefix, (*values, *self.tail))
        else:
            self.call(*self.head, stream, *self.prefix, *values, *self.tail)
        return True


class KeptLaunches:
    """The DirectLaunches of a caller's hot launches (a launch config holds one of these), kept
    under keys of the caller's own: a call pays its pointers, one alignment test and one lookup.

    The key is (launcher, current device, `varying`, the scalars' values): `varying` is what the
    caller lets vary beyond its config, the dtypes whose choice fixes all the others; the
    scalars' values are finer than Triton's integer classes (safe); and only calls whose every
    pointer is 16-byte aligned are kept (a misaligned one goes through the Launcher). A None
    (no DirectLaunch for lasting reasons: a kernel needing scratch, an argument the key does not
    model) is kept too; one for a passing reason (a launch hook, FAST_LAUNCH off) is not. At
    most `limit` are kept: a caller that varies its scalars call by call stays bounded."""

    __slots__ = ("kept", "limit")

    def __init__(self, limit: int = 64):
        self.kept: dict[tuple, DirectLaunch | None] = {}
        self.limit = limit

    def __call__(self, bound: Launcher, grid: tuple, varying: tuple, tensors: tuple, scalars: tuple) -> None:
        """bound(grid, *tensors, *scalars), through the DirectLaunch kept for it once there is one."""
        if bound.compiled:
            pointers = [t.data_ptr() for t in tensors]
            if not functools.reduce(or_, pointers) & 15:
                device = torch._C._cuda_getDevice()
                key = (bound, device, varying, scalars)
                direct = self.kept.get(key, _MISSING)
                if direct is _MISSING:
                    made = bound.direct(grid, *tensors, *scalars)  # launches
                    if made is not None or bound.fast_path_open():
                        if len(self.kept) >= self.limit:
                            self.kept.clear()
                        self.kept[key] = made
                    return
                if direct is not None and direct(torch._C._cuda_getCurrentRawStream(device), *pointers, *scalars):
                    return
        bound(grid, *tensors, *scalars)


# (id(kernel), meta items) -> its Launcher. Keyed by id: JITFunction.__hash__ hashes the
# source's sha under a lock on every call; the Launcher holds the kernel, so the id stays its.
_launchers: dict[tuple, Launcher] = {}


def launcher(kernel, **meta) -> Launcher:
    """The Launcher of `kernel` with this meta (constexprs and launch options), made once."""
    # the value's type too: True, 1 and 1.0 are equal keys, but not the same constexpr
    key = (id(kernel), tuple((name, type(value), value) for name, value in meta.items()))
    try:
        found = _launchers.get(key)
    except TypeError:  # an unhashable meta value: a Launcher of its own, never shared
        return Launcher(kernel, meta)
    if found is None:
        found = _launchers[key] = Launcher(kernel, meta)
    return found


def launchers_of(kernel) -> list[Launcher]:
    """Every Launcher made for `kernel` (the probes read their compiled entries)."""
    return [found for found in _launchers.values() if found.kernel is kernel]


_kept_launches = KeptLaunches(limit=256)


def on_device_of(t: torch.Tensor):
    """t's CUDA device made current for the launches (Triton launches on the current one)."""
    if t.is_cuda and t.get_device() != torch._C._cuda_getDevice():
        return torch.cuda.device(t.device)
    return contextlib.nullcontext()


def launch_kept(kernel, grid, *args, **meta) -> None:
    """launch(), for a kernel whose tensor arguments all come first: once a call with these
    dtypes, scalars and grid has launched, later ones go through its kept DirectLaunch (see
    KeptLaunches), which skips the Launcher's key over some twenty arguments (what each costs:
    scripts/moe_host_probe.py)."""
    n_tensors = 0
    for arg in args:
        if not isinstance(arg, _Tensor):
            break
        n_tensors += 1
    tensors = args[:n_tensors]
    _kept_launches(launcher(kernel, **meta), grid, (grid, *[t.dtype for t in tensors]), tensors, args[n_tensors:])


class PlannedLaunch:
    """One launch with its kernel, meta, grid and scalars fixed, called with its tensors alone
    (a kernel whose tensor parameters all come first), through the kept DirectLaunch once the
    first call made one (see KeptLaunches). `dtypes` are the tensors' dtypes, which the caller
    fixes by keeping one PlannedLaunch per call shape: they key the kept launch, so a call with
    other dtypes would run code compiled for these."""

    __slots__ = ("bound", "grid", "scalars", "varying", "direct")

    def __init__(self, kernel, grid: tuple, scalars: tuple, dtypes: tuple, **meta):
        self.bound = launcher(kernel, **meta)
        self.grid, self.scalars, self.varying = grid, scalars, (grid, *dtypes)
        # (device, its kept DirectLaunch), once there is one: everything else its key holds is
        # fixed here, so a call checks the device and the alignment, not a key
        self.direct: tuple[int, DirectLaunch] | None = None

    def __call__(self, *tensors) -> None:
        kept = self.direct
        if kept is not None:
            device, direct = kept
            pointers = [t.data_ptr() for t in tensors]
            if (not functools.reduce(or_, pointers) & 15 and torch._C._cuda_getDevice() == device
                    and direct(torch._C._cuda_getCurrentRawStream(device), *pointers, *self.scalars)):
                return
        _kept_launches(self.bound, self.grid, self.varying, tensors, self.scalars)
        if kept is None and self.bound.compiled:
            device = torch._C._cuda_getDevice()
            direct = _kept_launches.kept.get((self.bound, device, self.varying, self.scalars))
            if direct is not None:
                self.direct = (device, direct)


def descriptor_strides(strides: tuple, itemsize: int) -> bool:
    """Whether a TMA descriptor takes a tensor of these strides: a unit last stride and the
    others positive 16-byte multiples (planners check this once; `descriptor_ready` a call)."""
    return strides[-1] == 1 and all(s > 0 and s * itemsize % 16 == 0 for s in strides[:-1])


def descriptor_ready(t: torch.Tensor) -> bool:
    """Whether a TMA descriptor takes t as it is: a 16-byte aligned base, its strides
    (`descriptor_strides`), and no empty dimension."""
    return not t.data_ptr() & 15 and all(t.shape) and descriptor_strides(t.stride(), t.element_size())


def storage_order(t: torch.Tensor) -> torch.Tensor:
    """t, or where its last stride is not 1 and the one before is, its last two dims swapped:
    the view whose dims run in the order its memory does, which a TMA descriptor takes (a
    weight stored [E, out, in] and passed as its [E, in, out] transpose goes in stored)."""
    if t.dim() >= 2 and t.stride(-1) != 1 and t.stride(-2) == 1:
        return t.transpose(-1, -2)
    return t


class DescriptorLaunch:
    """A PlannedLaunch whose kernel takes some of its tensors as TMA descriptors (Triton's host
    TensorDescriptor: the copy engine fills shared memory, out-of-bounds elements read as zero),
    made on every call from the tensors given, in their storage order (`storage_order`), one
    block shape each, in that order (None: passed as a pointer). A call whose tensors a
    descriptor cannot take as they are stored (`descriptor_ready`) launches `fallback` instead,
    the same sums through pointers. Triton launches it (the kept launches
    do not model descriptors), with its per-call Python and a tensor map encoded per descriptor:
    more host time than a kept launch, which is why the planner takes it for large layers alone."""

    __slots__ = ("bound", "grid", "scalars", "blocks", "fallback")

    def __init__(self, kernel, grid: tuple, scalars: tuple, blocks: tuple, fallback: PlannedLaunch, **meta):
        self.bound = launcher(kernel, **meta)
        self.grid, self.scalars, self.blocks, self.fallback = grid, scalars, blocks, fallback

    def __call__(self, *tensors) -> None:
        args = []
        for t, block in zip(tensors, self.blocks):
            if block is None:
                args.append(t)
            elif descriptor_ready(stored := storage_order(t)):
                args.append(TensorDescriptor(stored, stored.shape, stored.stride(), block))
            else:
                self.fallback(*tensors)
                return
        self.bound(self.grid, *args, *self.scalars)


def launch(kernel, grid, *args, **meta) -> None:
    """kernel[grid](*args, **meta), compiled or interpreted. A caller that launches one
    kernel with one meta often keeps `launcher(kernel, **meta)` and calls that instead."""
    launcher(kernel, **meta)(grid, *args)
