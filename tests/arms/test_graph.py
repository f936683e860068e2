"""CapturedOptimizer: the refusals, host-side checks and optimizer interface (LR schedulers, closure,
hooks) on the CPU; on a GPU, captured steps bitwise equal to eager ones (constant lr, an 8x LR
schedule, OneCycleLR, weight decay, momentum and betas changed mid-run, a checkpoint mid-run,
release, a closure), and each saboteur caught by that comparison."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler
from torch.utils._python_dispatch import TorchDispatchMode

from bitwise import bits, bitwise_equal
from suite.arms.graph import CapturedOptimizer, CaptureError
from suite.arms.muon import Muon
from suite.errors import CouldNotRun

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# torch's AdamW warns once when a capturable instance steps eagerly, as every reference run does.
pytestmark = pytest.mark.filterwarnings("ignore:This instance was constructed with capturable=True")


def first_difference(params_a: list[torch.Tensor], params_b: list[torch.Tensor]) -> str | None:
    for index, (a, b) in enumerate(zip(params_a, params_b)):
        if not bitwise_equal(a, b):
            differ = (bits(a) != bits(b)).sum().item()
            return f"param {index} {tuple(a.shape)}: {differ} of {a.numel()} elements differ in bits"
    return None


# --------------------------------------------------------------------------------------------
# CPU: construction, refusals and the checks a replay runs
# --------------------------------------------------------------------------------------------


class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(4, 8, bias=False)
        self.down = torch.nn.Linear(8, 4, bias=False)
        self.gain = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        return self.down(F.silu(self.up(x))) * self.gain


def tiny_muon(model: Tiny | None = None, **kwargs) -> Muon:
    model = model or Tiny()
    named = dict(model.named_parameters())
    return Muon([{"params": [(n, named[n]) for n in ("up.weight", "down.weight")]},
                 {"params": [("gain", named["gain"])]}], lr=0.02, capturable=True, **kwargs)


def backward(opt: torch.optim.Optimizer) -> None:
    model_params = [p for group in opt.param_groups for p in group["params"]]
    loss = sum((p * p).sum() for p in model_params)
    loss.backward()


def stepped_muon(**wrapper_kwargs) -> CapturedOptimizer:
    """A CPU Muon that has stepped once (its state exists) with grads in place, wrapped."""
    opt = tiny_muon()
    backward(opt)
    opt.step()
    return CapturedOptimizer(opt, **wrapper_kwargs)


def stepped_adamw(**wrapper_kwargs) -> CapturedOptimizer:
    """A CPU AdamW with state and grads, wrapped. torch's capturable AdamW cannot step on the CPU,
    so it steps once as capturable=False and is then marked capturable: the host checks under test
    only read the groups, the state and the grads."""
    params = [torch.randn(4, 4, requires_grad=True), torch.randn(4, requires_grad=True)]
    opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for group in opt.param_groups:
        group["capturable"] = True
    return CapturedOptimizer(opt, **wrapper_kwargs)


def as_if_captured(captured: CapturedOptimizer) -> None:
    """What the capture records, without the CUDA graph: enough for the host-side paths."""
    captured._captured = captured._prepare_capture()


def stepping_on_the_cpu(captured: CapturedOptimizer) -> CapturedOptimizer:
    """Lets the wrapper's eager (warm-up) steps run the inner step on the CPU, with no side stream:
    what the wrapper does around a step (closure, hooks, scheduler counting) is then testable here."""
    captured._require_cuda = lambda: None
    captured._eager_step = captured.optimizer.step
    return captured


def fp32(value) -> float:
    return torch.tensor(float(value), dtype=torch.float32).item()


class CountItemCalls(TorchDispatchMode):
    """Counts device-to-host reads of a tensor's value (item(), a tensor passed as a python number)."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.count += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("make", [
    lambda p: Muon([p], lr=0.1),
    lambda p: torch.optim.AdamW([p], lr=0.1),
])
def test_non_capturable_optimizer_is_refused(make):
    with pytest.raises(ValueError, match="capturable=True"):
        CapturedOptimizer(make(torch.zeros(3, 3, requires_grad=True)))


def test_unsupported_optimizer_is_refused():
    with pytest.raises(TypeError, match="cannot capture SGD"):
        CapturedOptimizer(torch.optim.SGD([torch.zeros(3, requires_grad=True)], lr=0.1))
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        CapturedOptimizer(object())


def test_bad_arguments_are_refused():
    with pytest.raises(ValueError, match="warmup_steps must be an int >= 1"):
        CapturedOptimizer(tiny_muon(), warmup_steps=0)
    with pytest.raises(ValueError, match="not a parameter of the optimizer"):
        CapturedOptimizer(tiny_muon(), exclude=[torch.zeros(2)])


def test_none_grad_refusal_names_the_parameters():
    model = Tiny()
    frozen = torch.nn.Parameter(torch.ones(4), requires_grad=False)
    opt = tiny_muon(model)
    opt.add_param_group({"params": [("frozen", frozen)], "use_muon": False})
    model.up.weight.grad = torch.ones(8, 4)
    opt.step()  # up.weight has state; down.weight and gain have no grad
    with pytest.raises(CaptureError, match=r"'down.weight' of param group 0, 'gain' of param group 1 require grad"):
        CapturedOptimizer(opt)._prepare_capture()
    # A frozen param without grad is not in the step; an excluded one is left out on purpose.
    CapturedOptimizer(opt, exclude=[model.down.weight, model.gain])._prepare_capture()


def test_capture_before_any_state_is_refused():
    opt = tiny_muon()
    backward(opt)
    with pytest.raises(CaptureError, match=r"'up.weight' of param group 0, .* have no optimizer state"):
        CapturedOptimizer(opt)._prepare_capture()


def test_step_without_cuda_params_says_so():
    captured = stepped_muon()
    with pytest.raises(CouldNotRun, match="CUDA graphs need every parameter on a CUDA device"):
        captured.step()


def test_muon_live_values_may_change_others_may_not():
    captured = stepped_muon()
    record = captured._prepare_capture()
    group = captured.param_groups[1]
    group.update(lr=0.5, weight_decay=0.1, momentum=0.5, betas=(0.8, 0.9))  # live: no complaint
    captured._check_replay(record)
    captured._sync_live_values(record)
    live = captured.optimizer._device_hyperparameters[1]
    assert (live["lr"].item(), live["momentum"].item(), live["beta1"].item()) == (0.5, 0.5, fp32(0.8))
    group["eps"] = 1e-6
    with pytest.raises(CaptureError, match=r"param group 1: 'eps' changed from 1e-08 to 1e-06 after capture.*"
                                           r"cannot be live.*release\(\)"):
        captured._check_replay(record)


def test_a_key_added_after_capture_is_refused():
    captured = stepped_muon()
    record = captured._prepare_capture()
    captured.param_groups[0]["amsgrad"] = True
    with pytest.raises(CaptureError, match="'amsgrad' changed from <absent> to True"):
        captured._check_replay(record)


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # stepped before
def test_adamw_lr_is_a_live_device_tensor():
    captured = stepped_adamw()
    group = captured.param_groups[0]
    lr = group["lr"]
    assert isinstance(lr, torch.Tensor) and lr.dim() == 0 and lr.dtype == torch.float32
    scheduler = lr_scheduler.LambdaLR(captured.optimizer, lambda step: 0.5**step)
    scheduler.step()
    assert group["lr"] is lr and lr.item() == pytest.approx(5e-4)  # filled in place
    record = captured._prepare_capture()
    group["lr"] = 0.125  # a float assigned by hand still reaches the graph's tensor
    captured._check_replay(record)
    captured._sync_live_values(record)
    assert group["lr"] is lr and lr.item() == 0.125


def test_adamw_weight_decay_is_not_live():
    captured = stepped_adamw()
    record = captured._prepare_capture()
    captured.param_groups[0]["betas"] = [0.9, 0.999]  # equal to the recorded tuple
    captured._check_replay(record)
    captured.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(CaptureError, match="param group 0: 'weight_decay' changed from 0.01 to 0.1"):
        captured._check_replay(record)


def test_adamw_tensor_betas_are_refused():
    opt = torch.optim.AdamW([torch.zeros(3, requires_grad=True)], lr=1e-3,
                            betas=(torch.tensor(0.9), torch.tensor(0.99)), capturable=True)
    with pytest.raises(ValueError, match=r"param groups \[0\] have tensor betas.*item\(\).*pass float betas"):
        CapturedOptimizer(opt)


def test_torch_fused_adamw_reads_tensor_betas_on_the_host():
    """Why tensor betas are refused: torch's kernels take betas as host numbers, so a tensor beta is
    read back with item() every step (on the GPU a sync that a capture cannot contain; the foreach
    and for-loop steps too, see test_torch_adamw_reads_tensor_betas_on_the_host_on_gpu)."""
    p = torch.randn(4, 4, requires_grad=True)
    p.grad = torch.randn(4, 4)
    opt = torch.optim.AdamW([p], lr=1e-3, betas=(torch.tensor(0.9), torch.tensor(0.99)), fused=True)
    opt.step()
    with CountItemCalls() as reads:
        opt.step()
    assert reads.count >= 2


def test_baked_lr_saboteur_changes_go_unnoticed():
    muon = stepped_muon(live_lr=False)
    record = muon._prepare_capture()
    before = muon.optimizer._device_hyperparameters[0]["lr"].item()
    muon.param_groups[0]["lr"], muon.param_groups[0]["weight_decay"] = 0.5, 0.25
    muon._check_replay(record)
    muon._sync_live_values(record)
    live = muon.optimizer._device_hyperparameters[0]
    assert live["lr"].item() == before and live["weight_decay"].item() == 0.25

    adamw = stepped_adamw(live_lr=False)
    assert isinstance(adamw.param_groups[0]["lr"], float)
    record = adamw._prepare_capture()
    adamw.param_groups[0]["lr"] = 0.5
    adamw._check_replay(record)


def test_swapped_grad_is_refused_unless_unchecked():
    for check_grads in (True, False):
        captured = stepped_muon(check_grads=check_grads)
        record = captured._prepare_capture()
        gain = captured.param_groups[1]["params"][0]
        gain.grad = gain.grad.clone()
        if check_grads:
            with pytest.raises(CaptureError, match=r"grad of 'gain' of param group 1 is a new tensor.*set_to_none=False"):
                captured._check_replay(record)
        else:
            captured._check_replay(record)


def test_new_grad_or_new_storage_after_capture_is_refused():
    captured = stepped_muon()
    frozen = torch.nn.Parameter(torch.ones(3), requires_grad=False)
    captured.optimizer.add_param_group({"params": [("frozen", frozen)], "use_muon": False})
    record = captured._prepare_capture()
    frozen.grad = torch.ones(3)
    with pytest.raises(CaptureError, match="'frozen' of param group 2 has a grad now"):
        captured._check_replay(record)
    frozen.grad = None
    up = captured.param_groups[0]["params"][0]
    up.data = up.data.clone()
    with pytest.raises(CaptureError, match="'up.weight' of param group 0 was given new storage"):
        captured._check_replay(record)


def test_replaced_optimizer_state_is_refused():
    captured = stepped_muon()
    record = captured._prepare_capture()
    captured._check_replay(record)
    # a checkpoint loaded into the inner optimizer: new state tensors
    captured.optimizer.load_state_dict(copy.deepcopy(captured.optimizer.state_dict()))
    with pytest.raises(CaptureError, match="optimizer state of .* was replaced after capture"):
        captured._check_replay(record)


def test_excluded_param_is_not_watched():
    opt = tiny_muon()
    backward(opt)
    opt.step()
    gain = opt.param_groups[1]["params"][0]
    captured = CapturedOptimizer(opt, exclude=[gain])
    record = captured._prepare_capture()
    assert record.grads[2] is None
    gain.grad = torch.ones(4)
    captured._check_replay(record)


def test_zero_grad_before_and_after_capture():
    captured = stepped_muon()
    captured.zero_grad()
    assert all(p.grad is None for group in captured.param_groups for p in group["params"])
    backward(captured.optimizer)
    captured.optimizer.step()
    as_if_captured(captured)
    pointers = [p.grad.data_ptr() for group in captured.param_groups for p in group["params"]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        captured.zero_grad()
        captured.zero_grad(set_to_none=True)
    assert len([w for w in caught if "in place" in str(w.message)]) == 1
    grads = [p.grad for group in captured.param_groups for p in group["params"]]
    assert [g.data_ptr() for g in grads] == pointers and all(torch.count_nonzero(g) == 0 for g in grads)
    captured._check_replay(captured._captured)


def test_release_load_state_dict_and_add_param_group_re_warm():
    captured = stepped_muon(warmup_steps=2)
    state = captured.state_dict()
    extra = {"params": [("extra", torch.zeros(2, requires_grad=True))]}
    for action in (captured.release, lambda: captured.load_state_dict(state), lambda: captured.add_param_group(extra)):
        captured._eager_steps_left = 0
        as_if_captured(captured)
        assert captured.captured
        action()
        assert not captured.captured and captured._eager_steps_left == 2


def test_the_wrapper_is_an_optimizer_with_the_inner_ones_groups_state_and_defaults():
    captured = stepped_muon()
    inner = captured.optimizer
    assert isinstance(captured, torch.optim.Optimizer)
    assert captured.param_groups is inner.param_groups and captured.state is inner.state
    assert captured.defaults is inner.defaults and "betas" in captured.defaults
    inner.add_param_group({"params": [("extra", torch.zeros(2, requires_grad=True))]})
    assert len(captured.param_groups) == 3
    with pytest.raises(TypeError, match="cannot be pickled or copied.*state_dict"):
        copy.deepcopy(captured)


def test_lr_schedulers_attach_to_the_wrapper_or_the_inner_optimizer():
    captured = stepping_on_the_cpu(CapturedOptimizer(tiny_muon(), warmup_steps=100))
    scheduler = lr_scheduler.LambdaLR(captured, lambda step: 0.5**step)
    assert [group["lr"] for group in captured.optimizer.param_groups] == [0.02, 0.02]
    with warnings.catch_warnings():
        # no "lr_scheduler.step() before optimizer.step()": the scheduler counts the wrapper's steps
        warnings.simplefilter("error")
        for _ in range(3):
            backward(captured.optimizer)
            captured.step()
            captured.zero_grad()
            scheduler.step()
    assert [group["lr"] for group in captured.param_groups] == [0.02 * 0.5**3] * 2
    assert scheduler.state_dict()["_step_count"] == 4
    lr_scheduler.LambdaLR(CapturedOptimizer(tiny_muon()).optimizer, lambda step: 0.5)


def test_step_with_a_closure_evaluates_it_once_with_grad_and_returns_its_loss():
    captured = stepping_on_the_cpu(CapturedOptimizer(tiny_muon(), warmup_steps=100))
    params = [p for group in captured.param_groups for p in group["params"]]
    before = [p.detach().clone() for p in params]
    grad_enabled = []

    def closure():
        grad_enabled.append(torch.is_grad_enabled())
        captured.zero_grad()
        loss = sum((p * p).sum() for p in params)
        loss.backward()
        return loss

    with torch.no_grad():
        loss = captured.step(closure)
    assert grad_enabled == [True]  # once: the inner step is not handed the closure
    assert loss.item() == pytest.approx(sum((b * b).sum() for b in before).item())
    assert all(not torch.equal(p, b) for p, b in zip(params, before))


def test_step_on_cpu_params_refuses_before_the_closure():
    called = []
    with pytest.raises(CouldNotRun, match="CUDA graphs need every parameter on a CUDA device"):
        stepped_muon().step(lambda: called.append(True))
    assert not called


def test_hooks_registered_on_the_wrapper_run():
    captured = stepping_on_the_cpu(CapturedOptimizer(tiny_muon(), warmup_steps=100))
    seen = []
    captured.register_step_pre_hook(lambda opt, args, kwargs: seen.append(("step pre", opt)))
    captured.register_step_post_hook(lambda opt, args, kwargs: seen.append(("step post", opt)))
    captured.register_state_dict_post_hook(lambda opt, state: seen.append(("state_dict", opt)))
    captured.register_load_state_dict_pre_hook(lambda opt, state: seen.append(("load", opt)))
    backward(captured.optimizer)
    captured.step()
    captured.load_state_dict(captured.state_dict())
    # state_dict and load_state_dict are the inner optimizer's, hooks included
    assert seen == [("step pre", captured), ("step post", captured), ("state_dict", captured.optimizer),
                    ("load", captured.optimizer)]


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no step here
def test_onecycle_on_the_wrapper_drives_muon_lr_and_betas_on_the_device():
    captured = stepped_muon()
    record = captured._prepare_capture()
    # built after the capture: its bookkeeping keys (max_lr, max_momentum, ...) are never read by a step
    scheduler = lr_scheduler.OneCycleLR(captured, max_lr=[0.02, 1e-3], total_steps=10)
    for _ in range(9):
        captured._check_replay(record)
        captured._sync_live_values(record)
        for index, group in enumerate(captured.param_groups):
            live = captured.optimizer._device_hyperparameters[index]
            beta1 = group["betas"][0]
            assert (live["lr"].item(), live["beta1"].item()) == (fp32(group["lr"]), fp32(beta1))
            assert live["one_minus_beta1"].item() == fp32(1 - beta1)
            assert live["momentum"].item() == fp32(0.95)  # Muon's defaults hold betas: OneCycleLR cycles those
        scheduler.step()


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before")  # no step here
def test_onecycle_on_wrapped_adamw_drives_the_lr_and_refuses_cycled_betas():
    captured = stepped_adamw()
    lr = captured.param_groups[0]["lr"]
    scheduler = lr_scheduler.OneCycleLR(captured, max_lr=1e-3, total_steps=10, cycle_momentum=False)
    sgd = torch.optim.SGD([torch.zeros(1)], lr=1e-3)  # the same schedule on float lrs
    reference = lr_scheduler.OneCycleLR(sgd, max_lr=1e-3, total_steps=10, cycle_momentum=False)
    record = captured._prepare_capture()
    for _ in range(9):
        scheduler.step()
        reference.step()
        captured._check_replay(record)
        captured._sync_live_values(record)
        assert captured.param_groups[0]["lr"] is lr and lr.item() == fp32(sgd.param_groups[0]["lr"])

    captured = stepped_adamw()
    scheduler = lr_scheduler.OneCycleLR(captured, max_lr=1e-3, total_steps=10)  # cycle_momentum=True
    record = captured._prepare_capture()
    scheduler.step()
    with pytest.raises(CaptureError, match=r"'betas' changed from \(0.95, 0.999\) to \(0.89.*release.*"
                                           r"item\(\).*cycle_momentum=False.*Muon's AdamW groups keep betas live"):
        captured._check_replay(record)


# --------------------------------------------------------------------------------------------
# GPU: captured vs eager, bit for bit
# --------------------------------------------------------------------------------------------

LR = 0.02
STEPS = 25
SHAPES = [(64, 32), (32, 64), (48, 48), (64,), (32,)]


def make_params(seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen).cuda().requires_grad_() for shape in SHAPES]


def make_grads(steps: int = STEPS, seed: int = 1) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(shape, generator=gen).cuda() for shape in SHAPES] for _ in range(steps)]


def muon(params, capturable: bool) -> Muon:
    groups = [{"params": [p for p in params if p.dim() == 2]}, {"params": [p for p in params if p.dim() != 2]}]
    return Muon(groups, lr=LR, weight_decay=0.01, capturable=capturable)


def adamw(params, lr, fused: bool = False) -> torch.optim.AdamW:
    """torch's AdamW, foreach (its default on the GPU) or fused."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, capturable=True, fused=fused or None)


def eager(kind: str):
    """The reference: Muon(capturable=False), and for AdamW ("adamw", "adamw-fused") the capturable
    optimizer with the 0-d device lr that CapturedOptimizer gives it."""
    if kind == "muon":
        return lambda params: muon(params, capturable=False)
    return lambda params: adamw(params, torch.tensor(LR, device="cuda"), fused=kind == "adamw-fused")


def wrapped(kind: str, **wrapper_kwargs):
    if kind == "muon":
        return lambda params: CapturedOptimizer(muon(params, capturable=True), **wrapper_kwargs)
    return lambda params: CapturedOptimizer(adamw(params, LR, fused=kind == "adamw-fused"), **wrapper_kwargs)


def warmup_cosine(opt: torch.optim.Optimizer):
    """lr from LR / 8 up to LR in 5 steps, then down to LR / 8 by cosine: an 8x swing."""
    warmup = lr_scheduler.LinearLR(opt, start_factor=0.125, total_iters=5)
    cosine = lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 5, eta_min=LR / 8)
    return lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[5])


def onecycle(cycle_momentum: bool):
    """OneCycleLR over the run, each group peaking at its own lr; cycle_momentum=True also cycles
    betas[0] (Muon's and AdamW's defaults hold betas)."""
    def attach(opt: torch.optim.Optimizer):
        max_lr = [float(group["lr"]) for group in opt.param_groups]
        return lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=STEPS, cycle_momentum=cycle_momentum)
    return attach


def feed_in_place(params, grads):
    """Backward into grads zeroed in place: the same grad tensors every step."""
    for p, g in zip(params, grads):
        if p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


def feed_fresh(params, grads):
    """zero_grad(set_to_none=True), then backward: new grad tensors every step."""
    for p, g in zip(params, grads):
        p.grad = g.clone()


def train(make, *, schedule=None, steps=STEPS, feed=feed_in_place, before_step=None):
    """Fresh params, make(params) -> optimizer or CapturedOptimizer, steps 0..steps; the scheduler
    attaches to what make returns. before_step: {step: fn(stepper)}, run after the grads are in and
    before step()."""
    params = make_params()
    stepper = make(params)
    scheduler = schedule(stepper) if schedule else None
    resume(params, stepper, scheduler, 0, steps, feed, before_step)
    return params, stepper, scheduler


def resume(params, stepper, scheduler, start, steps=STEPS, feed=feed_in_place, before_step=None):
    grads = make_grads(steps)
    for step in range(start, steps):
        feed(params, grads[step])
        if before_step and step in before_step:
            before_step[step](stepper)
        stepper.step()
        if scheduler is not None:
            scheduler.step()
    torch.cuda.synchronize()


def set_weight_decay(value):
    def change(stepper):
        for group in stepper.param_groups:
            group["weight_decay"] = value
    return change


def set_momentum_and_betas(momentum, betas):
    def change(stepper):
        for group in stepper.param_groups:
            group.update(momentum=momentum, betas=betas)
    return change


def assert_same(reference_params, params):
    difference = first_difference(reference_params, params)
    assert difference is None, difference


def assert_differ(reference_params, sabotaged_params):
    assert first_difference(reference_params, sabotaged_params) is not None, "the saboteur left every bit unchanged"


@needs_cuda
@pytest.mark.cuda
def test_muon_capturable_eager_is_bitwise_plain_on_gpu():
    changes = {10: set_weight_decay(0.1), 14: set_momentum_and_betas(0.8, (0.8, 0.9))}
    plain, _, _ = train(eager("muon"), schedule=warmup_cosine, before_step=changes)
    capturable, _, _ = train(lambda params: muon(params, capturable=True), schedule=warmup_cosine, before_step=changes)
    assert_same(plain, capturable)


@needs_cuda
@pytest.mark.cuda
def test_muon_capture_with_capturable_false_is_refused():
    p = torch.randn(8, 8, device="cuda", requires_grad=True)
    p.grad = torch.randn_like(p)
    opt = Muon([p], lr=0.1)
    opt.step()
    with pytest.raises(RuntimeError, match="capturable=True"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            opt.step()


def assert_captured_matches_eager(kind, **training):
    """The same training eagerly and through the wrapper: captured, and bit for bit the same."""
    reference, _, _ = train(eager(kind), **training)
    captured, stepper, _ = train(wrapped(kind), **training)
    assert stepper.captured
    assert_same(reference, captured)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw"])
@pytest.mark.parametrize("schedule", [None, warmup_cosine], ids=["constant", "warmup_cosine"])
def test_captured_matches_eager(kind, schedule):
    assert_captured_matches_eager(kind, schedule=schedule)


@needs_cuda
@pytest.mark.cuda
def test_muon_weight_decay_changed_mid_run():
    changes = {10: set_weight_decay(0.1), 18: set_weight_decay(0.0)}
    assert_captured_matches_eager("muon", schedule=warmup_cosine, before_step=changes)


@needs_cuda
@pytest.mark.cuda
def test_muon_momentum_and_betas_changed_mid_run():
    changes = {10: set_momentum_and_betas(0.8, (0.8, 0.9)), 18: set_momentum_and_betas(0.95, (0.9, 0.999))}
    assert_captured_matches_eager("muon", schedule=warmup_cosine, before_step=changes)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw", "adamw-fused"])
def test_onecycle_on_the_wrapper_matches_eager(kind):
    # Muon: lr and betas[0] cycled, both live; torch AdamW: lr only (its betas are host numbers)
    assert_captured_matches_eager(kind, schedule=onecycle(cycle_momentum=kind == "muon"))


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["adamw", "adamw-fused"])
def test_adamw_cycled_momentum_is_refused_at_the_first_replay(kind):
    with pytest.raises(CaptureError, match="'betas' changed from .*cycle_momentum=False"):
        train(wrapped(kind), schedule=onecycle(cycle_momentum=True))


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("implementation", [dict(foreach=False), dict(foreach=True), dict(fused=True)],
                         ids=["for-loop", "foreach", "fused"])
def test_torch_adamw_reads_tensor_betas_on_the_host_on_gpu(implementation):
    """Why CapturedOptimizer refuses tensor betas: every capturable AdamW step reads them back to the
    host (a sync, which a capture cannot contain). If this fails, torch has made them device values."""
    p = torch.randn(8, 8, device="cuda", requires_grad=True)
    p.grad = torch.randn_like(p)
    betas = (torch.tensor(0.9, device="cuda"), torch.tensor(0.99, device="cuda"))
    opt = torch.optim.AdamW([p], lr=torch.tensor(1e-3, device="cuda"), betas=betas, capturable=True,
                            **implementation)
    opt.step()
    with CountItemCalls() as reads:
        opt.step()
    assert reads.count >= 1


@needs_cuda
@pytest.mark.cuda
def test_adamw_weight_decay_change_is_refused_then_release_recaptures():
    def change_refused_release(stepper):
        set_weight_decay(0.1)(stepper)
        with pytest.raises(CaptureError, match="'weight_decay' changed from 0.01 to 0.1"):
            stepper.step()
        stepper.release()

    reference, _, _ = train(eager("adamw"), before_step={10: set_weight_decay(0.1)})
    captured, stepper, _ = train(wrapped("adamw"), before_step={10: change_refused_release})
    assert stepper.captured
    assert_same(reference, captured)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_checkpoint_mid_run_continues_bitwise(kind):
    reference, _, _ = train(eager(kind), schedule=warmup_cosine)
    first_params, first, first_scheduler = train(wrapped(kind), schedule=warmup_cosine, steps=12)
    assert first.captured
    buffer = io.BytesIO()
    torch.save({"optimizer": first.state_dict(), "scheduler": first_scheduler.state_dict()}, buffer)
    buffer.seek(0)
    checkpoint = torch.load(buffer, weights_only=False)

    params = [p.detach().clone().requires_grad_() for p in first_params]
    resumed = wrapped(kind)(params)
    scheduler = warmup_cosine(resumed)
    resumed.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    resume(params, resumed, scheduler, start=12)
    assert resumed.captured
    assert_same(reference, params)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_release_then_continue(kind):
    def release(stepper):
        assert stepper.captured
        stepper.release()

    reference, _, _ = train(eager(kind), schedule=warmup_cosine)
    captured, stepper, _ = train(wrapped(kind), schedule=warmup_cosine, before_step={10: release})
    assert stepper.captured
    assert_same(reference, captured)


@needs_cuda
@pytest.mark.cuda
def test_zero_grad_set_to_none_warns_once_and_works():
    reference, _, _ = train(eager("muon"), schedule=warmup_cosine, feed=feed_fresh)

    params = make_params()
    captured = wrapped("muon")(params)
    scheduler = warmup_cosine(captured)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for grads in make_grads():
            captured.zero_grad(set_to_none=True)
            for p, g in zip(params, grads):  # what backward does: a new tensor, or accumulate in place
                if p.grad is None:
                    p.grad = g.clone()
                else:
                    p.grad.add_(g)
            captured.step()
            scheduler.step()
    torch.cuda.synchronize()
    assert len([w for w in caught if "zeroing the grads in place" in str(w.message)]) == 1
    assert_same(reference, params)


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_swapped_grad_raises(kind):
    with pytest.raises(CaptureError, match="is a new tensor since capture"):
        train(wrapped(kind), feed=feed_fresh)


# Each saboteur must differ from the reference where its flaw bites, and only there (a control
# run shows the flag alone changes nothing), so a gate's bitwise comparison is what catches it.


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_saboteur_baked_lr(kind):
    bake = wrapped(kind, live_lr=False)
    # AdamW's baked lr is a float, so its reference here is the eager AdamW with a float lr: the
    # two then differ by the baking alone.
    reference = eager(kind) if kind == "muon" else (lambda params: adamw(params, LR))
    assert_differ(train(reference, schedule=warmup_cosine)[0], train(bake, schedule=warmup_cosine)[0])
    assert_same(train(reference)[0], train(bake)[0])  # under a constant lr the baked value is right


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_saboteur_unchecked_grads(kind):
    unchecked = wrapped(kind, check_grads=False)
    reference, _, _ = train(eager(kind), feed=feed_fresh)
    sabotaged, _, _ = train(unchecked, feed=feed_fresh)
    assert_differ(reference, sabotaged)
    assert_same(train(eager(kind))[0], train(unchecked)[0])  # grads zeroed in place: no harm


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw"])
def test_saboteur_left_out_param(kind):
    def leave_out_first(params):
        return wrapped(kind, exclude=[params[0]])(params)

    reference, _, _ = train(eager(kind))
    sabotaged, _, _ = train(leave_out_first)
    assert_differ(reference[:1], sabotaged[:1])
    assert_same(reference[1:], sabotaged[1:])


# A model-like parameter set: 4 layers at d = 64; the embedding and the output head on AdamW.
VOCAB, D, LAYERS, BATCH, SEQ = 128, 64, 4, 4, 16


def model_params(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)

    def weight(*shape, std):
        return (torch.randn(shape, generator=gen) * std).cuda().requires_grad_()

    def gain():
        return torch.ones(D, device="cuda", requires_grad=True)

    params = {"embed": weight(VOCAB, D, std=1.0)}
    for layer in range(LAYERS):
        params |= {f"{layer}.norm1": gain(), f"{layer}.mix": weight(D, D, std=D**-0.5), f"{layer}.norm2": gain(),
                   f"{layer}.up": weight(4 * D, D, std=D**-0.5), f"{layer}.down": weight(D, 4 * D, std=(4 * D) ** -0.5)}
    params |= {"norm": gain(), "head": weight(VOCAB, D, std=D**-0.5)}
    return params


def model_loss(params: dict[str, torch.Tensor], tokens: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Only ops with deterministic backwards: a one-hot matmul for the lookup, no atomics."""
    def rms(x, gain):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * gain

    x = F.one_hot(tokens, VOCAB).float() @ params["embed"]
    for layer in range(LAYERS):
        x = x + rms(x, params[f"{layer}.norm1"]) @ params[f"{layer}.mix"].T
        h = F.silu(rms(x, params[f"{layer}.norm2"]) @ params[f"{layer}.up"].T)
        x = x + h @ params[f"{layer}.down"].T
    log_probs = F.log_softmax(rms(x, params["norm"]) @ params["head"].T, dim=-1)
    return -(log_probs * F.one_hot(targets, VOCAB)).sum(-1).mean()


def train_model(capture: bool, closure: bool = False) -> tuple[list[torch.Tensor], torch.Tensor]:
    """(final params, the losses). The scheduler attaches to the inner optimizer (the other tests
    attach theirs to the wrapper); closure=True hands step() the forward and backward."""
    params = model_params()
    marked = ("embed", "head")
    groups = [
        {"params": [(n, p) for n, p in params.items() if p.dim() == 2 and n not in marked]},
        {"params": [(n, p) for n, p in params.items() if p.dim() != 2]},
        {"params": [(n, params[n]) for n in marked], "use_muon": False},
    ]
    opt = Muon(groups, lr=LR, weight_decay=0.01, capturable=capture)
    stepper = CapturedOptimizer(opt) if capture else opt
    scheduler = lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 5) * (0.25 if step > 15 else 1.0))
    gen = torch.Generator().manual_seed(7)
    losses = []
    for _ in range(STEPS):
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen).cuda()

        def forward_backward():
            stepper.zero_grad(set_to_none=False)
            loss = model_loss(params, tokens[:, :-1], tokens[:, 1:])
            loss.backward()
            return loss

        if closure:
            losses.append(stepper.step(forward_backward))
        else:
            losses.append(forward_backward())
            stepper.step()
        scheduler.step()
    torch.cuda.synchronize()
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, False]
    assert not capture or stepper.captured
    return list(params.values()), torch.stack(losses).detach()


@needs_cuda
@pytest.mark.cuda
def test_model_like_training_is_bitwise_eager():
    assert_same(train_model(capture=False)[0], train_model(capture=True)[0])


@needs_cuda
@pytest.mark.cuda
def test_step_with_a_closure_is_bitwise_eager():
    eager_params, eager_losses = train_model(capture=False, closure=True)
    captured_params, captured_losses = train_model(capture=True, closure=True)
    assert_same(eager_params, captured_params)
    assert bitwise_equal(eager_losses, captured_losses)
    assert_same(train_model(capture=False)[0], captured_params)  # the closure changes only who calls it
