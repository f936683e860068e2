import pytest
import torch
import triton
import triton.language as tl
from triton import knobs
from triton.runtime.jit import JITFunction

from suite import triton_support
from suite.triton_support import UnsupportedArgument, specialization_key

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


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
@pytest.mark.skipif(not triton_support._fast_launch_verified, reason="fast launch verified for triton 3.6 only")
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
@pytest.mark.skipif(not triton_support._fast_launch_verified, reason="fast launch verified for triton 3.6 only")
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
