"""A tiny Llama written as a GGUF file (gguf's own writer and quantizers), as llama.cpp's converter writes one: query
and key rows permuted, the linear weights in the types the stored-width kernel reads (each type at least once), the
output layer tied to the Q8_0 token embedding, norms in F32. Types gguf has no quantizer for (the K-quants) are
written as random blocks with scales of the model's magnitude: the model is whatever values the file holds."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM

VOCAB = 96
INIT = 0.2  # weights large enough that the greedy output varies (at 0.02 it repeats one token)
HEADS, KV_HEADS = 4, 2
# each layer's linear weights and the type written: every type the kernel reads
TYPES = {"attn_q": "Q4_K", "attn_k": "Q4_0", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q4_1",
         "ffn_up": "Q5_1", "ffn_down": "Q4_K"}
HIDDEN, INTERMEDIATE = 256, 512  # multiples of the K-quants' 256 values a block
# the K-quants' random fp16 scales: values of about the other weights' magnitude (Q4_K: d * sc * q - dmin * mn with
# sc, mn < 64 and q < 16; Q6_K: d * sc * (q - 32) with |sc| <= 128)
K_SCALES = {"Q4_K": 1e-3, "Q6_K": 2e-4}


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter's row order for query and key weights."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


def write_tiny_llama(path: Path, seed: int = 0) -> Path:
    """``path`` (a ``.gguf`` file) holding a random Llama: `HIDDEN`, `INTERMEDIATE`, 2 layers, 4 query and 2
    key-value heads, ``VOCAB`` tokens."""
    import gguf

    from hf_triforce.kernels.gguf_linear import TYPES as BLOCKS
    from hf_triforce.kernels.gguf_linear import random_matrix

    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE, num_hidden_layers=2,
                         num_attention_heads=HEADS, num_key_value_heads=KV_HEADS, max_position_embeddings=512,
                         tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=10000.0,
                         initializer_range=INIT)
    model = LlamaForCausalLM(config).eval()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_context_length(512)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(2)
    writer.add_feed_forward_length(INTERMEDIATE)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"<t{i}>" for i in range(VOCAB)])
    writer.add_token_scores([0.0] * VOCAB)
    writer.add_token_types([1] * VOCAB)

    generator = torch.Generator().manual_seed(seed)

    def add(name: str, tensor: torch.Tensor, kind: str) -> None:
        values = tensor.detach().numpy().astype(np.float32)
        if kind == "F32":
            writer.add_tensor(name, values)
            return
        quantization = gguf.GGMLQuantizationType[kind]
        if kind not in K_SCALES:
            writer.add_tensor(name, gguf.quantize(values, quantization), raw_dtype=quantization)
            return
        blocks = random_matrix(kind, *values.shape, generator).blocks.reshape(values.shape[0], -1, BLOCKS[kind][1])
        for offset in BLOCKS[kind][3]:
            scales = (torch.randn(*blocks.shape[:2], 1, generator=generator) * K_SCALES[kind]).half()
            blocks[..., offset : offset + 2] = scales.view(torch.uint8)
        writer.add_tensor(name, blocks.reshape(values.shape[0], -1).numpy(), raw_dtype=quantization)

    add("token_embd.weight", model.model.embed_tokens.weight, "Q8_0")
    add("output_norm.weight", model.model.norm.weight, "F32")
    for i, layer in enumerate(model.model.layers):
        attention, mlp = layer.self_attn, layer.mlp
        weights = {"attn_q": _permute(attention.q_proj.weight.detach().numpy(), HEADS),
                   "attn_k": _permute(attention.k_proj.weight.detach().numpy(), KV_HEADS),
                   "attn_v": attention.v_proj.weight, "attn_output": attention.o_proj.weight,
                   "ffn_gate": mlp.gate_proj.weight, "ffn_up": mlp.up_proj.weight, "ffn_down": mlp.down_proj.weight}
        for part, weight in weights.items():
            add(f"blk.{i}.{part}.weight", torch.as_tensor(weight), TYPES[part])
        add(f"blk.{i}.attn_norm.weight", layer.input_layernorm.weight, "F32")
        add(f"blk.{i}.ffn_norm.weight", layer.post_attention_layernorm.weight, "F32")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
