"""scripts/rmsnorm_eager_probe.py's timeline on the CPU: every variant runs (the floor needs
compiled kernels, so it is left out here), the intervals come from the marks each variant
makes, and the arm's Function and KeptLaunches are restored afterwards."""

from __future__ import annotations

import pytest
import torch

from scriptload import load_script
from suite.arms import rmsnorm as arm
from suite.arms.triton_support import KeptLaunches


@pytest.fixture(scope="module")
def probe():
    return load_script("rmsnorm_eager_probe")


def test_timeline_variants_mark_what_each_variant_does(probe, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("the real thing runs on a GPU")
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    forward, backward, launch = arm._RMSNormFunction.forward, arm._RMSNormFunction.backward, KeptLaunches.__call__
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 64, generator=gen).bfloat16().requires_grad_()
    weight = torch.ones(64, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(4, 64, generator=gen).bfloat16()
    out = probe.timeline_variants(x, weight, dy, calls=2, warm=1)
    assert list(out) == ["ours", "identity Function", "F.rms_norm"]  # no floor without compiled kernels
    ours, identity, native = out.values()
    assert all(value is not None and value >= 0 for value in ours.values())  # every mark made
    assert ours["whole call"] >= ours["forward launch"] + ours["backward launch"]
    assert identity["forward launch"] is None and identity["whole call"] is not None
    assert native["forward body to its launch (config, allocations)"] is None
    assert native["whole call"] == pytest.approx(native["forward: call to y returned"]
                                                 + native["backward: y returned to autograd.grad returned"], rel=0.5)
    assert (arm._RMSNormFunction.forward, arm._RMSNormFunction.backward, KeptLaunches.__call__) == (forward, backward, launch)
    assert not hasattr(arm._RMSNormFunction, "untimed")
