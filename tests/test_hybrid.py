"""Hybrid attention (sliding-window + full layers), per-layer RoPE and the other decoder families.

Every family of `tests/families.py` is greedy-identical to plain `generate` with a prompt several times longer
than its sliding window and than the retrieval budget; verification blocks longer than the window; the sampled
law of a hybrid model is the target's (exact enumeration and chi-square); unsupported layer types are refused
before the prefill with their name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList, TopKLogitsWarper

from hf_triforce import TriForceConfig
from hf_triforce.caches.buffer import WindowLayer
from hf_triforce.caches.sink_window import make_layer_rerotations
from hf_triforce.compat import layer_windows
from hf_triforce.decoding.policy import AdaptivePolicy, Plan

from .conftest import random_prompt
from .families import FAMILIES, HYBRID, PROMPT, VOCAB, WINDOW, make_family
from .stats_util import chi_square_pvalue
from .test_distribution import exact_sequence_probs, sampled_counts
from .test_exact_enumeration import decoded_law, distance, exercised, target_law

BUDGET = 32


def _config(draft="self", **kw):
    base = dict(draft=draft, policy="fixed", retrieval_budget=BUDGET, chunk_size=8, retrieval_recent=8,
                sink_tokens=4, window=24, gamma1=2, gamma2=4)
    return TriForceConfig(**{**base, **kw})


def assert_identical(model, prompt, config, **gen):
    gen = {"max_new_tokens": 32, "do_sample": False, **gen}
    expected = model.generate(prompt, **gen)
    out = model.generate(prompt, triforce_config=config, return_dict_in_generate=True, **gen)
    assert torch.equal(out.sequences, expected), (out.sequences[0, prompt.shape[1]:], expected[0, prompt.shape[1]:])
    return out


def test_the_suite_covers_twenty_families_and_the_hybrid_ones():
    assert len(FAMILIES) >= 20
    assert {"gemma2", "gemma3", "phi3", "cohere2", "gpt-oss", "mixtral"} <= set(HYBRID)
    assert PROMPT >= 4 * max(WINDOW, BUDGET)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_family_greedy_identity(family):
    """Three levels (self draft on the sink+window cache, retrieval, full cache) on every family."""
    model = make_family(family)
    stats = assert_identical(model, random_prompt(PROMPT, VOCAB, period=37), _config()).triforce_stats
    assert stats.force3_steps > 0 and stats.detail.force1_proposed > 0 and not stats.detail.force2_sees_whole_cache


@pytest.mark.parametrize("family", ["gemma3", "mistral-sliding", "gpt-oss"])
def test_the_window_changes_the_output(family):
    """The tests above can fail: with the same weights and full attention everywhere, plain output differs."""
    prompt = random_prompt(PROMPT, VOCAB, period=37)
    windowed = make_family(family).generate(prompt, max_new_tokens=32, do_sample=False)
    wide = make_family(family, sliding_window=4 * PROMPT)  # a window longer than the whole sequence
    assert set(layer_windows(wide.config)) - {None} == {4 * PROMPT}
    assert not torch.equal(wide.generate(prompt, max_new_tokens=32, do_sample=False), windowed)


@pytest.mark.parametrize("draft,levels", [("ngram", 3), ("self", 3), ("self", 2)])
def test_verification_blocks_longer_than_the_window(draft, levels, family="gemma2"):
    """A 3-token window, 7-row verifications: each row must be cut at its own window (periodic prompt: long
    accepted runs, so blocks cross the window edge and roll back over it)."""
    model = make_family(family, sliding_window=3)
    prompt = random_prompt(PROMPT, VOCAB, seed=2, period=7)
    out = assert_identical(model, prompt, _config(draft, levels=levels, gamma1=3, gamma2=6), max_new_tokens=40)
    stats = out.triforce_stats
    rejected = stats.force3_accepted < stats.force3_proposed or stats.force2_accepted < stats.detail.force1_proposed
    assert stats.force3_accepted >= 3 and rejected  # accepted runs across the window edge, and rollbacks


def test_adaptive_policy_on_a_hybrid_model():
    model = make_family("gemma3")
    assert_identical(model, random_prompt(PROMPT, VOCAB, period=37), _config(policy="auto"), max_new_tokens=40)


def test_continuing_from_a_returned_cache_and_from_a_dynamic_cache():
    model = make_family("gemma2")
    prompt = random_prompt(PROMPT, VOCAB, period=37)
    first = assert_identical(model, prompt, _config(), max_new_tokens=16)
    turn = torch.cat((first.sequences, random_prompt(5, VOCAB, seed=9)), dim=1)
    expected = model.generate(turn, max_new_tokens=16, do_sample=False)  # plain generate would write into the cache
    out = model.generate(turn, max_new_tokens=16, do_sample=False, triforce_config=_config(), cache=first.cache)
    assert torch.equal(out, expected)
    dynamic = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :-3], cache=dynamic, use_cache=True)
    expected = model.generate(prompt, max_new_tokens=16, do_sample=False)
    out = model.generate(prompt, max_new_tokens=16, do_sample=False, triforce_config=_config(), cache=dynamic)
    assert torch.equal(out, expected)


NARROW_VALUES = {  # plan -> config overrides: chains, trees at both levels, tree plans under the policy
    "chain": {},
    "trees": dict(tree_nodes=8, tree_branch=3, force2_tree_nodes=9),
    "auto-trees": dict(policy="auto", tree_nodes=8, tree_branch=3, force2_tree_nodes=9, explore_every=2),
}
# under policy="auto" the plans run in this rotation (the policy's own choice depends on timings): tree plans at
# three and two levels between plain steps
TREE_PLAN_ROTATION = [Plan(3, "self", 2, 5, force1_tree=True, force2_tree=True), Plan(1),
                      Plan(2, "self", gamma2=4, force1_tree=True), Plan(3, "self", 2, 5, force2_tree=True)]


@pytest.mark.parametrize("plan", list(NARROW_VALUES))
@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_latent_attention_with_values_narrower_than_keys(monkeypatch, attn, plan):
    """DeepSeek-V3's values are narrower than its keys (``v_head_dim`` < ``qk_nope_head_dim + qk_rope_head_dim``):
    every attention route (one-row steps, verification, tree forwards) returns the values' width."""
    if plan == "auto-trees":
        def choose(self, remaining_tokens=None):
            self.current = TREE_PLAN_ROTATION[sum(r.steps for r in self.records.values()) % len(TREE_PLAN_ROTATION)]
            return self.current

        monkeypatch.setattr(AdaptivePolicy, "choose", choose)
    model = make_family("deepseek-v3-narrow-values")
    model.set_attn_implementation(attn)
    attention = model.model.layers[0].self_attn
    assert attention.v_head_dim < attention.qk_head_dim
    stats = assert_identical(model, random_prompt(PROMPT, VOCAB, period=37), _config(**NARROW_VALUES[plan]),
                             max_new_tokens=40).triforce_stats
    assert stats.force3_steps > 0 and stats.detail.force1_proposed > 0
    assert (stats.detail.tree_nodes > 0) == (plan != "chain")


def test_chunked_attention_is_refused_before_the_prefill():
    from transformers import Llama4ForCausalLM, Llama4TextConfig

    config = Llama4TextConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=32, intermediate_size_mlp=32,
                              num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                              num_local_experts=2, attention_chunk_size=8, bos_token_id=None, eos_token_id=None,
                              pad_token_id=None)
    model = Llama4ForCausalLM(config).eval()
    calls = []
    model.model.register_forward_pre_hook(lambda *args: calls.append(1))
    with pytest.raises(ValueError, match="chunked_attention"):
        model.generate(random_prompt(40, VOCAB), max_new_tokens=4, triforce_config=_config())
    assert not calls


def test_window_layer_rolls_back_only_within_what_it_keeps():
    layer = WindowLayer(window=4, keep=5, capacity=8)
    keys = torch.arange(20, dtype=torch.float32).reshape(1, 1, 20, 1)
    got, _ = layer.update(keys[:, :, :12], keys[:, :, :12])  # a prefill chunk longer than the buffer
    assert got.shape[2] == 12 and layer.get_seq_length() == 12 and layer.held == 5
    assert layer.get_mask_sizes(1) == (6, 7)
    got, _ = layer.update(keys[:, :, 12:14], keys[:, :, 12:14])
    assert got[0, 0, :, 0].tolist() == list(range(7, 14))
    assert layer.get_mask_sizes(3) == (8, 9)  # 7 + 3 > 8: the two oldest entries go, as announced
    got, _ = layer.update(keys[:, :, 14:17], keys[:, :, 14:17])
    assert got[0, 0, :, 0].tolist() == list(range(9, 17))
    layer.crop(14)  # the next row at 14 needs tokens 11..13
    with pytest.raises(RuntimeError, match="already dropped"):
        layer.crop(11)


def test_each_layer_is_moved_by_its_own_rotation():
    """Gemma 3's local and global layers use different RoPE bases; Cohere 2's global layers have none (NoPE) and
    its local ones rotate interleaved pairs; GPT-OSS rotates halves with one angle per pair; Ernie 4.5 and Helium
    interleaved pairs with the first half of the angles; NanoChat halves the other way; DeepSeek-V3 (MLA) only its
    rotary part. A cached key moved by
    `delta` equals the key computed at the moved position, layer by layer."""
    for family in ("gemma3", "cohere2", "gpt-oss", "smollm3", "phi", "ernie4_5", "helium", "nanochat", "deepseek-v3"):
        model = make_family(family)
        rerotations = make_layer_rerotations(model)
        from hf_triforce.caches.sink_window import _probe_keys

        at = _probe_keys(model, [3, 40])
        for index, rerotate in enumerate(rerotations):
            moved = at[index][0] if rerotate is None else rerotate(at[index][0][None, :, None], 37)[0, :, 0]
            torch.testing.assert_close(moved, at[index][1], rtol=1e-4, atol=1e-4)
        if family in ("cohere2", "smollm3"):
            assert None in rerotations and any(r is not None for r in rerotations)


# --- the sampled law of a hybrid model ----------------------------------------------------------------------

ENUM_VOCAB = 4


# family -> (model overrides, retrieval budget): Gemma 2 (sliding 3 + full, attention softcapping, eager attention),
# Mixtral (MoE), Qwen3 (qk-norm), Gemma 3's text decoder (the VLM's language model, per-layer-type RoPE, sliding and
# full layers alternating), DeepSeek-V3 (MLA, MoE). Each chosen so that both levels reject and accept on paths of real
# probability (`exercised`): Gemma's scaled, tied embeddings at the default init 0.3 give point masses (every tier
# agrees), so Gemma runs at 0.05; every Mixtral layer slides when a window is set, so every tier would see the same
# window, and Mixtral runs with full attention here (its window: `test_family_greedy_identity`).
ENUMERATED_FAMILIES = {
    "gemma2": (dict(sliding_window=3, final_logit_softcapping=None, initializer_range=0.05), 8),
    "mixtral": (dict(sliding_window=None), 16),
    "qwen3": ({}, 16),
    "gemma3": (dict(sliding_window=3, initializer_range=0.05, layer_types=["sliding_attention", "full_attention"] * 3),
               8),
    "deepseek-v3": ({}, 16),
}


@pytest.mark.parametrize("family", list(ENUMERATED_FAMILIES))
def test_enumerated_law_of_a_hybrid_model_equals_the_target_law(family):
    """Exact: every random path of one decode vs the target's sequence law, through the library's own loop, levels
    and caches."""
    overrides, budget = ENUMERATED_FAMILIES[family]
    model = make_family(family, vocab_size=ENUM_VOCAB, seed=3, **{"initializer_range": 0.3, **overrides})
    prompt = random_prompt(40, vocab_size=ENUM_VOCAB, seed=4, period=13)
    processors = LogitsProcessorList([TopKLogitsWarper(2)])
    config = TriForceConfig(draft="self", policy="fixed", retrieval_budget=budget, chunk_size=4, retrieval_recent=4,
                            sink_tokens=2, window=8, gamma1=2, gamma2=2)
    law, paths, stats = decoded_law(model, prompt, config, processors, 4)  # 4 tokens: both levels propose
    exact = target_law(model, prompt, processors, 4)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and paths > 10
    assert distance(law, exact) < 1e-5
    exercised(stats, 3)


@pytest.mark.extended  # 10-20 s; exact in the default tier: the enumerated hybrid families above (sliding layers)
def test_sampled_distribution_of_a_hybrid_model(runs=400, new=4):
    """Chi-square through `generate` and torch's RNG on a Qwen2 layout (a full layer, a sliding layer of window 4).
    Kept small for the suite (400 runs; cells expecting fewer than 5 are pooled)."""
    vocab = 8
    model = make_family("qwen2-hybrid", vocab_size=vocab, seed=3, initializer_range=0.3, sliding_window=4,
                        num_hidden_layers=2)
    assert layer_windows(model.config) == [None, 4]
    prompt = random_prompt(48, vocab_size=vocab, seed=4, period=13)
    config = TriForceConfig(draft="self", policy="fixed", retrieval_budget=16, chunk_size=4, retrieval_recent=4,
                            sink_tokens=2, window=8, gamma1=2, gamma2=2)
    exact = exact_sequence_probs(model, prompt, LogitsProcessorList(), new)
    counts, stats = sampled_counts(model, prompt, config, runs, new)
    keys = sorted(exact)
    assert set(counts) <= {k for k in keys if exact[k] > 0}, "sampled a sequence of probability zero"
    observed = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)
    expected = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    assert sum(s.force3_accepted for s in stats) < sum(s.force3_proposed for s in stats)
    assert 0 < sum(s.force2_accepted for s in stats) < sum(s.detail.force1_proposed for s in stats)
    assert chi_square_pvalue(observed, expected) > 1e-3


# --- Force 2's masks on a sparse retrieval cache of a hybrid model -------------------------------------------


def _force2_block_and_rows(model, new=5):
    """Force 2's logits for ``new`` tokens after a 150-token prompt on a 32-entry retrieval selection: one block
    forward, and one forward per token (a one-row forward sees every entry, so no mask can be offset there)."""
    import copy

    from hf_triforce import compat
    from hf_triforce.caches.buffer import BufferCache
    from hf_triforce.caches.retrieval import RetrievalCache
    from hf_triforce.forwards.forward import forward_logits
    from hf_triforce.kernels.attention import QueryRecorder
    from hf_triforce.kernels.attention_function import wrapped_name

    ids = random_prompt(PROMPT + new, VOCAB, period=37)
    windows = layer_windows(model.config)
    with compat.attention_implementation(model, wrapped_name(compat.current_attention_implementation(model))), \
            torch.no_grad():
        full = BufferCache(model.config.num_hidden_layers, PROMPT + 64, windows, rollback=8)
        recorder = QueryRecorder()
        forward_logits(model, ids[:, :PROMPT], full, 0, 1, recorder)
        retrieval = RetrievalCache(model.config.num_hidden_layers, BUDGET, 8, 8, 40, windows)
        retrieval.select(full, PROMPT, recorder.at(-1))
        assert not retrieval.sees_whole_cache
        block = forward_logits(model, ids[:, PROMPT:], copy.deepcopy(retrieval), PROMPT, new)
        rows_cache = copy.deepcopy(retrieval)
        rows = torch.cat([forward_logits(model, ids[:, PROMPT + i : PROMPT + i + 1], rows_cache, PROMPT + i, 1)
                          for i in range(new)])
    return block, rows


SPARSE_HYBRID = [name for name in HYBRID if None in layer_windows(make_family(name).config)]


@pytest.mark.parametrize("family", SPARSE_HYBRID)
def test_force2_block_masks_on_a_hybrid_retrieval_cache(family):
    """Sliding layers count absolute tokens, full layers count selected entries: transformers builds each mask from
    the first layer of its kind, so a block of drafts sees exactly what token-by-token Force 2 sees."""
    block, rows = _force2_block_and_rows(make_family(family))
    torch.testing.assert_close(block, rows, rtol=1e-5, atol=1e-5)


def test_force2_block_mask_check_catches_an_offset(monkeypatch):
    """The comparison above fails when the full layers' mask is offset by the tokens the selection left out."""
    from hf_triforce.caches.buffer import BufferLayer

    real = BufferLayer.get_mask_sizes
    monkeypatch.setattr(BufferLayer, "get_mask_sizes", lambda self, q: (real(self, q)[0], 3))
    block, rows = _force2_block_and_rows(make_family("gemma3"))
    assert not torch.allclose(block, rows, rtol=1e-5, atol=1e-5)
