"""Force 3's verification on the target's native lean forward at fixed shapes (``TriForceConfig.force3_compile``).

* the forward computes the target's own logits and queries: bit for bit in bf16 where no attention has run yet
  (layer 0's queries and entries: the model's rounding, not the drafting copies' fp32 activations), within summation
  order after it; the queries Force 2's selection reads after a verification are those of the rows verified;
* greedy output token-identical to plain ``generate`` (fp32) under two- and three-level fixed plans and the adaptive
  policy, Llama and Qwen2, with the same draft counts as transformers' forward (Force 2's selection reads the same
  queries);
* compiled with ``fullgraph=True``: one model's first call compiles, later calls (other prompt lengths, so other cache
  capacities; sampled too) compile nothing;
* the sampled law is exactly the target's (enumerated), and the enumeration catches a verifier reading its logits one
  row off;
* the decision (`tiers.force3_forward`): off on the CPU by default, on where the tiers are graphed on CUDA, and every
  request it cannot serve is a clear error.
"""

from __future__ import annotations

from operator import attrgetter

import pytest
import torch
from transformers import LogitsProcessorList, TopKLogitsWarper

from hf_triforce import TriForceConfig
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.decoding import force3, tiers
from hf_triforce.decoding.levels import Candidates
from hf_triforce.decoding.resolved import resolve
from hf_triforce.decoding.tiers import force3_forward, lean_model, resolve_draft_precision
from hf_triforce.forwards.forward import HostClock, forward_logits
from hf_triforce.integration import recording_attention
from hf_triforce.kernels.attention import QueryRecorder
from hf_triforce.stats import TriForceStats

from .conftest import make_model, random_prompt
from .families import make_family
from .test_exact_enumeration import CONFIG, VOCAB, decoded_law, distance, exercised, target_law
from .test_greedy_identity import assert_identical

COUNTS = ("detail.force1_proposed", "force2_accepted", "force3_accepted", "force3_steps")


def _config(**kw):
    base = dict(draft="self", policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24,
                gamma1=2, gamma2=4)
    return TriForceConfig(**{**base, **kw})


def _verify_beside_eager(model, mode: str):
    """The same 5 rows after the same 50 cached entries, by transformers' forward (queries recorded) and by the
    verifying view: ``(eager logits, recorded queries, eager cache, verify logits, stacked queries, its cache)``."""
    prompt = random_prompt(60, period=13)
    layers = model.config.num_hidden_layers
    eager_cache, fixed_cache = BufferCache(layers, 80), BufferCache(layers, 80)
    for cache in (eager_cache, fixed_cache):
        forward_logits(model, prompt[:, :50], cache, 0, 1)
    recorder = QueryRecorder()
    with recording_attention(model):
        eager = forward_logits(model, prompt[:, 50:55], eager_cache, 50, 5, recorder)
    logits, queries = lean_model(model, "native").verifying(mode).verify(prompt[:, 50:55],
                                                                          torch.arange(50, 55)[None], fixed_cache)
    return eager, recorder.queries, eager_cache, logits, queries, fixed_cache


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
def test_verify_computes_the_target_s_logits_and_queries(family):
    model = make_model(family, logit_scale=3.0)
    eager, recorded, eager_cache, logits, queries, cache = _verify_beside_eager(model, "fixed")
    assert logits.shape == (5, model.config.vocab_size) and cache.length == 55
    heads = model.config.num_attention_heads
    assert queries.shape == (2, 1, heads, 5, model.config.hidden_size // heads)
    torch.testing.assert_close(logits, eager.float(), rtol=0, atol=1e-5)  # fp32: summation order only
    for layer in range(2):
        torch.testing.assert_close(queries[layer], recorded[layer], rtol=0, atol=1e-6)
        torch.testing.assert_close(cache.layers[layer].keys[:, :, :55], eager_cache.layers[layer].keys[:, :, :55],
                                   rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
def test_verify_rounds_as_the_model_s_forward_in_bf16(family):
    """In bf16, layer 0's queries and entries (embedding, norm, projections, rotary: no attention yet) are the model's
    bit for bit -- the drafting copies' fp32 activations would round otherwise -- and the logits agree to bf16's
    rounding of a different attention kernel."""
    model = make_model(family, logit_scale=3.0).to(torch.bfloat16)
    eager, recorded, eager_cache, logits, queries, cache = _verify_beside_eager(model, "fixed")
    assert queries.dtype == torch.bfloat16 and torch.equal(queries[0], recorded[0])
    assert torch.equal(cache.layers[0].keys[:, :, :55], eager_cache.layers[0].keys[:, :, :55])
    assert torch.equal(cache.layers[0].values[:, :, :55], eager_cache.layers[0].values[:, :, :55])
    torch.testing.assert_close(logits, eager.float(), rtol=0, atol=2e-2)


def test_force2_gets_the_queries_of_the_rows_force3_verified():
    """`Force3.queries(b, row)` (Force 2's selection input after a verification) names the same rows whichever forward
    verified: the committed sequence's last token (row 0) and each candidate after it."""
    model = make_model("llama-gqa", logit_scale=3.0)
    prompt = random_prompt(60, period=13)
    rows = {}
    for mode in ("off", "fixed"):
        verifier = force3.Force3(model, resolve(_config(force3_compile=mode), model), 60, HostClock())
        with recording_attention(model):
            verifier.prefill([prompt[:, :50]], None, [TriForceStats()], lambda b, logits, queries: None)
            verifier.score({0: prompt[:, :51]}, {0: Candidates(prompt[0, 51:55].tolist(), None)},
                           [LogitsProcessorList()])
        assert (verifier.stacked is None) == (mode == "off")
        rows[mode] = [verifier.queries(0, row) for row in range(5)]
    for eager, fixed in zip(rows["off"], rows["fixed"]):
        for layer in range(2):
            torch.testing.assert_close(fixed[layer], eager[layer], rtol=0, atol=1e-6)


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
@pytest.mark.parametrize("plan", [dict(levels=2), dict(levels=3), dict(policy="auto", levels=3)],
                         ids=["two levels", "three levels", "adaptive"])
def test_greedy_identity_and_the_same_drafts(family, plan):
    model = make_model(family, logit_scale=3.0)
    prompt = random_prompt(150, period=37)
    fixed = assert_identical(model, prompt, _config(force3_compile="fixed", **plan))
    assert fixed.detail.tier_forwards["force3"] == "fixed (native)"
    assert fixed.detail.tier_compile["force3"]["forwards"] == fixed.force3_steps > 5
    if plan.get("policy") != "auto":  # the adaptive policy's plans follow timings: its drafts are not comparable
        eager = assert_identical(model, prompt, _config(**plan))
        assert eager.detail.tier_forwards["force3"] == "eager"
        assert {c: attrgetter(c)(fixed) for c in COUNTS} == {c: attrgetter(c)(eager) for c in COUNTS}


def test_compiled_once_across_prompt_lengths_and_steps():
    """fullgraph=True (no graph break, no host read, no data-dependent shape: what a CUDA graph capture needs too):
    one graph for one-row verifications and one for every larger row count and cache capacity, each compiled on its
    first use; later calls -- other prompt lengths (other cache capacities), other row counts, sampled -- compile
    nothing."""
    model = make_model("llama-gqa", logit_scale=3.0, num_hidden_layers=1, seed=7)
    config = _config(levels=2, force3_compile="compile")
    first = assert_identical(model, random_prompt(150, period=37), config)
    assert first.detail.tier_forwards["force3"] == "compile (native)"
    compiled = first.detail.tier_compile["force3"]
    assert compiled["compiles"] >= 1 and compiled["compile_seconds"] > 0
    one_row = assert_identical(model, random_prompt(60, period=37), config, max_new_tokens=2)  # no room: 1 row
    assert one_row.force3_steps == one_row.detail.tier_compile["force3"]["forwards"] == 1
    assert first.detail.tier_compile["force3"]["compiles"] + one_row.detail.tier_compile["force3"]["compiles"] == 2
    for length, new in ((97, 25), (203, 41)):
        later = assert_identical(model, random_prompt(length, period=29, seed=length), config, max_new_tokens=new)
        compiled = later.detail.tier_compile["force3"]
        assert compiled["compiles"] == 0 and compiled["forwards"] > 5
    sampled = model.generate(random_prompt(120, period=31), max_new_tokens=20, do_sample=True, top_k=20,
                             triforce_config=config, return_dict_in_generate=True).triforce_stats
    assert sampled.detail.tier_compile["force3"]["compiles"] == 0
    assert sampled.force3_steps == sampled.detail.tier_compile["force3"]["forwards"] > 3


# the default drafting tiers (lean-int4 here: drafts rejected often, so paths end early and the enumeration is short)
ENUMERATED = dict(CONFIG, draft_precision="auto", force3_compile="fixed")
PROCESSORS = LogitsProcessorList([TopKLogitsWarper(2)])


@pytest.fixture(scope="module")
def small():
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=3, initializer_range=0.3, num_hidden_layers=1)
    return model, random_prompt(40, vocab_size=VOCAB, seed=4, period=13)


def test_enumerated_law_equals_the_target_law(small):
    """Three levels: Force 3 verifies Force 2's chains (what two levels verify too, Force 1's)."""
    model, prompt = small
    config = TriForceConfig(draft="self", **ENUMERATED)
    law, paths, stats = decoded_law(model, prompt, config, PROCESSORS, 4)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and paths > 10
    assert distance(law, target_law(model, prompt, PROCESSORS, 4)) < 1e-5
    exercised(stats, 3)
    assert all(s.detail.tier_forwards["force3"] == "fixed (native)" and s.detail.tier_compile["force3"]["forwards"]
               for s in stats)


def test_the_enumeration_catches_logits_one_row_off(small, monkeypatch):
    """A verifier scoring each candidate with the row before its own (an off-by-one in the rows kept)."""
    model, prompt = small
    right = force3.score_fixed_shape

    def one_row_off(verifier, cache, extended, prefix, processors):
        logits, _, queries = right(verifier, cache, extended, prefix, processors)
        shifted = torch.cat((logits[:1], logits[:-1]))
        return shifted, force3.process_positions(processors, extended, shifted, prefix), queries

    monkeypatch.setattr(force3, "score_fixed_shape", one_row_off)
    config = TriForceConfig(draft="self", **{**ENUMERATED, "levels": 2})
    law, _, _ = decoded_law(model, prompt, config, PROCESSORS, 4)
    assert distance(law, target_law(model, prompt, PROCESSORS, 4)) > 1e-3


# -- the decision --------------------------------------------------------------------------------------------------

def test_auto_is_transformers_forward_on_the_cpu():
    """On the CPU the eager verification takes the split-KV route over long caches: "auto" keeps it, whatever the
    tiers run."""
    model = make_model("llama-gqa", logit_scale=3.0)
    stats = model.generate(random_prompt(100, period=37), max_new_tokens=8, return_dict_in_generate=True,
                           triforce_config=_config(draft="ngram", levels=2, policy="auto")).triforce_stats
    assert stats.detail.tier_forwards["force3"] == "eager" and "force3" not in stats.detail.tier_compile
    for tier_compile in ("fixed", "compile"):
        assert force3_forward(model, TriForceConfig(tier_compile=tier_compile)) == (None, "eager")


def test_auto_follows_the_graphed_tiers_on_cuda(monkeypatch):
    """Where the tiers run as CUDA graphs (or compiled) on a CUDA device, Force 3 does too, unless the call is one it
    cannot serve: then transformers' forward, and the description says why."""
    model = make_model("llama-gqa", logit_scale=3.0)
    monkeypatch.setattr(tiers, "on_cuda", lambda model: True)
    resolved, _ = resolve_draft_precision(TriForceConfig(), model)
    assert (resolved.draft_precision, resolved.tier_compile) == ("native", "graph")
    view, forward = force3_forward(model, resolved)
    assert forward == "graph (native)" and view.fixed_shape.mode == "graph" and view.activation_dtype == torch.float32
    assert force3_forward(model, TriForceConfig(tier_compile="compile"))[1] == "compile (native)"
    assert force3_forward(model, TriForceConfig(tier_compile="off")) == (None, "eager")
    assert force3_forward(model, TriForceConfig(force3_compile="off", tier_compile="graph")) == (None, "eager")
    offloaded = force3_forward(model, TriForceConfig(tier_compile="graph", full_cache_device="cpu"))
    assert offloaded[0] is None and offloaded[1].startswith("eager (full_cache_device='cpu'")
    batch = force3_forward(model, TriForceConfig(tier_compile="graph"), batch=2)
    assert batch[0] is None and "batch of 2" in batch[1]
    trees = force3_forward(model, TriForceConfig(tier_compile="graph", tree_nodes=4))[1]
    assert trees == "graph (native); candidate trees: eager (a tree's own mask)"
    gemma = force3_forward(make_family("gemma2"), TriForceConfig(tier_compile="graph"))
    assert gemma[0] is None and gemma[1].startswith("eager (Gemma2ForCausalLM is not one of")


def test_requests_it_cannot_serve_are_refused():
    with pytest.raises(ValueError, match="force3_compile must be one of"):
        TriForceConfig(force3_compile="cuda")
    with pytest.raises(ValueError, match="loop='assisted', force3_compile='fixed'"):
        TriForceConfig(loop="assisted", force3_compile="fixed")
    model = make_model("llama-gqa", logit_scale=3.0)
    prompt = random_prompt(60, period=13)
    refusals = {
        "graph": ("'graph' captures CUDA graphs and this model is on cpu", model, {}),
        "fixed": ("full_cache_device='cpu' streams the full cache", model, dict(full_cache_device="cpu")),
        "compile": ("Gemma2ForCausalLM is not one of", make_family("gemma2"), dict(draft_precision="model")),
    }
    for mode, (why, target, extra) in refusals.items():
        with pytest.raises(ValueError, match=f"force3_compile='{mode}' runs Force 3 .* {why}"):
            target.generate(prompt, max_new_tokens=4, triforce_config=_config(force3_compile=mode, **extra))
    batch = torch.cat((prompt, prompt))
    with pytest.raises(ValueError, match="a batch of 2 verifies under per-row masks"):
        model.generate(batch, max_new_tokens=4, triforce_config=_config(force3_compile="fixed"))


def test_trees_stay_on_transformers_forward():
    """A candidate tree's Force-3 forward carries the tree's mask: it runs eagerly, chains at fixed shapes."""
    model = make_model("llama-gqa", logit_scale=3.0)
    config = _config(draft="ngram", levels=2, tree_nodes=4, tree_branch=2, force3_compile="fixed")
    stats = assert_identical(model, random_prompt(150, period=37), config, max_new_tokens=24)
    assert stats.detail.tier_forwards["force3"] == "fixed (native); candidate trees: eager (a tree's own mask)"
    assert stats.detail.tree_nodes > 0
