"""Models loaded with accelerate's ``device_map=`` (real dispatch hooks; layers on the CPU and offloaded to
disk with ``offload_folder=``): greedy TriForce output equals plain ``generate`` of the same loaded model;
every cache layer lives on its layer's execution device; drafting copies leave the map as it is."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_triforce import TriForceConfig
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.compat import layer_devices, offloaded_modules
from hf_triforce.kernels.quantized import Int8Linear, forget_int8_copy, int8_copy, int8_copy_bytes

from .conftest import make_model, random_prompt

GEN = dict(max_new_tokens=20, do_sample=False)
DEVICE_MAP = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
              "model.layers.2": "disk", "model.layers.3": "cpu", "model.norm": "cpu", "model.rotary_emb": "cpu",
              "lm_head": "cpu"}


def _config(**kw):
    base = dict(draft="self", policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=2,
                gamma2=4)
    return TriForceConfig(**{**base, **kw})


def _load(tmp_path_factory, layers: int, device_map, seed: int = 0):
    path = tmp_path_factory.mktemp("checkpoint")
    make_model("llama-gqa", num_hidden_layers=layers, seed=seed).save_pretrained(path)
    offload = tmp_path_factory.mktemp("offload")
    return AutoModelForCausalLM.from_pretrained(path, device_map=device_map, offload_folder=offload,
                                                dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def dispatched(tmp_path_factory):
    model = _load(tmp_path_factory, 4, DEVICE_MAP)
    assert model.hf_device_map["model.layers.1"] == "disk"
    assert model.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # really offloaded
    assert any(name.startswith("model.layers.2") for name in offloaded_modules(model))
    return model


@pytest.fixture(scope="module")
def prompt():
    return random_prompt(100, period=37)


def _assert_identical(model, prompt, config):
    expected = model.generate(prompt, **GEN)
    out = model.generate(prompt, triforce_config=config, return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, expected), (out.sequences[0, prompt.shape[1]:], expected[0, prompt.shape[1]:])
    assert out.triforce_stats.force3_steps > 0
    return out


@pytest.mark.parametrize("draft,precision", [("self", "model"), ("self", "int8"), ("ngram", "int8")])
def test_disk_offloaded_layers(dispatched, prompt, draft, precision):
    out = _assert_identical(dispatched, prompt, _config(draft=draft, draft_precision=precision))
    assert out.cache.devices() == layer_devices(dispatched)  # every full-cache layer on its execution device
    assert dispatched.model.layers[1].self_attn.q_proj.weight.device.type == "meta"  # the map is unchanged
    assert out.triforce_stats.detail.force2_steps > 0


def test_int8_copy_of_an_offloaded_model(dispatched):
    forget_int8_copy(dispatched)
    copy = int8_copy(dispatched)
    # the copy holds the offloaded layers' weights (int8 linears) in CPU memory; the model stays offloaded
    assert isinstance(copy.model.layers[1].self_attn.q_proj, Int8Linear)
    assert copy.model.layers[1].mlp.down_proj.weight.device.type == "cpu"
    assert not any(hasattr(module, "_hf_hook") for module in copy.modules())
    assert dispatched.model.layers[2].mlp.down_proj.weight.device.type == "meta"
    assert int8_copy_bytes(dispatched) > 0


def test_draft_model_with_its_own_device_map(dispatched, prompt, tmp_path_factory):
    draft_map = {"model.embed_tokens": "cpu", "model.layers.0": "disk", "model.norm": "cpu",
                 "model.rotary_emb": "cpu", "lm_head": "cpu"}
    draft = _load(tmp_path_factory, 1, draft_map, seed=5)
    _assert_identical(dispatched, prompt, _config(draft=draft))
    _assert_identical(dispatched, prompt, _config(draft=draft, draft_precision="int8"))


def test_cache_refuses_entries_from_another_device():
    cache = BufferCache(2, 16).expect_devices([torch.device("cpu"), torch.device("meta")])
    cache.layers[0].update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(RuntimeError, match="executes on meta"):
        cache.layers[1].update(torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4))
    with pytest.raises(ValueError, match="3 layer devices"):
        cache.expect_devices([torch.device("cpu")] * 3)
