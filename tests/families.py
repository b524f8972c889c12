"""Tiny random configs of the decoder families the suite covers (no hub access), hybrid windows included.

Each entry builds a causal LM from its config alone: 2-6 layers, hidden size 64, vocabulary 96. Sliding-window
families get a window of `WINDOW` tokens, so that a prompt of `PROMPT` tokens is several times longer than the
window and than the retrieval budget the tests use. The table of what each family exercises is
``docs/families.md``.
"""

from __future__ import annotations

import torch
import transformers as T

WINDOW = 16  # sliding window of the hybrid families, in tokens
PROMPT = 150  # prompt length of the family tests: > 9 windows, > 4 retrieval budgets of 32
VOCAB = 96

BASE = dict(hidden_size=64, intermediate_size=96, max_position_embeddings=2048, vocab_size=VOCAB,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
HEADS = dict(num_attention_heads=4, num_key_value_heads=2)
MOE = dict(num_experts_per_tok=2)

# name -> (config class, model class, config kwargs, what it exercises)
FAMILIES: dict[str, tuple[type, type, dict, str]] = {
    "llama": (T.LlamaConfig, T.LlamaForCausalLM, dict(num_hidden_layers=2, **HEADS), "GQA, RoPE"),
    "mistral-sliding": (T.MistralConfig, T.MistralForCausalLM,
                        dict(num_hidden_layers=2, **HEADS, sliding_window=WINDOW), "sliding window on every layer"),
    "qwen2-hybrid": (T.Qwen2Config, T.Qwen2ForCausalLM,
                     dict(num_hidden_layers=3, **HEADS, use_sliding_window=True, sliding_window=WINDOW,
                          max_window_layers=1), "full layer 0, sliding layers 1-2 (max_window_layers)"),
    "gemma": (T.GemmaConfig, T.GemmaForCausalLM, dict(num_hidden_layers=2, **HEADS, head_dim=16), "GeGLU, MQA-style"),
    "gemma2": (T.Gemma2Config, T.Gemma2ForCausalLM,
               dict(num_hidden_layers=2, **HEADS, head_dim=16, sliding_window=WINDOW,
                    attn_logit_softcapping=50.0, final_logit_softcapping=30.0),
               "alternating sliding/full, attention and final-logit softcapping"),
    "gemma3": (T.Gemma3TextConfig, T.Gemma3ForCausalLM,
               dict(num_hidden_layers=6, **HEADS, head_dim=16, sliding_window=WINDOW),
               "5 sliding : 1 full, per-layer-type RoPE bases (10k local, 1M global), qk-norm"),
    "cohere2": (T.Cohere2Config, T.Cohere2ForCausalLM,
                dict(num_hidden_layers=4, **HEADS, sliding_window=WINDOW),
                "3 sliding : 1 full, NoPE full layers, interleaved RoPE, parallel block"),
    "gpt-oss": (T.GptOssConfig, T.GptOssForCausalLM,
                dict(num_hidden_layers=2, **HEADS, head_dim=16, sliding_window=WINDOW, num_local_experts=4,
                     num_experts_per_tok=2), "alternating sliding/full, attention sinks, MoE"),
    "phi3": (T.Phi3Config, T.Phi3ForCausalLM, dict(num_hidden_layers=2, **HEADS, sliding_window=WINDOW),
             "sliding window on every layer (Phi-3 4k variants), fused qkv"),
    "mixtral": (T.MixtralConfig, T.MixtralForCausalLM,
                dict(num_hidden_layers=2, **HEADS, num_local_experts=4, **MOE, sliding_window=WINDOW),
                "MoE, sliding window"),
    "qwen2-moe": (T.Qwen2MoeConfig, T.Qwen2MoeForCausalLM,
                  dict(num_hidden_layers=2, **HEADS, num_experts=4, **MOE, moe_intermediate_size=32,
                       shared_expert_intermediate_size=32), "MoE with a shared expert"),
    "qwen3": (T.Qwen3Config, T.Qwen3ForCausalLM, dict(num_hidden_layers=2, **HEADS, head_dim=16), "qk-norm"),
    "qwen3-moe": (T.Qwen3MoeConfig, T.Qwen3MoeForCausalLM,
                  dict(num_hidden_layers=2, **HEADS, head_dim=16, num_experts=4, **MOE, moe_intermediate_size=32),
                  "MoE, qk-norm"),
    "olmoe": (T.OlmoeConfig, T.OlmoeForCausalLM, dict(num_hidden_layers=2, **HEADS, num_experts=4, **MOE),
              "MoE, qk-norm"),
    "olmo2": (T.Olmo2Config, T.Olmo2ForCausalLM, dict(num_hidden_layers=2, **HEADS), "qk-norm, post-norm"),
    "olmo3": (T.Olmo3Config, T.Olmo3ForCausalLM, dict(num_hidden_layers=4, **HEADS, sliding_window=WINDOW),
              "3 sliding : 1 full, qk-norm"),
    "smollm3": (T.SmolLM3Config, T.SmolLM3ForCausalLM, dict(num_hidden_layers=4, **HEADS),
                "NoPE every 4th layer"),
    "phi": (T.PhiConfig, T.PhiForCausalLM, dict(num_hidden_layers=2, num_attention_heads=4,
                                                 partial_rotary_factor=0.5), "partial rotary, parallel block"),
    "stablelm": (T.StableLmConfig, T.StableLmForCausalLM, dict(num_hidden_layers=2, **HEADS,
                                                                partial_rotary_factor=0.25), "partial rotary"),
    "gpt-neox": (T.GPTNeoXConfig, T.GPTNeoXForCausalLM, dict(num_hidden_layers=2, num_attention_heads=4,
                                                              rotary_pct=0.25), "partial rotary, parallel residual"),
    "starcoder2": (T.Starcoder2Config, T.Starcoder2ForCausalLM,
                   dict(num_hidden_layers=2, **HEADS, sliding_window=WINDOW), "sliding window, biases"),
    "cohere": (T.CohereConfig, T.CohereForCausalLM, dict(num_hidden_layers=2, **HEADS), "interleaved RoPE"),
    "granite": (T.GraniteConfig, T.GraniteForCausalLM, dict(num_hidden_layers=2, **HEADS), "scaled residuals"),
    "exaone4": (T.Exaone4Config, T.Exaone4ForCausalLM, dict(num_hidden_layers=4, **HEADS, sliding_window=WINDOW),
                "3 sliding : 1 full (global layers NoPE), qk-norm"),
    "gemma4": (T.Gemma4TextConfig, T.Gemma4ForCausalLM,
               dict(num_hidden_layers=6, **HEADS, head_dim=16, sliding_window=WINDOW, vocab_size_per_layer_input=VOCAB,
                    hidden_size_per_layer_input=16), "5 sliding : 1 full, per-layer input embeddings"),
    "ernie4_5": (T.Ernie4_5Config, T.Ernie4_5ForCausalLM, dict(num_hidden_layers=2, **HEADS, head_dim=16),
                 "interleaved RoPE pairs taking the first half of the angles"),
    "helium": (T.HeliumConfig, T.HeliumForCausalLM, dict(num_hidden_layers=2, **HEADS, head_dim=16),
               "interleaved RoPE pairs taking the first half of the angles"),
    "nanochat": (T.NanoChatConfig, T.NanoChatForCausalLM, dict(num_hidden_layers=2, **HEADS, head_dim=16),
                 "RoPE halves rotated the other way, qk-norm"),
    "deepseek-v3": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,
                    dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                         qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16, kv_lora_rank=16, q_lora_rank=16,
                         n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                         moe_intermediate_size=32, first_k_dense_replace=1),
                    "multi-head latent attention (values as wide as keys), MoE"),
    "deepseek-v3-narrow-values": (T.DeepseekV3Config, T.DeepseekV3ForCausalLM,
                                  dict(num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, head_dim=8,
                                       qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, kv_lora_rank=16,
                                       q_lora_rank=16, n_routed_experts=4, num_experts_per_tok=2, n_group=1,
                                       topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1),
                                  "multi-head latent attention, values narrower than keys (8 < 8 + 8, as the real "
                                  "model's 128 < 128 + 64), MoE"),
}

HYBRID = [name for name, (_, _, kwargs, _) in FAMILIES.items() if kwargs.get("sliding_window")]


def make_family(name: str, seed: int = 0, **overrides):
    """The tiny random fp32 model of family ``name``."""
    config_cls, model_cls, kwargs, _ = FAMILIES[name]
    torch.manual_seed(seed)
    return model_cls(config_cls(**{**BASE, **kwargs, **overrides})).eval()
