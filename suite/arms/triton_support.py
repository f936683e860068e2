"""What every Triton arm needs around a launch: the interpreter's bf16 rounding fixed, and the
compiled kernels recorded on request (tests check their shared memory against the RTX limit).
"""

from __future__ import annotations

import contextlib
import os

import numpy as np
import torch
import triton
import triton.language as tl

# Tests set RECORD_COMPILED to collect each kernel's compiled form, keyed by kernel name.
RECORD_COMPILED = False
compiled_kernels: dict[str, object] = {}


def interpreting(kernel) -> bool:
    """The env asks for the interpreter and triton honoured it when `kernel` was decorated."""
    return os.environ.get("TRITON_INTERPRET") == "1" and not isinstance(kernel, triton.runtime.JITFunction)


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


def launch(kernel, grid, *args, **meta) -> None:
    """kernel[grid](*args, **meta), compiled or interpreted."""
    if isinstance(kernel, triton.runtime.JITFunction):
        compiled = kernel[grid](*args, **meta)
        if RECORD_COMPILED:
            compiled_kernels[kernel.fn.__name__] = compiled
    else:
        with _interpreter_rounds_bf16_like_gpu():
            kernel[grid](*args, **meta)
