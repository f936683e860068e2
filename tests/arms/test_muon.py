"""The Muon reference optimizer on the CPU: Newton-Schulz, scale rules, the Muon and AdamW updates
against independent re-implementations (the float64 Muon the optimizer gates share), group
inference, and the capturable mode's bitwise equality with the plain one under live lr, weight
decay, momentum and betas (the GPU side of that contract is in test_graph.py)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from bitwise import assert_bitwise
from gates.optimizer_runs import muon_float64
from suite.arms.muon import Muon, muon_scale, newton_schulz


def assert_states_bitwise(opt_a: torch.optim.Optimizer, opt_b: torch.optim.Optimizer) -> None:
    params_a = [p for g in opt_a.param_groups for p in g["params"]]
    params_b = [p for g in opt_b.param_groups for p in g["params"]]
    for index, (pa, pb) in enumerate(zip(params_a, params_b)):
        assert_bitwise(pa, pb, f"param {index}")
        sa, sb = opt_a.state[pa], opt_b.state[pb]
        assert sa.keys() == sb.keys(), (index, sa.keys(), sb.keys())
        for key in sa:
            assert_bitwise(sa[key], sb[key], f"param {index} state {key!r}")


SHAPES = {"wide": (16, 24), "tall": (24, 16), "square": (20, 20), "gain": (24,), "bias": (16,)}


def make_params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).requires_grad_() for shape in SHAPES.values()]


def clone_params(params: list[torch.Tensor]) -> list[torch.Tensor]:
    return [p.detach().clone().requires_grad_() for p in params]


def make_grads(params: list[torch.Tensor], steps: int, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(p.shape, generator=gen) for p in params] for _ in range(steps)]


def set_grads(params: list[torch.Tensor], grads: list[torch.Tensor]) -> None:
    for p, g in zip(params, grads):
        p.grad = g.clone()


def groups(params: list[torch.Tensor]) -> list[dict]:
    """Matrices and vectors in separate groups, use_muon left to inference."""
    return [{"params": [p for p in params if p.dim() == 2]}, {"params": [p for p in params if p.dim() != 2]}]


# --------------------------------------------------------------------------------------------
# Newton-Schulz and the scale rules
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (48, 48)])
def test_newton_schulz_singular_values_near_one(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    O = newton_schulz(G)
    assert O.shape == G.shape and O.dtype == G.dtype
    singular = torch.linalg.svdvals(O.double())
    assert singular.min() > 0.5 and singular.max() < 1.5, singular
    # It approximates the polar factor U V^T, not just any matrix with such singular values.
    U, _, Vh = torch.linalg.svd(G.double(), full_matrices=False)
    polar = U @ Vh
    cosine = (O.double() * polar).sum() / (O.double().norm() * polar.norm())
    assert cosine > 0.95, cosine


def test_newton_schulz_tall_is_transposed_wide():
    G = torch.randn(64, 32, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(newton_schulz(G), newton_schulz(G.T.contiguous()).T, atol=2e-2, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_newton_schulz_keeps_dtype(dtype):
    G = torch.randn(8, 12).to(dtype)
    O = newton_schulz(G, steps=3)
    assert O.dtype == dtype and O.shape == (8, 12)


def test_newton_schulz_of_zero_is_zero():
    assert torch.count_nonzero(newton_schulz(torch.zeros(6, 4))) == 0


@pytest.mark.parametrize("shape", [(6,), (2, 3, 4, 5)])
def test_newton_schulz_rejects_non_matrix(shape):
    with pytest.raises(ValueError, match="a matrix or a 3-D batch"):
        newton_schulz(torch.randn(shape))


@pytest.mark.parametrize("shape", [(3, 16, 24), (3, 24, 16)])
def test_batched_newton_schulz_is_each_matrix_s(shape):
    G = torch.randn(shape, generator=torch.Generator().manual_seed(4))
    batched = newton_schulz(G)
    assert batched.shape == G.shape
    for k in range(shape[0]):
        # each matrix normalised by its own norm: scaling one must not move the others
        torch.testing.assert_close(batched[k], newton_schulz(G[k]), atol=2e-2, rtol=0)
    G[0] *= 1000
    assert torch.equal(newton_schulz(G)[1:], batched[1:])


def test_scale_rules():
    assert muon_scale(64, 32, "spectral") == pytest.approx(math.sqrt(2))
    assert muon_scale(32, 64, "spectral") == 1.0
    assert muon_scale(64, 32, "rms") == pytest.approx(0.2 * 8)
    assert muon_scale(32, 64, "rms") == pytest.approx(0.2 * 8)
    with pytest.raises(ValueError, match="spectral"):
        muon_scale(4, 4, "frobenius")


# --------------------------------------------------------------------------------------------
# The updates against independent re-implementations
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rule", ["spectral", "rms"])
@pytest.mark.parametrize("shape", [(16, 24), (24, 16)])
def test_muon_update_matches_float64_reimplementation(shape, rule, nesterov):
    gen = torch.Generator().manual_seed(2)
    p0 = torch.randn(shape, generator=gen)
    grads = [torch.randn(shape, generator=gen) for _ in range(4)]
    p = p0.clone().requires_grad_()
    kwargs = dict(lr=0.05, momentum=0.9, nesterov=nesterov, weight_decay=0.1, scale=rule, ns_steps=5)
    opt = Muon([p], **kwargs)
    for g in grads:
        p.grad = g.clone()
        opt.step()
    p_ref, m_ref = muon_float64(p0, grads, kwargs["lr"], kwargs["momentum"], nesterov, kwargs["weight_decay"],
                                rule, kwargs["ns_steps"])
    # The momentum buffer is plain fp32 arithmetic; the step carries Newton-Schulz's bf16 error.
    torch.testing.assert_close(opt.state[p]["momentum_buffer"].double(), m_ref, rtol=1e-6, atol=1e-6)
    change, change_ref = (p.detach().double() - p0.double()), (p_ref - p0.double())
    rel = (change - change_ref).norm() / change_ref.norm()
    assert rel < 0.03, f"Muon step differs from the float64 re-implementation by {rel:.3e} (relative)"


def test_adamw_groups_match_torch_adamw():
    gen = torch.Generator().manual_seed(3)
    shapes = [(24,), (16,), (10, 12)]  # a matrix marked use_muon=False (an embedding) too
    params = [torch.randn(s, generator=gen).requires_grad_() for s in shapes]
    torch_params = clone_params(params)
    hyper = dict(lr=3e-3, betas=(0.85, 0.97), eps=1e-7, weight_decay=0.05)
    muon = Muon([{"params": params, "use_muon": False}], **hyper)
    adamw = torch.optim.AdamW(torch_params, foreach=False, **hyper)
    for _ in range(6):
        grads = [torch.randn(s, generator=gen) for s in shapes]
        set_grads(params, grads)
        set_grads(torch_params, grads)
        muon.step()
        adamw.step()
    for p, q in zip(params, torch_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(muon.state[p]["exp_avg_sq"], adamw.state[q]["exp_avg_sq"], rtol=1e-6, atol=0)
        assert muon.state[p]["step"].item() == adamw.state[q]["step"].item() == 6


def test_subclass_overrides_the_direction():
    class SignMuon(Muon):
        def orthogonalize(self, update, group):
            return update.sign()

    p = torch.zeros(4, 6, requires_grad=True)
    p.grad = torch.randn(4, 6)
    SignMuon([p], lr=0.5, nesterov=False).step()
    assert set(p.detach().abs().unique().tolist()) == {0.5}


# --------------------------------------------------------------------------------------------
# Groups
# --------------------------------------------------------------------------------------------


def test_group_inference():
    matrix, vector = torch.zeros(4, 4, requires_grad=True), torch.zeros(4, requires_grad=True)
    opt = Muon([{"params": [matrix]}, {"params": [vector]}, {"params": [matrix.new_zeros(2, 2), vector.new_zeros(3)]},
                {"params": [torch.zeros(5, 5)], "use_muon": False}], lr=0.1)
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, False, False]


def test_muon_group_with_a_vector_is_refused_and_rolled_back():
    opt = Muon([torch.zeros(4, 4)], lr=0.1)
    with pytest.raises(ValueError, match=r"use_muon=True but params\[1\] \(shape \(4,\)\) is 1-D.*use_muon=False"):
        opt.add_param_group({"params": [torch.zeros(3, 3), torch.zeros(4)], "use_muon": True})
    assert len(opt.param_groups) == 1


def test_refusal_names_named_parameters():
    model = torch.nn.Linear(4, 3)
    with pytest.raises(ValueError, match="'bias' is 1-D"):
        Muon([{"params": list(model.named_parameters()), "use_muon": True}], lr=0.1)


@pytest.mark.parametrize("bad", [
    {"lr": -1.0}, {"lr": torch.tensor(0.1)}, {"weight_decay": -0.1}, {"momentum": 1.0}, {"scale": "frobenius"},
    {"ns_steps": 0}, {"betas": (0.9, 1.0)}, {"eps": -1.0}, {"use_muon": "yes"},
])
def test_bad_hyperparameters_are_refused(bad):
    with pytest.raises(ValueError, match="Muon: param group 0"):
        Muon([{"params": [torch.zeros(3, 3)], **bad}], lr=0.1)


# --------------------------------------------------------------------------------------------
# capturable=True on the CPU, checkpoints, LR schedulers
# --------------------------------------------------------------------------------------------


def warmup_then_flat(step: int) -> float:
    return min(1.0, (step + 1) / 4)


def run(params, capturable, grads, start=0, opt=None, scheduler=None):
    """Steps start..len(grads) with a LambdaLR warm-up; weight decay, momentum and betas changed at step 5."""
    opt = opt or Muon(groups(params), lr=0.02, weight_decay=0.01, capturable=capturable)
    scheduler = scheduler or torch.optim.lr_scheduler.LambdaLR(opt, warmup_then_flat)
    for step in range(start, len(grads)):
        if step == 5:
            for group in opt.param_groups:
                group.update(weight_decay=0.2, momentum=0.8, betas=(0.7, 0.99))
        set_grads(params, grads[step])
        opt.step()
        scheduler.step()
    return opt, scheduler


def test_capturable_on_cpu_is_bitwise_equal_to_plain():
    params = make_params()
    grads = make_grads(params, 10)
    plain, _ = run(params, False, grads)
    capturable_params = clone_params(make_params())
    captured, _ = run(capturable_params, True, grads)
    assert_states_bitwise(plain, captured)
    # The device copies follow the host numbers the scheduler and the test set.
    for index, group in enumerate(captured.param_groups):
        assert isinstance(group["lr"], float)
        live = captured._device_hyperparameters[index]
        assert live["lr"].dtype == torch.float32 and live["lr"].device.type == "cpu"
        assert live["weight_decay"].item() == fp32(0.2) and live["momentum"].item() == fp32(0.8)
        assert (live["beta1"].item(), live["beta2"].item()) == (fp32(0.7), fp32(0.99))
        # 1 - beta is rounded from double once, not computed from the rounded beta
        assert live["one_minus_beta2"].item() == fp32(1 - 0.99) != fp32(1 - fp32(0.99))


def fp32(value: float) -> float:
    return torch.tensor(value, dtype=torch.float32).item()


def test_sync_hyperparameters_fills_in_place():
    opt = Muon([torch.zeros(3, 3)], lr=0.1, capturable=True)
    opt.sync_hyperparameters()
    live = dict(opt._device_hyperparameters[0])
    opt.param_groups[0].update(lr=0.25, momentum=0.5, betas=(0.6, 0.7))
    opt.sync_hyperparameters(["lr", "betas"])
    assert opt._device_hyperparameters[0] == live  # the same tensors
    assert live["lr"].item() == 0.25 and live["beta1"].item() == fp32(0.6) and live["beta2"].item() == fp32(0.7)
    assert live["momentum"].item() == fp32(0.95)  # not asked for
    opt.sync_hyperparameters(["momentum"])
    assert live["momentum"].item() == 0.5
    with pytest.raises(ValueError, match="not live"):
        opt.sync_hyperparameters(["eps"])


@pytest.mark.parametrize("saved_capturable,loaded_capturable", [(False, False), (True, True), (False, True)])
def test_state_dict_round_trip_continues_bitwise(saved_capturable, loaded_capturable):
    grads = make_grads(make_params(), 10)
    whole_params = make_params()
    whole, _ = run(whole_params, saved_capturable, grads)

    first_params = make_params()
    first, first_scheduler = run(first_params, saved_capturable, grads[:6])
    buffer = io.BytesIO()
    torch.save({"optimizer": first.state_dict(), "scheduler": first_scheduler.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer)
    saved_groups = checkpoint["optimizer"]["param_groups"]
    assert not any(isinstance(v, torch.Tensor) for g in saved_groups for v in g.values())

    resumed_params = clone_params(first_params)
    resumed = Muon(groups(resumed_params), lr=0.02, weight_decay=0.01, capturable=loaded_capturable)
    scheduler = torch.optim.lr_scheduler.LambdaLR(resumed, warmup_then_flat)
    resumed.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    assert all(g["capturable"] is loaded_capturable for g in resumed.param_groups)
    gain = resumed.param_groups[1]["params"][0]
    assert resumed.state[gain]["step"].item() == 6
    run(resumed_params, loaded_capturable, grads, start=6, opt=resumed, scheduler=scheduler)
    assert_states_bitwise(whole, resumed)


def make_scheduler(name: str, opt: torch.optim.Optimizer):
    lr_scheduler = torch.optim.lr_scheduler
    if name == "lambda":
        return lr_scheduler.LambdaLR(opt, lambda step: 0.5**step)
    if name == "cosine":
        return lr_scheduler.CosineAnnealingLR(opt, T_max=6, eta_min=1e-3)
    if name == "linear":
        return lr_scheduler.LinearLR(opt, start_factor=0.125, total_iters=4)
    warmup = lr_scheduler.LinearLR(opt, start_factor=0.125, total_iters=3)
    return lr_scheduler.SequentialLR(opt, [warmup, lr_scheduler.CosineAnnealingLR(opt, T_max=5)], milestones=[3])


@pytest.mark.parametrize("name", ["lambda", "cosine", "linear", "sequential"])
def test_lr_schedulers_drive_the_device_lr(name):
    params = make_params()
    opt = Muon(groups(params), lr=0.02, capturable=True)
    sgd = torch.optim.SGD([torch.zeros(1)], lr=0.02)  # the same schedule on a torch optimizer
    scheduler, reference = make_scheduler(name, opt), make_scheduler(name, sgd)
    for step, grads in enumerate(make_grads(params, 8)):
        set_grads(params, grads)
        opt.step()
        sgd.step()
        for index, group in enumerate(opt.param_groups):
            assert isinstance(group["lr"], float) and group["lr"] == sgd.param_groups[0]["lr"], step
            live = opt._device_hyperparameters[index]["lr"]
            assert live.item() == torch.tensor(group["lr"], dtype=torch.float32).item(), step
        scheduler.step()
        reference.step()


def test_onecycle_cycles_betas_and_stays_bitwise():
    """Muon's defaults hold betas, so OneCycleLR(cycle_momentum=True) writes betas[0] of every group
    (the AdamW groups read it) and leaves momentum alone; capturable=True follows it bit for bit."""
    grads = make_grads(make_params(), 12)
    runs = []
    for capturable in (False, True):
        params = make_params()
        opt = Muon(groups(params), lr=0.02, capturable=capturable)
        scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=[0.02, 3e-3], total_steps=len(grads))
        beta1s = []
        for step_grads in grads:
            set_grads(params, step_grads)
            opt.step()
            scheduler.step()
            beta1s.append([group["betas"][0] for group in opt.param_groups])
            if capturable:
                opt.sync_hyperparameters()
                for index, group in enumerate(opt.param_groups):
                    live = opt._device_hyperparameters[index]
                    assert live["lr"].item() == fp32(group["lr"]) and live["beta1"].item() == fp32(group["betas"][0])
        assert all(group["momentum"] == 0.95 for group in opt.param_groups)
        assert len({b for step in beta1s for b in step}) > len(grads) // 2  # changed (nearly) every step
        runs.append(opt)
    assert_states_bitwise(*runs)


def _kept_update_matches_eager_ops(device: str, dtype, skipped, n: int) -> None:
    from suite.arms import muon

    gen = torch.Generator().manual_seed(7)
    x = torch.randn(n, generator=gen).to(dtype)
    y = torch.randn(n, generator=gen).to(dtype)
    x[:3] = torch.tensor([-0.0, float("nan"), 0.0])
    y[3] = float("nan")
    if device == "cuda" or dtype == torch.float32:
        # values whose products fall below the normal range (fp32's and bf16's): the GPU must not
        # flush them. Triton's interpreter rounds bf16 subnormals its own way, not the GPU's
        x[3:5] = torch.tensor([1e-38, -3e-38])
        y[4:6] = torch.tensor([1e-37, -2e-38])
    x, y = x.to(device), y.to(device)
    bits = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}[dtype]
    for a_value, b_value in ((0.9951, 0.0173), (0.95, 0.02)):
        a, b = torch.tensor(a_value, device=device), torch.tensor(b_value, device=device)
        # Muon's own calls, with its 0-d fp32 device scalars: on a GPU ATen casts such a scalar to
        # the other operand's dtype first; on the CPU it keeps a 0-d tensor in fp32, so the
        # interpreted check takes the GPU's rounding by casting it here
        a_eager, b_eager = (a, b) if device == "cuda" else (a.to(dtype), b.to(dtype))
        skip = None if skipped is None else torch.tensor(skipped, device=device)
        for sign, scale in ((-1, b), (1, None)):
            eager = x.clone()
            eager.mul_(a_eager).add_(y * b_eager if scale is not None else y * 1, alpha=sign)
            fused = x.clone()
            muon.launch_kept_update(skip, fused, a, y, scale, sign)
            expected = x if skipped else eager
            assert torch.equal(fused.view(bits), expected.view(bits)), (a_value, sign)


# one dtype for x and y, as Muon calls it (its grads and directions take their param's dtype)
KEPT_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.parametrize("dtype", KEPT_DTYPES)
@pytest.mark.parametrize("skipped", [False, True, None])
def test_the_kept_update_rounds_as_the_eager_ops_and_a_skip_keeps_every_bit(dtype, skipped):
    """x * a + sign * (y * b) in one kernel against x.mul_(a).add_(y * b, alpha=sign), including
    -0.0 and NaN entries, with a skip flag and without one (plain Muon's steps); interpreted on
    the CPU, compiled on the GPU by the CUDA test below."""
    from suite.arms import muon
    from suite.triton_support import interpreting

    if not interpreting(muon._kept_update_kernel):
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    _kept_update_matches_eager_ops("cpu", dtype, skipped, 5000)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", KEPT_DTYPES)
@pytest.mark.parametrize("skipped", [False, True, None])
def test_on_the_gpu_the_kept_update_rounds_as_the_eager_ops(dtype, skipped):
    """The same on the GPU's own arithmetic (no FMA contraction), over a million entries: plain
    Muon's momentum and parameter updates take this kernel there, so its bits are Muon's."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _kept_update_matches_eager_ops("cuda", dtype, skipped, 1 << 20)


def test_the_group_options_are_the_defaults_but_how_a_param_splits():
    """muon_param_groups refuses any option outside Muon.group_options: the list must be the
    constructor's group defaults, less the layout settings it sets per weight itself."""
    defaults = Muon([torch.nn.Parameter(torch.ones(2, 2))], lr=0.02).defaults
    layout = {"split_sizes", "split_dim", "split_interleaved", "transposed"}
    assert set(Muon.group_options) == set(defaults) - layout
