import pytest
import torch
import triton
import triton.language as tl

from suite.arms import triton_support


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
