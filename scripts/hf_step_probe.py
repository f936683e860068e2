#!/usr/bin/env python3
"""Whole training steps of a transformers model with and without the suite's integrations, eager
and under torch.compile: what a user sees when they switch an arm on (the first figures of the
train-step bench to come).

    python scripts/hf_step_probe.py --model olmoe   (or llama) [--batch 4 --seq 1024 --steps 14]

Random init from a config (no download), bf16, AdamW fused; each contender runs `--steps` steps
from the same weights and batch and reports the median step time of the steps after the first
four (wall clock, synchronized each step) and its first step (compile included) apart. olmoe:
8 layers d1024, 64 experts top-8, ffn 512, stock experts "grouped_mm" against the suite's
(`use_suite_experts`); llama: 8 layers d1024, GQA 16:4, stock RMSNorm against `apply_rms_norm`
("auto"). Needs a CUDA GPU and transformers >= 5. Writes $OUT/hf_step_probe.json when OUT is
set, and prints a table last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from tabulate import tabulate


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=("olmoe", "llama"), default="olmoe")
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=14)
    return parser.parse_args(argv)


def build(name: str):
    import transformers

    torch.manual_seed(0)
    common = dict(vocab_size=50304, hidden_size=1024, num_hidden_layers=8, max_position_embeddings=4096)
    if name == "olmoe":
        config = transformers.OlmoeConfig(intermediate_size=512, num_experts=64, num_experts_per_tok=8,
                                          num_attention_heads=16, num_key_value_heads=16, **common)
        return transformers.OlmoeForCausalLM(config)
    config = transformers.LlamaConfig(intermediate_size=2816, num_attention_heads=16, num_key_value_heads=4, **common)
    return transformers.LlamaForCausalLM(config)


def switch_on(model, name: str) -> None:
    from suite.integrations import transformers as hf

    if name == "olmoe":
        hf.use_suite_experts(model)
    else:
        hf.apply_rms_norm(model)


def run(model, ids, steps: int, compile_: bool) -> dict:
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)
    step_fn = torch.compile(model) if compile_ else model
    times, losses = [], []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = step_fn(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
        losses.append(loss.item())
    return {"first_ms": times[0], "median_ms": statistics.median(times[4:]), "losses": losses,
            "peak_gib": torch.cuda.max_memory_allocated() / 2**30}


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("hf_step_probe: needs a CUDA GPU")
        return 3
    ids = torch.randint(0, 50304, (args.batch, args.seq), generator=torch.Generator().manual_seed(1)).cuda()
    arm = "suite experts" if args.model == "olmoe" else "suite rms_norm (auto)"
    rows = {}
    for label, on, compile_ in (("stock", False, False), (arm, True, False), ("stock compiled", False, True),
                                (f"{arm} compiled", True, True)):
        torch._dynamo.reset()
        torch.cuda.reset_peak_memory_stats()
        model = build(args.model).cuda().bfloat16()
        if on:
            switch_on(model, args.model)
        rows[label] = run(model, ids, args.steps, compile_)
        del model
        torch.cuda.empty_cache()
    result = {"model": args.model, "tokens": [args.batch, args.seq], "torch": torch.__version__,
              "device": torch.cuda.get_device_name(), "rows": rows}
    if os.environ.get("OUT"):
        os.makedirs(os.environ["OUT"], exist_ok=True)
        with open(os.path.join(os.environ["OUT"], f"hf_step_probe_{args.model}.json"), "w") as fh:
            json.dump(result, fh, indent=2)
    stock = rows["stock"]["median_ms"]
    table = [[label, r["median_ms"], stock / r["median_ms"], r["first_ms"], r["losses"][0], r["losses"][-1],
              r["peak_gib"]] for label, r in rows.items()]
    print(f"{args.model}, {args.batch}x{args.seq} tokens, bf16, AdamW fused ({result['device']}, torch {torch.__version__})")
    print(tabulate(table, headers=["contender", "step ms (median)", "stock / this", "first step ms", "loss 1",
                                   f"loss {args.steps}", "peak GiB"], floatfmt=".3f"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
