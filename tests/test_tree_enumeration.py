"""The output law of the sampled decode loop with candidate trees, enumerated exactly, equals the target's.

As `tests/test_exact_enumeration.py` (same model, prompt and harness): every path of the decoder's random
choices — drafts, sibling-by-sibling acceptances at both levels, residual and bonus draws — is visited once
through a `ReplaySampler`, with Force 1 proposing trees (several siblings per node). Mutations: the residual
not updated after a rejected sibling, at Force 3 (two levels) and at Force 2 (three levels), must be caught.
"""

from __future__ import annotations

import pytest
from transformers import LogitsProcessorList, TopKLogitsWarper

from hf_triforce import TriForceConfig

from .test_exact_enumeration import (
    CONFIG,
    TOLERANCE,
    decoded_law,
    distance,
    setup,  # noqa: F401  (the module's model and prompt fixture)
    target_law,
)

CASES = {
    "ngram tree, two levels": ("ngram", 3, 4, {"levels": 2, "tree_nodes": 4, "tree_branch": 3}),
    "self tree, two levels": ("self", 2, 4, {"levels": 2, "tree_nodes": 4, "tree_branch": 2}),
    "ngram tree, three levels": ("ngram", 3, 4, {"tree_nodes": 4, "tree_branch": 3}),
    "self tree, three levels": ("self", 2, 5, {"tree_nodes": 3, "tree_branch": 2}),
}


def run_case(model_and_prompt, case, mutate=None):
    model, prompt = model_and_prompt
    draft, top_k, new, extra = CASES[case]
    processors = LogitsProcessorList([TopKLogitsWarper(top_k)])
    config = TriForceConfig(draft=draft, **{**CONFIG, **extra})
    law, paths, stats = decoded_law(model, prompt, config, processors, new, mutate)
    return law, paths, stats, target_law(model, prompt, processors, new)


@pytest.mark.parametrize("case", sorted(CASES))
def test_enumerated_law_with_trees_equals_the_target_law(setup, case):  # noqa: F811
    law, paths, stats, exact = run_case(setup, case)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and paths > 10
    assert set(law) <= {k for k, p in exact.items() if p > 0}, "a sequence of probability zero was emitted"
    assert distance(law, exact) < TOLERANCE
    assert any(s.tree_nodes > s.force1_proposed for s in stats), "no path verified a tree with siblings"
    assert any(0 < s.force3_accepted < s.force2_proposed for s in stats)


def stale_residual_at_force3(decoder):
    decoder.force3_tree_verifier.resample = lambda residual, proposal: residual


def stale_residual_at_force2(decoder):
    decoder.force2_tree_verifier.resample = lambda residual, proposal: residual


@pytest.mark.parametrize("case, mutate", [("ngram tree, two levels", stale_residual_at_force3),
                                          ("self tree, two levels", stale_residual_at_force3),
                                          ("ngram tree, three levels", stale_residual_at_force2)])
def test_a_stale_residual_is_caught(setup, case, mutate):  # noqa: F811
    law, _, _, exact = run_case(setup, case, mutate)
    assert distance(law, exact) > 100 * TOLERANCE, f"the enumeration did not catch: {mutate.__name__}"
