"""Batches (`hf_triforce.decoding.loop`): each row of a left-padded batch is exactly what it would be alone.

Greedy: every row is token-identical to plain ``generate`` of that row alone, rows stopping at EOS at different
steps are padded like plain ``generate`` pads them. Sampled: the joint law of a batch's rows, enumerated
exactly with a `ReplaySampler` over every path of the batched decoder's random choices, is the product of
each row's target law; a wrong top-level rule is caught.
"""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from transformers import (
    DynamicCache,
    EpsilonLogitsWarper,
    EtaLogitsWarper,
    ExponentialDecayLengthPenalty,
    ForcedBOSTokenLogitsProcessor,
    ForcedEOSTokenLogitsProcessor,
    InfNanRemoveLogitsProcessor,
    LogitNormalization,
    LogitsProcessor,
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    NoBadWordsLogitsProcessor,
    NoRepeatNGramLogitsProcessor,
    SequenceBiasLogitsProcessor,
    StaticCache,
    SuppressTokensAtBeginLogitsProcessor,
    SuppressTokensLogitsProcessor,
    TemperatureLogitsWarper,
    TopHLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
    TypicalLogitsWarper,
    pipeline,
)

from hf_triforce import TriForceConfig
from hf_triforce.decoding.lockstep import Lockstep
from hf_triforce.decoding.loop import Decoder
from hf_triforce.decoding.policy import AdaptivePolicy, Plan
from hf_triforce.forwards import forward as forward_module
from hf_triforce.integration import recording_attention
from hf_triforce.verification.scoring import ROW_WISE

from .conftest import make_model, random_prompt
from .enumeration_util import enumerate_outcomes
from .test_exact_enumeration import target_law
from .tokenizer_util import text_of, word_tokenizer


def _config(draft="self", levels=3, **kw):
    base = dict(draft=draft, policy="fixed", levels=levels, retrieval_budget=64, chunk_size=8, sink_tokens=4,
                window=24, gamma1=2, gamma2=4)
    return TriForceConfig(**{**base, **kw})


def left_padded(prompts: list[torch.Tensor], pad: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(p.shape[-1] for p in prompts)
    ids = torch.full((len(prompts), width), pad, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - p.shape[-1]:] = p.reshape(-1)
        mask[row, width - p.shape[-1]:] = 1
    return ids, mask


PROMPTS = [random_prompt(150, period=37, seed=1), random_prompt(97, period=29, seed=2), random_prompt(120, seed=3)]


@pytest.mark.parametrize("family,draft,levels", [
    ("llama-gqa", "self", 3), ("llama-mha", "self", 3), ("qwen2", "self", 3), ("gemma", "self", 2),
    ("llama-gqa", "ngram", 2), ("llama-gqa", "self", 2),
])
def test_greedy_rows_equal_each_row_alone(family, draft, levels):
    model = make_model(family)
    ids, mask = left_padded(PROMPTS)
    gen = dict(max_new_tokens=40, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, triforce_config=_config(draft, levels), return_dict_in_generate=True,
                         **gen)
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out.sequences[row, ids.shape[1]:], alone), row
    assert torch.equal(out.sequences[:, : ids.shape[1]], ids)
    if draft == "self" or levels == 3:  # the rows' lower-tier forwards ran together (hf_triforce.decoding.lockstep)
        detail = out.triforce_stats.detail
        assert detail.lockstep_forwards > 0 and detail.lockstep_requests >= 1.5 * detail.lockstep_forwards
    rows = out.triforce_row_stats
    assert len(rows) == 3 and all(s.new_tokens == 40 and s.force3_steps > 0 for s in rows)
    assert out.triforce_stats.new_tokens == 120
    assert out.triforce_stats.force3_accepted == sum(s.force3_accepted for s in rows)
    assert out.triforce_stats.force3_steps == max(s.force3_steps for s in rows)
    # rows accept different numbers of tokens per step: the ragged case is exercised (the tiny random Gemma
    # repeats one token in every row, so each row accepts everything: identity there is the aligned case)
    assert family == "gemma" or len({(s.force3_steps, s.force3_accepted) for s in rows}) > 1


def test_rows_stopping_at_different_steps_are_padded_like_plain_generate(model):
    ids, mask = left_padded(PROMPTS)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    new = free[:, ids.shape[1]:]
    # an EOS that row 0 emits early and the other rows later or never
    eos = next(int(t) for t in new[0, 3:] if all(int(t) not in new[r, :8].tolist() for r in (1, 2)))
    gen = dict(max_new_tokens=30, do_sample=False, eos_token_id=eos, pad_token_id=5)
    expected = model.generate(ids, attention_mask=mask, **gen)
    out = model.generate(ids, attention_mask=mask, triforce_config=_config(), **gen)
    assert torch.equal(out, expected)
    assert (expected == 5).any() and expected.shape[1] > ids.shape[1] + 4


@pytest.mark.parametrize("new", [1, 2, 5])
def test_short_requests(model, new):
    ids, mask = left_padded([random_prompt(3, seed=7), random_prompt(60, period=11)])
    gen = dict(max_new_tokens=new, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, attention_mask=mask, triforce_config=_config("ngram"), **gen),
                       model.generate(ids, attention_mask=mask, **gen))


def test_num_return_sequences_prefills_each_prompt_once(model, monkeypatch):
    ids, mask = left_padded(PROMPTS[:2])
    calls = []
    real = forward_module.prefill_steps
    monkeypatch.setattr("hf_triforce.decoding.force3.prefill_steps", lambda *a, **k: calls.append(1) or real(*a, **k))
    gen = dict(max_new_tokens=20, do_sample=True, pad_token_id=0, num_return_sequences=3)  # sampling only
    torch.manual_seed(0)
    sampled = model.generate(ids, attention_mask=mask, triforce_config=_config(), **gen)
    assert sampled.shape[0] == 6 and len(calls) == 2  # each prompt prefilled once, its copies share the entries
    assert torch.equal(sampled[:, : ids.shape[1]], ids.repeat_interleave(3, dim=0))
    assert len({tuple(r.tolist()) for r in sampled}) == 6  # the copies draw independently


def test_pipeline_batch_size(model):
    tokenizer = word_tokenizer()
    tokenizer.padding_side = "left"
    texts = [text_of(p[0].tolist()) for p in PROMPTS]
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    plain = generator(texts, max_new_tokens=12, do_sample=False, batch_size=3)
    mine = generator(texts, max_new_tokens=12, do_sample=False, batch_size=3, triforce_config=_config())
    assert mine == plain


def test_batch_refusals_name_the_parameter(model):
    ids, mask = left_padded(PROMPTS[:2])
    with pytest.raises(ValueError, match="full_cache_device"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, triforce_config=_config(full_cache_device="cpu"))
    with pytest.raises(ValueError, match="output_scores"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, output_scores=True, return_dict_in_generate=True,
                       triforce_config=_config())
    with pytest.raises(ValueError, match="tree_nodes=0"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, triforce_config=_config(tree_nodes=8))
    with pytest.raises(ValueError, match="force2_tree_nodes=0"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, triforce_config=_config(force2_tree_nodes=8))
    sliding = make_model("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding-window"):
        sliding.generate(ids, attention_mask=mask, max_new_tokens=3, triforce_config=_config())
    mask[1] = 0
    with pytest.raises(ValueError, match="all padding"):
        model.generate(ids, attention_mask=mask, max_new_tokens=3, triforce_config=_config())


VOCAB, NEW = 4, 3
ENUM_CONFIG = dict(policy="fixed", retrieval_budget=16, chunk_size=4, retrieval_recent=4, sink_tokens=2, window=8,
                   gamma1=2, gamma2=2)


def joint_law(model, prompts, config, processors, mutate=None, new=NEW):
    """The exact joint law of the rows' continuations (``new`` tokens), over every path of the batched decoder's
    choices."""
    ids, mask = left_padded(prompts)
    pads = [ids.shape[1] - p.shape[1] for p in prompts]
    stats = []

    def run(sampler):
        decoder = Decoder(model, config, processors, None, [ids.shape[1] - pad + new for pad in pads], True,
                          [ids[r : r + 1, :pad] for r, pad in enumerate(pads)], sampler=sampler)
        if mutate is not None:
            mutate(decoder)
        with torch.no_grad(), recording_attention(model):
            result = decoder.run([p.reshape(1, -1) for p in prompts])
        stats.append(result.stats)
        return tuple(tuple(seq[0, p.shape[1]:].tolist()) for seq, p in zip(result.sequences, prompts))

    law, paths = enumerate_outcomes(run, max_paths=50000)
    return law, paths, stats


def product_law(model, prompts, processors):
    marginals = [target_law(model, p, processors, NEW) for p in prompts]
    return {keys: marginals[0][keys[0]] * marginals[1][keys[1]]
            for keys in itertools.product(*(sorted(m) for m in marginals))}


@pytest.fixture(scope="module")
def enum_setup():
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=3, initializer_range=0.3, num_hidden_layers=1)
    prompts = [random_prompt(40, vocab_size=VOCAB, seed=4, period=13), random_prompt(29, vocab_size=VOCAB, seed=6)]
    return model, prompts


@pytest.mark.parametrize("draft,levels", [("self", 3), ("ngram", 2)])
def test_enumerated_joint_law_is_the_product_of_row_target_laws(enum_setup, draft, levels):
    model, prompts = enum_setup
    processors = LogitsProcessorList([TopKLogitsWarper(2)])
    config = TriForceConfig(draft=draft, levels=levels, **ENUM_CONFIG)
    law, paths, stats = joint_law(model, prompts, config, processors)
    exact = product_law(model, prompts, processors)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and paths > 50
    assert any(0 < s.force3_accepted < s.force3_proposed for s in stats)
    assert max(abs(law.get(k, 0.0) - exact[k]) for k in exact) < 1e-5


def test_a_wrong_top_level_rule_is_caught(enum_setup):
    model, prompts = enum_setup
    processors = LogitsProcessorList([TopKLogitsWarper(2)])
    config = TriForceConfig(draft="self", levels=3, **ENUM_CONFIG)

    def top_resamples_from_p(decoder):
        decoder.force3_verifier.resample = lambda target, proposal: target

    law, _, _ = joint_law(model, prompts, config, processors, mutate=top_resamples_from_p)
    exact = product_law(model, prompts, processors)
    assert max(abs(law.get(k, 0.0) - exact[k]) for k in exact) > 1e-3


class RandomAfter(LogitsProcessor):
    """Top-k 2 for the token after ``prompt`` plus one token, the argmax everywhere else (and in rows of other
    prompts): one random token, the rest follows from it, so long chains enumerate in a few paths."""

    def __init__(self, prompt: torch.Tensor) -> None:
        self.prompt = prompt

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        length = self.prompt.shape[1]
        random = input_ids.shape[1] == length + 1 and torch.equal(input_ids[:1, :length], self.prompt)
        return TopKLogitsWarper(2 if random else 1)(input_ids, scores)


def small_support_law(model, prompt, processors, new: int) -> dict[tuple[int, ...], float]:
    """The processed target law of ``new`` tokens, by walking every continuation of positive probability."""
    law = {(): 1.0}
    for _ in range(new):
        grown = {}
        for tokens, probability in law.items():
            sequence = torch.cat((prompt, torch.tensor([tokens], dtype=torch.long)), dim=1)
            with torch.no_grad():
                scores = processors(sequence, model(sequence).logits[:, -1].float())
            probs = torch.softmax(scores.double(), -1)[0]
            for token in probs.nonzero()[:, 0].tolist():
                grown[tokens + (token,)] = probability * float(probs[token])
        law = grown
    return law


def test_int8_force2_calls_over_64_rows_keep_the_joint_law_exact(enum_setup):
    """A lockstep Force-2 verification of 2 rows x 33 tokens (66 rows) on the int8 copy. The copy's rows must not
    depend on each other at any call size, or row 0's q depends on the draft it verifies next to it (a rule that
    quantizes calls of more than 64 rows with one scale puts the law off by 3e-2 here; with gamma1=30, 62-row calls,
    it stays exact)."""
    model, _ = enum_setup
    # Which seeds leave rejections to enumerate depends on the CPU's int8 products (seeds 5, 6 gave 4 paths on an
    # AVX-512 Xeon and 3 on an AVX2 EPYC, where 7, 8 gave 6): every seed's law must be exact, and at least one must
    # have Force 2 reject drafts (paths beyond the two of the random token and the one of a point-mass chain)
    paths_seen = []
    for seed in (5, 7, 9):
        prompts = [random_prompt(40, vocab_size=VOCAB, seed=seed + row, period=13) for row in range(2)]
        new = 35  # the first token from the prefill, then Force 2 is asked for 33: Force 1 drafts 32, the first random
        processors = LogitsProcessorList([RandomAfter(prompts[0])])
        config = TriForceConfig(draft="self", levels=3, draft_precision="int8",
                                **{**ENUM_CONFIG, "gamma1": 32, "gamma2": 33, "retrieval_budget": 96, "window": 100})
        rows = []

        def counted(self, requests, rows=rows, lockstep_forward=Lockstep.forward):
            rows.append(sum(request.tokens.shape[1] for request in requests.values()))
            return lockstep_forward(self, requests)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(Lockstep, "forward", counted)
            law, paths, _ = joint_law(model, prompts, config, processors, new=new)
        assert max(rows) == 66
        paths_seen.append(paths)
        marginals = [small_support_law(model, p, processors, new) for p in prompts]
        exact = {(a, b): pa * pb for a, pa in marginals[0].items() for b, pb in marginals[1].items()}
        assert len(exact) == 2 and abs(sum(law.values()) - 1.0) < 1e-6
        assert max(abs(law.get(k, 0.0) - exact[k]) for k in exact) < 1e-5, seed
    assert max(paths_seen) >= 4, paths_seen


AUTO = dict(retrieval_budget=48, chunk_size=8, sink_tokens=4, window=24, gamma1=2, gamma2=6, explore_every=4)


@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_auto_policy_batch_rows_equal_each_row_alone(draft):
    """``policy="auto"`` (the default): one plan per batched step, chosen from the batch's own timings."""
    model = make_model("llama-gqa")
    ids, mask = left_padded(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0,
                         triforce_config=TriForceConfig(draft=draft, **AUTO), return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out.sequences[row, ids.shape[1]:], alone), row
    stats = out.triforce_stats
    assert sum(p["steps"] for p in stats.detail.plans.values()) == stats.force3_steps
    assert len(stats.detail.plans) >= 2, "exploration must try more than one plan"
    for row in out.triforce_row_stats:
        assert sum(row.plan_steps.values()) == row.force3_steps


PLAN_CYCLE = [Plan(3, "self", 2, 5), Plan(1), Plan(2, "ngram", gamma2=4), Plan(2, "self", gamma2=3), Plan(1),
              Plan(3, "self", 1, 3)]


@pytest.mark.parametrize("period", [1, 3])
def test_batch_plan_switches_keep_each_row_identical(monkeypatch, period):
    """Plans change every ``period`` batched steps: every row's dormant levels catch up (shared caches too)."""
    def choose(self, remaining_tokens=None):
        steps = sum(record.steps for record in self.records.values())
        self.current = PLAN_CYCLE[(steps // period) % len(PLAN_CYCLE)]
        return self.current

    monkeypatch.setattr(AdaptivePolicy, "choose", choose)
    model = make_model("llama-gqa")
    ids, mask = left_padded(PROMPTS)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=60, do_sample=False, pad_token_id=0,
                         triforce_config=TriForceConfig(draft="self", **AUTO), return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(prompt, max_new_tokens=60, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out.sequences[row, ids.shape[1]:], alone), row
    assert set(out.triforce_stats.plan_steps) == {1, 2, 3}


def test_batch_plans_chosen_from_the_past_keep_the_joint_law_exact(monkeypatch, enum_setup):
    """The batch's plan of each step is a function of the path so far (as timings are): the joint law is
    still the product of the rows' target laws."""
    plans = [Plan(3, "self", 1, 2), Plan(1), Plan(2, "ngram", gamma2=2), Plan(2, "self", gamma2=2)]

    def choose(self, remaining_tokens=None):
        steps = sum(record.steps for record in self.records.values())
        tokens = sum(record.tokens for record in self.records.values())
        self.current = plans[(steps + (tokens > 2 * steps)) % len(plans)]
        return self.current

    monkeypatch.setattr(AdaptivePolicy, "choose", choose)
    model, prompts = enum_setup
    processors = LogitsProcessorList([TopKLogitsWarper(2)])
    config = TriForceConfig(draft="self", **{**ENUM_CONFIG, "policy": "auto", "explore_every": 1})
    law, paths, stats = joint_law(model, prompts, config, processors)
    assert paths > 50 and any(len(s.plan_steps) >= 2 for s in stats)
    exact = product_law(model, prompts, processors)
    assert max(abs(law.get(k, 0.0) - exact[k]) for k in exact) < 1e-5


@pytest.mark.parametrize("cached,kind", [(100, "dynamic"), (40, "dynamic"), (100, "static")])
def test_batch_continues_from_a_prefilled_cache(cached, kind):
    """``cache=``: the DynamicCache of a forward of the left-padded batch's first columns (at 40 columns one row
    is still all padding there); rows equal plain batched ``generate`` from the same cache and each row alone."""
    model = make_model("llama-gqa")
    ids, mask = left_padded(PROMPTS)
    prefix = DynamicCache(config=model.config) if kind == "dynamic" else StaticCache(config=model.config,
                                                                                       max_cache_len=200)
    with torch.no_grad():
        model(ids[:, :cached], attention_mask=mask[:, :cached], cache=prefix,
              position_ids=(mask[:, :cached].cumsum(-1) - 1).clamp(min=0))
    gen = dict(attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, cache=copy.deepcopy(prefix), **gen)
    out = model.generate(ids, cache=prefix, triforce_config=_config(), **gen)
    assert torch.equal(out, plain)
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out[row, ids.shape[1]:], alone), row
    assert prefix.get_seq_length() == cached  # read, not modified
    if cached < 53:  # row 1's 53 padding columns: nothing of it in the prefix
        return
    with pytest.raises(ValueError, match="at least one"):
        model.generate(ids[:, :cached], attention_mask=mask[:, :cached], cache=prefix, triforce_config=_config(),
                       max_new_tokens=3, pad_token_id=0)


def test_ragged_cache_rows_and_mask():
    from hf_triforce.caches.ragged import RaggedBufferCache, ragged_causal_mask

    cache = RaggedBufferCache(num_layers=1, batch=2, capacity=8)
    row = cache.row(1)
    keys = torch.arange(3.0).reshape(1, 1, 3, 1)
    row.layers[0].update(keys, keys)  # a row prefill through the view allocates the batch and writes row 1 only
    assert cache.lengths == [0, 3] and row.length == 3
    assert torch.equal(cache.layers[0].keys[1, 0, :3, 0], torch.arange(3.0))
    new = torch.full((2, 1, 2, 1), 9.0)
    out_keys, _ = cache.layers[0].update(new, new)  # row 0 writes at 0, row 1 after its 3 entries
    assert out_keys.shape[2] == 5 and cache.lengths == [2, 5]
    assert torch.equal(cache.layers[0].keys[1, 0, :5, 0], torch.tensor([0.0, 1, 2, 9, 9]))
    cache.set_length(1, 4)
    assert row.length == 4
    mask = ragged_causal_mask([2, 4], 2, torch.float32, torch.device("cpu"), additive=False)
    assert mask.shape == (2, 1, 2, 6)
    assert mask[0, 0].tolist() == [[True, True, True, False, False, False], [True, True, True, True, False, False]]
    assert mask[1, 0].tolist() == [[True] * 5 + [False], [True] * 6]
    additive = ragged_causal_mask([2, 4], 2, torch.float32, torch.device("cpu"), additive=True)
    assert torch.equal(additive == 0, mask)
    with pytest.raises(ValueError, match="cannot extend"):
        cache.set_length(0, 3)


def test_eager_attention_takes_the_additive_mask():
    model = make_model("qwen2")
    model.set_attn_implementation("eager")
    ids, mask = left_padded(PROMPTS[1:])
    gen = dict(max_new_tokens=20, do_sample=False, pad_token_id=0)
    out = model.generate(ids, attention_mask=mask, triforce_config=_config("ngram", 2), **gen)
    for row, prompt in enumerate(PROMPTS[1:]):
        alone = model.generate(prompt, max_new_tokens=20, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out[row, ids.shape[1]:], alone)


def test_stopped_rows_padded_with_eos_when_no_pad_token(model):
    ids, mask = left_padded(PROMPTS)
    free = model.generate(ids, attention_mask=mask, max_new_tokens=20, do_sample=False, pad_token_id=0)
    eos = int(free[0, ids.shape[1] + 4])
    gen = dict(max_new_tokens=20, do_sample=False, eos_token_id=eos)  # no pad_token_id: plain pads with eos
    assert torch.equal(model.generate(ids, attention_mask=mask, triforce_config=_config(), **gen),
                       model.generate(ids, attention_mask=mask, **gen))


def _parity(batch_id: int, sent: torch.Tensor) -> list[int]:
    """Row ``batch_id``'s allowed tokens: its parity, never the token just emitted (the padded sentence)."""
    return [t for t in range(batch_id % 2, 96, 2) if t != int(sent[-1])]


def test_prefix_allowed_tokens_fn_sees_each_rows_batch_id(model):
    """Every processor scores row ``b`` as batch row ``b`` (`scoring.row_processors`): ``batch_id`` is the row's,
    and the callback is only ever called with a row's own batch id and that row's padded sentence."""
    ids, mask = left_padded(PROMPTS[:2])
    calls = []

    def allowed(batch_id, sent):
        calls.append((batch_id, sent.clone()))
        return _parity(batch_id, sent)

    gen = dict(attention_mask=mask, max_new_tokens=24, do_sample=False, pad_token_id=0)
    plain = model.generate(ids, prefix_allowed_tokens_fn=_parity, **gen)
    out = model.generate(ids, prefix_allowed_tokens_fn=allowed, triforce_config=_config(), **gen)
    assert torch.equal(out, plain)
    assert (plain[1, ids.shape[1]:] % 2 == 1).all()  # row 1 is constrained by its own (odd) set
    assert calls and all(torch.equal(sent[: ids.shape[1]], ids[batch_id]) for batch_id, sent in calls)


def test_prefix_allowed_tokens_fn_batch_id_with_num_return_sequences(model):
    """``num_return_sequences``: expanded row ``e`` is batch ``e // num_return_sequences``, as in ``generate``."""
    ids, mask = left_padded(PROMPTS[:2])
    torch.manual_seed(0)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=True, num_return_sequences=2,
                         pad_token_id=0, prefix_allowed_tokens_fn=_parity, triforce_config=_config())
    parities = (out[:, ids.shape[1]:] % 2).tolist()
    assert parities == [[0] * 12, [0] * 12, [1] * 12, [1] * 12]


@pytest.mark.parametrize("gen", [
    dict(repetition_penalty=3.0),  # prompt_ignore_length: each row's padding length
    dict(encoder_repetition_penalty=2.0),  # the prompts' ids, one row per prompt
    dict(encoder_no_repeat_ngram_size=2),
], ids=["repetition_penalty", "encoder_repetition_penalty", "encoder_no_repeat_ngram_size"])
def test_processors_built_from_the_batch_inputs_equal_plain_batched_generate(model, gen):
    """Processors holding per-row tensors of the left-padded batch see each row at its index."""
    ids, mask = left_padded(PROMPTS)
    gen = dict(gen, attention_mask=mask, max_new_tokens=30, do_sample=False, pad_token_id=0)
    assert torch.equal(model.generate(ids, triforce_config=_config(), **gen), model.generate(ids, **gen))


ROW_WISE_EXAMPLES = [
    SequenceBiasLogitsProcessor([[[3, 4], 2.0], [[5], -1.0]]), NoRepeatNGramLogitsProcessor(2),
    NoBadWordsLogitsProcessor([[7], [3, 4]], eos_token_id=1), MinLengthLogitsProcessor(20, eos_token_id=1),
    MinNewTokensLengthLogitsProcessor(8, 10, eos_token_id=1), ForcedBOSTokenLogitsProcessor(2),
    ForcedEOSTokenLogitsProcessor(13, eos_token_id=1), InfNanRemoveLogitsProcessor(),
    ExponentialDecayLengthPenalty((5, 1.5), eos_token_id=1, input_ids_seq_length=4),
    SuppressTokensLogitsProcessor([2, 3]), SuppressTokensAtBeginLogitsProcessor([2, 3], begin_index=12),
    TemperatureLogitsWarper(0.7), TopHLogitsWarper(0.5), TopKLogitsWarper(5), TopPLogitsWarper(0.8),
    MinPLogitsWarper(0.1), TypicalLogitsWarper(0.8), EpsilonLogitsWarper(0.02), EtaLogitsWarper(0.02),
    LogitNormalization(),
]


def test_row_wise_processors_score_each_row_as_in_the_batch():
    """`scoring.ROW_WISE` runs these on a batch row alone: each row of a batch is what that row gives alone."""
    assert {type(p) for p in ROW_WISE_EXAMPLES} == set(ROW_WISE)
    generator = torch.Generator().manual_seed(0)
    for length in (1, 12, 14):  # forced BOS, begin suppression / forced EOS, past both
        ids = torch.randint(0, 50, (3, length), generator=generator)
        ids[1, -1] = 3  # the first token of a biased / bad sequence
        scores = torch.randn(3, 50, generator=generator) * 3
        scores[2, 6] = -float("inf")  # a token an earlier processor removed
        for processor in ROW_WISE_EXAMPLES:
            batch = processor(ids, scores.clone())
            for row in range(3):
                alone = processor(ids[row : row + 1], scores[row : row + 1].clone())
                assert torch.equal(alone[0], batch[row]), (type(processor).__name__, length, row)
