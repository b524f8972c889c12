"""Tier forwards at fixed shapes (`hf_triforce.kernels.fixed_shape`, ``TriForceConfig.tier_compile``).

* ``"fixed"`` (the lean forward on whole cache buffers) drafts what the lean forward drafts: the same counts in
  every tier (fp32), with the sink+window cache evicting and Force 2 on its retrieval cache;
* entries past a row's own (stale values in the buffer) contribute exactly nothing;
* ``"compile"``: greedy output token-identical, the sampled law exactly the target's (enumerated, Force 1
  drafting 2 tokens per round), and no recompilation after a model's first call (other prompt lengths, other
  numbers of new tokens, sampled and greedy);
* batches (their tier forwards carry a per-row mask) run the lean forward;
* bad settings get clear errors.
"""

from __future__ import annotations

from operator import attrgetter

import pytest
import torch
from transformers import LogitsProcessorList

from hf_triforce import TriForceConfig
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.decoding.tiers import lean_model
from hf_triforce.kernels.fixed_shape import FixedShapeForward

from .conftest import make_model, random_prompt
from .enumeration_util import FreeThenGreedy
from .families import make_family
from .test_exact_enumeration import decoded_law, distance, exercised, target_law
from .test_greedy_identity import assert_identical

COUNTS = ("detail.force1_proposed", "force2_accepted", "force3_accepted", "force3_steps")


def _config(**kw):
    base = dict(draft="self", policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24,
                gamma1=2, gamma2=4)
    return TriForceConfig(**{**base, **kw})


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
@pytest.mark.parametrize("levels", [2, 3])
def test_fixed_shapes_draft_what_the_lean_forward_drafts(family, levels):
    model = make_model(family, logit_scale=3.0)
    prompt = random_prompt(150, period=37)
    lean = assert_identical(model, prompt, _config(draft_precision="lean", levels=levels))
    fixed = assert_identical(model, prompt, _config(draft_precision="lean", levels=levels, tier_compile="fixed"))
    assert {c: attrgetter(c)(fixed) for c in COUNTS} == {c: attrgetter(c)(lean) for c in COUNTS}
    assert fixed.detail.tier_compile["mode"] == "fixed" and fixed.detail.tier_compile["forwards"] > 20
    assert fixed.detail.tier_compile["compiles"] == 0 and lean.detail.tier_compile == {}


def test_stale_entries_past_a_row_contribute_nothing():
    """The fixed-shape forward reads the whole buffer: entries past the cache's length (here: garbage) are
    masked exactly, so the logits equal those of the same cache with zeros there."""
    model = make_model("llama-gqa", logit_scale=3.0)
    lean = lean_model(model, "lean")
    fixed = lean.compiled("fixed")
    prompt = random_prompt(40, period=13)
    logits = []
    for fill in (0.0, 1e3):
        cache = BufferCache(model.config.num_hidden_layers, 64)
        lean(input_ids=prompt[:, :30], cache=cache, position_ids=torch.arange(30)[None])
        for layer in cache.layers:
            layer.keys[:, :, 30:].fill_(fill)
            layer.values[:, :, 30:].fill_(fill)
        assert FixedShapeForward.covers(cache)
        out = fixed(input_ids=prompt[:, 30:34], cache=cache, position_ids=torch.arange(30, 34)[None],
                    logits_to_keep=4).logits
        assert cache.length == 34
        logits.append(out)
    assert torch.equal(logits[0], logits[1])
    eager_cache = BufferCache(model.config.num_hidden_layers, 64)
    lean(input_ids=prompt[:, :30], cache=eager_cache, position_ids=torch.arange(30)[None])
    eager = lean(input_ids=prompt[:, 30:34], cache=eager_cache, position_ids=torch.arange(30, 34)[None],
                 logits_to_keep=4).logits
    torch.testing.assert_close(logits[0], eager, rtol=0, atol=1e-4)  # fp32: summation order only


@pytest.mark.parametrize("precision", ["lean-int4", "native"])
def test_compiled_tiers_keep_greedy_identity_and_never_recompile(precision):
    """One model's first call compiles its graphs (fullgraph=True: no graph break, no data-dependent shape, no host
    read -- what a CUDA graph capture needs too); later calls (other prompt lengths and new tokens, greedy and
    sampled) compile nothing. The native precision is the GPU path's (the model's own weights, in its dtype)."""
    model = make_model("llama-gqa", logit_scale=3.0, num_hidden_layers=2, seed=11)
    config = _config(draft_precision=precision, tier_compile="compile")
    first = assert_identical(model, random_prompt(150, period=37), config)
    assert first.detail.draft_precision == precision
    assert first.detail.tier_compile["compiles"] >= 1 and first.detail.tier_compile["compile_seconds"] > 0
    assert first.force2_accepted > 0 and first.detail.tier_compile["forwards"] > 20
    for length, new in ((97, 25), (203, 41)):
        later = assert_identical(model, random_prompt(length, period=29, seed=length), config, max_new_tokens=new)
        compiled = later.detail.tier_compile
        assert compiled["compiles"] == 0 and compiled["forwards"] > 10, compiled
    sampled = model.generate(random_prompt(120, period=31), max_new_tokens=20, do_sample=True, top_k=20,
                             triforce_config=config, return_dict_in_generate=True).triforce_stats
    assert sampled.detail.tier_compile["compiles"] == 0 and sampled.detail.tier_compile["forwards"] > 10


@pytest.mark.parametrize("tier_compile, levels", [("fixed", 2), ("fixed", 3), ("compile", 3)])
def test_batches_run_under_tier_compile(tier_compile, levels):
    """A batch's tier forwards carry its per-row mask: they run the lean forward (a fixed-shape forward covers batch
    1 only), greedy rows identical to plain batched generate; sampled copies of a prompt run too."""
    from .test_batch import PROMPTS, left_padded

    model = make_model("llama-gqa", logit_scale=3.0)
    ids, mask = left_padded(PROMPTS[:2])
    config = _config(draft_precision="lean-int4", levels=levels, tier_compile=tier_compile)
    gen = dict(attention_mask=mask, max_new_tokens=16, pad_token_id=0)
    out = model.generate(ids, do_sample=False, triforce_config=config, return_dict_in_generate=True, **gen)
    assert torch.equal(out.sequences, model.generate(ids, do_sample=False, **gen))
    stats = out.triforce_stats
    assert stats.force3_accepted > 0 and stats.detail.tier_compile["mode"] == tier_compile
    assert stats.detail.tier_compile["forwards"] == 0  # the stats say that no forward ran at fixed shapes
    sampled = model.generate(ids, do_sample=True, top_k=20, num_return_sequences=2, triforce_config=config, **gen)
    assert sampled.shape == (4, ids.shape[1] + 16)


VOCAB = 4
NEW = 5  # the first token, then a round of Force 1 drafting 2 tokens (gamma2 = 3 tokens handed up)
# top-k 2 on the first FREE new tokens (the first token and the round's two drafts), one token after: 72 paths per
# law instead of 828 with top-k 2 on all 5 (the extended tier runs those)
FREE = 3
FREE_POSITIONS = [pytest.param(FREE, id="top-k 2 on the first 3"),
                  pytest.param(NEW, marks=pytest.mark.extended, id="top-k 2 on every token")]
ENUMERATION = dict(policy="fixed", retrieval_budget=16, chunk_size=4, retrieval_recent=4, sink_tokens=2, window=8,
                   gamma1=2, gamma2=3)


@pytest.mark.parametrize("free", FREE_POSITIONS)
@pytest.mark.parametrize("tier_compile", ["fixed", "compile"])
def test_enumerated_law_equals_the_target_law(tier_compile, free):
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=3, initializer_range=0.3, num_hidden_layers=1)
    prompt = random_prompt(40, vocab_size=VOCAB, seed=4, period=13)
    processors = LogitsProcessorList([FreeThenGreedy(prompt.shape[1], free)])
    config = TriForceConfig(draft="self", draft_precision="lean-int4", tier_compile=tier_compile, **ENUMERATION)
    law, paths, stats = decoded_law(model, prompt, config, processors, NEW)
    exact = target_law(model, prompt, processors, NEW)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and paths > 10
    assert distance(law, exact) < 1e-5
    exercised(stats, 3)
    assert max(s.detail.force1_proposed / max(s.detail.force2_steps, 1) for s in stats) >= 2  # rounds of 2 drafts ran
    assert all(s.detail.tier_compile["forwards"] > 0 for s in stats)


def test_bad_settings_are_refused():
    with pytest.raises(ValueError, match="tier_compile must be one of"):
        TriForceConfig(draft_precision="lean", tier_compile="cuda")
    with pytest.raises(ValueError, match="set draft_precision to one of"):
        TriForceConfig(draft_precision="model", tier_compile="compile")
    gemma = make_family("gemma2")  # draft_precision="auto" runs its eager forward: nothing to compile
    with pytest.raises(ValueError, match="which tier_compile does not compile; use tier_compile='off'"):
        gemma.generate(random_prompt(20), max_new_tokens=4, triforce_config=TriForceConfig(tier_compile="compile"))


# -- the native lean forward: the model's own weights, the GPU path's tiers ----------------------------------------

def test_native_precision_reads_the_model_s_weights_in_place():
    """No copy: every projection multiplies by the module's own tensor (what lets the tiers run on a GPU in the
    model's dtype without a second set of weights)."""
    model = make_model("qwen2", logit_scale=3.0)
    native = lean_model(model, "native")
    owned = {p.data_ptr() for p in model.parameters()}
    read = {w.data_ptr() for layer in native.layers for proj in (layer.qkv, layer.o, layer.gate_up, layer.down)
            for w in proj.weights} | {w.data_ptr() for w in native.head.weights}
    assert read <= owned and native.nbytes() < sum(p.nbytes for p in model.parameters()) / 50


def test_native_tiers_compile_once_in_bf16():
    """The GPU path's dtype: the bf16 native tiers compile fullgraph once across prompt lengths (greedy identity is
    an fp32 claim: a bf16 verification of several rows rounds otherwise than one-row decoding)."""
    model = make_model("llama-gqa", logit_scale=3.0, num_hidden_layers=2, seed=5).to(torch.bfloat16)
    config = _config(draft_precision="native", tier_compile="compile")
    compiles = []
    for length, new in ((150, 30), (97, 25), (203, 41)):
        stats = model.generate(random_prompt(length, period=29, seed=length), max_new_tokens=new,
                               triforce_config=config, return_dict_in_generate=True).triforce_stats
        compiled = stats.detail.tier_compile
        assert stats.detail.draft_precision == "native" and compiled["forwards"] > 10, compiled
        compiles.append(stats.detail.tier_compile["compiles"])
    assert compiles[0] >= 1 and compiles[1:] == [0, 0], compiles


def test_native_fixed_shapes_draft_what_the_native_forward_drafts():
    model = make_model("llama-gqa", logit_scale=3.0)
    prompt = random_prompt(150, period=37)
    native = assert_identical(model, prompt, _config(draft_precision="native"))
    fixed = assert_identical(model, prompt, _config(draft_precision="native", tier_compile="fixed"))
    assert {c: attrgetter(c)(fixed) for c in COUNTS} == {c: attrgetter(c)(native) for c in COUNTS}
    assert native.detail.tier_forwards == {"force1 self": "lean", "force2": "lean", "force3": "eager"}
    assert native.detail.tier_compile == {}


def test_graph_mode_and_auto_on_the_cpu():
    """tier_compile='graph' captures CUDA graphs: on the CPU a clear error; the default ('auto') resolves to 'off'
    on the CPU (lean-int4 there) and would be 'graph' for the native forward on a CUDA device."""
    model = make_model("llama-gqa", logit_scale=3.0)
    with pytest.raises(ValueError, match="tier_compile='graph' captures CUDA graphs"):  # before the prefill
        model.generate(random_prompt(150, period=37), max_new_tokens=8,
                       triforce_config=_config(draft_precision="native", tier_compile="graph"))
    stats = model.generate(random_prompt(150, period=37), max_new_tokens=8, return_dict_in_generate=True,
                           triforce_config=_config()).triforce_stats
    assert stats.detail.draft_precision == "lean-int4" and stats.detail.tier_compile == {}
