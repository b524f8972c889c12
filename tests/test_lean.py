"""The lean drafting forward (`hf_triforce.kernels.lean`, ``draft_precision="lean"``, ``"lean-int8"``, ``"lean-int4"``).

* fp32 lean computes the eager model: the same drafts and acceptances in every tier and cache (sink+window with
  evictions, retrieval, trees, a batch's shared caches);
* the quantized lean tiers keep greedy output token-identical to plain ``generate`` (families, two and three
  levels, a draft model, a batch of 2, trees) and the sampled law exactly the target's (enumerated through the
  library's own loop, Force 1 drafting 2 tokens per round); a lean forward whose rows depend on each other is
  caught there;
* a row's logits are bit-identical whatever the later rows' and the other batch rows' values;
* copies are cached per model, quantized as documented, and bad inputs get clear errors.
"""

from __future__ import annotations

from operator import attrgetter

import pytest
import torch
from transformers import LogitsProcessorList, TopKLogitsWarper

from hf_triforce import TriForceConfig
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.caches.ragged import RaggedBufferCache
from hf_triforce.decoding import tiers
from hf_triforce.decoding.tiers import forget_lean_copy, lean_copy_bytes, lean_model
from hf_triforce.forwards.forward import ragged_forward
from hf_triforce.kernels import lean
from hf_triforce.kernels.lean import INT4_MM, LEAN_PRECISIONS, LeanModel, Projection
from hf_triforce_bench.restricted_vocabulary import OUTSIDE_LOGIT, restricted

from .conftest import make_model, random_prompt
from .enumeration_util import FreeThenGreedy
from .families import make_family
from .test_batch import PROMPTS, left_padded
from .test_exact_enumeration import decoded_law, distance, exercised, target_law
from .test_fixed_shape import ENUMERATION, FREE_POSITIONS, NEW, VOCAB
from .test_greedy_identity import assert_identical


def dequantized(projection: Projection) -> torch.Tensor:
    """The fp32 weight ``projection`` multiplies by."""
    if projection.precision == "model":
        return torch.cat(projection.weights).float()
    if projection.precision == "fp32":
        return projection.weight
    if projection.precision == "int8":
        return projection.weight.float() * projection.scales.float()[:, None]
    eye = torch.eye(projection.in_features, dtype=torch.bfloat16)
    columns = INT4_MM(eye, projection.weight, projection.group_size, projection.scales_zeros)
    return columns.float().T.contiguous()


LEAN_FAMILIES = ["llama-gqa", "qwen2", "mistral"]  # Llama (GQA), Qwen2 (QKV biases), Mistral (MQA, no window)
QUANTIZED = ["lean-int8", "lean-int4"]


def _config(draft="self", **kw):
    """The eager forward ("model") unless ``draft_precision`` says otherwise."""
    base = dict(draft=draft, draft_precision="model", policy="fixed", retrieval_budget=64, chunk_size=8,
                sink_tokens=4, window=24, gamma1=2, gamma2=4)
    return TriForceConfig(**{**base, **kw})


@pytest.fixture
def lean_calls(monkeypatch):
    """Counts the lean forwards run (so that a test knows the lean tiers, not the eager ones, drafted)."""
    calls = []
    real = LeanModel.__call__
    monkeypatch.setattr(LeanModel, "__call__",
                        lambda self, *a, **k: calls.append(self.precision) or real(self, *a, **k))
    return calls


@pytest.mark.parametrize("family", LEAN_FAMILIES)
def test_fp32_lean_drafts_what_the_eager_forward_drafts(family, lean_calls):
    """Same model, same drafts: every count of every tier equal, chains and trees (a tree's mask), with the
    sink+window cache evicting (window 24, 40 new tokens) and Force 2 on its retrieval cache."""
    model = make_model(family, logit_scale=3.0)
    prompt = random_prompt(150, period=37)
    counts = ("detail.force1_proposed", "force2_accepted", "force3_accepted", "force3_steps", "detail.tree_nodes",
              "detail.tree_side_accepts")
    for extra in ({}, dict(tree_nodes=6, tree_branch=3, gamma1=3), dict(levels=2)):
        eager = assert_identical(model, prompt, _config(**extra))
        fast = assert_identical(model, prompt, _config(draft_precision="lean", **extra))
        tiers = ["force1 self"] + ["force2"] * (extra.get("levels", 3) == 3)
        assert fast.detail.tier_forwards == {**dict.fromkeys(tiers, "lean"), "force3": "eager"}
        assert eager.detail.tier_forwards == {**dict.fromkeys(tiers, "eager"), "force3": "eager"}
        assert {c: attrgetter(c)(fast) for c in counts} == {c: attrgetter(c)(eager) for c in counts}, extra
    assert "lean" in lean_calls


def test_fp32_lean_batch_drafts_what_the_eager_forward_drafts(lean_calls):
    """A batch's rows draft together on shared caches (`Lockstep`, per-row masks): the same counts per row."""
    model = make_model("llama-gqa", logit_scale=3.0)
    ids, mask = left_padded(PROMPTS[:2])
    gen = dict(max_new_tokens=30, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    eager = model.generate(ids, attention_mask=mask, triforce_config=_config(), **gen)
    fast = model.generate(ids, attention_mask=mask, triforce_config=_config(draft_precision="lean"), **gen)
    assert torch.equal(fast.sequences, eager.sequences)
    assert fast.triforce_stats.detail.lockstep_forwards > 0
    for a, b in zip(fast.triforce_row_stats, eager.triforce_row_stats):
        assert (a.detail.force1_proposed, a.force2_accepted, a.force3_accepted) == \
               (b.detail.force1_proposed, b.force2_accepted, b.force3_accepted)
    assert "lean" in lean_calls


@pytest.mark.parametrize("family", LEAN_FAMILIES)
@pytest.mark.parametrize("precision", QUANTIZED)
@pytest.mark.parametrize("draft,levels", [("self", 3), ("self", 2), ("model", 3)])
def test_greedy_identity_with_quantized_lean_tiers(family, precision, draft, levels, lean_calls):
    model = make_model(family, logit_scale=3.0)
    tiers = [f"force1 {draft}"] + ["force2"] * (levels == 3)
    if draft == "model":
        draft = make_model(family, num_hidden_layers=1, seed=5)
    stats = assert_identical(model, random_prompt(150, period=37), _config(draft, levels=levels,
                                                                            draft_precision=precision))
    assert stats.detail.tier_forwards == {**dict.fromkeys(tiers, "lean"), "force3": "eager"}
    assert stats.detail.draft_precision == precision
    assert stats.force3_steps > 0 and lean_calls == [precision] * len(lean_calls)
    assert len(lean_calls) > 10


@pytest.mark.parametrize("precision", QUANTIZED)
def test_greedy_batch_of_two_with_lean_tiers(precision, lean_calls):
    model = make_model("llama-gqa", logit_scale=3.0)
    ids, mask = left_padded(PROMPTS[:2])
    out = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0,
                         triforce_config=_config(draft_precision=precision), return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS[:2]):
        alone = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out.sequences[row, ids.shape[1]:], alone), row
    assert out.triforce_stats.detail.lockstep_forwards > 0 and lean_calls


@pytest.mark.parametrize("precision", QUANTIZED)
@pytest.mark.parametrize("levels", [2, 3])
def test_greedy_trees_with_lean_tiers(precision, levels, lean_calls):
    model = make_model("qwen2", logit_scale=3.0)
    config = _config(draft_precision=precision, levels=levels, tree_nodes=8, tree_branch=3, gamma1=3,
                     **(dict(force2_tree_nodes=9) if levels == 3 else {}))
    stats = assert_identical(model, random_prompt(150, period=37), config)
    assert stats.detail.tree_nodes > stats.detail.force1_proposed and lean_calls


def test_other_families_draft_with_their_eager_forward_and_say_so(lean_calls):
    model = make_model("gemma")
    stats = assert_identical(model, random_prompt(120, period=37), _config(draft_precision="lean-int4"))
    assert set(stats.detail.tier_forwards) == {"force1 self", "force2", "force3"} and not lean_calls
    drafting = [stats.detail.tier_forwards[tier] for tier in ("force1 self", "force2")]
    assert all(forward.startswith("eager (GemmaForCausalLM is not one of") for forward in drafting)


def test_a_draft_model_the_lean_forward_does_not_cover_drafts_eager_beside_a_lean_force2(lean_calls):
    """Per tier, the forward that ran: the Gemma draft's eager forward in Force 1, the Llama target's lean copy in
    Force 2."""
    target, draft = make_model("llama-gqa", logit_scale=3.0), make_model("gemma", seed=4, num_hidden_layers=1)
    stats = assert_identical(target, random_prompt(120, period=37), _config(draft, draft_precision="lean-int4"))
    detail = stats.detail
    assert detail.draft_precision == "lean-int4" and set(detail.tier_forwards) == {"force1 model", "force2", "force3"}
    assert detail.tier_forwards["force1 model"].startswith("eager (GemmaForCausalLM is not one of")
    assert detail.tier_forwards["force2"] == "lean" and lean_calls == ["lean-int4"] * len(lean_calls) and lean_calls


@pytest.mark.parametrize("policy", ["fixed", "auto"])
@pytest.mark.parametrize("precision", ["auto", "lean-int4"])
def test_lookup_drafts_verified_by_force3_alone_run_no_drafting_forward_and_copy_nothing(policy, precision):
    """``draft="ngram", levels=2``: no tier runs a drafting forward, so no copy of the target is made and the stats
    name none."""
    model = make_model("llama-gqa", logit_scale=3.0, seed=8)  # fresh: no copy made by an earlier call
    config = _config("ngram", levels=2, policy=policy, draft_precision=precision)
    stats = assert_identical(model, random_prompt(150, period=37), config)
    assert stats.detail.force1_proposed > 0 and stats.plan_steps.get(2, 0) > 0
    assert (stats.detail.draft_precision, stats.detail.tier_forwards) == ("none", {"force3": "eager"})
    assert tiers.lean_copy_bytes(model) == 0 and stats.detail.draft_copy_seconds < 0.01


# --- exactness of the sampled law -----------------------------------------------------------------------------



@pytest.fixture(scope="module")
def tiny():
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=3, initializer_range=0.3, num_hidden_layers=1)
    return model, random_prompt(40, vocab_size=VOCAB, seed=4, period=13)


@pytest.mark.parametrize("free", FREE_POSITIONS)
@pytest.mark.parametrize("precision", ["lean-int4"])
def test_enumerated_law_equals_the_target_law(tiny, precision, free, lean_calls):
    """Force 1 drafts 2 tokens per round on the lean copy, Force 2 verifies them on it in one 3-row forward."""
    model, prompt = tiny
    processors = LogitsProcessorList([FreeThenGreedy(prompt.shape[1], free)])
    config = TriForceConfig(draft="self", draft_precision=precision, **ENUMERATION)
    law, paths, stats = decoded_law(model, prompt, config, processors, NEW)
    exact = target_law(model, prompt, processors, NEW)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and paths > 10
    assert set(law) <= {k for k, p in exact.items() if p > 0}
    assert distance(law, exact) < 1e-5
    exercised(stats, 3)
    assert max(s.detail.force1_proposed / max(s.detail.force2_steps, 1) for s in stats) >= 2  # rounds of 2 drafts ran
    assert lean_calls


def test_rows_that_depend_on_each_other_are_caught(tiny, monkeypatch):
    """A lean forward quantizing a call's activations with one scale (rows mixed, as dynamic int8 did) is off
    the target law: the enumeration sees the lean tiers."""
    real = Projection.__call__

    def mixed(self, x):
        scale = x.abs().amax() / 7  # one scale for every row of the call
        return real(self, torch.round(x / scale) * scale)

    monkeypatch.setattr(Projection, "__call__", mixed)
    model, prompt = tiny
    processors = LogitsProcessorList([TopKLogitsWarper(2)])
    config = TriForceConfig(draft="self", draft_precision="lean-int4", **ENUMERATION)
    law, _, _ = decoded_law(model, prompt, config, processors, 4)  # Force 2 verifies 2 rows: enough to mix them
    assert distance(law, target_law(model, prompt, processors, 4)) > 1e-4


def test_a_restricted_drafting_vocabulary_keeps_the_law_exact(tiny, monkeypatch, lean_calls):
    """Force 1 scoring tokens 0-2 only (q is 0 for token 3, in 86% of the target's continuations): the residual
    covers it."""
    from hf_triforce.decoding import hierarchy

    real = hierarchy.tier_model  # what the hierarchy hands the drafters as Force 1's model (tier 1)
    monkeypatch.setattr(hierarchy, "tier_model", lambda m, p, tier, *mode: restricted(
        real(m, p, tier, *mode), torch.tensor([0, 1, 2])) if tier == 1 else real(m, p, tier, *mode))
    model, prompt = tiny
    processors = LogitsProcessorList([TopKLogitsWarper(2)])
    config = TriForceConfig(draft="self", draft_precision="lean-int4", **ENUMERATION)
    law, paths, stats = decoded_law(model, prompt, config, processors, 4)
    exact = target_law(model, prompt, processors, 4)
    assert distance(law, exact) < 1e-5 and paths > 10
    assert sum(p for key, p in law.items() if 3 in key) > 0.5
    exercised(stats, 3)


def test_a_restricted_output_layer_scores_its_subset_only():
    model = make_model("llama-gqa")
    full = LeanModel(model, "lean-int8")
    subset = torch.tensor([40, 0, 5, 7, 5])
    view = restricted(full, subset)
    prompt = random_prompt(20)

    def logits(copy):
        return copy(prompt, BufferCache(2, 32), torch.arange(20)[None], logits_to_keep=3).logits[0]

    a, b = logits(full), logits(view)
    inside = torch.tensor([0, 5, 7, 40])
    outside = torch.ones(96, dtype=torch.bool)
    outside[inside] = False
    assert torch.allclose(a[:, inside], b[:, inside], atol=1e-2) and (b[:, outside] == OUTSIDE_LOGIT).all()
    assert (torch.softmax(b / 0.6, -1)[:, outside] == 0).all()
    assert view.layers is full.layers and type(full) is LeanModel and "vocabulary" not in vars(full)


# --- row independence -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("precision", list(LEAN_PRECISIONS))
def test_a_rows_logits_do_not_depend_on_later_rows(precision):
    model = make_model("qwen2")
    copy = LeanModel(model, precision)
    prompt = random_prompt(30)

    def last_rows(tokens):
        cache = BufferCache(2, 64)
        copy(prompt[:, :20], cache, torch.arange(20)[None])
        return copy(tokens, cache, torch.arange(20, 25)[None], logits_to_keep=5).logits[0]

    tokens = prompt[:, 20:25]
    changed = tokens.clone()
    changed[0, 2:] = (changed[0, 2:] + 1 + torch.arange(3)) % 96
    a, b = last_rows(tokens), last_rows(changed)
    assert torch.equal(a[:2], b[:2]) and not torch.equal(a[2:], b[2:])


@pytest.mark.parametrize("precision", list(LEAN_PRECISIONS))
def test_a_batch_rows_logits_do_not_depend_on_the_other_rows(precision):
    """Two rows on a shared ragged cache (a batch drafting in lockstep): row 0's logits bit-identical whatever
    row 1 holds and feeds (same row count)."""
    model = make_model("llama-gqa")
    copy = LeanModel(model, precision)

    def row0(other_seed):
        rows = {0: random_prompt(17, seed=1), 1: random_prompt(23, seed=other_seed)}
        cache = RaggedBufferCache(2, 2, 64)
        for b, ids in rows.items():
            copy(ids[:, :-3], cache.row(b), torch.arange(ids.shape[1] - 3)[None])
        logits = ragged_forward(copy, cache, {b: ids[:, -3:] for b, ids in rows.items()},
                                {b: ids.shape[1] - 3 for b, ids in rows.items()})
        return logits[0], logits[1]

    (a0, a1), (b0, b1) = row0(2), row0(9)
    assert torch.equal(a0, b0) and not torch.equal(a1, b1)


# --- copies, quantization, errors -----------------------------------------------------------------------------


def test_copies_are_cached_per_model_and_precision():
    model = make_model("llama-gqa")
    first = lean_model(model, "lean-int4")
    assert lean_model(model, "lean-int4") is first and lean_model(model, "lean-int8") is not first
    int4_bytes = lean_copy_bytes(model)
    fp32 = sum(p.nbytes for name, p in model.named_parameters() if "proj" in name or "lm_head" in name)
    assert 0 < int4_bytes < fp32 / 2  # int4 layers and an int8 output layer
    forget_lean_copy(model)
    assert lean_copy_bytes(model) == 0 and lean_model(model, "lean-int4") is not first
    assert lean_model(make_model("gemma"), "lean-int4").__class__.__name__ == "GemmaForCausalLM"


def test_quantized_projections_multiply_by_their_documented_weights():
    torch.manual_seed(0)
    weight, x = torch.randn(96, 128) * 0.1, torch.randn(3, 128)
    for kind in ("int8", "int4"):
        projection = Projection(weight, None, kind, group_size=32)
        values = dequantized(projection)
        if kind == "int8":
            step = projection.scales.float()[:, None].expand_as(weight)
        else:  # per group of 32 inputs
            step = projection.scales_zeros[..., 0].float().T.repeat_interleave(32, dim=1)
        assert ((values - weight).abs() <= 0.5 * step + weight.abs().amax() * 2 ** -8).all()
        expected = x.bfloat16().float() @ values.T
        assert torch.allclose(projection(x).float(), expected, rtol=1e-2, atol=1e-2)


def test_errors_name_the_setting():
    with pytest.raises(ValueError, match=r"draft_precision='lean-int4' copies a float32 or bfloat16 model"):
        make_model("llama-gqa").to(torch.float16).generate(
            random_prompt(60), max_new_tokens=4, triforce_config=_config(draft_precision="lean-int4"))
    narrow = make_model("llama-gqa", hidden_size=80)  # 80 inputs: not a multiple of the int4 group of 32
    with pytest.raises(ValueError, match="not multiples of the int4 group size"):
        narrow.generate(random_prompt(60), max_new_tokens=4, triforce_config=_config(draft_precision="lean-int4"))
    assert_identical(narrow, random_prompt(100), _config(draft_precision="lean-int8"))
    with pytest.raises(ValueError, match="draft_precision must be one of"):
        TriForceConfig(draft_precision="int4")
    assert lean.INT4_GROUP_SIZE == 32


def test_a_dispatched_model_is_refused_by_name(tmp_path_factory):
    """Weights under accelerate hooks (``device_map=``, here some offloaded to disk) are not copied: a clear error."""
    from .test_device_map import DEVICE_MAP, _load

    model = _load(tmp_path_factory, 4, DEVICE_MAP)
    with pytest.raises(ValueError, match=r"draft_precision='lean-int4' copies the weights of a model loaded in one "
                                         r"piece on the CPU; module .* runs under an accelerate hook"):
        model.generate(random_prompt(60), max_new_tokens=4, triforce_config=_config(draft_precision="lean-int4"))


def test_scales_round_up_to_bf16():
    x = torch.tensor([1.0, 1.001, 0.3, 3.14159, 1e-6, 250.7])
    rounded = lean._bf16_at_least(x)
    assert rounded.dtype == torch.bfloat16 and (rounded.float() >= x).all()
    assert (rounded.float() <= x * (1 + 2 ** -7)).all()  # the nearest bf16 at or above: within one bf16 step


def test_the_default_precision_runs_lean_int4_where_the_lean_forward_covers_the_model():
    """``draft_precision="auto"`` (the default): lean-int4 tiers for an fp32 Llama on the CPU, its copy made on the
    model's first call only; the eager forward elsewhere, with the reason in the stats; greedy identical either way."""
    model = make_model("llama-gqa", logit_scale=3.0, seed=5)
    config = TriForceConfig(draft="self", policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4,
                            window=24, gamma1=2, gamma2=4)
    assert config.draft_precision == "auto"
    first = assert_identical(model, random_prompt(120, period=37), config)
    lean_tiers = {"force1 self": "lean", "force2": "lean", "force3": "eager"}
    detail = first.detail
    assert (detail.draft_precision, detail.tier_forwards) == ("lean-int4", lean_tiers) and detail.draft_copy_seconds > 0
    assert first.force2_accepted > 0
    copy = tiers.tier_model(model, "lean-int4", 1)
    made = []
    with pytest.MonkeyPatch.context() as patch:  # the second call looks the copy up: no LeanModel is made
        real_init = LeanModel.__init__
        patch.setattr(LeanModel, "__init__", lambda self, *a, **k: made.append(a) or real_init(self, *a, **k))
        again = assert_identical(model, random_prompt(90, period=31, seed=2), config)
    assert again.detail.draft_precision == "lean-int4" and not made and tiers.tier_model(model, "lean-int4", 1) is copy
    half = make_model("llama-gqa", logit_scale=3.0, seed=5).to(torch.float16)
    out = half.generate(random_prompt(60), max_new_tokens=6, triforce_config=config, return_dict_in_generate=True)
    stats = out.triforce_stats
    assert stats.detail.draft_precision == "model" and set(stats.detail.tier_forwards) == set(lean_tiers)
    assert stats.detail.tier_forwards.pop("force3") == "eager"
    assert all(forward.startswith("eager (draft_precision='auto': ") and "copies a float32 or bfloat16 model" in
               forward for forward in stats.detail.tier_forwards.values())
    gemma = make_family("gemma2")
    stats = gemma.generate(random_prompt(60), max_new_tokens=6, triforce_config=config,
                           return_dict_in_generate=True).triforce_stats
    detail = stats.detail
    assert detail.draft_precision == "model" and "Gemma2ForCausalLM is not one of" in detail.tier_forwards["force2"]


def test_a_bf16_model_drafts_on_a_quantized_lean_copy():
    """A bf16 model's int4 copy quantizes its weights as an fp32 model's with the same values would (the same
    products), keeps bf16 caches, and decodes greedy-identically to plain ``generate`` (sharp laws: no bf16 ties);
    ``"lean"`` (fp32 weights) is refused by name for it."""
    fp32 = make_model("llama-gqa", logit_scale=3.0, seed=5)
    fp32.load_state_dict({k: v.bfloat16().float() for k, v in fp32.state_dict().items()})
    bf16 = make_model("llama-gqa", logit_scale=3.0, seed=5).to(torch.bfloat16)
    wide, narrow = lean.LeanModel(fp32, "lean-int4"), lean.LeanModel(bf16, "lean-int4")
    for a, b in zip(wide.layers, narrow.layers):
        torch.testing.assert_close(dequantized(a.qkv), dequantized(b.qkv), rtol=0, atol=0)
    config = TriForceConfig(draft="self", policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4,
                            window=24, gamma1=2, gamma2=4)
    stats = assert_identical(bf16, random_prompt(120, period=37), config)
    assert stats.detail.tier_forwards == {"force1 self": "lean", "force2": "lean", "force3": "eager"}
    assert stats.detail.draft_precision == "lean-int4"
    assert stats.force2_accepted > 0
    with pytest.raises(ValueError, match="'lean' copies a float32 model; parameter"):
        tiers.check_lean_eligible(bf16, "lean")
