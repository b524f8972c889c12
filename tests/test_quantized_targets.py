"""Quantized targets: bitsandbytes 8-bit (LLM.int8) and 4-bit (nf4, fp4), torchao int8 weight-only.

Greedy TriForce output equals plain ``generate`` of the same quantized model; Force 1 and Force 2 run the
quantized weights directly (``draft_precision="model"``: no copy). All of these run on the CPU here
(bitsandbytes >= 0.48 has CPU kernels for 8-bit and 4-bit).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, TorchAoConfig

from hf_triforce import TriForceConfig
from hf_triforce.kernels.row_mixing import RowByRowMixingLayers, row_mixing_layers

from .conftest import make_model, random_prompt

pytestmark = pytest.mark.filterwarnings("ignore:MatMul8bitLt:UserWarning")
GEN = dict(max_new_tokens=24, do_sample=False)
CONFIG = TriForceConfig(draft="self", policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24,
                        gamma1=2, gamma2=4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama whose norms put activation outliers (> 6, LLM.int8's default threshold) in some rows of
    the linear layers' inputs and not in others, as real LLMs have."""
    model = make_model("llama-gqa", hidden_size=128, intermediate_size=256)
    with torch.no_grad():
        for layer in model.model.layers:
            layer.input_layernorm.weight[::9] = 8.0
            layer.post_attention_layernorm.weight[::11] = 8.0
    path = tmp_path_factory.mktemp("tiny-llama")
    model.save_pretrained(path)
    return path


def _load(path, quantization_config):
    return AutoModelForCausalLM.from_pretrained(path, quantization_config=quantization_config, device_map="cpu",
                                                dtype=torch.float32).eval()


def _assert_identical(model, prompt, config=CONFIG):
    expected = model.generate(prompt, **GEN)
    out = model.generate(prompt, triforce_config=config, return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, expected), (out.sequences[0, prompt.shape[1]:], expected[0, prompt.shape[1]:])
    assert out.triforce_stats.force3_steps > 0 and out.triforce_stats.detail.force2_steps > 0
    return out


def test_bnb_8bit_with_outlier_threshold(checkpoint, monkeypatch):
    model = _load(checkpoint, BitsAndBytesConfig(load_in_8bit=True))
    assert type(model.model.layers[0].self_attn.q_proj).__name__ == "Linear8bitLt"
    assert row_mixing_layers(model)  # threshold 6.0: each call picks its outlier columns from all its rows
    prompts = [random_prompt(100, period=37, seed=seed) for seed in (1, 2)]
    for prompt in prompts:
        _assert_identical(model, prompt)
    # the mutation: verification rows computed together (without RowByRowMixingLayers) diverges from plain generate
    monkeypatch.setattr(RowByRowMixingLayers, "enable", lambda self: None)
    diverged = [not torch.equal(model.generate(p, triforce_config=CONFIG, **GEN), model.generate(p, **GEN))
                for p in prompts]
    assert any(diverged)


def test_bnb_8bit_with_outlier_threshold_refuses_chains_longer_than_rows_apart_covers(checkpoint):
    model = _load(checkpoint, BitsAndBytesConfig(load_in_8bit=True))
    too_long = TriForceConfig(draft="ngram", policy="fixed", retrieval_budget=64, chunk_size=8, gamma1=2, gamma2=64)
    with pytest.raises(ValueError, match="gamma2 \\+ 1 must be at most 64"):
        model.generate(random_prompt(100, period=37, seed=1), triforce_config=too_long, **GEN)


def test_bnb_8bit_without_outlier_threshold(checkpoint):
    model = _load(checkpoint, BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=0.0))
    assert not row_mixing_layers(model)
    _assert_identical(model, random_prompt(100, period=37, seed=1))


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
def test_bnb_4bit(checkpoint, quant_type):
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant_type, bnb_4bit_compute_dtype=torch.float32)
    model = _load(checkpoint, config)
    assert type(model.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    _assert_identical(model, random_prompt(100, period=37, seed=1))


def test_torchao_int8_weight_only(checkpoint):
    from torchao.quantization import Int8WeightOnlyConfig

    model = _load(checkpoint, TorchAoConfig(Int8WeightOnlyConfig()))
    assert model.model.layers[0].self_attn.q_proj.weight.__class__.__name__ != "Parameter"
    _assert_identical(model, random_prompt(100, period=37, seed=1))
