"""Tiny transformers causal LMs (random init, seeded, no download) for the integration, record
and step-probe tests."""

from __future__ import annotations

import torch
import transformers

_SHAPE = dict(vocab_size=64, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=64)


def tiny(family: str, **extra):
    """A tiny causal LM of `family`, seeded; None where this transformers lacks the family."""
    torch.manual_seed(0)
    if family == "olmoe":
        config = transformers.OlmoeConfig(intermediate_size=24, num_experts=6, num_experts_per_tok=2, **_SHAPE)
        return transformers.OlmoeForCausalLM(config, **extra)
    if family == "qwen3-moe":
        config = transformers.Qwen3MoeConfig(moe_intermediate_size=24, intermediate_size=40, num_experts=6,
                                             num_experts_per_tok=3, norm_topk_prob=True, **_SHAPE)
        return transformers.Qwen3MoeForCausalLM(config)
    if family == "mixtral":
        config = transformers.MixtralConfig(intermediate_size=24, num_local_experts=4, num_experts_per_tok=2, **_SHAPE)
        return transformers.MixtralForCausalLM(config)
    if family == "deepseek-v3":  # shared experts, sigmoid routing with a bias, MLA; its RMSNorm a copy of Llama's
        config = transformers.DeepseekV3Config(
            moe_intermediate_size=16, intermediate_size=40, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
            topk_group=1, n_shared_experts=1, first_k_dense_replace=0, kv_lora_rank=16, q_lora_rank=16,
            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, **{**_SHAPE, "num_key_value_heads": 4})
        return transformers.DeepseekV3ForCausalLM(config)
    if family == "gemma4":  # Gemma 4's MoE (26B-A4B): GeGLU experts beside a dense MLP
        # global_head_dim: its full-attention layer's heads, 512 by default: at Gemma 4's attention
        # scaling of 1 their softmax is so sharp that the step's fp32 error grows up to 10x
        config = transformers.Gemma4TextConfig(
            head_dim=8, global_head_dim=8, intermediate_size=48, enable_moe_block=True, num_experts=4, top_k_experts=2,
            moe_intermediate_size=16, layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=64,
            hidden_size_per_layer_input=8, **_SHAPE)
        return transformers.Gemma4ForCausalLM(config)
    if family == "llama":
        return transformers.LlamaForCausalLM(transformers.LlamaConfig(intermediate_size=48, **_SHAPE))
    if family == "gemma":
        return transformers.GemmaForCausalLM(transformers.GemmaConfig(intermediate_size=48, head_dim=8, **_SHAPE))
    if family == "olmo2":
        return transformers.Olmo2ForCausalLM(transformers.Olmo2Config(intermediate_size=48, **_SHAPE))
    if family == "helium":
        return transformers.HeliumForCausalLM(transformers.HeliumConfig(intermediate_size=48, head_dim=8, **_SHAPE))
    if family == "phi3":
        return transformers.Phi3ForCausalLM(transformers.Phi3Config(intermediate_size=48, pad_token_id=0, **_SHAPE))
    raise ValueError(family)
