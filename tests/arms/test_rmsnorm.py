"""The fused RMSNorm arm against a float64 truth and against the eager reference.

Without a GPU the kernels run under Triton's interpreter (tests/conftest.py), so shapes stay tiny.
"""

from __future__ import annotations

import contextlib
import functools

import pytest
import torch
from triton import knobs

from bitwise import assert_bitwise, bits
from rtxcheck import assert_fit_rtx, record_compiled
from suite.arms import rmsnorm as arm
from suite import triton_support
from suite.device_profile import RTX_SMEM_BYTES
from suite.errors import CouldNotRun

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# our kernels at every size: impl="auto" hands small CUDA tensors to torch's native kernel
fused = functools.partial(arm.rms_norm, impl="fused")


def rel_l2(value: torch.Tensor, truth: torch.Tensor) -> float:
    return ((value.double() - truth).norm() / truth.norm().clamp_min(1e-300)).item()


def run(norm, x, weight, dy, eps=1e-6, offset=0.0):
    """y, dx, dw of `norm`; x may be a view (its grad is taken as is)."""
    x = x.detach().requires_grad_()
    weight = weight.detach().requires_grad_()
    y = norm(x, weight, eps, offset)
    dx, dw = torch.autograd.grad(y, (x, weight), dy)
    return y, dx, dw


def check_against_truth(x, weight, dy, eps=1e-6, offset=0.0, floor=1e-6):
    """Arm error vs float64 <= 2 x the same-dtype reference's error + floor, for y, dx and dw."""
    got = run(fused, x, weight, dy, eps, offset)
    ref = run(arm.rms_norm_reference, x, weight, dy, eps, offset)
    truth = run(arm.rms_norm_reference, x.double(), weight.double(), dy.double(), eps, offset)
    for name, g, r, t in zip(("y", "dx", "dw"), got, ref, truth):
        expected_dtype = weight.dtype if name == "dw" else x.dtype
        assert g.dtype == expected_dtype and g.shape == t.shape, (name, g.dtype, g.shape)
        err, ref_err = rel_l2(g, t), rel_l2(r, t)
        assert err <= 2 * ref_err + floor, f"{name}: arm error {err:.3e} vs reference {ref_err:.3e}"
    return got


def make(shape, dtype, seed=0, weight_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(DEVICE, weight_dtype or dtype)
    dy = torch.randn(shape, generator=gen).to(DEVICE, dtype)
    return x, weight, dy


@pytest.mark.parametrize("n", [1, 7, 96, 130])
@pytest.mark.parametrize("dtype", DTYPES)
def test_matches_float64(dtype, n):
    # At n == 1, dx = g * rstd * eps / (x^2 + eps) cancels catastrophically; a larger eps keeps
    # the comparison about the kernel rather than about fp32 cancellation noise.
    eps = 1e-2 if n == 1 else 1e-6
    check_against_truth(*make((2, 3, n), dtype), eps=eps)


@pytest.mark.parametrize("n", [50, 100])
@pytest.mark.parametrize("dtype", DTYPES)
def test_looped_path(monkeypatch, dtype, n):
    monkeypatch.setattr(arm, "MAX_FUSED_N", 32)
    x, weight, dy = make((3, 70, n), dtype)
    cfg = arm._launch_config(210, n, x.device)
    assert cfg.looped and cfg.block_n < n
    check_against_truth(x, weight, dy)


def test_looped_path_makes_several_partials(monkeypatch):
    monkeypatch.setattr(arm, "MAX_FUSED_N", 32)
    x, weight, dy = make((210, 50), torch.float32)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    _, partials = arm.rms_norm_backward(dy, x, weight, stats, 0.0)
    assert partials.shape[0] > 1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_noncontiguous_x(dtype):
    _, weight, dy = make((40, 96), dtype)
    transposed = torch.randn(96, 40, device=DEVICE).to(dtype).t()  # last-dim stride 40: copied
    check_against_truth(transposed, weight, dy)
    sliced = torch.randn(40, 101, device=DEVICE).to(dtype)[:, 3:99]  # row stride 101: read in place
    assert sliced.stride() == (101, 1)
    check_against_truth(sliced, weight, dy)
    permuted = torch.randn(3, 96, 4, device=DEVICE).to(dtype).permute(0, 2, 1)  # (3, 4, 96)
    check_against_truth(permuted, weight, dy.reshape(3, 4, 320)[..., :96])


def test_noncontiguous_dy():
    x, weight, _ = make((40, 96), torch.bfloat16)
    expanded = torch.randn(96, device=DEVICE).to(torch.bfloat16).expand(40, 96)  # row stride 0
    check_against_truth(x, weight, expanded)
    transposed = torch.randn(96, 40, device=DEVICE).to(torch.bfloat16).t()
    check_against_truth(x, weight, transposed)
    # y.sum() backward hands over a dy whose every stride is 0.
    leaf = x.detach().requires_grad_()
    fused(leaf, weight).float().sum().backward()
    ref_leaf = x.detach().requires_grad_()
    arm.rms_norm_reference(ref_leaf, weight).float().sum().backward()
    torch.testing.assert_close(leaf.grad, ref_leaf.grad, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_offset_one(dtype):
    x, weight, dy = make((2, 3, 96), dtype)
    check_against_truth(x, weight - 1, dy, offset=1.0)  # zero-centred weight, scale near 1


def test_fp32_weight_with_bf16_x():
    x, weight, dy = make((2, 3, 130), torch.bfloat16, weight_dtype=torch.float32)
    y, dx, dw = check_against_truth(x, weight, dy)
    assert (y.dtype, dx.dtype, dw.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32)


def test_no_rows_launches_nothing(monkeypatch):
    def no_launch(*args, **kwargs):
        raise AssertionError("launched a kernel for an empty input")

    monkeypatch.setattr(triton_support.Launcher, "__call__", no_launch)
    x, weight, _ = make((0, 96), torch.bfloat16)
    y, dx, dw = run(fused, x, weight, torch.empty_like(x))
    assert y.shape == dx.shape == (0, 96)
    assert dw.shape == (96,) and not dw.any()


def test_a_second_backward_of_one_graph_returns_a_dw_of_its_own():
    """The forward allocates dW for the backward; a second backward (retain_graph) must not
    write into the tensor the first returned."""
    x, weight, dy = make((40, 96), torch.bfloat16)
    x, weight = x.requires_grad_(), weight.requires_grad_()
    y = fused(x, weight)
    first = torch.autograd.grad(y, (x, weight), dy, retain_graph=True)
    kept = [t.clone() for t in first]
    second = torch.autograd.grad(y, (x, weight), 2 * dy)
    assert second[1].data_ptr() != first[1].data_ptr()
    for got, was in zip(first, kept):
        assert torch.equal(got, was)  # untouched by the second backward
    torch.testing.assert_close(second[1].float(), 2 * first[1].float(), rtol=1e-2, atol=1e-2)


@pytest.mark.cuda  # and on the CPU, interpreted: the GPU run takes it too (the stream's workspace)
@pytest.mark.parametrize("n", [96, 1 << 15])  # a row in one stripe, and a looped one
def test_a_frozen_weight_gets_no_dw_and_x_the_same_gradient(monkeypatch, n):
    """A weight that needs no gradient (frozen, or an unweighted norm's ones): the backward takes
    the launch that leaves the dW partials unsummed, and dx has the bits it has beside a dW."""
    launched = []
    direct = triton_support.KeptLaunches.__call__

    def spy(self, launcher, *args):
        launched.append(launcher)
        return direct(self, launcher, *args)

    monkeypatch.setattr(triton_support.KeptLaunches, "__call__", spy)
    x, weight, dy = make((40, n), torch.bfloat16)
    x = x.requires_grad_()
    (frozen_dx,) = torch.autograd.grad(fused(x, weight), x, dy)
    cfg = arm._launch_config(40, n, x.device)
    assert cfg.backward_partials in launched and cfg.backward not in launched
    trained = weight.detach().requires_grad_()
    dx, dw = torch.autograd.grad(fused(x, trained), (x, trained), dy)
    assert torch.equal(bits(frozen_dx), bits(dx)) and dw is not None


def test_deterministic():
    x, weight, dy = make((200, 96), torch.bfloat16)
    first, second = run(fused, x, weight, dy), run(fused, x, weight, dy)
    for a, b in zip(first, second):
        assert torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_dw_partials_reduce_exactly(dtype):
    x, weight, dy = make((200, 96), torch.float32)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    dx, partials = arm.rms_norm_backward(dy, x, weight, stats, 0.0)
    assert partials.dtype == torch.float32 and partials.shape[0] > 1
    dw = arm.reduce_dw_partials(partials, dtype)
    assert dw.dtype == dtype
    exact = partials.double().sum(0)
    # Any fp32 summation order is within (G - 1) ulps of the magnitudes summed, plus dtype rounding.
    bound = partials.shape[0] * 2.0**-24 * partials.double().abs().sum(0) + exact.abs() * torch.finfo(dtype).eps
    assert ((dw.double() - exact).abs() <= bound).all()


@pytest.mark.parametrize(
    "rows, n, programs, max_fused_n",
    [
        (200, 96, None, None),  # 4 partials: 2 groups of 2
        (200, 130, 5, None),  # 5 partials: groups of 3 and 2
        (2, 96, None, None),  # 2 row blocks, so 2 partials
        (1, 96, None, None),  # 1 partial
        (70, 100, 7, 32),  # looped: 4 column stripes, 7 programs -> 1 partial row per stripe
        (210, 50, 9, 32),  # looped: 2 stripes x 4 partials
    ],
)
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_folded_dw_matches_the_two_stage_blocks_bit_for_bit(monkeypatch, rows, n, programs, max_fused_n, weight_dtype):
    if programs is not None:
        monkeypatch.setattr(arm, "INTERPRETER_MAX_PROGRAMS", programs)
    if max_fused_n is not None:
        monkeypatch.setattr(arm, "MAX_FUSED_N", max_fused_n)
    monkeypatch.setattr(arm, "_configs", {})
    x, weight, dy = make((rows, n), torch.bfloat16, weight_dtype=weight_dtype)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    dx_two, partials = arm.rms_norm_backward(dy, x, weight, stats, 0.0)
    dw_two = arm.reduce_dw_partials(partials, weight.dtype)
    dx_folded, dw_folded = arm.rms_norm_backward_reduced(dy, x, weight, stats, 0.0)
    _, dx_autograd, dw_autograd = run(fused, x, weight, dy)
    for dx in (dx_folded, dx_autograd):
        assert_bitwise(dx, dx_two, "dx")
    for dw in (dw_folded, dw_autograd):
        assert_bitwise(dw, dw_two, "dw")


def test_partial_sums_pad_with_negative_zero_so_zero_signs_survive():
    partials = torch.full((5, 130), -0.0, device=DEVICE)  # 5 rows: groups of 3 and 2, padded
    partials[2, :65] = 0.0
    dw = arm.reduce_dw_partials(partials, torch.float32)
    assert torch.equal(torch.signbit(dw), torch.arange(130, device=DEVICE) >= 65)


def test_group_sizes_keep_counters_within_the_slots_the_forward_zeroes():
    for n_parts in range(1, 1200):
        group_size = arm.dw_group_size(n_parts)
        n_groups = -(-n_parts // group_size)
        assert n_groups <= group_size <= arm.dw_group_size(1200)
        assert group_size * group_size < n_parts + 2 * group_size  # about sqrt(G)


def test_folded_backward_leaves_its_counters_at_zero_and_repeats():
    x, weight, dy = make((200, 96), torch.float32)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    counters = stats[200:].view(torch.int32)
    assert counters.numel() >= arm._launch_config(200, 96, x.device).counters_used and not counters.any()
    first = arm.rms_norm_backward_reduced(dy, x, weight, stats, 0.0)
    assert not counters.any()
    second = arm.rms_norm_backward_reduced(dy, x, weight, stats, 0.0)  # e.g. retain_graph
    for a, b in zip(first, second):
        assert_bitwise(a, b)


def test_stats_without_counter_slots_take_the_two_stage_path():
    x, weight, dy = make((200, 96), torch.float32)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    expected = arm.rms_norm_backward_reduced(dy, x, weight, stats, 0.0)
    got = arm.rms_norm_backward_reduced(dy, x, weight, stats[:200].clone(), 0.0)
    for a, b in zip(got, expected):
        assert_bitwise(a, b)


def test_forward_without_grad_gives_the_same_bits():
    x, weight, _ = make((3, 40, 96), torch.bfloat16)
    with torch.no_grad():
        y = fused(x, weight)
    assert_bitwise(y, fused(x, weight.detach().requires_grad_()).detach())


def test_launch_config_cache_keys_on_the_profile(monkeypatch):
    computed = []
    compute = arm._compute_launch_config
    monkeypatch.setattr(arm, "_configs", {})
    monkeypatch.setattr(arm, "_compute_launch_config", lambda *a: computed.append(a) or compute(*a))
    device = torch.device(DEVICE)
    monkeypatch.setenv("SUITE_PROFILE", "rtx")
    first = arm._launch_config(64, 96, device)
    assert arm._launch_config(64, 96, device) is first and len(computed) == 1
    monkeypatch.setenv("SUITE_PROFILE", "none")
    arm._launch_config(64, 96, device)
    monkeypatch.setattr(arm, "MAX_FUSED_N", 32)
    arm._launch_config(64, 96, device)
    assert len(computed) == 3


def test_module_impls():
    x, _, dy = make((2, 3, 96), torch.float32)
    fused, eager = (arm.RMSNorm(96, impl=impl, device=DEVICE) for impl in ("fused", "eager"))
    assert torch.equal(fused.weight, torch.ones(96, device=DEVICE))
    torch.testing.assert_close(fused(x), eager(x))
    assert "impl='fused'" in repr(fused) and "eps=1e-06" in repr(fused)
    gemma = arm.RMSNorm(96, offset=1.0, device=DEVICE, dtype=torch.bfloat16)
    assert gemma.weight.dtype == torch.bfloat16 and not gemma.weight.any()
    gemma(x.bfloat16()).float().sum().backward()
    assert gemma.weight.grad.dtype == torch.bfloat16


def test_module_unknown_impl():
    with pytest.raises(ValueError, match="impl must be"):
        arm.RMSNorm(96, impl="liger")


@pytest.mark.parametrize("dtype", [torch.int32, torch.float64])
def test_bad_dtype(dtype):
    x = torch.ones(4, 8, device=DEVICE, dtype=dtype)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        arm.rms_norm(x, torch.ones(8, device=DEVICE))


@pytest.mark.parametrize("weight_shape", [(7,), (8, 1), ()])
def test_wrong_weight_shape(weight_shape):
    with pytest.raises(ValueError, match="weight must be 1-D of size 8"):
        arm.rms_norm(torch.ones(4, 8, device=DEVICE), torch.ones(weight_shape, device=DEVICE))


def test_cpu_without_interpreter_says_what_to_do(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    with pytest.raises(CouldNotRun, match=r'need CUDA tensors.*RMSNorm\(impl="eager"\)'):
        arm.rms_norm(torch.ones(4, 8), torch.ones(8))


@pytest.mark.parametrize("n", [1, 96, 2048, 4096, 8192, 16384, 16385, 65536])
def test_launch_config_fits_rtx(monkeypatch, n):
    monkeypatch.setenv("SUITE_PROFILE", "rtx")
    cfg = arm._launch_config(16384, n, torch.device(DEVICE))
    assert cfg.looped == (n > 16384)
    assert cfg.looped or cfg.block_n >= n
    assert cfg.block_m * cfg.block_n * 4 <= RTX_SMEM_BYTES


@pytest.mark.cuda
@needs_cuda
def test_more_than_2_31_elements():
    n = 4096
    rows = 2**31 // n + 8
    if torch.cuda.mem_get_info()[0] < 4 * rows * n * 2 + 2**30:
        pytest.skip("not enough free GPU memory for four 4 GiB tensors")
    torch.manual_seed(0)
    x = torch.randn(rows, n, device="cuda", dtype=torch.bfloat16)
    weight = (1 + 0.1 * torch.randn(n, device="cuda")).bfloat16()
    y, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    rstd = stats[:rows]
    tail = slice(rows - 16, rows)  # rows whose offsets pass 2**31
    expected_rstd = torch.rsqrt(x[tail].float().pow(2).mean(-1) + 1e-6)
    torch.testing.assert_close(rstd[tail], expected_rstd, rtol=1e-5, atol=0)
    torch.testing.assert_close(y[tail], arm.rms_norm_reference(x[tail], weight), rtol=1.6e-2, atol=1e-2)
    del y
    dx, _ = arm.rms_norm_backward_reduced(x, x, weight, stats, 0.0)  # dy = x: any dy will do
    tail_x = x[tail].float().requires_grad_()
    (expected_dx,) = torch.autograd.grad(arm.rms_norm_reference(tail_x, weight.float()), tail_x, x[tail].float())
    torch.testing.assert_close(dx[tail].float(), expected_dx, rtol=2e-2, atol=2e-2)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("shape", [(4096, 2048), (8192, 2880), (512, 65536)])
def test_folded_dw_is_stable_over_repeated_launches(shape):
    """The arrival counters and the last programs' reads race with every other program: a
    memory-ordering bug would show as an occasional dW that differs from the two-stage one."""
    x, weight, dy = make(shape, torch.bfloat16, weight_dtype=torch.float32)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    _, partials = arm.rms_norm_backward(dy, x, weight, stats, 0.0)
    expected = arm.reduce_dw_partials(partials, weight.dtype)
    assert arm._launch_config(*shape, x.device).n_parts >= 16  # several groups, two levels
    dws = [arm.rms_norm_backward_reduced(dy, x, weight, stats, 0.0)[1] for _ in range(100)]
    assert all(torch.equal(bits(dw), bits(expected)) for dw in dws)
    assert not stats[shape[0]:].view(torch.int32).any()


@pytest.mark.cuda
@needs_cuda
def test_folded_backward_keeps_one_partials_buffer_per_stream_and_none_in_a_capture():
    x, weight, dy = make((4096, 2048), torch.bfloat16)
    cfg = arm._launch_config(4096, 2048, x.device)
    arm._workspaces.clear()
    expected = run(fused, x, weight, dy)
    key = (x.device.index, torch.cuda.current_stream().cuda_stream, 2048, cfg.max_parts)
    assert arm._workspaces[key].shape == (cfg.max_parts, 2048)
    buffer = arm._workspaces[key].data_ptr()
    again = run(fused, x, weight, dy)
    assert arm._workspaces[key].data_ptr() == buffer and len(arm._workspaces) == 1
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        other = run(fused, x, weight, dy)
    torch.cuda.current_stream().wait_stream(side)
    assert len(arm._workspaces) == 2  # the side stream's own
    for got in (again, other):
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, expected))
    # a capture on a stream no eager call used: a workspace kept for it would show as a third
    xg, wg = x.detach().requires_grad_(), weight.detach().requires_grad_()
    graph, capture_stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(side):
        torch.autograd.grad(fused(xg, wg), (xg, wg), dy)  # warm-up outside the capture
    capture_stream.wait_stream(side)
    with torch.cuda.graph(graph, stream=capture_stream):
        captured = torch.autograd.grad(fused(xg, wg), (xg, wg), dy)
    assert len(arm._workspaces) == 2  # the capture allocated its own
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(captured, expected[1:]))


@pytest.mark.cuda
@needs_cuda
def test_direct_launches_give_the_launchers_bits_and_step_aside_for_misalignment_and_hooks(monkeypatch):
    x, weight, dy = make((256, 1024), torch.bfloat16)
    cfg = arm._launch_config(256, 1024, x.device)
    cfg.direct.kept.clear()
    first = run(fused, x, weight, dy)  # through the launchers, keeping the specializations
    assert sum(direct is not None for direct in cfg.direct.kept.values()) == 2  # forward and backward
    launcher_calls = []
    through_launcher = triton_support.Launcher.__call__

    def counted(bound, grid, *args):
        launcher_calls.append(bound)
        through_launcher(bound, grid, *args)

    monkeypatch.setattr(triton_support.Launcher, "__call__", counted)
    again = run(fused, x, weight, dy)  # the kept DirectLaunches
    assert not launcher_calls
    monkeypatch.setattr(triton_support, "FAST_LAUNCH", False)
    through_triton = run(fused, x, weight, dy)  # kernel[grid]
    monkeypatch.undo()
    for got in (again, through_triton):
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(got, first))
    # a misaligned x (2 bytes past alignment) takes the launcher: a kernel of its own
    shifted = torch.empty(256 * 1024 + 1, dtype=x.dtype, device=x.device)[1:].view(256, 1024).copy_(x)
    assert shifted.data_ptr() % 16
    kept = len(cfg.direct.kept)
    launcher_calls.clear()
    monkeypatch.setattr(triton_support.Launcher, "__call__", counted)
    misaligned = run(fused, shifted, weight, dy)
    monkeypatch.undo()
    assert len(cfg.direct.kept) == kept and len(launcher_calls) == 2  # forward and backward
    assert all(torch.equal(bits(a), bits(b)) for a, b in zip(misaligned, first))
    # a launch hook (a profiler's) sees every launch again
    seen = []
    chain = knobs.runtime.launch_enter_hook
    if hasattr(chain, "add"):
        chain.add(seen.append)
        try:
            hooked = run(fused, x, weight, dy)
        finally:
            chain.remove(seen.append)
        assert len(seen) == 2
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(hooked, first))


@pytest.mark.cuda
@needs_cuda
def test_blocks_refuse_tensors_on_another_device_and_take_x_device():
    x, weight, dy = make((64, 256), torch.bfloat16)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    arm.rms_norm_backward_reduced(dy, x, weight, stats, 0.0)  # keeps the direct launches
    for block in (arm.rms_norm_backward_reduced, arm.rms_norm_backward):
        for name, args in {"dy": (dy.cpu(), x, weight, stats), "weight": (dy, x, weight.cpu(), stats),
                           "stats": (dy, x, weight, stats.cpu())}.items():
            with pytest.raises(ValueError, match=f"{name} is on cpu"):
                block(*args, 0.0)
    with pytest.raises(ValueError, match="weight is on cpu"):
        arm.rms_norm_forward(x, weight.cpu(), 1e-6, 0.0)
    if torch.cuda.device_count() > 1:  # x on the second GPU while the first is current
        second = [t.to("cuda:1") for t in (x, weight, dy)]
        with torch.cuda.device(1):
            expected = run(fused, *second)
        on_second = run(fused, *second)
        assert all(torch.equal(bits(a), bits(b)) for a, b in zip(on_second, expected))


def test_blocks_refuse_stats_that_are_not_fp32():
    x, weight, dy = make((16, 96), torch.bfloat16)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    with pytest.raises(TypeError, match="fp32 stats"):
        arm.rms_norm_backward_reduced(dy, x, weight, stats.half(), 0.0)


def _blocks_and_autograd(x, weight, dy):
    """Every kernel, every variant: the autograd path (folded dW) and the two-stage blocks."""
    run(fused, x, weight, dy)
    _, stats = arm.rms_norm_forward(x, weight, 1e-6, 0.0)
    _, partials = arm.rms_norm_backward(dy, x, weight, stats, 0.0)
    arm.reduce_dw_partials(partials, weight.dtype)


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("n", [2048, 4096, 8192, 65536])
def test_compiled_kernels_fit_rtx_shared_memory(monkeypatch, n):
    recorded = record_compiled(monkeypatch)
    x, weight, dy = make((1024, n), torch.bfloat16)  # rows enough for the tallest tile
    _blocks_and_autograd(x, weight, dy)
    expected = {"rms_norm_fwd_kernel", "rms_norm_bwd_kernel", "reduce_dw_partials_kernel"}
    if n > arm.MAX_FUSED_N:
        expected.add("rms_norm_bwd_row_dot_kernel")
    assert {name for name, _ in recorded} == expected
    assert len({id(c) for name, c in recorded if name == "rms_norm_bwd_kernel"}) == 2  # folded, two-stage
    assert_fit_rtx(recorded)


class _FakeTensor:
    """What rms_norm's routing reads of a tensor, on a machine without CUDA."""

    def __init__(self, numel, dtype, requires_grad=False, dims=1, is_cuda=True):
        self._numel, self.dtype, self.requires_grad, self._dims = numel, dtype, requires_grad, dims
        self.is_cuda, self.shape = is_cuda, (numel,)

    def numel(self):
        return self._numel

    def dim(self):
        return self._dims


@pytest.fixture
def routes(monkeypatch):
    """routes(x, weight): whether rms_norm's impl="auto" takes the native op for these fakes, as a
    compiled CUDA launch outside a capture (a routed call reaches the native op; the rest go on
    to our validation, which the fakes fail)."""
    monkeypatch.setattr(arm, "_KERNELS_COMPILED", True)
    monkeypatch.setattr(arm, "_capturing", lambda: False)
    routed = []
    monkeypatch.setattr(arm, "_native_rms_norm", lambda *args: routed.append(args) or ["native"])

    def call(x, weight) -> bool:
        routed.clear()
        with contextlib.suppress(Exception):
            arm.rms_norm(x, weight)
        return bool(routed)

    return call


def test_auto_routes_only_small_compiled_cuda_launches_of_one_dtype(monkeypatch, routes):
    small, between, with_grad, large = 4096 * 2048, 8192 * 2880, 16384 * 4096, 4096 * 65536
    bf16 = _FakeTensor(4096, torch.bfloat16)
    for needs_grad in (False, True):
        assert routes(_FakeTensor(small, torch.bfloat16, needs_grad), bf16)
        assert routes(_FakeTensor(between, torch.bfloat16, needs_grad), bf16)
        assert not routes(_FakeTensor(large, torch.bfloat16, needs_grad), bf16)
        assert not routes(_FakeTensor(small, torch.bfloat16, needs_grad, is_cuda=False), bf16)
        assert not routes(_FakeTensor(small, torch.bfloat16, needs_grad), _FakeTensor(4096, torch.float32))
    # the class a backward widens: the native op when differentiated, ours for a forward alone
    assert routes(_FakeTensor(with_grad, torch.bfloat16, requires_grad=True), bf16)
    assert not routes(_FakeTensor(with_grad, torch.bfloat16, requires_grad=False), bf16)
    monkeypatch.setattr(arm, "_KERNELS_COMPILED", False)  # the interpreter runs our kernels
    assert not routes(_FakeTensor(small, torch.bfloat16, requires_grad=True), bf16)


@pytest.mark.parametrize("numel", [4096 * 2048, 8192 * 2880, 16384 * 4096, 4096 * 65536])
@pytest.mark.parametrize("training", [False, True])
@pytest.mark.parametrize("weight_dtype", [torch.bfloat16, torch.float32])
def test_rms_norm_routes_by_size_class_grad_state_and_dtypes(monkeypatch, routes, numel, training, weight_dtype):
    """rms_norm's impl="auto" takes the native op for x and weight of one dtype below
    NATIVE_BELOW, or NATIVE_BELOW_WITH_GRAD when a backward follows, for every size class, grad
    state and dtype pair."""

    def expected(needs_grad: bool) -> bool:
        return weight_dtype is torch.bfloat16 and numel < (arm.NATIVE_BELOW_WITH_GRAD if needs_grad
                                                           else arm.NATIVE_BELOW)

    x = _FakeTensor(numel, torch.bfloat16, requires_grad=training)
    weight = _FakeTensor(4096, weight_dtype)
    assert routes(x, weight) == expected(needs_grad=training)
    with torch.no_grad():  # no backward will follow: a forward alone's class
        assert routes(x, weight) == expected(needs_grad=False)
    assert routes(_FakeTensor(numel, torch.bfloat16, training, is_cuda=False), weight) is False
    # the checks beside the rule: never a dtype ours refuses, a weight that is not 1-D, nor
    # inside torch.compile or a CUDA-graph capture
    assert not routes(_FakeTensor(numel, torch.float64, training), _FakeTensor(4096, torch.float64))
    assert not routes(x, _FakeTensor(4096, weight_dtype, dims=2))
    monkeypatch.setattr(arm, "_compiling", lambda: True)
    assert not routes(x, weight)
    monkeypatch.setattr(arm, "_compiling", lambda: False)
    monkeypatch.setattr(arm, "_capturing", lambda: True)
    assert not routes(x, weight)


def test_the_routed_op_is_the_one_torch_rms_norm_reaches():
    """The routed path calls torch's fused op directly: the values and gradients of
    torch.rms_norm (on the GPU, the same kernels; here its CPU composite)."""
    x = torch.randn(6, 32, requires_grad=True)
    weight = torch.randn(32, requires_grad=True)
    dy = torch.randn(6, 32)
    y = arm._native_rms_norm(x, weight.shape, weight, 1e-6)[0]
    want = torch.rms_norm(x, (32,), weight, 1e-6)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    for got, expected in zip(torch.autograd.grad(y, (x, weight), dy), torch.autograd.grad(want, (x, weight), dy)):
        torch.testing.assert_close(got, expected, rtol=0, atol=0)


def test_impl_is_checked():
    x, weight, _ = make((4, 8), torch.float32)
    with pytest.raises(ValueError, match="impl must be one of"):
        arm.rms_norm(x, weight, impl="liger")


@pytest.mark.cuda
@needs_cuda
def test_the_routed_call_gives_torch_rms_norms_bits_and_gradients_on_cuda():
    """The routed path calls torch's fused op directly: on CUDA, the values and gradients of
    torch.rms_norm (and F.rms_norm), bit for bit, in every supported dtype."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        x, weight, dy = make((64, 256), dtype)
        x.requires_grad_()
        weight.requires_grad_()
        y = arm.rms_norm(x, weight)
        want = torch.rms_norm(x, (256,), weight, 1e-6)
        torch.testing.assert_close(y, want, rtol=0, atol=0)
        for got, expected in zip(torch.autograd.grad(y, (x, weight), dy), torch.autograd.grad(want, (x, weight), dy)):
            torch.testing.assert_close(got, expected, rtol=0, atol=0)


@pytest.mark.cuda
@needs_cuda
def test_under_autocast_y_keeps_xs_dtype_on_every_path():
    """y is in x's dtype on each path, inside autocast too: our kernels ignore autocast, and the
    routed call (torch's fused op itself) has no autocast rule, where torch.rms_norm's fp32
    policy would return fp32 for bf16 inputs."""
    x, weight, _ = make((64, 256), torch.bfloat16)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert arm.rms_norm(x, weight).dtype == torch.bfloat16  # routed
        assert fused(x, weight).dtype == torch.bfloat16  # ours


@pytest.mark.cuda
@needs_cuda
def test_auto_takes_the_native_kernel_below_the_crossover_and_ours_above(monkeypatch):
    calls = []
    native = arm._native_rms_norm
    monkeypatch.setattr(arm, "_native_rms_norm", lambda *args: calls.append("native") or native(*args))
    x, weight, _ = make((64, 256), torch.bfloat16)
    torch.testing.assert_close(arm.rms_norm(x, weight), torch.rms_norm(x, (256,), weight, 1e-6), rtol=0, atol=0)
    calls.clear()
    small = make((64, 256), torch.bfloat16)
    arm.rms_norm(small[0], small[1])
    assert calls == ["native"]
    fused(small[0], small[1])
    assert calls == ["native"]  # impl="fused" never routes
    double = make((64, 256), torch.float64)
    with pytest.raises(TypeError, match="bfloat16, float16 or float32"):
        arm.rms_norm(double[0], double[1])  # refused at every size, as our kernels refuse it
    bad_weight = small[1][:-1]
    with pytest.raises(ValueError, match="weight must be 1-D of size 256"):
        arm.rms_norm(small[0], bad_weight)  # the native op refuses it first; ours names the problem
    calls.clear()
    graph = torch.cuda.CUDAGraph()
    arm.rms_norm(small[0], small[1], impl="fused")  # our kernels compiled before the capture
    with torch.cuda.graph(graph):
        captured = arm.rms_norm(small[0], small[1])
    graph.replay()
    assert calls == []  # captured: ours, whose host cost is paid once
    torch.testing.assert_close(captured, fused(small[0], small[1]), rtol=0, atol=0)
    monkeypatch.setattr(arm, "NATIVE_BELOW", 64 * 256)  # now at the crossover: ours
    arm.rms_norm(small[0], small[1])
    assert calls == []
