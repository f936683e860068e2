"""The cross-compiler's own parts: ptxas's count of registers and spills, the checks it makes
before it fakes a card, and what a build is judged by. Compiling the arms themselves for the
two cards: tests/scripts/test_cross_compile.py."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from suite.errors import CouldNotRun
from suite.harness import cross_compile
from suite.harness.cross_compile import TARGETS, Build

# A kernel written to a file and compiled for sm_90 in a process of its own: triton.jit gives
# this process (TRITON_INTERPRET=1 on a CPU) interpreted kernels, which compile to nothing.
_PTX_OF = textwrap.dedent('''
    import sys
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    @triton.jit
    def held(A, B, C, n_k, COLS: tl.constexpr):
        # a [64, COLS] fp32 accumulator live across the loop: 2 * COLS values a thread in one warp
        rows = tl.arange(0, 64)
        cols = tl.arange(0, COLS)
        ks = tl.arange(0, 16)
        acc = tl.zeros([64, COLS], tl.float32)
        for k0 in range(0, n_k, 16):
            a = tl.load(A + rows[:, None] * n_k + k0 + ks[None, :])
            b = tl.load(B + (k0 + ks)[:, None] * COLS + cols[None, :])
            acc = tl.dot(a, b, acc)
        tl.store(C + rows[:, None] * COLS + cols[None, :], acc)

    cols = int(sys.argv[1])
    source = ASTSource(fn=held, signature={"A": "*bf16", "B": "*bf16", "C": "*fp32", "n_k": "i32",
                                             "COLS": "constexpr"}, constexprs={"COLS": cols})
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 1})
    sys.stdout.write(compiled.asm["ptx"])
''')


def _ptx(folder, cols: int) -> str:
    script = folder / "held.py"  # triton.jit reads a kernel's source from its file
    script.write_text(_PTX_OF)
    done = subprocess.run([sys.executable, str(script), str(cols)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TRITON_INTERPRET": "0"})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout


def test_ptxas_counts_the_spills_of_a_tile_too_big_for_the_registers(tmp_path):
    """One warp holding a [64, 256] fp32 accumulator (512 values a thread, past any register
    budget) spills; [64, 16] does not: the count the cross-compiler judges tiles by says both."""
    registers, spills = cross_compile.ptxas_usage(_ptx(tmp_path, 256), 90)
    assert registers > 0 and spills > 0
    registers, spills = cross_compile.ptxas_usage(_ptx(tmp_path, 16), 90)
    assert registers > 0 and spills == 0


def test_a_build_fits_only_without_an_error_and_within_its_cards_shared_memory():
    limit = TARGETS["sm120"].smem_bytes
    build = Build("k", {}, "bfloat16", "sm120", limit, shared=limit)
    assert build.fits
    assert not Build("k", {}, "bfloat16", "sm120", limit, shared=limit + 1).fits
    assert not Build("k", {}, "bfloat16", "sm120", limit, shared=0, error="CompilationError: ...").fits
    assert not Build("k", {}, "bfloat16", "sm120", limit).fits  # nothing compiled


def test_the_targets_are_the_h200_and_the_rtx_card_under_its_profile():
    assert (TARGETS["sm90"].arch, TARGETS["sm90"].profile) == (90, "none")
    assert (TARGETS["sm120"].arch, TARGETS["sm120"].profile, TARGETS["sm120"].smem_bytes) == (120, "rtx", 101376)


@pytest.mark.skipif(torch.backends.cuda.is_built(), reason="a CUDA build of torch can fake a card")
def test_a_cpu_build_of_torch_is_refused_with_the_fix():
    with pytest.raises(CouldNotRun, match="CUDA build of torch"):
        with cross_compile.compiling_for(TARGETS["sm90"]):
            pass


@pytest.mark.skipif(not torch.backends.cuda.is_built(), reason="a CPU build is refused before the interpreter")
def test_the_interpreter_is_refused_with_the_fix(monkeypatch):
    monkeypatch.setattr(cross_compile.triton_support, "interpreted", lambda: True)
    with pytest.raises(CouldNotRun, match="unset TRITON_INTERPRET"):
        with cross_compile.compiling_for(TARGETS["sm90"]):
            pass
