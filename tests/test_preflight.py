"""Models that cannot run on the tiers are refused before the prefill, with what is unsupported and what to use.

Found by sweeping transformers' decoder-only list (`benchmarks/family_sweep.py`, docs/families.md): CPM-Ant writes
extra cache entries per token, GPT-NeoX-Japanese's attention (and Falcon's before transformers 5.25) bypasses the
``AttentionInterface`` (no query for Force-2 retrieval), GPT-2-style absolute positions leave nothing for the
sink+window cache to re-rotate, ALiBi Falcon (5.25) adds its position bias to the attention mask. Each is refused by
name, before a long prefill, and the alternative it names works.
"""

from __future__ import annotations

import pytest
import torch
import transformers as T
from packaging.version import Version

import hf_triforce.decoding.force3
from hf_triforce import TriForceConfig
from hf_triforce.kernels import native_attention

from .conftest import make_model, random_prompt

TINY = dict(vocab_size=96, bos_token_id=None, eos_token_id=None, pad_token_id=None)


def _config(**kw):
    base = dict(policy="fixed", retrieval_budget=32, chunk_size=8, retrieval_recent=8, sink_tokens=4, window=24,
                gamma1=2, gamma2=4)
    return TriForceConfig(**{**base, **kw})


@pytest.fixture
def no_prefill(monkeypatch):
    """Fail the test if the decoder starts its prefill: refusals must come first."""
    def refuse(*args, **kwargs):
        raise AssertionError("the prefill started before the refusal")

    monkeypatch.setattr(hf_triforce.decoding.force3, "prefill", refuse)


def _model(config_cls, model_cls, **kw):
    torch.manual_seed(0)
    return model_cls(config_cls(**{**TINY, **kw})).eval()


def cpmant():
    return _model(T.CpmAntConfig, T.CpmAntForCausalLM, hidden_size=64, num_attention_heads=4, dim_head=16,
                  dim_ff=96, num_hidden_layers=2, prompt_length=8)


# transformers 5.25 moved Falcon's attention onto the AttentionInterface (`FalconAttention.forward` calls
# `ALL_ATTENTION_FUNCTIONS.get_interface`); 5.24's computed it inline
FALCON_USES_THE_INTERFACE = Version(T.__version__) >= Version("5.25")


def falcon(**kw):
    """A rotary Falcon (multi-query, the default config), or with ``alibi=True`` the ALiBi variant (Falcon-RW)."""
    return _model(T.FalconConfig, T.FalconForCausalLM, hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                  **kw)


def gpt_neox_japanese():
    return _model(T.GPTNeoXJapaneseConfig, T.GPTNeoXJapaneseForCausalLM, hidden_size=64, num_attention_heads=4,
                  num_hidden_layers=2, intermediate_multiple_size=2)


def gpt2():
    return _model(T.GPT2Config, T.GPT2LMHeadModel, n_embd=64, n_head=4, n_layer=2, n_positions=512)


def test_extra_cache_entries_per_token_are_refused_before_the_prefill(no_prefill):
    with pytest.raises(ValueError, match=r"CpmAntForCausalLM stores \[9\] cache entries per input token"):
        cpmant().generate(random_prompt(40), max_new_tokens=4, triforce_config=_config(draft="ngram"))


def test_attention_outside_the_interface_is_refused_for_three_levels_and_runs_on_two(no_prefill):
    prompt = random_prompt(80, period=17)
    with pytest.raises(ValueError, match=r"GPTNeoXJapaneseForCausalLM's decoder layers \[0, 1\] does not go through "
                                         r"transformers' AttentionInterface.*levels=2"):
        gpt_neox_japanese().generate(prompt, max_new_tokens=4, triforce_config=_config(draft="ngram"))


def test_two_levels_on_a_model_whose_attention_records_nothing():
    model, prompt = gpt_neox_japanese(), random_prompt(80, period=17)
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False)
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, triforce_config=_config(draft="ngram", levels=2))
    assert torch.equal(out, expected)


@pytest.mark.parametrize("case", ["tree_nodes", "batch"])
def test_attention_outside_the_interface_is_refused_with_trees_and_batches(no_prefill, case):
    """Tree attention and a batch's per-row masks are applied by the wrapper inside the AttentionInterface: a layer
    that bypasses it would attend with its own causal mask (a tree's siblings seeing each other)."""
    prompt = random_prompt(80, period=17)
    if case == "batch":
        prompt = torch.cat([prompt, random_prompt(80, period=17, seed=2)])
    config = _config(draft="ngram", levels=2, tree_nodes=6 if case == "tree_nodes" else 0)
    what = r"TriForceConfig\(tree_nodes=0, force2_tree_nodes=0\)" if case == "tree_nodes" else "one prompt per call"
    with pytest.raises(ValueError, match=r"GPTNeoXJapaneseForCausalLM's decoder layers \[0, 1\] does not go through "
                                         rf"transformers' AttentionInterface, where TriForce applies .*use {what}"):
        gpt_neox_japanese().generate(prompt, max_new_tokens=4, do_sample=False, triforce_config=config)


def test_attention_outside_the_interface_runs_two_levels_with_eager_attention_only(no_prefill):
    """Its own SDPA code may mask a multi-token forward over TriForce's caches as a square causal block:
    transformers 5.24's Falcon with SDPA gave other tokens than plain generate at two levels (found with weights
    large enough for attention to decide tokens)."""
    model = gpt_neox_japanese()
    model.config._attn_implementation = "sdpa"  # what the refusal reads: the model's own code does not change
    with pytest.raises(ValueError, match=r"GPTNeoXJapaneseForCausalLM's decoder layers \[0, 1\] does not go through "
                                         r"transformers' AttentionInterface, and its own 'sdpa' code.*"
                                         r"attn_implementation='eager'"):
        model.generate(random_prompt(80, period=17), max_new_tokens=4,
                       triforce_config=_config(draft="ngram", levels=2))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
@pytest.mark.parametrize("draft", ["ngram", "self"])
def test_falcon_runs_three_levels_where_its_attention_goes_through_the_interface(draft, attn):
    """transformers 5.25: Falcon's attention is recorded, so three levels run it (token-identical, Force 2 used);
    5.24: refused for three levels like any attention outside the interface; two levels run it with eager attention
    and refuse its SDPA code (which gave other tokens there)."""
    model, prompt = falcon(initializer_range=0.3), random_prompt(120, period=17)
    model.config._attn_implementation = attn
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    if not FALCON_USES_THE_INTERFACE:
        with pytest.raises(ValueError, match=r"FalconForCausalLM's decoder layers \[0, 1\] does not go through"):
            model.generate(prompt, max_new_tokens=4, triforce_config=_config(draft=draft))
        two_levels = _config(draft=draft, levels=2)
        if attn == "sdpa":
            with pytest.raises(ValueError, match=r"attn_implementation='eager'"):
                model.generate(prompt, max_new_tokens=4, triforce_config=two_levels)
            return
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, triforce_config=two_levels)
        assert torch.equal(out, expected)
        return
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, triforce_config=_config(draft=draft),
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.triforce_stats.detail.force2_steps > 0 and not out.triforce_stats.detail.force2_sees_whole_cache


def alibi_falcon():
    """ALiBi Falcon with weights large enough that its position bias decides greedy tokens (checked below)."""
    return falcon(alibi=True, multi_query=False, initializer_range=0.3)


@pytest.mark.parametrize("attn", ["sdpa", "eager"] if FALCON_USES_THE_INTERFACE else ["eager"])
def test_alibi_bias_in_the_mask_survives_a_mask_free_verification_route(attn):
    """ALiBi Falcon adds its position bias to the attention mask (a float mask under SDPA). Verification forwards
    must not take a mask-free fused route (pinned here to FlexAttention, which the CPU runs; on CUDA flash-attn,
    varlen and Flex are taken automatically): it dropped the bias and the tokens differed."""
    model, prompt = alibi_falcon(), random_prompt(120, period=17)
    model.config._attn_implementation = attn
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    model.transformer.use_alibi = False
    assert not torch.equal(model.generate(prompt, max_new_tokens=24, do_sample=False), expected)  # the bias matters
    model.transformer.use_alibi = True
    levels = 3 if FALCON_USES_THE_INTERFACE else 2
    with native_attention.force_route("flex"):
        out = model.generate(prompt, max_new_tokens=24, do_sample=False,
                             triforce_config=_config(draft="ngram", levels=levels), return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.triforce_stats.force3_steps > 0


@pytest.mark.skipif(not FALCON_USES_THE_INTERFACE, reason="transformers < 5.25: Falcon's attention (and its mask) "
                                                          "bypasses the AttentionInterface")
@pytest.mark.parametrize("case", ["tree_nodes", "force2_tree_nodes", "batch"])
def test_a_bias_in_the_attention_mask_is_refused_with_trees_and_batches_before_the_prefill(no_prefill, case):
    """Tree attention replaces the model's mask (and lays nodes in cache slots, not at their positions): with ALiBi
    the tokens differed; a batch's per-row 4-D mask made Falcon's bias a shape error (ValueError: too many values to
    unpack)."""
    prompt = random_prompt(80, period=17)
    if case == "batch":
        prompt = torch.cat([prompt, random_prompt(80, period=17, seed=2)])
    config = {"tree_nodes": _config(draft="ngram", levels=2, tree_nodes=6),
              "force2_tree_nodes": _config(draft="self", force2_tree_nodes=8),
              "batch": _config(draft="ngram")}[case]
    what = "batches" if case == "batch" else r"candidate trees .*tree_nodes=0, force2_tree_nodes=0"
    with pytest.raises(ValueError, match=rf"FalconForCausalLM adds a bias to the attention mask of decoder layers "
                                         rf"\[0, 1\] \(ALiBi\); TriForce does not support that with {what}"):
        alibi_falcon().generate(prompt, max_new_tokens=4, do_sample=False, triforce_config=config)


@pytest.mark.skipif(not FALCON_USES_THE_INTERFACE, reason="transformers < 5.25: Falcon's attention bypasses the "
                                                          "AttentionInterface, so trees are refused on it")
def test_rotary_falcon_is_not_mistaken_for_a_biased_mask():
    """The mask probe reads only masks: rotary Falcon (boolean SDPA masks, 0 / min eager masks) runs trees."""
    model, prompt = falcon(initializer_range=0.3), random_prompt(120, period=17)
    model.config._attn_implementation = "eager"
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, return_dict_in_generate=True,
                         triforce_config=_config(draft="ngram", levels=2, tree_nodes=6))
    assert torch.equal(out.sequences, expected)
    assert out.triforce_stats.detail.tree_nodes > 0, "no candidate tree was verified"


def test_a_model_drafter_without_rotary_embeddings_is_refused_before_the_prefill(no_prefill):
    with pytest.raises(ValueError, match=r"GPT2LMHeadModel has no `rotary_emb`.*draft='ngram' or draft='suffix'"):
        gpt2().generate(random_prompt(80), max_new_tokens=4, triforce_config=_config(draft="self"))


def test_absolute_position_models_run_three_levels_with_a_lookup_drafter():
    model, prompt = gpt2(), random_prompt(120, period=17)
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, triforce_config=_config(draft="ngram"),
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.triforce_stats.detail.force2_steps > 0 and not out.triforce_stats.detail.force2_sees_whole_cache


def moshi(**kw):
    return _model(T.MoshiConfig, T.MoshiForCausalLM, hidden_size=64, num_attention_heads=4, num_key_value_heads=4,
                  num_hidden_layers=2, intermediate_size=96, sliding_window=16, **kw)


def test_sliding_layers_the_decoder_does_not_mask_are_refused_before_the_prefill(no_prefill):
    """Moshi's plain `generate` attends to everything in its prefill and to its cache's last window when decoding
    (it differs from its own no-cache forward); no tier can reproduce that exactly."""
    with pytest.raises(ValueError, match=r"MoshiForCausalLM's config declares sliding-window layers"):
        moshi().generate(random_prompt(40), max_new_tokens=4, triforce_config=_config(draft="ngram"))


def test_logits_of_a_model_that_ignores_logits_to_keep_are_the_last_rows():
    """Whisper's decoder returns logits for every input row whatever ``logits_to_keep`` says: the prefill's first
    token came from the prompt's first row before `forward_logits` kept the last rows."""
    model = _model(T.WhisperConfig, T.WhisperForCausalLM, d_model=64, decoder_layers=2, decoder_attention_heads=4,
                   decoder_ffn_dim=96, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=96,
                   max_target_positions=512, decoder_start_token_id=1, begin_suppress_tokens=None)
    prompt = random_prompt(80, period=17)
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False)
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, triforce_config=_config(draft="ngram"))
    assert torch.equal(out, expected)


def test_a_decoder_with_more_layers_than_its_config_declares_is_refused(no_prefill):
    model = _model(T.WhisperConfig, T.WhisperForCausalLM, d_model=64, decoder_layers=2, decoder_attention_heads=4,
                   decoder_ffn_dim=96, encoder_layers=1, encoder_attention_heads=4, encoder_ffn_dim=96,
                   max_target_positions=512, decoder_start_token_id=1, begin_suppress_tokens=None)
    with pytest.raises(ValueError, match=r"decoder has 2 layers but its config's num_hidden_layers is 1"):
        model.generate(random_prompt(40), max_new_tokens=4, triforce_config=_config(draft="ngram"))


def test_a_multimodal_model_given_text_only_runs_three_levels():
    """Gemma 3's vision-language model: ``generate`` hands a text-only prompt an empty ``mm_encoder_outputs``, and
    every config read goes through the nested text config (the composite config has no ``num_hidden_layers``)."""
    torch.manual_seed(0)
    config = T.Gemma3Config(
        text_config=dict(hidden_size=64, intermediate_size=96, num_hidden_layers=6, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=96, sliding_window=16,
                         max_position_embeddings=2048, bos_token_id=None, eos_token_id=None, pad_token_id=None),
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                           image_size=32, patch_size=8),
        mm_tokens_per_image=4, image_token_index=95, boi_token_index=93, eoi_token_index=94,
    )
    model = T.Gemma3ForConditionalGeneration(config).eval()
    assert not hasattr(model.config, "num_hidden_layers")
    prompt = random_prompt(120, vocab_size=90, period=17)
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False)
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, triforce_config=_config(draft="self"),
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.triforce_stats.detail.force2_steps > 0 and not out.triforce_stats.detail.force2_sees_whole_cache


def latent_attention():
    """DeepSeek-V3's multi-head latent attention caching latents 32 wide for a query 8 + 8 = 16 wide per head (the
    real model: 512 against 128 + 64); `tests/families.py`'s deepseek-v3 has the two widths equal (16)."""
    from .families import make_family

    return make_family("deepseek-v3", kv_lora_rank=32)


LATENT_PLANS = {"fixed": dict(policy="fixed"), "auto": dict(policy="auto")}


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("plan", sorted(LATENT_PLANS))
def test_cached_latents_of_another_width_than_the_query_are_refused_for_three_levels(no_prefill, plan, batch):
    """Force-2 retrieval scores the query against chunk means of the cached entries: latents 32 wide against a
    16-wide query failed after the prefill (an einsum size error; under ``policy="auto"`` only once a three-level
    plan ran)."""
    prompt = torch.cat([random_prompt(80, period=17, seed=1 + b) for b in range(batch)])
    config = _config(draft="self", **LATENT_PLANS[plan])
    with pytest.raises(ValueError, match=r"DeepseekV3ForCausalLM \(model_type 'deepseek_v3'\) caches entries 32 "
                                         r"wide in decoder layer 0, .* 16 wide per head .*TriForceConfig\(levels=2\)"):
        latent_attention().generate(prompt, max_new_tokens=4, do_sample=False, triforce_config=config)


@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.parametrize("plan", sorted(LATENT_PLANS))
def test_two_levels_on_cached_latents_wider_than_the_query(plan, batch):
    model = latent_attention()
    prompt = torch.cat([random_prompt(120, period=17, seed=1 + b) for b in range(batch)])
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    out = model.generate(prompt, max_new_tokens=24, do_sample=False,
                         triforce_config=_config(draft="self", levels=2, **LATENT_PLANS[plan]))
    assert torch.equal(out, expected)


def test_the_probe_runs_once_per_model_and_attention_implementation(monkeypatch):
    """Its findings are the model's structure: a second call (another prompt) reuses them; another attention
    implementation probes again; so does another model of the same class."""
    from hf_triforce.decoding import preflight

    probes = []
    original = preflight.forward_logits
    monkeypatch.setattr(preflight, "forward_logits", lambda *a, **k: probes.append(1) or original(*a, **k))
    model, config = gpt2(), _config(draft="ngram")
    model.config._attn_implementation = "eager"
    for seed in (1, 2):
        model.generate(random_prompt(80, period=17, seed=seed), max_new_tokens=4, triforce_config=config)
    assert len(probes) == 1
    model.config._attn_implementation = "sdpa"
    model.generate(random_prompt(80, period=17), max_new_tokens=4, triforce_config=config)
    assert len(probes) == 2
    gpt2().generate(random_prompt(80, period=17), max_new_tokens=4, triforce_config=config)
    assert len(probes) == 3
    preflight.forget_findings(model)  # after changing a module's state by hand
    model.generate(random_prompt(80, period=17), max_new_tokens=4, triforce_config=config)
    assert len(probes) == 4
    model.transformer.h[0].attn = type(model.transformer.h[0].attn)(model.config, layer_idx=0)  # a swapped module
    model.transformer.h[0].attn.__class__ = type("OtherAttention", (type(model.transformer.h[0].attn),), {})
    model.generate(random_prompt(80, period=17), max_new_tokens=4, triforce_config=config)
    assert len(probes) == 5


def test_the_rerotation_probe_runs_once_per_model(monkeypatch):
    """A model drafter's key re-rotations are the model's structure: a second call reuses them (the probe forward
    was a per-call cost of every short answer)."""
    from hf_triforce.decoding import preflight

    probes = []
    original = preflight.make_layer_rerotations
    monkeypatch.setattr(preflight, "make_layer_rerotations", lambda m: probes.append(1) or original(m))
    target, draft = make_model("llama-gqa"), make_model("llama-gqa", seed=3)
    for seed in (1, 2):
        target.generate(random_prompt(80, period=17, seed=seed), max_new_tokens=4,
                        triforce_config=_config(draft=draft, levels=2))
    assert len(probes) == 1
