"""CapturedOptimizer: the refusals and host-side checks on the CPU; on a GPU, captured steps bitwise
equal to eager ones (constant lr, an 8x LR schedule, weight decay, momentum and betas changed
mid-run, a checkpoint mid-run, release), and each saboteur caught by that comparison."""

from __future__ import annotations

import copy
import io
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.optim import lr_scheduler

from suite.arms.graph import CapturedOptimizer, CaptureError
from suite.arms.muon import Muon
from suite.errors import CouldNotRun

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
# torch's AdamW warns once when a capturable instance steps eagerly, as every reference run does.
pytestmark = pytest.mark.filterwarnings("ignore:This instance was constructed with capturable=True")


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and bool((bits(a) == bits(b)).all())


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


def fp32(value) -> float:
    return torch.tensor(float(value), dtype=torch.float32).item()


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
    captured.param_groups[0]["weight_decay"] = 0.1
    with pytest.raises(CaptureError, match="param group 0: 'weight_decay' changed from 0.01 to 0.1"):
        captured._check_replay(record)


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


def test_lr_schedulers_attach_to_the_inner_optimizer():
    captured = CapturedOptimizer(tiny_muon())
    with pytest.raises(TypeError):
        lr_scheduler.LambdaLR(captured, lambda step: 1.0)
    lr_scheduler.LambdaLR(captured.optimizer, lambda step: 0.5)
    assert captured.param_groups[0]["lr"] == 0.01


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


def adamw(params, lr) -> torch.optim.AdamW:
    return torch.optim.AdamW(params, lr=lr, weight_decay=0.01, capturable=True)


def eager(kind: str):
    """The reference: Muon(capturable=False), and for AdamW the capturable optimizer with the 0-d
    device lr that CapturedOptimizer gives it."""
    if kind == "muon":
        return lambda params: muon(params, capturable=False)
    return lambda params: adamw(params, torch.tensor(LR, device="cuda"))


def wrapped(kind: str, **wrapper_kwargs):
    if kind == "muon":
        return lambda params: CapturedOptimizer(muon(params, capturable=True), **wrapper_kwargs)
    return lambda params: CapturedOptimizer(adamw(params, LR), **wrapper_kwargs)


def warmup_cosine(opt: torch.optim.Optimizer):
    """lr from LR / 8 up to LR in 5 steps, then down to LR / 8 by cosine: an 8x swing."""
    warmup = lr_scheduler.LinearLR(opt, start_factor=0.125, total_iters=5)
    cosine = lr_scheduler.CosineAnnealingLR(opt, T_max=STEPS - 5, eta_min=LR / 8)
    return lr_scheduler.SequentialLR(opt, [warmup, cosine], milestones=[5])


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


def inner(stepper):
    return stepper.optimizer if isinstance(stepper, CapturedOptimizer) else stepper


def train(make, *, schedule=None, steps=STEPS, feed=feed_in_place, before_step=None):
    """Fresh params, make(params) -> optimizer or CapturedOptimizer, steps 0..steps.
    before_step: {step: fn(stepper)}, run after the grads are in and before step()."""
    params = make_params()
    stepper = make(params)
    scheduler = schedule(inner(stepper)) if schedule else None
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


@needs_cuda
@pytest.mark.cuda
@pytest.mark.parametrize("kind", ["muon", "adamw"])
@pytest.mark.parametrize("schedule", [None, warmup_cosine], ids=["constant", "warmup_cosine"])
def test_captured_matches_eager(kind, schedule):
    reference, _, _ = train(eager(kind), schedule=schedule)
    captured, stepper, _ = train(wrapped(kind), schedule=schedule)
    assert stepper.captured
    assert_same(reference, captured)


@needs_cuda
@pytest.mark.cuda
def test_muon_weight_decay_changed_mid_run():
    changes = {10: set_weight_decay(0.1), 18: set_weight_decay(0.0)}
    reference, _, _ = train(eager("muon"), schedule=warmup_cosine, before_step=changes)
    captured, _, _ = train(wrapped("muon"), schedule=warmup_cosine, before_step=changes)
    assert_same(reference, captured)


@needs_cuda
@pytest.mark.cuda
def test_muon_momentum_and_betas_changed_mid_run():
    changes = {10: set_momentum_and_betas(0.8, (0.8, 0.9)), 18: set_momentum_and_betas(0.95, (0.9, 0.999))}
    reference, _, _ = train(eager("muon"), schedule=warmup_cosine, before_step=changes)
    captured, stepper, _ = train(wrapped("muon"), schedule=warmup_cosine, before_step=changes)
    assert stepper.captured
    assert_same(reference, captured)


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
    scheduler = warmup_cosine(resumed.optimizer)
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
    scheduler = warmup_cosine(captured.optimizer)
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


def train_model(capture: bool) -> list[torch.Tensor]:
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
    for _ in range(STEPS):
        tokens = torch.randint(VOCAB, (BATCH, SEQ + 1), generator=gen).cuda()
        stepper.zero_grad(set_to_none=False)
        model_loss(params, tokens[:, :-1], tokens[:, 1:]).backward()
        stepper.step()
        scheduler.step()
    torch.cuda.synchronize()
    assert [g["use_muon"] for g in opt.param_groups] == [True, False, False]
    assert not capture or stepper.captured
    return list(params.values())


@needs_cuda
@pytest.mark.cuda
def test_model_like_training_is_bitwise_eager():
    assert_same(train_model(capture=False), train_model(capture=True))
