"""PEFT LoRA targets and drafts: ``peft_model.generate(..., triforce_config=cfg)`` equals ``peft_model.generate``.

Covers an unmerged adapter, two adapters switched with ``set_adapter`` (the int8 drafting copy follows the
switch), a merged model, and a draft model carrying its own adapter.
"""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model

from hf_triforce import TriForceConfig
from hf_triforce.compat import adapter_state
from hf_triforce.kernels.quantized import Int8Linear, forget_int8_copy, int8_copy

from .conftest import make_model, random_prompt

GEN = dict(max_new_tokens=20, do_sample=False)


def _config(**kw):
    base = dict(draft="self", policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=2,
                gamma2=4)
    return TriForceConfig(**{**base, **kw})


def _lora(targets, rank=4, alpha=8):
    # init_lora_weights=False: random B, so the adapter changes the output (the default B = 0 would not)
    return LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False)


@pytest.fixture(scope="module")
def peft_model():
    model = get_peft_model(make_model("llama-gqa"), _lora(["q_proj", "v_proj", "o_proj", "down_proj"]),
                           adapter_name="first")
    model.add_adapter("second", _lora(["q_proj", "k_proj", "gate_proj"], alpha=16))
    return model.eval()


@pytest.fixture(scope="module")
def prompt():
    return random_prompt(100, period=37)


def _assert_identical(model, prompt, config):
    expected = model.generate(input_ids=prompt, **GEN)
    out = model.generate(input_ids=prompt, triforce_config=config, return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, expected), (out.sequences[0, -GEN["max_new_tokens"]:],
                                                  expected[0, -GEN["max_new_tokens"]:])
    assert out.triforce_stats.force3_steps > 0 and not out.triforce_stats.detail.force2_sees_whole_cache
    return expected


@pytest.mark.parametrize("precision", ["model", "int8"])
def test_unmerged_adapters_switched_with_set_adapter(peft_model, prompt, precision):
    outputs = {}
    for name in ("first", "second", "first"):
        peft_model.set_adapter(name)
        outputs.setdefault(name, _assert_identical(peft_model, prompt, _config(draft_precision=precision)))
    base = make_model("llama-gqa").generate(prompt, **GEN)
    assert not torch.equal(outputs["first"], outputs["second"])  # the adapters matter ...
    assert not torch.equal(outputs["first"], base)  # ... and differ from the base model


def test_int8_copy_follows_the_active_adapter(peft_model):
    model = peft_model.get_base_model()
    forget_int8_copy(model)
    peft_model.set_adapter("first")
    first = int8_copy(model)
    assert int8_copy(model) is first
    peft_model.set_adapter("second")
    second = int8_copy(model)
    assert second is not first and adapter_state(second) == adapter_state(model)
    # the adapter weights stay fp32 linears (their owner layers read .weight); the base layers are int8
    attention = second.model.layers[0].self_attn.q_proj
    assert type(attention.lora_A["second"]) is torch.nn.Linear
    assert isinstance(attention.base_layer, Int8Linear)
    peft_model.set_adapter("first")


def test_merged_adapter(prompt):
    model = get_peft_model(make_model("llama-gqa"), _lora(["q_proj", "up_proj"])).eval()
    expected = model.generate(input_ids=prompt, **GEN)
    merged = model.merge_and_unload()
    assert torch.equal(merged.generate(prompt, **GEN), expected)
    _assert_identical(merged, prompt, _config())
    _assert_identical(merged, prompt, _config(draft_precision="int8"))


def test_draft_model_with_its_own_adapter(peft_model, prompt):
    draft = get_peft_model(make_model("llama-gqa", num_hidden_layers=1, seed=5), _lora(["q_proj", "o_proj"])).eval()
    peft_model.set_adapter("second")
    _assert_identical(peft_model, prompt, _config(draft=draft))
    _assert_identical(peft_model, prompt, _config(draft=draft, draft_precision="int8"))
    peft_model.set_adapter("first")
