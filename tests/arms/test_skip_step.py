"""suite.arms.skip_step on the CPU: the decision against the obvious host code in float64, bits
of skipped steps (Muon, AdamW fused), resume, the monitor, and the refusals. Captured and
capturable-AdamW paths run on a GPU (cuda-marked)."""

from __future__ import annotations

import copy
import math
import statistics

import pytest
import torch

from gates.skip_step import as_captured_steps_it, host_run, host_skips, scenario_values
from suite.arms.muon import Muon
from suite.arms.skip_step import SkipStepOptimizer, StabilityMonitor, decide

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def scenario(kind: str) -> list[tuple[float, float]]:
    return scenario_values(kind, 300, seed=0)


def _tiny_params(seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(8, 16, generator=gen)), torch.nn.Parameter(torch.randn(16, generator=gen))]


def _grads(params, step):
    gen = torch.Generator().manual_seed(1000 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=gen) * 1e-2


def _muon(params):
    return Muon([{"params": [params[0]], "use_muon": True}, {"params": [params[1]], "use_muon": False}],
                lr=0.01, weight_decay=0.1)


def _adamw_fused(params):
    return torch.optim.AdamW(params, lr=1e-3, weight_decay=0.1, fused=True)


@pytest.mark.parametrize("kind", ["loss-spike", "grad-spike", "nan-loss", "inf-grad", "drift", "constant",
                                  "early-spike"])
def test_decisions_match_the_host_reference_and_skipped_steps_change_no_bit(kind):
    values = scenario(kind)
    expected = host_run(values)
    # a drift is never skipped, nor a spike inside the first min_history steps; the others are
    assert any(expected) == (kind not in ("drift", "early-spike"))
    for make in (_muon, _adamw_fused):
        params, by_hand = _tiny_params(), _tiny_params()
        opt = SkipStepOptimizer(make(params))
        plain = make(by_hand)
        got = []
        for step, (loss, norm) in enumerate(values):
            _grads(params, step)
            _grads(by_hand, step)
            opt.latest_loss = torch.tensor(loss)
            opt.latest_grad_norm = torch.tensor(norm)
            opt.step()
            got.append(opt.step_factor().item() == 0.0)
            if not expected[step]:
                plain.step()  # the eager run that skips those steps by hand
        assert got == expected, (make.__name__, [i for i, (a, b) in enumerate(zip(got, expected)) if a != b])
        for a, b in zip(params, by_hand):
            assert torch.equal(a, b), make.__name__
        for p, q in zip(params, by_hand):
            for key, t in plain.state[q].items():
                assert torch.equal(opt.state[p][key], t), (make.__name__, key)


def test_a_skip_keeps_nan_and_negative_zero_bits_and_the_step_count():
    params = _tiny_params()
    opt = SkipStepOptimizer(_muon(params), min_history=2)
    for step in range(3):
        _grads(params, step)
        opt.latest_loss, opt.latest_grad_norm = 1.0 + 0.01 * step, 1.0
        opt.step()
    params[0].data[0, 0] = -0.0
    state = {k: v.clone() for k, v in opt.state[params[1]].items()}
    before = [p.detach().clone() for p in params]
    for p in params:
        p.grad = torch.full_like(p, math.nan)
    opt.latest_loss, opt.latest_grad_norm = 1.01, math.nan
    opt.step()
    assert opt.step_factor().item() == 0.0
    for a, b in zip(before, params):
        assert torch.equal(a.view(torch.int32), b.detach().view(torch.int32))  # -0.0 kept as -0.0
    for key, t in state.items():
        assert torch.equal(t, opt.state[params[1]][key])


def test_a_nonfinite_value_never_enters_the_window_and_resume_continues_bitwise():
    values = scenario("nan-loss")
    params, resumed_params = _tiny_params(), _tiny_params()
    opt = SkipStepOptimizer(_adamw_fused(params))
    for step, (loss, norm) in enumerate(values[:200]):
        _grads(params, step)
        opt.latest_loss, opt.latest_grad_norm = loss, norm
        opt.step()
    assert torch.isfinite(opt.values).all() and opt.count.item() == 199
    saved = copy.deepcopy(opt.state_dict())  # as a checkpoint holds it: torch's state_dict shares its tensors
    with torch.no_grad():
        for a, b in zip(resumed_params, params):
            a.copy_(b)
    resumed = SkipStepOptimizer(_adamw_fused(resumed_params))
    resumed.load_state_dict(saved)
    for step, (loss, norm) in enumerate(values[200:], start=200):
        for o, ps in ((opt, params), (resumed, resumed_params)):
            _grads(ps, step)
            o.latest_loss, o.latest_grad_norm = loss, norm
            o.step()
    for a, b in zip(params, resumed_params):
        assert torch.equal(a, b)
    assert torch.equal(opt.values, resumed.values)


def test_the_monitor_reports_what_the_step_decided():
    values = scenario("loss-spike")
    params = _tiny_params()
    opt = SkipStepOptimizer(_muon(params))
    monitor = StabilityMonitor(opt)
    for step, (loss, norm) in enumerate(values):
        _grads(params, step)
        opt.latest_loss, opt.latest_grad_norm = loss, norm
        opt.step()
        if step == 150:
            report = monitor.report()
            assert not report["last_step_taken"] and report["spikes"] == 1 and report["skipped_since_last_report"] == 1
    report = monitor.report()
    assert report["skipped"] == 1 and report["skipped_since_last_report"] == 0 and report["window"] == 128
    kept = [v for i, v in enumerate(values) if i != 150][-128:]
    assert report["loss_mean"] == pytest.approx(statistics.fmean(v[0] for v in kept), rel=1e-12)
    assert report["loss_std"] == pytest.approx(statistics.stdev(v[0] for v in kept), rel=1e-9)


def test_decide_matches_the_host_on_random_windows():
    gen = torch.Generator().manual_seed(3)
    for trial in range(50):
        length = 16
        count = int(torch.randint(0, 40, (1,), generator=gen))
        history = torch.randn(count, 2, generator=gen, dtype=torch.float64).tolist()
        latest = (torch.randn(2, generator=gen, dtype=torch.float64) * 4).tolist()
        values = torch.zeros(2, length, dtype=torch.float64)
        for i, row in enumerate(history):
            values[:, i % length] = torch.tensor(row)
        got = decide(values, torch.tensor(count), torch.tensor(latest, dtype=torch.float64), 2.0, 5)
        assert bool(got.skip) == host_skips(history, tuple(latest), sigma=2.0, min_history=5, window=length), trial


@pytest.mark.parametrize("length, block", [(16, 16), (40, 16)])
def test_the_fused_decision_kernel_writes_what_decide_and_remember_write(length, block, monkeypatch):
    """The one-launch decision against the torch path on random windows (interpreted on the CPU):
    partly and over-filled rings, a zero std, NaN and Inf values, a window longer than a block."""
    import suite.arms.skip_step as skip_step

    from suite.triton_support import interpreting

    if not interpreting(skip_step._decide_and_remember_kernel):
        pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (tests/conftest.py sets it)")
    monkeypatch.setattr(skip_step, "next_pow2", lambda n: block)  # several blocks per row
    gen = torch.Generator().manual_seed(5)
    specials = [math.nan, math.inf, -math.inf]
    for trial in range(40):
        fused, plain = (SkipStepOptimizer(_muon(_tiny_params()), rolling_interval_length=length, min_history=5,
                                          sigma_factor=2.0) for _ in range(2))
        plain.fused_decision = False
        count = int(torch.randint(0, 3 * length, (1,), generator=gen))
        ring = torch.randn(2, length, generator=gen, dtype=torch.float64)
        if trial % 5 == 0:
            ring.fill_(1.5)  # constant: zero std
        latest = (torch.randn(2, generator=gen, dtype=torch.float64) * 3).tolist()
        if trial % 4 == 1:
            latest[trial % 2] = specials[trial % 3]
        if trial % 5 == 0 and trial % 10 == 0:
            latest[0] = 1.5
        if trial % 3 == 2:
            ring[trial % 2, ::3] = math.nan  # slots of steps that did not set that row
        for opt in (fused, plain):
            opt.values.copy_(ring)
            opt.count.fill_(count)
            opt.skipped.fill_(trial)
            opt.consecutive.fill_(trial % 3)
            if trial % 7 == 3:  # neither value set for this step
                continue
            if trial % 7 in (1, 5):  # the loss alone
                opt.latest_loss = latest[0]
                continue
            opt.latest_loss, opt.latest_grad_norm = latest
        fused._decide_and_remember_fused()
        decision = plain.decision()
        plain._factor.copy_(decision.factor)
        plain.last_z.copy_(decision.z)
        plain._found_inf.copy_(decision.skip.to(torch.float32))
        plain._remember(decision)
        for key in ("values", "count", "skipped", "nonfinite", "consecutive", "_factor", "_found_inf"):
            torch.testing.assert_close(getattr(fused, key), getattr(plain, key), rtol=0, atol=0, equal_nan=True,
                                       msg=f"{trial} {key}")
        torch.testing.assert_close(fused.last_z, plain.last_z, rtol=1e-12, atol=0, equal_nan=True)


def test_what_cannot_skip_on_the_device_is_refused_naming_the_fix():
    params = _tiny_params()
    with pytest.raises(ValueError, match=r"fused=True"):
        SkipStepOptimizer(torch.optim.AdamW(params, lr=1e-3))
    with pytest.raises(TypeError, match="cannot skip steps of SGD"):
        SkipStepOptimizer(torch.optim.SGD(params, lr=1e-3))
    with pytest.raises(ValueError, match="min_history"):
        SkipStepOptimizer(_muon(params), rolling_interval_length=8, min_history=20)


# ---- on a GPU: captured steps, capturable AdamW, no host sync, the finite guard ----


def _run_on_cuda(make, values, capture: bool):
    from suite.arms.graph import CapturedOptimizer

    params = [p.detach().cuda().requires_grad_() for p in _tiny_params()]
    inner = make(params)
    opt = SkipStepOptimizer(CapturedOptimizer(inner) if capture else inner)
    grads = [torch.zeros_like(p) for p in params]
    for p, g in zip(params, grads):
        p.grad = g
    skips = []
    for step, (loss, norm) in enumerate(values):
        gen = torch.Generator().manual_seed(1000 + step)
        for p, g in zip(params, grads):
            g.copy_(torch.randn(p.shape, generator=gen) * 1e-2)
        opt.latest_loss = torch.tensor(loss, device="cuda")
        opt.latest_grad_norm = torch.tensor(norm, device="cuda")
        if step >= 10:  # past the captured optimizer's warm-up and capture: replays only
            torch.cuda.set_sync_debug_mode("error")
        try:
            opt.step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
        skips.append(opt.step_factor().clone())
    return torch.stack(skips).eq(0).tolist(), params


@pytest.mark.cuda
@needs_cuda
@pytest.mark.parametrize("optimizer", ["muon", "adamw-fused", "adamw-capturable"])
@pytest.mark.parametrize("capture", [False, True])
def test_on_the_gpu_decisions_and_bits_match_eager_skipping_without_a_host_sync(optimizer, capture):
    make = {"muon": lambda ps: Muon([{"params": [ps[0]], "use_muon": True}, {"params": [ps[1]], "use_muon": False}],
                                    lr=0.01, weight_decay=0.1, capturable=True),
            "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, fused=True, capturable=True),
            "adamw-capturable": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1, foreach=True,
                                                             capturable=True)}[optimizer]
    for kind in ("loss-spike", "nan-loss", "inf-grad", "constant"):
        values = scenario(kind)
        expected = host_run(values)
        skips, params = _run_on_cuda(make, values, capture)
        assert skips == expected, (kind, [i for i, (a, b) in enumerate(zip(skips, expected)) if a != b])
        by_hand = [p.detach().cuda().requires_grad_() for p in _tiny_params()]
        plain = as_captured_steps_it(make(by_hand)) if capture else make(by_hand)
        for step, skip in enumerate(expected):
            gen = torch.Generator().manual_seed(1000 + step)
            for p in by_hand:
                p.grad = (torch.randn(p.shape, generator=gen) * 1e-2).cuda()
            if not skip:
                plain.step()
        for a, b in zip(params, by_hand):
            assert torch.equal(a, b), kind


_GUARD = """
import math, sys, torch
from suite.arms.muon import Muon
from suite.arms.skip_step import SkipStepOptimizer
p = torch.nn.Parameter(torch.randn(8, 16, device="cuda"))
opt = SkipStepOptimizer(Muon([p], lr=0.01), finite_guard=True, min_history=2)
p.grad = torch.randn_like(p)
opt.latest_loss, opt.latest_grad_norm = 1.0, 1.0
opt.step()
torch.cuda.synchronize()
print("finite step passed", flush=True)
if sys.argv[1] == "nan":
    opt.state[p]["momentum_buffer"].fill_(math.nan)
    opt.latest_loss, opt.latest_grad_norm = 1.0, 1.0
    opt.step()
    torch.cuda.synchronize()
print("done", flush=True)
"""


@pytest.mark.cuda
@needs_cuda
def test_on_the_gpu_the_finite_guard_fires_on_a_nan_momentum_only():
    import subprocess
    import sys

    ok = subprocess.run([sys.executable, "-c", _GUARD, "finite"], capture_output=True, text=True)
    assert ok.returncode == 0 and "done" in ok.stdout, ok.stderr[-2000:]
    bad = subprocess.run([sys.executable, "-c", _GUARD, "nan"], capture_output=True, text=True)
    assert bad.returncode != 0 and "finite step passed" in bad.stdout and "done" not in bad.stdout


def test_a_scheduler_attaches_to_the_wrapper_and_advances_on_a_skipped_step():
    params = _tiny_params()
    opt = SkipStepOptimizer(_adamw_fused(params), min_history=2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))
    for step, loss in enumerate([1.0, 1.01, 0.99, math.nan]):
        _grads(params, step)
        opt.latest_loss, opt.latest_grad_norm = loss, 1.0
        opt.step()
        scheduler.step()
    assert opt.step_factor().item() == 0.0  # the NaN step was skipped
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 / 5)  # and the schedule moved on regardless


# ---- what a loop leaves unset, the closure, resume, and bad arguments ----


def _run(opt, params, values, set_loss=True, set_norm=True):
    for step, (loss, norm) in enumerate(values):
        _grads(params, step)
        if set_loss:
            opt.latest_loss = loss
        if set_norm:
            opt.latest_grad_norm = norm
        opt.step()


def test_a_value_a_loop_never_sets_is_not_judged_and_the_other_still_is():
    """A loop that sets nothing steps as without the wrapper; one that sets only the loss has its
    loss spike skipped and nothing else (an unset grad norm read as NaN had skipped every step)."""
    values = scenario("loss-spike")
    params, plain_params = _tiny_params(), _tiny_params()
    opt, plain = SkipStepOptimizer(_adamw_fused(params)), _adamw_fused(plain_params)
    with pytest.warns(UserWarning, match="neither latest_loss nor latest_grad_norm"):
        for step in range(len(values)):
            _grads(params, step)
            _grads(plain_params, step)
            opt.step()
            plain.step()
    assert opt.skipped.item() == 0 and all(torch.equal(a, b) for a, b in zip(params, plain_params))

    params = _tiny_params()
    opt = SkipStepOptimizer(_adamw_fused(params))
    monitor = StabilityMonitor(opt)
    _run(opt, params, values, set_norm=False)
    report = monitor.report()
    assert report["skipped"] == 1 and report["spikes"] == 1 and report["nonfinite"] == 0
    assert report["window"] == 128 and math.isfinite(report["loss_mean"])
    assert report["grad_norm_mean"] is None and report["grad_norm_std"] is None  # no grad norm was ever set
    assert torch.isnan(opt.values[1]).all() and torch.isfinite(opt.values[0]).all()


def test_the_monitor_says_none_for_a_row_with_no_value_yet():
    opt = SkipStepOptimizer(_muon(_tiny_params()))
    report = StabilityMonitor(opt).report()
    assert report["window"] == 0
    assert [report[k] for k in ("loss_mean", "loss_std", "grad_norm_mean", "grad_norm_std")] == [None] * 4
    opt.latest_grad_norm = 2.5
    opt.step()
    report = StabilityMonitor(opt).report()
    assert report["grad_norm_mean"] == 2.5 and report["loss_mean"] is None and report["loss_std"] is None


def test_a_loop_that_sets_neither_value_is_warned_once_naming_the_setters(recwarn):
    """It had stepped forever, judging nothing and skipping nothing, without a word."""
    params = _tiny_params()
    opt = SkipStepOptimizer(_muon(params), min_history=5)
    for step in range(4):  # fewer unjudged steps than a window needs to judge: no warning yet
        _grads(params, step)
        opt.step()
    assert not recwarn.list
    _grads(params, 4)
    with pytest.warns(UserWarning) as caught:
        opt.step()
    assert len(caught) == 1 and caught[0].filename == __file__  # pointed at the loop's step() call
    message = str(caught[0].message)
    assert "5 steps in a row with neither latest_loss nor latest_grad_norm set" in message
    assert "opt.latest_loss = loss.detach()" in message
    for step in range(5, 40):
        _grads(params, step)
        opt.step()
    assert not recwarn.list  # once


def test_a_loop_that_sets_one_value_or_starts_setting_them_late_is_not_warned(recwarn):
    params = _tiny_params()
    values = scenario("drift")
    only_loss = SkipStepOptimizer(_muon(params), min_history=5)
    _run(only_loss, params, values[:30], set_norm=False)
    late_params = _tiny_params()
    late = SkipStepOptimizer(_muon(late_params), min_history=5)
    for step in range(4):  # a few steps before the loop sets values (a warm-up) is no mistake
        _grads(late_params, step)
        late.step()
    _run(late, late_params, values[:30])
    assert not recwarn.list


def test_the_closures_loss_is_the_steps_loss():
    values = scenario("loss-spike")
    params = _tiny_params()
    opt = SkipStepOptimizer(_muon(params))
    skipped = []
    for step, (loss, norm) in enumerate(values):
        _grads(params, step)
        opt.latest_grad_norm = norm
        returned = opt.step(lambda loss=loss: torch.tensor(loss, dtype=torch.float64))
        assert returned.item() == loss
        skipped.append(opt.step_factor().item() == 0.0)
    assert skipped == host_run(values)


def test_load_state_dict_checks_before_it_loads_and_the_monitor_resumes_with_the_last_decision():
    values = scenario("loss-spike")[:151]  # ends on the spike: the last step was skipped
    params = _tiny_params()
    opt = SkipStepOptimizer(_adamw_fused(params))
    _run(opt, params, values)
    saved = copy.deepcopy(opt.state_dict())

    other_params = _tiny_params(seed=1)
    other = SkipStepOptimizer(_adamw_fused(other_params), rolling_interval_length=64)
    _run(other, other_params, values[:5])
    inner_before = copy.deepcopy(other.optimizer.state_dict())
    with pytest.raises(ValueError, match="same rolling_interval_length"):
        other.load_state_dict(saved)
    after = other.optimizer.state_dict()
    for key, state in inner_before["state"].items():  # the inner optimizer's state untouched
        assert all(torch.equal(t, after["state"][key][k]) for k, t in state.items())

    resumed = SkipStepOptimizer(_adamw_fused(_tiny_params()))
    resumed.load_state_dict(saved)
    report = StabilityMonitor(resumed).report()
    assert not report["last_step_taken"] and report["last_z_loss"] > 6


@pytest.mark.parametrize("kwargs, error, words", [
    ({"sigma_factor": "6"}, TypeError, "sigma_factor must be a number, got str"),
    ({"sigma_factor": math.inf}, ValueError, "sigma_factor must be a finite number > 0"),
    ({"sigma_factor": math.nan}, ValueError, "sigma_factor must be a finite number > 0"),
    ({"finite_guard": "yes"}, TypeError, "finite_guard must be True or False"),
    ({"rolling_interval_length": True}, ValueError, "rolling_interval_length must be an int"),
])
def test_bad_constructor_arguments_are_named(kwargs, error, words):
    with pytest.raises(error, match=words):
        SkipStepOptimizer(_muon(_tiny_params()), **kwargs)


def test_bad_values_state_and_monitor_targets_are_named():
    opt = SkipStepOptimizer(_muon(_tiny_params()))
    with pytest.raises(ValueError, match=r"latest_loss must be one real number .* shape \(2, 2\)"):
        opt.latest_loss = torch.ones(2, 2)
    with pytest.raises(ValueError, match="latest_grad_norm must be one real number .*complex"):
        opt.latest_grad_norm = torch.tensor(1 + 2j)
    with pytest.raises(TypeError, match="latest_loss must be a tensor or a real number, got str"):
        opt.latest_loss = "1.0"
    with pytest.raises(ValueError, match=r"expected the keys \['optimizer', 'skip_step'\].*got \[\]"):
        opt.load_state_dict({})
    with pytest.raises(ValueError, match="a window state holds"):
        opt.load_state_dict({"optimizer": opt.optimizer.state_dict(), "skip_step": {"values": opt.values}})
    with pytest.raises(TypeError, match="StabilityMonitor reads a SkipStepOptimizer's window, got AdamW"):
        StabilityMonitor(_adamw_fused(_tiny_params()))
