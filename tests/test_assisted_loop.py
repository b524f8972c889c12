"""`TriForceConfig(loop="assisted")`: transformers' own assisted-generation loop verifying Force 2's tokens.

Greedy output is token-identical to plain ``generate`` (families, drafters, ``cache=``, stops, a streamer, left
padding); what that loop cannot do is refused by name. The sampled law is enumerated exactly: the tiers draw from a
`ReplaySampler`, and transformers' own draws in ``_speculative_sampling`` (a uniform per candidate, compared with
``p / q``; one categorical draw from the residual or from ``p``) are routed to the same sampler with the probability
transformers' draw gives each outcome, so the law of its real code is enumerated; mutations show the comparison
catches a wrong law handed to the loop and a wrong Force-2 rule.
"""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import (
    DynamicCache,
    GenerationConfig,
    LogitsProcessorList,
    MaxLengthCriteria,
    StoppingCriteriaList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
)

from hf_triforce import TriForceCandidateGenerator, TriForceConfig, TriForceGenerateOutput
from hf_triforce.assisted import run_assisted
from hf_triforce.decoding import hierarchy
from hf_triforce.verification.sampling import ChainVerifier

from .conftest import make_model, random_prompt
from .enumeration_util import enumerate_outcomes
from .families import make_family
from .test_exact_enumeration import CONFIG as ENUMERATED
from .test_exact_enumeration import TOLERANCE, VOCAB, PathStats, distance, exercised, target_law
from .test_generate_conventions import Collect
from .tokenizer_util import word_tokenizer

BASE = dict(draft="self", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=2, gamma2=4,
            draft_precision="model", loop="assisted")


def assert_identical(model, prompt, config=None, **gen):
    config = config if config is not None else TriForceConfig(**BASE)
    gen = {"max_new_tokens": 40, "do_sample": False, **gen}
    # plain generate extends a cache= it is given: it gets a copy
    expected = model.generate(prompt, **{k: copy.deepcopy(v) if k == "cache" else v for k, v in gen.items()})
    out = model.generate(prompt, triforce_config=config, return_dict_in_generate=True, **gen)
    assert isinstance(out, TriForceGenerateOutput)
    assert torch.equal(out.sequences, expected), (out.sequences[0, prompt.shape[1]:], expected[0, prompt.shape[1]:])
    return out


@pytest.mark.parametrize("family", ["llama-gqa", "qwen2", "mistral", "gemma"])
def test_three_levels_greedy_identical_across_families(family):
    out = assert_identical(make_model(family), random_prompt(150, period=37))
    stats = out.triforce_stats
    assert stats.plan_steps.get(3, 0) > 0 and stats.force3_proposed > 0 and stats.detail.retrieval_selections > 0
    assert not stats.detail.force2_sees_whole_cache and stats.new_tokens == 40
    assert out.cache.get_seq_length() == 150 + 40 - 1  # the committed sequence but its last token


def test_default_lean_tiers_and_other_drafters(model):
    prompt = random_prompt(140, period=29)
    assert_identical(model, prompt, TriForceConfig(**{**BASE, "draft_precision": "auto"}))
    for draft, levels in (("ngram", 3), ("ngram", 2), ("self", 2), ("suffix", 3)):
        stats = assert_identical(model, prompt, TriForceConfig(**{**BASE, "draft": draft, "levels": levels}))
        assert stats.triforce_stats.force3_proposed > 0, (draft, levels)


def test_draft_model_and_sliding_window_family():
    target = make_model("qwen2", num_hidden_layers=3)
    assert_identical(target, random_prompt(100), TriForceConfig(**{**BASE, "draft": make_model("qwen2", seed=5)}))
    hybrid = make_family("gemma2")
    assert_identical(hybrid, random_prompt(120, period=31), max_new_tokens=30)


def test_prefilled_cache_stop_strings_and_streamer(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :60], cache=cache)
    out = assert_identical(model, prompt, cache=cache)
    assert out.triforce_stats.force3_steps < 40 and cache.get_seq_length() == 60  # read, not extended
    free = out.sequences[0, prompt.shape[1]:].tolist()
    # a stop in the middle of what one step commits: the candidates stop before it, so the loop stops there
    for index in (5, 17, 26):
        got = assert_identical(model, prompt, stop_strings=[f"t{free[index]}"], tokenizer=word_tokenizer())
        assert got.sequences.shape[1] < prompt.shape[1] + 40
    streamer = Collect()
    seq = model.generate(prompt, max_new_tokens=20, do_sample=False, triforce_config=TriForceConfig(**BASE),
                         streamer=streamer)
    assert streamer.chunks[0] == prompt[0].tolist() and streamer.ended
    assert [c for chunk in streamer.chunks[1:] for c in chunk] == seq[0, prompt.shape[1]:].tolist()


def test_left_padding_and_output_scores(model, prompt):
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), prompt), dim=1)
    mask = torch.cat((torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)), dim=1)
    out = assert_identical(model, padded, attention_mask=mask, output_scores=True, output_logits=True,
                           repetition_penalty=1.3)
    plain = model.generate(padded, attention_mask=mask, max_new_tokens=40, do_sample=False, repetition_penalty=1.3,
                           output_scores=True, return_dict_in_generate=True)
    assert len(out.scores) == len(out.logits) == 40
    assert all(torch.allclose(a, b, atol=1e-4) for a, b in zip(out.scores, plain.scores))


def test_what_the_assisted_loop_cannot_do_is_refused(model, prompt):
    config = TriForceConfig(**BASE)
    with pytest.raises(ValueError, match="one prompt per call"):
        model.generate(prompt.repeat(2, 1), max_new_tokens=4, triforce_config=config)
    with pytest.raises(ValueError, match="chains only"):
        TriForceConfig(**{**BASE, "tree_nodes": 4})
    with pytest.raises(ValueError, match="loop must be one of"):
        TriForceConfig(**{**BASE, "loop": "hf"})


def test_generator_is_a_transformers_candidate_generator(model, prompt):
    from transformers.generation.candidate_generator import CandidateGenerator

    assert issubclass(TriForceCandidateGenerator, CandidateGenerator)
    with pytest.raises(ValueError, match="chains only"):
        TriForceCandidateGenerator(model, GenerationConfig(max_length=200),
                                   model_kwargs={"cache": DynamicCache(config=model.config)},
                                   triforce_config=TriForceConfig(**{**BASE, "loop": "triforce", "tree_nodes": 4}))


# --- the sampled law, enumerated through transformers' loop -------------------------------------------------------


class RoutedDraws:
    """``torch.rand_like`` and ``torch.multinomial`` answered from a `ReplaySampler` while transformers' loop runs:
    ``rand_like(ratio)`` (one uniform ``r_i`` per candidate, candidate ``i`` kept while ``r_i < ratio_i``) draws the
    keep/reject coins in order up to the first rejection, each kept with probability ``min(1, ratio_i)`` (what a
    uniform gives), and returns 0 for a kept and 1 for a rejected candidate; ``multinomial(probs, 1)`` draws each row
    from its normalized ``probs``."""

    def __init__(self, sampler) -> None:
        self.sampler, self.coins = sampler, 0

    def rand_like(self, ratio: torch.Tensor, **kwargs) -> torch.Tensor:
        uniforms = torch.ones_like(ratio).reshape(-1)
        for index, value in enumerate(ratio.reshape(-1).tolist()):
            self.coins += 1
            if not self.sampler.bernoulli(torch.tensor(min(1.0, value))):
                break
            uniforms[index] = 0.0
        return uniforms.reshape(ratio.shape)

    def multinomial(self, probs: torch.Tensor, num_samples: int = 1, **kwargs) -> torch.Tensor:
        assert num_samples == 1
        rows = probs.reshape(-1, probs.shape[-1])
        drawn = torch.tensor([[self.sampler.categorical(row.double())] for row in rows])
        return drawn.reshape(*probs.shape[:-1], 1)


@pytest.fixture(scope="module")
def small():
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=3, initializer_range=0.3, num_hidden_layers=1)
    return model, random_prompt(40, vocab_size=VOCAB, seed=4, period=13)


def assisted_law(model, prompt, config, processors, new, monkeypatch) -> tuple[dict, int, PathStats, int]:
    """``({continuation: probability}, paths, every path's stats, keep/reject coins drawn in the loop)``."""
    stats, coins = PathStats(), []

    def run(sampler):
        draws = RoutedDraws(sampler)
        generation = GenerationConfig(do_sample=True, max_length=prompt.shape[1] + new)
        criteria = StoppingCriteriaList([MaxLengthCriteria(prompt.shape[1] + new)])
        with monkeypatch.context() as patch, torch.no_grad():
            patch.setattr(torch, "rand_like", draws.rand_like)
            patch.setattr(torch, "multinomial", draws.multinomial)
            out, generator = run_assisted(model, prompt, processors, criteria, generation, config, sampler=sampler)
        coins.append(draws.coins)
        stats.append(generator.stats)
        stats.probabilities.append(sampler.probability)
        return tuple(out[0, prompt.shape[1]:].tolist())

    law, paths = enumerate_outcomes(run)
    return law, paths, stats, sum(coins)


TEMPERED = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(3)])
TOP_2 = LogitsProcessorList([TopKLogitsWarper(2)])
# (config overrides, processors, new tokens): 4-6 s each on 2 busy cores (100-240 paths)
CASES = {
    "self, T 0.8, top-k 3": ({}, TEMPERED, 3),
    "two levels, self, top-k 3": ({"levels": 2}, LogitsProcessorList([TopKLogitsWarper(3)]), 3),
    "default drafting tiers (auto), top-k 2": ({"draft_precision": "auto"}, TOP_2, 4),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_sampled_law_through_transformers_loop_is_the_targets(small, monkeypatch, case):
    model, prompt = small
    overrides, processors, new = CASES[case]
    config = TriForceConfig(**{**ENUMERATED, "loop": "assisted", **overrides})
    law, paths, stats, coins = assisted_law(model, prompt, config, processors, new, monkeypatch)
    exact = target_law(model, prompt, processors, new)
    assert coins > 0 and paths > 50  # `_speculative_sampling` ran: candidates came with their laws
    assert abs(sum(law.values()) - 1.0) < 1e-6 and set(law) <= {k for k, p in exact.items() if p > 0}
    assert distance(law, exact) < TOLERANCE
    exercised(stats, config.levels)  # acceptances and rejections at both levels, on paths of real probability


@pytest.mark.parametrize("mutation", ["candidate laws at another temperature", "Force 2 resamples from q"])
def test_enumeration_catches_a_wrong_law(small, monkeypatch, mutation):
    model, prompt = small
    case = "self, T 0.8, top-k 3" if mutation.startswith("candidate") else "default drafting tiers (auto), top-k 2"
    overrides, processors, new = CASES[case]
    new = min(new, 3)  # a mutated rule multiplies the paths
    config = TriForceConfig(**{**ENUMERATED, "loop": "assisted", **overrides})
    with monkeypatch.context() as patch:
        if mutation.startswith("candidate"):  # q handed to the loop as if sampled at T = 1 instead of 0.8
            patch.setattr(TriForceCandidateGenerator, "candidate_logits", lambda self, probs: torch.log(probs) * 0.8)
        else:  # the reference implementation's middle level: after a rejection, draw from Force 2's own law
            patch.setattr(hierarchy, "ChainVerifier",
                          lambda do_sample, sampler: ChainVerifier(do_sample, sampler, resample=lambda p, q: p))
        law, _, _, _ = assisted_law(model, prompt, config, processors, new, monkeypatch)
    assert distance(law, target_law(model, prompt, processors, new)) > 100 * TOLERANCE, mutation


def test_force3_rejections_count_the_loops_short_verifications(monkeypatch):
    """Force 3's rejections in transformers' loop: the verifications whose matches fell short of the candidates."""
    outcomes = []  # (candidates proposed, matches) per verification
    update = TriForceCandidateGenerator.update_candidate_strategy

    def recording_update(self, input_ids, scores, num_matches, **outputs):
        outcomes.append((self.proposed, int(num_matches)))
        return update(self, input_ids, scores, num_matches, **outputs)

    monkeypatch.setattr(TriForceCandidateGenerator, "update_candidate_strategy", recording_update)
    stats = assert_identical(make_model("llama-gqa"), random_prompt(150, period=37)).triforce_stats
    assert stats.force3_rejections == sum(matches < proposed for proposed, matches in outcomes) > 0
    assert stats.force3_accepted == sum(matches for _, matches in outcomes)
    assert 0 < stats.force3_position_acceptance < 1
