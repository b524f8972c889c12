"""Greedy TriForce output is token-identical to plain `generate`, for every draft mode, budget and family."""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig

from .conftest import FAMILIES, make_model, random_prompt


def _config(draft, budget=64, **kw):
    base = dict(draft=draft, policy="fixed", retrieval_budget=budget, chunk_size=8, sink_tokens=4, window=24,
                gamma1=2, gamma2=4)
    base.update(kw)
    return TriForceConfig(**base)


def assert_identical(model, prompt, config, **gen):
    gen = {"max_new_tokens": 40, "do_sample": False, **gen}
    expected = model.generate(prompt, **gen)
    out = model.generate(prompt, triforce_config=config, return_dict_in_generate=True, **gen)
    assert torch.equal(out.sequences, expected), (out.sequences[0, prompt.shape[1]:], expected[0, prompt.shape[1]:])
    return out.triforce_stats


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_families_and_draft_modes(family, draft):
    model = make_model(family)
    prompt = random_prompt(150, period=37)
    stats = assert_identical(model, prompt, _config(draft))
    assert stats.force3_steps > 0 and not stats.detail.force2_sees_whole_cache


@pytest.mark.parametrize("budget", [16, 48, 256])
@pytest.mark.parametrize("gammas", [(1, 1), (2, 6), (4, 3)])
def test_budgets_and_gammas(gqa_model, budget, gammas):
    prompt = random_prompt(120)
    stats = assert_identical(gqa_model, prompt, _config("self", budget=budget, gamma1=gammas[0], gamma2=gammas[1]))
    assert stats.detail.force2_sees_whole_cache == (budget >= 120)


def test_draft_model_with_fewer_layers():
    target = make_model("qwen2", num_hidden_layers=3)
    draft = make_model("qwen2", num_hidden_layers=1, seed=5)
    assert_identical(target, random_prompt(100), _config(draft))


@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_two_level_baseline(gqa_model, draft):
    stats = assert_identical(gqa_model, random_prompt(140, period=29), _config(draft, levels=2))
    assert stats.detail.retrieval_cache_bytes == 0 and stats.force3_proposed > 0


def test_refresh_policies(gqa_model):
    prompt = random_prompt(200)
    for kw in (dict(refresh_every=3), dict(refresh_every=50), dict(refresh_every=4, refresh_below=0.5)):
        assert_identical(gqa_model, prompt, _config("self", **kw), max_new_tokens=60)


def test_logits_processors_applied_identically(gqa_model):
    prompt = random_prompt(90, period=11)
    assert_identical(
        gqa_model, prompt, _config("ngram"), repetition_penalty=1.3, no_repeat_ngram_size=3, min_new_tokens=5
    )


def test_eager_attention_implementation():
    model = make_model("llama-gqa", attn_implementation="eager")
    assert_identical(model, random_prompt(80), _config("self"))
    assert model.config._attn_implementation == "eager"


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
@pytest.mark.parametrize("draft,levels", [("self", 3), ("ngram", 3), ("self", 2), ("model", 3)])
def test_int8_drafting_tiers(family, draft, levels):
    from hf_triforce.kernels.quantized import _COPIES

    model = make_model(family, logit_scale=3.0)
    before = {name: p.clone() for name, p in model.state_dict().items()}
    if draft == "model":
        draft = make_model(family, num_hidden_layers=1, seed=5)
    stats = assert_identical(model, random_prompt(150, period=37), _config(draft, levels=levels,
                                                                            draft_precision="int8"))
    assert stats.force3_steps > 0
    assert model in _COPIES and (isinstance(draft, str) or draft in _COPIES)  # the tiers ran the int8 copies
    assert all(type(m) is torch.nn.Linear for m in model.modules() if "Linear" in type(m).__name__)
    after = model.state_dict()
    assert all(torch.equal(before[name], after[name]) for name in before)  # the target itself is untouched


def test_int8_needs_an_fp32_cpu_model():
    model = make_model("llama-gqa").to(torch.bfloat16)
    with pytest.raises(ValueError, match="draft_precision='int8' quantizes an fp32 model"):
        model.generate(random_prompt(60), max_new_tokens=4, triforce_config=_config("self", draft_precision="int8"))


def _assert_identical_with_self_and_ngram_drafts() -> None:
    """Greedy identity on a GQA model through every tier, for the tests that swap an attention route."""
    model = make_model("llama-gqa", logit_scale=3.0)
    for draft in ("self", "ngram"):
        assert_identical(model, random_prompt(150, period=37), _config(draft, budget=48))


def _reference_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                     dropout_p=0.0, softmax_scale=None, causal=False):
    """flash-attn's varlen contract ([tokens, h, d], sequences bounded by cu_seqlens, GQA, bottom-right causal)
    written with SDPA, for the glue test."""
    assert causal and dropout_p == 0.0
    assert cu_seqlens_q.dtype == cu_seqlens_k.dtype == torch.int32
    assert cu_seqlens_q.tolist() == [0, q.shape[0]] == [0, max_seqlen_q]
    assert cu_seqlens_k.tolist() == [0, k.shape[0]] == [0, max_seqlen_k]
    assert q.stride(-1) == k.stride(-1) == v.stride(-1) == 1  # flash-attn needs a contiguous last dimension
    mask = torch.ones(max_seqlen_q, max_seqlen_k, dtype=torch.bool).tril(max_seqlen_k - max_seqlen_q)
    out = torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=softmax_scale, enable_gqa=True
    )
    _reference_flash_attn_varlen_func.calls += 1
    return out.transpose(0, 1)


def test_flash_attention_glue_keeps_greedy_identity(monkeypatch):
    """The flash-attn route (CUDA-only in use) run on CPU with a reference kernel: every tier's mask must be
    bottom-right causal for it to be exact. `tests/test_cuda.py` runs the real kernel where a GPU is present."""
    from hf_triforce.kernels import attention

    _reference_flash_attn_varlen_func.calls = 0
    monkeypatch.setattr(attention, "_flash_device", lambda query: True)
    monkeypatch.setattr(attention, "flash_varlen", lambda: _reference_flash_attn_varlen_func)
    _assert_identical_with_self_and_ngram_drafts()
    assert _reference_flash_attn_varlen_func.calls > 0


def test_split_kv_verification_keeps_greedy_identity(monkeypatch):
    """The CPU split-cache route (taken from 8192 cached entries in use) forced on for every multi-token call
    of a tiny model: each tier's mask must be bottom-right causal for it to be exact."""
    from hf_triforce.kernels import attention

    calls = []
    real = attention.split_kv_sdpa
    monkeypatch.setattr(attention, "SPLIT_KV_MIN_CACHED", 0)
    monkeypatch.setattr(attention, "_split_pays", lambda query, key: True)  # whatever the heads and threads
    monkeypatch.setattr(attention, "split_kv_sdpa", lambda *a, **k: calls.append(1) or real(*a, **k))
    _assert_identical_with_self_and_ngram_drafts()
    assert calls
