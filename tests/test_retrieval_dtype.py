"""Force 2's retrieval cache in bf16 (`TriForceConfig.retrieval_dtype`): its entries are the full cache's rounded to
bf16 (selected, replaced on a re-selection, synced and computed), it holds half the bytes, "auto" chooses it only
where Force 2 runs the lean forward on the CPU over an fp32 model, and every greedy output stays identical to plain
``generate`` (the sampled law under it: `test_exact_enumeration`'s "default drafting tiers (auto)" case)."""

from __future__ import annotations

import pytest
import torch

from hf_triforce import RetrievalCache, TriForceConfig
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.decoding.resolved import resolve

from .conftest import make_model, random_prompt
from .test_batch import PROMPTS, left_padded

LEAN = dict(draft="self", draft_precision="lean-int4", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24,
            gamma1=2, gamma2=4, policy="fixed")


def _full(model, length: int) -> BufferCache:
    cache = BufferCache(model.config.num_hidden_layers, length + 8)
    with torch.no_grad():
        model(random_prompt(length, seed=3), cache=cache)
    return cache


def test_selected_replaced_and_synced_entries_are_the_full_caches_rounded_to_bf16():
    """A bf16 cache and an fp32 twin driven alike (a selection, a re-selection that replaces chunks and renews the
    recent tokens in place, a sync): the bf16 one holds exactly the twin's entries, rounded."""
    model = make_model("llama-gqa")
    full = _full(model, 160)
    layers, heads = model.config.num_hidden_layers, model.config.num_attention_heads
    dim = model.config.hidden_size // heads
    twins = {dtype: RetrievalCache(layers, 64, 8, 16, 16).store_as(dtype) for dtype in (None, torch.bfloat16)}
    generator = torch.Generator().manual_seed(0)
    for upto, action in ((120, "select"), (150, "select"), (158, "sync")):
        queries = {i: torch.randn(1, heads, dim, generator=generator) for i in range(layers)}
        for cache in twins.values():
            cache.select(full, upto, queries) if action == "select" else cache.sync(full, upto)
        for exact, rounded in zip(twins[None].layers, twins[torch.bfloat16].layers):
            (keys, values), (half_keys, half_values) = exact.valid(), rounded.valid()
            assert keys.dtype == torch.float32 and half_keys.dtype == half_values.dtype == torch.bfloat16
            assert torch.equal(half_keys, keys.to(torch.bfloat16)) and torch.equal(half_values,
                                                                                   values.to(torch.bfloat16))
    assert sum(layer.chunks_copied for layer in twins[torch.bfloat16].layers) > 0  # the re-selection replaced chunks


@pytest.mark.parametrize("policy", ["fixed", "auto"])
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
def test_greedy_output_is_identical_and_force2_reads_half_the_bytes(family, policy):
    model = make_model(family, logit_scale=3.0)
    prompt = random_prompt(150, period=37)
    expected = model.generate(prompt, max_new_tokens=30, do_sample=False)
    stats = {}
    for dtype in ("model", "bfloat16"):
        config = TriForceConfig(**{**LEAN, "policy": policy}, retrieval_dtype=dtype)
        out = model.generate(prompt, max_new_tokens=30, do_sample=False, triforce_config=config,
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected), dtype
        stats[dtype] = out.triforce_stats
    assert stats["model"].detail.retrieval_dtype == "float32" and stats["bfloat16"].detail.retrieval_dtype == "bfloat16"
    assert stats["bfloat16"].detail.retrieval_cache_bytes * 2 == stats["model"].detail.retrieval_cache_bytes
    if policy == "fixed":
        assert stats["bfloat16"].force2_accepted > 0


def test_a_batch_shares_bf16_force2_caches_and_stays_identical():
    model = make_model("llama-gqa", logit_scale=3.0)
    ids, mask = left_padded(PROMPTS[:2])
    gen = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    out = model.generate(ids, do_sample=False, triforce_config=TriForceConfig(**LEAN, retrieval_dtype="bfloat16"),
                         return_dict_in_generate=True, **gen)
    assert torch.equal(out.sequences, model.generate(ids, do_sample=False, **gen))
    assert out.triforce_stats.detail.retrieval_dtype == "bfloat16" and out.triforce_stats.force2_accepted > 0


def test_auto_chooses_bf16_only_for_an_fp32_model_whose_force2_runs_lean():
    fp32 = make_model("llama-gqa")
    assert resolve(TriForceConfig(), fp32).retrieval_dtype == "bfloat16"  # auto: lean-int4 tiers on the CPU
    assert resolve(TriForceConfig(draft_precision="model"), fp32).retrieval_dtype == "model"
    assert resolve(TriForceConfig(draft_precision="int8"), fp32).retrieval_dtype == "model"
    assert resolve(TriForceConfig(), make_model("llama-gqa").to(torch.bfloat16)).retrieval_dtype == "model"
    gemma = make_model("gemma")  # the lean forward does not cover it: "auto" drafts with the eager forward
    assert resolve(TriForceConfig(), gemma).retrieval_dtype == "model"
    with pytest.raises(ValueError, match="retrieval_dtype='bfloat16' needs Force 2's lean forward"):
        resolve(TriForceConfig(retrieval_dtype="bfloat16"), gemma)


def test_bad_values_are_refused_by_name():
    with pytest.raises(ValueError, match=r"retrieval_dtype must be one of \('auto', 'model', 'bfloat16'\)"):
        TriForceConfig(retrieval_dtype="float16")
    with pytest.raises(ValueError, match="retrieval_dtype='bfloat16' needs Force 2's lean forward"):
        TriForceConfig(retrieval_dtype="bfloat16", draft_precision="model")
