"""``TriForceConfig(full_cache_device="cpu")``: Force 3's cache in host memory, streamed per layer.

On the CPU both devices are the CPU, and the same code path runs (host buffers, a device copy of each layer
per forward, the next layer prefetched). Output equals the on-device cache's and plain ``generate``'s; what
stays on the compute device does not grow with the context except the chunk summaries (context / chunk_size
mean keys, the retrieval index).
"""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.caches.offloaded import OffloadedBufferCache

from .conftest import make_model, random_prompt

GEN = dict(max_new_tokens=20, do_sample=False)


def _config(**kw):
    base = dict(draft="self", policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=2,
                gamma2=4, full_cache_device="cpu")
    return TriForceConfig(**{**base, **kw})


@pytest.mark.parametrize("draft,precision", [("self", "model"), ("ngram", "int8")])
def test_identical_to_plain_generate_and_to_the_on_device_cache(model, draft, precision):
    prompt = random_prompt(150, period=37)
    expected = model.generate(prompt, **GEN)
    out = model.generate(prompt, triforce_config=_config(draft=draft, draft_precision=precision),
                         return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, expected)
    cache = out.cache
    assert isinstance(cache, OffloadedBufferCache) and cache.resident_bytes() == 0
    assert all(layer.keys.device.type == "cpu" for layer in cache.layers)
    # streamed: every Force-3 forward copied every layer, all but the first prefetched during the one before
    assert cache.stream.copies >= out.triforce_stats.force3_steps * len(cache.layers)
    assert cache.stream.prefetched >= out.triforce_stats.force3_steps * (len(cache.layers) - 1)
    assert out.triforce_stats.detail.force2_steps > 0


def test_sampled_output_identical_to_the_on_device_cache(model):
    prompt = random_prompt(120, period=37)
    outputs = []
    for device in (None, "cpu"):
        torch.manual_seed(7)
        outputs.append(model.generate(prompt, triforce_config=_config(full_cache_device=device), do_sample=True,
                                      max_new_tokens=20))
    assert torch.equal(*outputs)


def test_device_memory_independent_of_context(model):
    chunk = 8
    resident = {}
    for length in (120, 400):
        out = model.generate(random_prompt(length, period=37), triforce_config=_config(chunk_size=chunk),
                             return_dict_in_generate=True, **GEN)
        stats = out.triforce_stats
        assert stats.detail.full_cache_bytes > 0 and stats.detail.device_resident_bytes < stats.detail.full_cache_bytes
        resident[length] = stats.detail.device_resident_bytes - stats.detail.retrieval_summary_bytes
        # the summaries: one fp32 mean key per complete chunk past the sink chunk, KV head and layer
        config = model.config
        head_dim = config.hidden_size // config.num_attention_heads
        per_chunk = config.num_key_value_heads * head_dim * 4 * config.num_hidden_layers
        assert stats.detail.retrieval_summary_bytes <= (length + GEN["max_new_tokens"]) // chunk * per_chunk
    assert resident[120] == resident[400] > 0
    # with the cache next to the model, what stays resident grows with the context
    on_device = [model.generate(random_prompt(n, period=37), triforce_config=_config(full_cache_device=None),
                                return_dict_in_generate=True, **GEN).triforce_stats.detail.device_resident_bytes
                 for n in (120, 400)]
    assert on_device[1] > on_device[0]


def test_continue_from_the_returned_offloaded_cache(model):
    prompt = random_prompt(110, period=37)
    first = model.generate(prompt, triforce_config=_config(), return_dict_in_generate=True, **GEN)
    follow = torch.cat((first.sequences, random_prompt(5, seed=3)), dim=1)
    expected = model.generate(follow, **GEN)
    out = model.generate(follow, cache=first.cache, triforce_config=_config(), **GEN)
    assert torch.equal(out, expected)


def test_bad_device_named():
    with pytest.raises(ValueError, match=r"full_cache_device must be one of \(None, 'cpu'\)"):
        TriForceConfig(full_cache_device="disk")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the pinned, side-stream route)")
def test_cuda_offloaded_cache_streams_from_pinned_memory():
    model = make_model("llama-gqa").cuda()
    prompt = random_prompt(300, period=37).cuda()
    expected = model.generate(prompt, **GEN)
    out = model.generate(prompt, triforce_config=_config(), return_dict_in_generate=True, **GEN)
    assert torch.equal(out.sequences, expected)
    assert all(layer.keys.is_pinned() for layer in out.cache.layers)
    assert out.cache.stream.prefetched > 0
    resident = []
    for length in (300, 1200):
        stats = model.generate(random_prompt(length, period=37).cuda(), triforce_config=_config(),
                               return_dict_in_generate=True, **GEN).triforce_stats
        resident.append(stats.detail.device_resident_bytes - stats.detail.retrieval_summary_bytes)
    assert resident[0] == resident[1]
