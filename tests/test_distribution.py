"""Sampled TriForce output has exactly the target's sequence distribution (chi-square, fixed seeds).

A tiny random model with large weights (peaked, context-dependent logits) and a vocabulary of 8; the
retrieval budget and the draft window are smaller than the prompt, so all three tiers disagree and every
acceptance path is exercised.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from hf_triforce import TriForceConfig

from .conftest import make_model, random_prompt
from .stats_util import chi_square_pvalue

# The extended tier: 20-70 s each on 2 cores. The default tier checks the same rules exactly, by enumerating
# the library's own loop (tests/test_exact_enumeration.py: "self top-k 2, 5 tokens", "self top-k 3, T 0.8",
# "ngram top-k 3", "two levels, self", "int8 drafting tiers"; tests/test_tree_enumeration.py: "ngram trees at
# both levels"), and torch's RNG draws (`TorchSampler`) by Monte Carlo (tests/test_sampling.py).
pytestmark = pytest.mark.extended

VOCAB, NEW, RUNS = 8, 4, 1500


def exact_sequence_probs(model, prompt, processors, new: int = NEW) -> dict[tuple[int, ...], float]:
    """Probability of every continuation of length ``new`` under the processed target distribution."""
    continuations = torch.tensor(list(itertools.product(range(VOCAB), repeat=new)))
    batch = torch.cat((prompt.expand(continuations.shape[0], -1), continuations), dim=1)
    with torch.no_grad():
        logits = model(batch).logits[:, prompt.shape[1] - 1 : -1].float()
    logprob = torch.zeros(continuations.shape[0], dtype=torch.float64)
    for step in range(new):
        scores = processors(batch[:, : prompt.shape[1] + step], logits[:, step])
        logprob += torch.log_softmax(scores.double(), -1).gather(1, continuations[:, step : step + 1])[:, 0]
    return {tuple(c.tolist()): float(p) for c, p in zip(continuations, logprob.exp())}


def sampled_counts(model, prompt, config, runs, new: int = NEW, **gen):
    torch.manual_seed(1234)
    counts, stats = {}, []
    for _ in range(runs):
        out = model.generate(prompt, max_new_tokens=new, do_sample=True, triforce_config=config,
                             return_dict_in_generate=True, **gen)
        key = tuple(out.sequences[0, prompt.shape[1]:].tolist())
        counts[key] = counts.get(key, 0) + 1
        stats.append(out.triforce_stats)
    return counts, stats


def check(draft, gen, processors, levels=3, **config_kw):
    model = make_model("llama-gqa", vocab_size=VOCAB, seed=3, initializer_range=0.3)
    prompt = random_prompt(48, vocab_size=VOCAB, seed=4, period=13)
    config = TriForceConfig(draft=draft, policy="fixed", retrieval_budget=16, chunk_size=4,
                            retrieval_recent=4, sink_tokens=2,
                            window=8, gamma1=2, gamma2=2, levels=levels, **config_kw)
    exact = exact_sequence_probs(model, prompt, processors)
    counts, stats = sampled_counts(model, prompt, config, RUNS, **gen)
    keys = sorted(exact)
    observed = torch.tensor([counts.get(k, 0) for k in keys], dtype=torch.float64)
    expected = torch.tensor([exact[k] for k in keys], dtype=torch.float64)
    assert set(counts) <= {k for k in keys if exact[k] > 0}, "sampled a sequence of probability zero"
    proposed2 = sum(s.detail.force1_proposed for s in stats)
    accepted2 = sum(s.force2_accepted for s in stats)
    proposed3 = sum(s.force3_proposed for s in stats)
    accepted3 = sum(s.force3_accepted for s in stats)
    # Both levels must see acceptances and rejections, or the test would not exercise the residuals.
    assert 0 < accepted3 < proposed3
    if levels == 3:
        assert 0 < accepted2 < proposed2
    assert chi_square_pvalue(observed, expected) > 1e-3


def test_self_draft_matches_target_distribution():
    check("self", {}, LogitsProcessorList())


def test_ngram_draft_with_warpers_matches_target_distribution():
    processors = LogitsProcessorList([TemperatureLogitsWarper(0.8), TopKLogitsWarper(5)])
    check("ngram", dict(temperature=0.8, top_k=5), processors)


def test_two_level_baseline_matches_target_distribution():
    check("self", dict(top_p=0.9), LogitsProcessorList([TopPLogitsWarper(0.9)]), levels=2)


def test_int8_drafting_tiers_match_target_distribution():
    """Force 1 and Force 2 on the int8 copy: q and r change, p (Force 3, fp32) is still what comes out."""
    check("self", dict(temperature=1.3), LogitsProcessorList([TemperatureLogitsWarper(1.3)]), draft_precision="int8")


def test_trees_at_both_levels_match_target_distribution():
    """Force 1 proposes n-gram trees (several suffix matches), Force 2 verifies them with tree attention and hands
    Force 3 a tree too (`force2_tree_nodes`: its chain plus q's next tokens)."""
    check("ngram", dict(top_k=5), LogitsProcessorList([TopKLogitsWarper(5)]), tree_nodes=6, tree_branch=3,
          force2_tree_nodes=5)
