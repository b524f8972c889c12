"""The output law of the sampled decode loop with candidate trees, enumerated exactly, equals the target's.

As `tests/test_exact_enumeration.py` (same model, prompt and harness): every path of the decoder's random
choices — drafts, sibling-by-sibling acceptances at both levels, residual and bonus draws — is visited once
through a `ReplaySampler`, with Force 1 proposing trees (several siblings per node). Mutations: the residual
not updated after a rejected sibling, at Force 3 (two levels) and at Force 2 (three levels), must be caught.
The model drafter's siblings are drawn without replacement (`tree.draw_siblings`) where `branching` puts them;
giving them the un-renormalised draft law instead of the law they were drawn with must be caught too.

Cost: the first new token (drawn from the prefill's logits, before any tree) is one token (top-k 1), the others
``top_k`` tokens: the trees' steps keep every random choice, at about a third of the paths of a drawn first
token (the extended tier, ``pytest -m extended``, draws it too).
"""

from __future__ import annotations

import pytest
from transformers import LogitsProcessorList

from hf_triforce import TriForceConfig
from hf_triforce.decoding import levels
from hf_triforce.drafters import branching
from hf_triforce.drafters import model as model_drafter
from hf_triforce.drafters.branching import sibling_counts
from hf_triforce.drafters.registry import DRAFTERS, DrafterSpec
from hf_triforce.kernels.quantized import drafting_model
from hf_triforce.verification.draft_tree import draw_siblings

from .enumeration_util import FreeThenGreedy
from .test_exact_enumeration import (
    CONFIG,
    TOLERANCE,
    decoded_law,
    distance,
    setup,  # noqa: F401  (the module's model and prompt fixture)
    target_law,
)

SAMPLED_SIBLINGS = "self, sampled siblings"  # registered while a case runs: `ModelDrafter(sampled_siblings=True)`


def sampled_siblings_drafter(context):
    config = context.config
    return model_drafter.ModelDrafter(drafting_model(context.target, config.draft_precision), config.sink_tokens,
                                      config.window, context.processors, context.do_sample, context.sampler,
                                      sampled_siblings=True)


CASES = {
    "ngram tree, two levels": ("ngram", 3, 4, {"levels": 2, "tree_nodes": 4, "tree_branch": 3}),
    "self tree, two levels": ("self", 2, 4, {"levels": 2, "tree_nodes": 4, "tree_branch": 2}),
    "ngram tree, three levels": ("ngram", 3, 4, {"tree_nodes": 4, "tree_branch": 3}),
    "self tree, three levels": ("self", 2, 5, {"tree_nodes": 3, "tree_branch": 2}),
    # the budget binds (2 chain nodes + 2 of 4 possible siblings): where the siblings go depends on the chain,
    # and each is a real draw without replacement (top-k 3 leaves 2 tokens after the chain's)
    "self sampled siblings, two levels": (SAMPLED_SIBLINGS, 3, 4, {"levels": 2, "tree_nodes": 4, "tree_branch": 3}),
    # Force 2 hands Force 3 its chain (2 tokens drawn as q) plus q's next tokens where q is least certain
    "self, Force 2 hands a tree": ("self", 3, 4, {"force2_tree_nodes": 4, "tree_branch": 3}),
    "ngram trees at both levels": ("ngram", 3, 4, {"tree_nodes": 4, "tree_branch": 3, "force2_tree_nodes": 3}),
}
FORCE2_TREES = ("self, Force 2 hands a tree", "ngram trees at both levels")
FIRST_RANDOM = [pytest.param(1, id="first token top-1"),  # the first random position
                pytest.param(0, marks=pytest.mark.extended, id="first token drawn")]


def run_case(model_and_prompt, case, mutate=None, first_random=1):
    model, prompt = model_and_prompt
    draft, top_k, new, extra = CASES[case]
    processors = LogitsProcessorList([FreeThenGreedy(prompt.shape[1], new, top_k, first_random)])
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(DRAFTERS, SAMPLED_SIBLINGS, DrafterSpec(SAMPLED_SIBLINGS, sampled_siblings_drafter, "model", "",
                                                                 trees=True))
        config = TriForceConfig(draft=draft, **{**CONFIG, **extra})
        law, paths, stats = decoded_law(model, prompt, config, processors, new, mutate)
    return law, paths, stats, target_law(model, prompt, processors, new)


def recording_siblings(monkeypatch) -> tuple[list[int], set[tuple[int, ...]]]:
    """Records, while a case runs, each drawn sibling's support size and each tree's sibling counts per depth."""
    draws, shapes = [], set()

    def recorded_draws(law, count, sampler, drawn=None):
        tokens, laws = draw_siblings(law, count, sampler, drawn)
        draws.extend(int((sibling_law > 0).sum()) for sibling_law in laws)
        return tokens, laws

    def recorded_counts(*args):
        counts = sibling_counts(*args)
        shapes.add(tuple(counts))
        return counts

    monkeypatch.setattr(branching, "draw_siblings", recorded_draws)
    monkeypatch.setattr(branching, "sibling_counts", recorded_counts)
    return draws, shapes


@pytest.mark.parametrize("first_random", FIRST_RANDOM)
@pytest.mark.parametrize("case", sorted(CASES))
def test_enumerated_law_with_trees_equals_the_target_law(setup, monkeypatch, case, first_random):  # noqa: F811
    """Every case's law; the sampled-siblings case also exercises what it claims: siblings drawn at random (with
    more than one token left), and where they go varies with the drafted chain (at both positions on some paths)."""
    draws, shapes = recording_siblings(monkeypatch)
    law, paths, stats, exact = run_case(setup, case, first_random=first_random)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and paths > 10
    assert set(law) <= {k for k, p in exact.items() if p > 0}, "a sequence of probability zero was emitted"
    assert distance(law, exact) < TOLERANCE
    assert any(s.detail.tree_nodes > s.detail.force1_proposed for s in stats), "no path verified a tree with siblings"
    if case in FORCE2_TREES:
        assert any(s.detail.tree_side_accepts for s in stats), "Force 3 never accepted one of Force 2's alternatives"
    assert any(0 < s.force3_accepted < s.force3_proposed for s in stats)
    if case == "self sampled siblings, two levels":
        assert draws and max(draws) > 1
        assert len({shape for shape in shapes if sum(shape) == 2}) > 1, shapes


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


def test_siblings_with_the_unrenormalised_law_are_caught(setup, monkeypatch):  # noqa: F811
    """Siblings drawn without replacement but carrying q (not q without the earlier draws): caught."""

    def unrenormalised(law, count, sampler, drawn=None):
        tokens, _ = draw_siblings(law, count, sampler, drawn)
        return tokens, [law] * len(tokens)

    monkeypatch.setattr(branching, "draw_siblings", unrenormalised)
    law, _, _, exact = run_case(setup, "self sampled siblings, two levels")
    assert distance(law, exact) > 100 * TOLERANCE, "the enumeration did not catch siblings carrying q"


def test_force2_alternatives_carrying_q_are_caught(setup, monkeypatch):  # noqa: F811
    """Force 2's alternatives are q's next tokens, point masses: verifying them as if drawn from q is wrong and
    must be caught. (The chain's tokens as point masses would not be: the point-mass rule is exact for any token
    chosen before the coins, only less often accepted.)"""

    def alternatives_as_draws(chain, laws, chain_laws, nodes, branch, sampler=None):
        tree = branching.branched_chain(chain, laws, chain_laws, nodes, branch, sampler)
        depths = tree.depths()
        for node, parent in enumerate(tree.parents):
            if tree.children(parent)[0] != node:
                tree.laws[node] = laws[depths[node] - 1]
        return tree

    monkeypatch.setattr(levels, "branched_chain", alternatives_as_draws)
    law, _, _, exact = run_case(setup, "self, Force 2 hands a tree")
    assert distance(law, exact) > 100 * TOLERANCE, "the enumeration did not catch alternatives verified as draws"
