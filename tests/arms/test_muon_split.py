"""Split-block Muon on the CPU: a fused weight with split_sizes steps bit for bit as its blocks
given as separate parameters, and a 3-D stack of matrices (a MoE's experts) as its matrices;
batched Newton-Schulz is within bf16 error of one-by-one and batches are capped; the options are
validated, and checkpoints cross between split and whole-matrix optimizers."""

from __future__ import annotations

import io

import pytest
import torch

from gates.optimizer_runs import newton_schulz_float64
from suite.arms.muon import Muon, muon_scale, newton_schulz
from bitwise import assert_bitwise

# (fused shape, split_sizes, split_dim): input-major halves, grouped-query QKV, SwiGLU gate/up
CASES = {
    "input-major": ((2, 6), (3, 3), 1),
    "gqa-qkv": ((48, 32), (32, 8, 8), 0),
    "gate-up": ((256, 32), (128, 128), 0),
}


def fused_and_separate(shape, sizes, dim, seed=0):
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    fused = p0.clone().requires_grad_()
    separate = [block.clone().requires_grad_() for block in p0.split(sizes, dim)]
    return fused, separate


def grads_for(shape, steps, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(shape, generator=gen) for _ in range(steps)]


def step_both(fused_opt, fused, separate_opt, separate, grad, sizes, dim):
    fused.grad = grad.clone()
    for p, block in zip(separate, grad.split(sizes, dim)):
        p.grad = block.clone()
    fused_opt.step()
    separate_opt.step()


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rule", ["spectral", "rms"])
@pytest.mark.parametrize("case", CASES)
def test_fused_split_is_bitwise_the_separate_blocks(case, rule, nesterov):
    shape, sizes, dim = CASES[case]
    fused, separate = fused_and_separate(shape, sizes, dim)
    hyper = dict(lr=0.02, nesterov=nesterov, scale=rule, weight_decay=0.01)
    fused_opt = Muon([{"params": [fused], "split_sizes": sizes, "split_dim": dim}], **hyper)
    separate_opt = Muon([{"params": separate}], **hyper)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: 0.125 + k / 8) for o in (fused_opt, separate_opt)]
    for grad in grads_for(shape, 10):
        step_both(fused_opt, fused, separate_opt, separate, grad, sizes, dim)
        for scheduler in schedulers:
            scheduler.step()
    assert_bitwise(fused.detach(), torch.cat([p.detach() for p in separate], dim), case)
    buffers = [separate_opt.state[p]["momentum_buffer"] for p in separate]
    assert_bitwise(fused_opt.state[fused]["momentum_buffer"], torch.cat(buffers, dim), "momentum")


def test_each_block_gets_its_own_scale_and_polar_factor():
    """One step from zero with lr 1: each block of the fused direction is scale(block) * NS(block)."""
    shape, sizes, dim = CASES["gqa-qkv"]
    grad = grads_for(shape, 1)[0]
    p = torch.zeros(shape, requires_grad=True)
    p.grad = grad.clone()
    Muon([{"params": [p], "split_sizes": sizes}], lr=1.0, momentum=0.0, nesterov=False, scale="rms").step()
    whole = (muon_scale(*shape, "rms") * newton_schulz_float64(grad, 5)).split(sizes, dim)
    for block, g, of_whole in zip((-p.detach()).split(sizes, dim), grad.split(sizes, dim), whole):
        expected = muon_scale(*g.shape, "rms") * newton_schulz_float64(g, 5)
        # within bf16 Newton-Schulz error of the block's own direction, far from the whole matrix's
        assert ((block.double() - expected).norm() / expected.norm()) < 0.05
        assert ((block.double() - of_whole).norm() / expected.norm()) > 0.3


@pytest.mark.parametrize("case", CASES)
def test_batched_newton_schulz_is_one_by_one_within_bf16(case):
    shape, sizes, dim = CASES[case]
    results = []
    for batch_ns in (True, False):
        p = torch.zeros(shape, requires_grad=True)
        p.grad = grads_for(shape, 1)[0]
        Muon([{"params": [p], "split_sizes": sizes, "split_dim": dim, "batch_ns": batch_ns}], lr=1.0).step()
        results.append(p.detach())
    batched, one_by_one = results
    assert ((batched - one_by_one).norm() / one_by_one.norm()) < 0.02


def test_equal_shapes_share_one_newton_schulz_call():
    class Counting(Muon):
        def orthogonalize(self, update, group):
            self.calls.append(tuple(update.shape))
            return super().orthogonalize(update, group)

    qkv = [torch.zeros(48, 32, requires_grad=True) for _ in range(2)]
    # another dtype or scale rule never joins a batch
    other_dtype, other_rule = torch.zeros(32, 32, dtype=torch.float64, requires_grad=True), torch.zeros(8, 32, requires_grad=True)
    wo = torch.zeros(32, 32, requires_grad=True)
    for p in (*qkv, wo, other_dtype, other_rule):
        p.grad = torch.randn(p.shape, dtype=p.dtype)
    opt = Counting([{"params": qkv, "split_sizes": (32, 8, 8)}, {"params": [wo, other_dtype]},
                    {"params": [other_rule], "scale": "rms"}], lr=0.1)
    opt.calls = []
    opt.step()
    # the two q blocks and wo (another group) in one batch, the four k and v blocks in another
    assert opt.calls == [(3, 32, 32), (4, 8, 32), (1, 32, 32), (1, 8, 32)]
    opt.param_groups[0]["batch_ns"] = False
    opt.calls = []
    opt.step()
    assert opt.calls == [(32, 32), (8, 32), (8, 32), (32, 32), (8, 32), (8, 32), (1, 32, 32), (1, 32, 32), (1, 8, 32)]


def test_capturable_with_splits_is_bitwise_plain():
    shape, sizes, dim = CASES["gqa-qkv"]
    runs = []
    for capturable in (False, True):
        fused, _ = fused_and_separate(shape, sizes, dim)
        opt = Muon([{"params": [fused], "split_sizes": sizes}], lr=0.02, weight_decay=0.01, capturable=capturable)
        for k, grad in enumerate(grads_for(shape, 8)):
            if k == 4:
                opt.param_groups[0].update(lr=0.005, momentum=0.8)
            fused.grad = grad.clone()
            opt.step()
        runs.append((fused.detach(), opt.state[fused]["momentum_buffer"]))
    for a, b in zip(*runs):
        assert_bitwise(a, b)


@pytest.mark.parametrize("group,message", [
    ({"split_sizes": (48,)}, r"param group 0: split_sizes must list two or more"),
    ({"split_sizes": (32, 16, 0)}, r"param group 0: split_sizes must be positive ints"),
    ({"split_sizes": (32, 8, 4)}, r"param group 0: split_sizes \(32, 8, 4\) sum to 44, but 'qkv' has 48 along split_dim=0"),
    ({"split_sizes": (32, 8, 8), "split_dim": 1}, r"sum to 48, but 'qkv' has 32 along split_dim=1"),
    ({"split_sizes": (24, 24), "use_muon": False}, r"param group 0 has split_sizes but use_muon=False"),
    ({"split_dim": 2}, r"param group 0: split_dim must be 0 \(output rows\) or 1"),
    ({"split_dim": True}, r"split_dim must be 0"),
    ({"batch_ns": 1}, r"batch_ns must be True or False"),
    ({"transposed": 1}, r"transposed must be True or False"),
])
def test_bad_split_options_are_refused(group, message):
    with pytest.raises(ValueError, match=message):
        Muon([{"params": [("qkv", torch.zeros(48, 32))], **group}], lr=0.1)


def test_split_of_a_vector_is_refused_naming_it():
    # without use_muon the vector would make the group AdamW: the message still names the vector
    with pytest.raises(ValueError, match=r"param group 0: split_sizes splits matrices \(or each matrix of a 3-D stack\), "
                                         r"but 'gain' is 1-D"):
        Muon([{"params": [("qkv", torch.zeros(4, 4)), ("gain", torch.zeros(4))], "split_sizes": (2, 2)}], lr=0.1)
    opt = Muon([torch.zeros(4, 4)], lr=0.1)
    with pytest.raises(ValueError, match=r"param group 1: split_sizes splits matrices .*, but params\[1\] \(shape \(4,\)\) is 1-D"):
        opt.add_param_group({"params": [torch.zeros(4, 4), torch.zeros(4)], "use_muon": True, "split_sizes": (2, 2)})
    assert len(opt.param_groups) == 1


# (stack shape, split_sizes, split_dim): experts whole, gate_up [E, 2f, d] as transformers 5 stores
# it (each matrix's rows), and its transposed layout [E, d, 2f] (each matrix's columns)
STACKS = {
    "experts-whole": ((5, 12, 8), None, 0),
    "gate-up-rows": ((5, 12, 8), (6, 6), 0),
    "gate-up-columns": ((3, 8, 12), (6, 6), 1),
}
# gpt-oss's gate_up [E, d, 2f] alternates gate and up columns: split_interleaved
INTERLEAVED = {"rows": ((3, 12, 8), (6, 6), 0), "columns": ((3, 8, 12), (4, 4, 4), 1)}


def blocks_of(stack, sizes, dim):
    """A stack's matrices in order, each split into its blocks."""
    return [b for m in stack.unbind(0) for b in ([m] if sizes is None else m.split(sizes, dim))]


def stack_and_matrices(shape, sizes, dim, seed=0):
    """A 3-D parameter and the same values as separate 2-D parameters (`blocks_of`)."""
    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(seed))
    return p0.clone().requires_grad_(), [b.clone().requires_grad_() for b in blocks_of(p0, sizes, dim)]


def joined(blocks, shape, sizes, dim):
    per = 1 if sizes is None else len(sizes)
    return torch.stack([torch.cat(blocks[i:i + per], dim) for i in range(0, len(blocks), per)]).reshape(shape)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("rule", ["spectral", "rms"])
@pytest.mark.parametrize("case", STACKS)
def test_a_stack_of_matrices_is_bitwise_its_matrices_as_separate_params(case, rule, nesterov):
    shape, sizes, dim = STACKS[case]
    stacked, separate = stack_and_matrices(shape, sizes, dim)
    hyper = dict(lr=0.02, nesterov=nesterov, scale=rule, weight_decay=0.01)
    split = {} if sizes is None else {"split_sizes": sizes, "split_dim": dim}
    stacked_opt = Muon([{"params": [stacked], "use_muon": True, **split}], **hyper)
    separate_opt = Muon([{"params": separate}], **hyper)
    for grad in grads_for(shape, 6):
        stacked.grad = grad.clone()
        for p, block in zip(separate, blocks_of(grad, sizes, dim)):
            p.grad = block.clone()
        stacked_opt.step()
        separate_opt.step()
    assert_bitwise(stacked.detach(), joined([p.detach() for p in separate], shape, sizes, dim), case)
    buffers = [separate_opt.state[p]["momentum_buffer"] for p in separate]
    assert_bitwise(stacked_opt.state[stacked]["momentum_buffer"], joined(buffers, shape, sizes, dim), "momentum")


@pytest.mark.parametrize("case", INTERLEAVED)
def test_interleaved_blocks_are_bitwise_their_every_nth_rows_as_separate_params(case):
    """split_interleaved: block k of each matrix is its rows (columns) k, k + n, ...; the stack
    steps as those blocks given as separate parameters, de-interleaved."""
    shape, sizes, dim = INTERLEAVED[case]
    n = len(sizes)

    def blocks(t):
        return [m.unflatten(dim, (sizes[0], n)).select(dim + 1, k) for m in t.unbind(0) for k in range(n)]

    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    stacked = p0.clone().requires_grad_()
    separate = [b.clone().requires_grad_() for b in blocks(p0)]
    split = {"split_sizes": sizes, "split_dim": dim, "split_interleaved": True}
    stacked_opt = Muon([{"params": [stacked], "use_muon": True, **split}], lr=0.02, weight_decay=0.01)
    separate_opt = Muon([{"params": separate}], lr=0.02, weight_decay=0.01)
    for grad in grads_for(shape, 4):
        stacked.grad = grad.clone()
        for p, block in zip(separate, blocks(grad)):
            p.grad = block.clone()
        stacked_opt.step()
        separate_opt.step()
    assert_bitwise(torch.stack([b for b in blocks(stacked.detach())]), torch.stack([p.detach() for p in separate]), case)
    contiguous = Muon([{"params": [p0.clone().requires_grad_()], "use_muon": True, "split_sizes": sizes,
                        "split_dim": dim}], lr=0.02)
    assert contiguous.param_groups[0]["split_interleaved"] is False  # the default: contiguous blocks


# experts stored [E, in, out] (transformers' is_transposed ones, the suite's MoEExperts): (stack
# shape, split_sizes along each matrix's columns, interleaved): a down_proj [E, f, d] whole,
# a gate_up [E, d, 2f] in halves, gpt-oss's alternating
TRANSPOSED = {"whole": ((3, 8, 12), None, False), "halves": ((3, 8, 12), (6, 6), False),
              "interleaved": ((3, 8, 12), (6, 6), True)}


@pytest.mark.parametrize("rule", ["spectral", "rms"])
@pytest.mark.parametrize("case", TRANSPOSED)
def test_a_transposed_stack_steps_as_its_layers_out_by_in_matrices(case, rule):
    """transposed=True: each matrix stored [in, out] steps bit for bit as the layer's [out, in]
    matrix (a torch.nn.Linear weight) given as a separate parameter, and as the same stack stored
    [E, out, in]: scale and Newton-Schulz read the layer's out x in, not the storage's (the
    spectral scale had been off by sqrt(in / out))."""
    shape, sizes, interleaved = TRANSPOSED[case]

    def layers(stored):  # each expert's blocks as the layer's [out, in] matrices
        matrices = stored.unbind(0)
        if sizes is None:
            blocks = matrices
        elif interleaved:
            blocks = [m[:, k::len(sizes)] for m in matrices for k in range(len(sizes))]
        else:
            blocks = [b for m in matrices for b in m.split(sizes, 1)]
        return [b.mT.contiguous() for b in blocks]

    p0 = torch.randn(shape, generator=torch.Generator().manual_seed(0))
    stored, upright = p0.clone().requires_grad_(), p0.mT.contiguous().requires_grad_()
    separate = [b.requires_grad_() for b in layers(p0)]
    split = {} if sizes is None else {"split_sizes": sizes, "split_interleaved": interleaved}
    hyper = dict(lr=0.02, scale=rule, weight_decay=0.01)
    optimizers = [Muon([{"params": [stored], "use_muon": True, "transposed": True, "split_dim": 1, **split}], **hyper),
                  Muon([{"params": [upright], "use_muon": True, "split_dim": 0, **split}], **hyper),
                  Muon([{"params": separate}], **hyper)]
    for grad in grads_for(shape, 4):
        stored.grad, upright.grad = grad.clone(), grad.mT.contiguous()
        for p, block in zip(separate, layers(grad)):
            p.grad = block
        for optimizer in optimizers:
            optimizer.step()
    assert_bitwise(torch.stack(layers(stored.detach())), torch.stack([p.detach() for p in separate]), case)
    assert_bitwise(stored.detach(), upright.detach().mT.contiguous(), "against the stack stored [E, out, in]")


def test_interleaved_blocks_must_be_equal():
    with pytest.raises(ValueError, match=r"split_interleaved takes every n-th row .* must be equal, not \(4, 8\)"):
        Muon([{"params": [torch.zeros(12, 4)], "split_sizes": (4, 8), "split_interleaved": True}], lr=0.1)
    with pytest.raises(ValueError, match=r"split_interleaved must be True or False, not 1"):
        Muon([{"params": [torch.zeros(12, 4)], "split_sizes": (6, 6), "split_interleaved": 1}], lr=0.1)
    with pytest.raises(ValueError, match=r"split_interleaved says how split_sizes cuts; give split_sizes too"):
        Muon([{"params": [torch.zeros(12, 4)], "split_interleaved": True}], lr=0.1)


def test_each_matrix_of_a_stack_gets_its_own_scale_and_polar_factor():
    """One step from zero with lr 1: each matrix's block is scale(block) * NS(block), up to the
    batched call's rounding, and far from its whole matrix's direction."""
    shape, sizes, dim = STACKS["gate-up-rows"]
    grad = grads_for(shape, 1)[0]
    p = torch.zeros(shape, requires_grad=True)
    p.grad = grad.clone()
    Muon([{"params": [p], "use_muon": True, "split_sizes": sizes}], lr=1.0, momentum=0.0, nesterov=False,
         scale="rms").step()
    for got, g in zip((-p.detach()).unbind(0), grad.unbind(0)):
        whole = (muon_scale(*g.shape, "rms") * newton_schulz(g, 5)).split(sizes, dim)
        for block, g_block, of_whole in zip(got.split(sizes, dim), g.split(sizes, dim), whole):
            expected = muon_scale(*g_block.shape, "rms") * newton_schulz(g_block, 5)
            assert ((block - expected).norm() / expected.norm()) < 1e-5
            assert ((block - of_whole).norm() / expected.norm()) > 0.3


def test_a_stack_without_use_muon_stays_with_adamw_and_a_4d_one_is_refused():
    opt = Muon([{"params": [torch.zeros(2, 4, 4)]}], lr=0.1)
    assert opt.param_groups[0]["use_muon"] is False
    empty = torch.zeros(0, 4, 4, requires_grad=True)  # a stack of no matrices steps as nothing
    empty.grad = torch.zeros_like(empty)
    Muon([{"params": [empty], "use_muon": True}], lr=0.1).step()
    with pytest.raises(ValueError, match=r"use_muon=True but 'w' is 4-D: Muon orthogonalises matrices and 3-D stacks"):
        Muon([{"params": [("w", torch.zeros(2, 2, 4, 4))], "use_muon": True}], lr=0.1)
    with pytest.raises(ValueError, match=r"split_sizes \(4, 4\) sum to 8, but 'experts' has 6 along split_dim=1"):
        Muon([{"params": [("experts", torch.zeros(3, 8, 6))], "use_muon": True, "split_sizes": (4, 4), "split_dim": 1}],
             lr=0.1)


def test_batches_past_the_cap_run_in_consecutive_runs_with_the_bits_of_separate_params():
    """max_batch_elements splits a batch of 10 matrices of 96 elements at 4 a call (a cap of
    400): 4 + 4 + 2, for the stack and for its matrices given separately, which stay equal."""
    class Capped(Muon):
        max_batch_elements = 400

        def orthogonalize(self, update, group):
            self.calls.append(tuple(update.shape))
            return super().orthogonalize(update, group)

    shape, sizes, dim = STACKS["experts-whole"]
    stacked, separate = stack_and_matrices((10, 12, 8), sizes, dim)
    runs = []
    for params, group in (([stacked], {"use_muon": True}), (separate, {})):
        opt = Capped([{"params": params, **group}], lr=0.02)
        opt.calls = []
        for grad in grads_for((10, 12, 8), 3):
            for p, g in zip(params, [grad] if len(params) == 1 else blocks_of(grad, sizes, dim)):
                p.grad = g.clone()
            opt.step()
        assert opt.calls == [(4, 12, 8), (4, 12, 8), (2, 12, 8)] * 3
        runs.append(torch.stack([p.detach() for p in params]).reshape(10, 12, 8))
    assert_bitwise(*runs)


def test_a_chunks_output_is_freed_once_its_params_are_joined():
    """Three stacks of 4 matrices, a cap of one stack a batch: when the second and third batches
    are orthogonalised, the earlier batches' outputs are gone (each stack joined as its own
    copy), so the step holds one batch's output at a time, not all of them."""
    import weakref

    class Watching(Muon):
        max_batch_elements = 4 * 8 * 8

        def orthogonalize(self, update, group):
            self.alive_before.append(sum(ref() is not None for ref in self.outputs))
            out = super().orthogonalize(update, group)
            self.outputs.append(weakref.ref(out))
            return out

    stacks = [torch.zeros(4, 8, 8, requires_grad=True) for _ in range(3)]
    for p in stacks:
        p.grad = torch.randn(p.shape)
    opt = Watching([{"params": stacks, "use_muon": True}], lr=0.02)
    opt.outputs, opt.alive_before = [], []
    opt.step()
    assert opt.alive_before == [0, 0, 0] and len(opt.outputs) == 3


@pytest.mark.parametrize("saved_split,loaded_split", [(True, False), (False, True), (True, True)])
def test_checkpoints_cross_between_split_and_whole(saved_split, loaded_split):
    """Momentum has the fused shape either way; the loading optimizer keeps its own split options."""
    shape, sizes, dim = CASES["gqa-qkv"]
    grads = grads_for(shape, 8)

    def make(p, split):
        return Muon([{"params": [p], **({"split_sizes": sizes} if split else {})}], lr=0.02)

    uninterrupted_p, _ = fused_and_separate(shape, sizes, dim)
    uninterrupted = make(uninterrupted_p, saved_split)
    for grad in grads:
        uninterrupted_p.grad = grad.clone()
        uninterrupted.step()

    first_p, _ = fused_and_separate(shape, sizes, dim)
    first = make(first_p, saved_split)
    for grad in grads[:4]:
        first_p.grad = grad.clone()
        first.step()
    saved = first.state_dict()["param_groups"][0]
    assert (saved["split_sizes"], saved["split_dim"]) == ((sizes if saved_split else None), 0)
    buffer = io.BytesIO()
    torch.save(first.state_dict(), buffer)
    buffer.seek(0)
    resumed_p = first_p.detach().clone().requires_grad_()
    resumed = make(resumed_p, loaded_split)
    resumed.load_state_dict(torch.load(buffer))
    group = resumed.param_groups[0]
    assert group["split_sizes"] == (sizes if loaded_split else None) and group["split_dim"] == 0
    assert resumed.state[resumed_p]["momentum_buffer"].shape == shape
    # the same continuation with the momentum handed over by hand
    reference_p = first_p.detach().clone().requires_grad_()
    reference = make(reference_p, loaded_split)
    reference.state[reference_p]["momentum_buffer"] = first.state[first_p]["momentum_buffer"].clone()
    for grad in grads[4:]:
        for p, opt in ((resumed_p, resumed), (reference_p, reference)):
            p.grad = grad.clone()
            opt.step()
    assert_bitwise(resumed_p.detach(), reference_p.detach())
    if saved_split == loaded_split:
        assert_bitwise(resumed_p.detach(), uninterrupted_p.detach())


def test_model_layout_is_bitwise_its_blocks_as_separate_params():
    """Two layers of fused QKV and gate/up beside whole wo and down matrices: the q blocks batch
    with wo (another group), and the fused model steps as the model with the blocks separated."""
    gen = torch.Generator().manual_seed(5)
    d, kv, f = 16, 4, 64
    shapes = {"qkv": (d + 2 * kv, d), "gate_up": (2 * f, d), "wo": (d, d), "down": (d, f)}
    splits = {"qkv": (d, kv, kv), "gate_up": (f, f)}
    layers = [{name: torch.randn(shape, generator=gen) for name, shape in shapes.items()} for _ in range(2)]
    grads = [[{name: torch.randn(shape, generator=gen) for name, shape in shapes.items()} for _ in layers]
             for _ in range(6)]

    fused = [{name: w.clone().requires_grad_() for name, w in layer.items()} for layer in layers]
    fused_opt = Muon([{"params": [l["qkv"] for l in fused], "split_sizes": splits["qkv"]},
                      {"params": [l["gate_up"] for l in fused], "split_sizes": splits["gate_up"]},
                      {"params": [m for l in fused for m in (l["wo"], l["down"])]}], lr=0.02)
    separate = [{name: ([b.clone().requires_grad_() for b in w.split(splits[name])] if name in splits
                        else [w.clone().requires_grad_()]) for name, w in layer.items()} for layer in layers]
    separate_opt = Muon([{"params": [b for l in separate for b in l["qkv"]]},
                         {"params": [b for l in separate for b in l["gate_up"]]},
                         {"params": [m for l in separate for n in ("wo", "down") for m in l[n]]}], lr=0.02)
    for step_grads in grads:
        for f_layer, s_layer, g_layer in zip(fused, separate, step_grads):
            for name, g in g_layer.items():
                f_layer[name].grad = g.clone()
                for p, block in zip(s_layer[name], g.split(splits.get(name, (g.size(0),)))):
                    p.grad = block.clone()
        fused_opt.step()
        separate_opt.step()
    for f_layer, s_layer in zip(fused, separate):
        for name in shapes:
            assert_bitwise(f_layer[name].detach(), torch.cat([p.detach() for p in s_layer[name]]), name)
