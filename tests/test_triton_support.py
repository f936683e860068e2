import os
import subprocess
import sys

import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from suite import triton_support
from suite.triton_support import UnsupportedArgument, specialization_key

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
needs_read_triton = pytest.mark.skipif(not triton_support._fast_launch_verified,
                                       reason="fast launch read for triton 3.6, 3.7 and 3.8 only")


@triton.jit
def _to_bf16(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n).to(tl.bfloat16), mask=offs < n)


@pytest.mark.skipif(not triton_support.interpreting(_to_bf16), reason="checks the interpreter's rounding")
def test_interpreted_fp32_to_bf16_rounds_to_nearest_even_like_the_gpu():
    # values just above a bf16 half-way point: truncation would round them down
    x = (torch.arange(1, 65, dtype=torch.float32) * (1 + 2**-8 + 2**-12))
    y = torch.empty(64, dtype=torch.bfloat16)
    triton_support.launch(_to_bf16, (1,), x, y, 64, BLOCK=64)
    assert torch.equal(y.view(torch.int16), x.to(torch.bfloat16).view(torch.int16))


# ---- the specialization key (pure, CPU) ----


def key(*args):
    return specialization_key(args)


def test_key_separates_misaligned_pointers_and_dtypes():
    base = torch.zeros(64)
    assert base.data_ptr() % 16 == 0
    assert key(base) == key(base[4:])  # 16 bytes on: still aligned
    assert key(base) != key(base[1:])  # 4 bytes on
    assert key(base) != key(base.view(torch.int32))
    assert key(torch.nn.Parameter(base)) == key(base)


@pytest.mark.parametrize(
    "same, different",
    [
        ((32, 48, -16), (33,)),  # divisible by 16 or not
        ((2, 3, 7), (1,)),  # 1 is passed as a constexpr
        ((2**31 - 16,), (2**31 + 16,)),  # i32 or i64 range
        ((2**62,), (2**63,)),  # i64 or u64
        ((0.5, 1.0, -3.0), (1,)),  # floats are fp32 whatever their value
        ((True, False), (1, 0)),  # bools are u1, never ints
    ],
)
def test_key_of_scalars(same, different):
    keys = {key(value) for value in same}
    assert len(keys) == 1
    assert all(key(value) not in keys for value in different)


def test_key_of_ints_as_triton_types_them():
    assert [key(v)[0] for v in (1, 16, 17, 2**31, 2**31 + 1, 2**63, 2**63 + 1)] == [
        "one", "i32D", "i32", "i64D", "i64", "u64D", "u64"
    ]


def test_key_of_constexpr_positions_is_the_value():
    assert specialization_key((4, 8), frozenset({1})) != specialization_key((4, 16), frozenset({1}))
    assert specialization_key((4, True), frozenset({1})) != specialization_key((4, 1), frozenset({1}))


def test_key_is_at_least_as_fine_as_the_installed_tritons_own():
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend

    ints = [0, 1, 2, 15, 16, 17, -1, -16, -17, 2**31 - 16, 2**31 - 1, 2**31, 2**31 + 16, -2**31, -2**31 - 1,
            -2**31 - 16, 2**63 - 16, 2**63 - 1, 2**63, 2**64 - 16, 2**64 - 1]
    base = torch.zeros(64)
    tensors = [base, base[1:], base[2:], base[4:], base.view(torch.int32), base.view(torch.int32)[3:],
               base.to(torch.bfloat16), base.to(torch.bfloat16)[8:], base.to(torch.bfloat16)[1:],
               torch.nn.Parameter(base)]
    tritons_by_key = {}
    for value in [*ints, 0.5, 1.0, -3.0, True, False, None, *tensors]:
        theirs = native_specialize_impl(CUDABackend, value, False, True, True)
        tritons_by_key.setdefault(key(value), set()).add(theirs)
    assert all(len(theirs) == 1 for theirs in tritons_by_key.values()), tritons_by_key


@pytest.mark.parametrize("value", ["a string", (1, 2), 2**64])
def test_key_refuses_what_it_does_not_model(value):
    with pytest.raises(UnsupportedArgument):
        key(torch.zeros(4), value)


def _plain_kernel(X, n, BLOCK: tl.constexpr, FLAG: tl.constexpr = False):
    pass


def _kernel_with_late_runtime_arg(X, BLOCK: tl.constexpr, n=4):
    pass


def test_tail_params_fill_constexprs_from_meta_and_defaults():
    kernel = JITFunction(_plain_kernel)
    assert triton_support._tail_params(kernel, 2, {"BLOCK": 8, "num_warps": 4}) == (8, False)
    assert triton_support._tail_params(kernel, 2, {"BLOCK": 8, "FLAG": True}) == (8, True)
    assert triton_support._tail_params(kernel, 2, {}) is None  # Triton reports the missing BLOCK
    # a runtime parameter after the positional ones would vary per call: no cached launch
    assert triton_support._tail_params(JITFunction(_kernel_with_late_runtime_arg), 1, {"BLOCK": 8}) is None


def test_pointers_replace_cuda_tensors_only():
    cpu = torch.zeros(4)
    assert triton_support._pointers((cpu, 3, 0.5, None)) == [cpu, 3, 0.5, None]  # the launcher names a CPU tensor
    if torch.cuda.is_available():
        gpu = torch.zeros(4, device="cuda")
        assert triton_support._pointers((gpu, torch.nn.Parameter(gpu), 7)) == [gpu.data_ptr(), gpu.data_ptr(), 7]


def test_one_launcher_per_kernel_and_meta():
    first = triton_support.launcher(_to_bf16, BLOCK=64)
    assert triton_support.launcher(_to_bf16, BLOCK=64) is first
    assert triton_support.launcher(_to_bf16, BLOCK=32) is not first
    assert triton_support.launcher(_to_bf16, BLOCK=64, num_warps=8) is not first
    assert first in triton_support.launchers_of(_to_bf16)
    # an unhashable meta value gets a launcher of its own instead of an error
    assert triton_support.launcher(_to_bf16, BLOCK=[64]).meta == {"BLOCK": [64]}


class _FakeLauncher:
    """A compiled kernel's Launcher as KeptLaunches sees it: records how each call went."""

    compiled = True

    def __init__(self, direct_available=True, fast_path=True):
        self.direct_available, self.fast_path, self.calls = direct_available, fast_path, []

    def __call__(self, grid, *args):
        self.calls.append("launcher")

    def fast_path_open(self):
        return self.fast_path

    def direct(self, grid, *args):
        self.calls.append("made")
        if not self.direct_available:
            return None
        return lambda stream, *values: self.calls.append(("direct", stream, values)) or True


@pytest.fixture
def stand_in_device(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)


def test_kept_launches_make_once_then_call_the_direct_launch_with_addresses(stand_in_device):
    kept, bound = triton_support.KeptLaunches(), _FakeLauncher()
    a, b = torch.zeros(8), torch.zeros(8)
    kept(bound, (1,), (torch.float32,), (a, b), (8, 0.5))
    kept(bound, (1,), (torch.float32,), (a, b), (8, 0.5))
    assert bound.calls == ["made", ("direct", 77, (a.data_ptr(), b.data_ptr(), 8, 0.5))]
    kept(bound, (1,), (torch.float32,), (a, b), (16, 0.5))  # another scalar value: another key
    assert bound.calls[-1] == "made" and len(kept.kept) == 2


def test_kept_launches_send_a_misaligned_pointer_to_the_launcher(stand_in_device):
    kept, bound = triton_support.KeptLaunches(), _FakeLauncher()
    base = torch.zeros(16)
    kept(bound, (1,), (torch.float32,), (base, base[1:]), (8,))
    assert bound.calls == ["launcher"] and not kept.kept


def test_kept_launches_keep_a_lasting_none_but_not_a_passing_one(stand_in_device):
    a = torch.zeros(8)
    passing = _FakeLauncher(direct_available=False, fast_path=False)  # a hook, FAST_LAUNCH off
    kept = triton_support.KeptLaunches()
    kept(passing, (1,), (), (a,), ())
    kept(passing, (1,), (), (a,), ())
    assert passing.calls == ["made", "made"] and not kept.kept  # asked again once it may be open
    lasting = _FakeLauncher(direct_available=False)  # a kernel the cached path never takes
    kept(lasting, (1,), (), (a,), ())
    kept(lasting, (1,), (), (a,), ())
    assert lasting.calls == ["made", "launcher"] and list(kept.kept.values()) == [None]


def test_kept_launches_stay_within_their_limit(stand_in_device):
    kept, bound, a = triton_support.KeptLaunches(limit=3), _FakeLauncher(), torch.zeros(8)
    for eps in range(10):
        kept(bound, (1,), (), (a,), (float(eps),))
        assert len(kept.kept) <= 3


def test_hooks_idle_until_a_profiler_registers_one(monkeypatch):
    kernel = JITFunction(_plain_kernel)
    assert triton_support._hooks_idle(kernel)
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):  # a HookChain (triton >= 3.5)
        chain.add(print)
        try:
            assert not triton_support._hooks_idle(kernel)
        finally:
            chain.remove(print)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", print)
    assert not triton_support._hooks_idle(kernel)
    monkeypatch.undo()
    kernel.add_pre_run_hook(print)
    assert not triton_support._hooks_idle(kernel)


# ---- the cached launch on a GPU ----


@triton.jit
def _scale_rows(X, Y, n_cols, x_row_stride, alpha, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * x_row_stride + cols, mask=mask)
    tl.store(Y + row * n_cols + cols, x * alpha + row, mask=mask)


def _fast_entries():
    return {key: entry for found in triton_support.launchers_of(_scale_rows) for key, entry in found.entries.items()}


def _run(launcher, x, n_cols, alpha=1.5):
    y = torch.empty((x.shape[0], n_cols), device=x.device, dtype=x.dtype)
    launcher(_scale_rows, (x.shape[0],), x, y, n_cols, x.stride(0), alpha, BLOCK=triton.next_power_of_2(n_cols))
    return y


def _plain(kernel, grid, *args, **meta):
    kernel[grid](*args, **meta)


@pytest.mark.cuda
@needs_cuda
@needs_read_triton
def test_fast_launch_matches_kernel_getitem_bit_for_bit(monkeypatch):
    monkeypatch.setattr(triton_support, "FAST_LAUNCH", True)
    torch.manual_seed(0)
    base = torch.randn(8, 80, device="cuda")
    cases = {
        "aligned": (base, 64),
        "misaligned view": (base[:, 1:], 64),  # data pointer 4 bytes past 16-byte alignment
        "odd width": (base, 63),
        "width 1": (base, 1),  # Triton passes 1 as a constexpr
    }
    compiled = {}
    for name, (x, n_cols) in cases.items():
        expected = _run(_plain, x, n_cols)
        first = _run(triton_support.launch, x, n_cols)  # compiles through Triton, caches
        again = _run(triton_support.launch, x, n_cols)  # from the cache
        for got in (first, again):
            assert torch.equal(got.view(torch.int32), expected.view(torch.int32)), name
        (entry,) = [
            e for k, e in _fast_entries().items()
            if k[1] == specialization_key((x, expected, n_cols, x.stride(0), 1.5))
        ]
        compiled[name] = entry.compiled
    # each specialization got a compile of its own
    assert len({id(c) for c in compiled.values()}) == len(cases)


@pytest.mark.cuda
@needs_cuda
@needs_read_triton
def test_cached_launch_bypasses_triton_run_and_uses_the_current_stream(monkeypatch):
    monkeypatch.setattr(triton_support, "FAST_LAUNCH", True)
    x = torch.randn(4, 32, device="cuda")
    expected = _run(triton_support.launch, x, 32)

    def no_run(*args, **kwargs):
        raise AssertionError("went through JITFunction.run")

    monkeypatch.setattr(JITFunction, "run", no_run)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        got = _run(triton_support.launch, x, 32)
    stream.synchronize()
    assert torch.equal(got, expected)
    with pytest.raises(ValueError, match="cpu tensor"):  # the cached path still names a CPU tensor
        triton_support.launch(_scale_rows, (4,), x.cpu(), got, 32, x.stride(0), 1.5, BLOCK=32)
    monkeypatch.setattr(triton_support, "FAST_LAUNCH", False)  # SUITE_TRITON_FAST_LAUNCH=0
    with pytest.raises(AssertionError, match="JITFunction.run"):
        _run(triton_support.launch, x, 32)


@pytest.mark.parametrize("value, on", [("0", False), ("false", False), (" OFF ", False), ("no", False), ("1", True),
                                       ("", True), ("True", True), ("yes", True)])
def test_the_fast_launch_switch_reads_the_words_a_user_writes(value, on):
    assert triton_support._fast_launch_setting(value) is on


def test_a_fast_launch_switch_it_cannot_read_stops_the_cli_with_one_line():
    # =false had read as on: a user who turned the cached launches off still ran them
    with pytest.raises(ValueError, match="SUITE_TRITON_FAST_LAUNCH must be 0 or 1 .* not 'maybe'"):
        triton_support._fast_launch_setting("maybe")
    env = {**os.environ, "SUITE_TRITON_FAST_LAUNCH": "maybe", "TRITON_INTERPRET": "1"}
    done = subprocess.run([sys.executable, "-m", "cli", "gate", "rmsnorm", "--device", "cpu", "--no-sabotage"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "error: SUITE_TRITON_FAST_LAUNCH must be 0 or 1 (false/true, off/on, no/yes), not 'maybe'"], done.stderr


# ---- the cached launch's calling convention, held to Triton's own (no GPU, nor CUDA torch, needed) ----


@triton.jit
def _shift(X, Y, n, alpha, BLOCK: tl.constexpr, NEGATE: tl.constexpr = False):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs < n)
    tl.store(Y + offs, -x + alpha if NEGATE else x + alpha, mask=offs < n)


class _OnDevice(torch.Tensor):
    """A CPU tensor that reads as a CUDA one, so the cached path passes its address."""

    @property
    def is_cuda(self):
        return True


_FAKE_DEVICE, _FAKE_STREAM, _FAKE_FUNCTION = 90, 7, 0xF00D


@pytest.fixture
def c_launches(monkeypatch):
    """Triton compiling for an sm_90 card that is not here, with the C launcher it builds
    replaced by one that records its arguments: Triton's own CudaLauncher stays in between."""
    import triton.backends.nvidia.driver as nvidia
    from triton.backends.compiler import GPUTarget

    calls = []
    utils = type("Utils", (), {
        "load_binary": staticmethod(lambda name, kernel, shared, device: (1, _FAKE_FUNCTION, 32, 0, 1024)),
        "get_device_properties": staticmethod(lambda device: {"max_shared_mem": 232448}),
        "unload_module": staticmethod(lambda module: None),  # 3.8 unloads a collected kernel
        "launch": staticmethod(lambda *args: calls.append(args)),  # 3.7's and 3.8's one C launcher
        "build_signature_metadata": staticmethod(lambda types: ("signature", *types)),
    })
    driver = type("Driver", (), {
        "utils": utils, "launcher_cls": nvidia.CudaLauncher,
        "get_current_device": staticmethod(lambda: _FAKE_DEVICE),
        "get_current_stream": staticmethod(lambda device=None: _FAKE_STREAM),
        "get_current_target": staticmethod(lambda: GPUTarget("cuda", 90, 32)),
    })
    # 3.6 builds a C launcher per kernel; here it is the recorder
    monkeypatch.setattr(nvidia, "compile_module_from_src", lambda **_: type("Module", (), {"launch": utils.launch}),
                        raising=False)
    monkeypatch.setattr(nvidia, "library_dirs", lambda: [], raising=False)
    # 3.7's argument annotations come from the C module CudaUtils would have built
    monkeypatch.setattr(nvidia, "PyKernelArg", lambda nested_tuple, type: (type, nested_tuple), raising=False)
    for kind in ("ARG_KERNEL", "ARG_CONSTEXPR", "ARG_TUPLE"):
        monkeypatch.setattr(nvidia, kind, kind, raising=False)
    monkeypatch.setattr(triton.runtime.driver, "_active", driver())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: _FAKE_DEVICE)
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: _FAKE_DEVICE, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: _FAKE_STREAM, raising=False)
    monkeypatch.setattr(triton_support, "FAST_LAUNCH", True)
    return calls


def _as_the_launcher_reads_it(value):
    """What the C launcher does with an argument: a tensor is its address, and None, an empty
    hook chain and the launch metadata only the hooks read all mean no hook is called."""
    if isinstance(value, torch.Tensor):
        return value.data_ptr()
    if isinstance(value, tuple):
        return tuple(map(_as_the_launcher_reads_it, value))
    if isinstance(value, knobs.HookChain):
        assert not value.calls
        return None
    if type(value).__name__ == "LazyDict":
        return None
    return value


@pytest.mark.cuda
@pytest.mark.skipif(triton_support.interpreting(_shift), reason="compiling for a fake card needs TRITON_INTERPRET=0")
@needs_read_triton
def test_the_cached_launch_hands_the_c_launcher_what_triton_hands_it(c_launches):
    base = torch.zeros(4096)
    cases = {
        "aligned": (base, 1000, 0.5, {}),
        "misaligned": (base[1:], 1000, 0.5, {}),  # another specialization, its own entry
        "n of 1": (base, 1, 0.5, {}),  # Triton passes 1 as a constexpr: the launcher drops it
        "i64 n": (base, 2**31 + 16, -2.0, {}),
        "constexpr from meta": (base, 1000, 0.5, {"NEGATE": True}),
    }
    for name, (x, n, alpha, extra) in cases.items():
        x, y = (torch.Tensor._make_subclass(_OnDevice, t) for t in (x, torch.zeros(4096)))
        args, grid, meta = (x, y, n, alpha), (3,), {"BLOCK": 128, **extra}
        c_launches.clear()
        _shift[grid](*args, **meta)  # Triton's own launch
        bound = triton_support.launcher(_shift, **meta)
        bound(grid, *args)  # the first call goes through Triton and keeps its entry
        bound(grid, *args)  # the second takes the cached path
        direct = bound.direct(grid, *args)  # launches through the cached path, then binds
        assert direct is not None, name
        assert direct(_FAKE_STREAM, x.data_ptr(), y.data_ptr(), n, alpha), name
        tritons, *ours = map(_as_the_launcher_reads_it, c_launches)
        assert len(ours) == 4 and all(call == tritons for call in ours), (name, tritons, ours)
        flat = str(tritons)  # the call carries the kernel, the stream and the tensors' addresses
        assert all(str(value) in flat for value in (_FAKE_FUNCTION, _FAKE_STREAM, x.data_ptr(), y.data_ptr())), name


@pytest.mark.skipif(not triton_support.interpreting(_shift), reason="the check above runs in this process")
@needs_read_triton
def test_the_c_launcher_check_runs_compiled_beside_the_interpreted_tests():
    """The tests interpret every kernel (CI has no GPU); the check above compiles one, so it runs
    in a process of its own with the interpreter off, on the Triton installed here."""
    check = f"{__file__}::test_the_cached_launch_hands_the_c_launcher_what_triton_hands_it"
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", check],
                          env={**os.environ, "TRITON_INTERPRET": "0"}, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0 and "1 passed" in done.stdout, done.stdout[-3000:] + done.stderr[-3000:]
