"""Candidate trees end to end: greedy output identical to plain `generate`; sampled output law exactly the target's."""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig

from .conftest import FAMILIES, make_model, random_prompt
from .test_greedy_identity import assert_identical


def _config(draft, levels=3, nodes=8, branch=3, **kw):
    base = dict(draft=draft, policy="fixed", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24,
                gamma1=3, gamma2=4, levels=levels, tree_nodes=nodes, tree_branch=branch)
    base.update(kw)
    return TriForceConfig(**base)


@pytest.mark.parametrize("family", sorted(set(FAMILIES) - {"mistral"}) + ["mistral"])
@pytest.mark.parametrize("draft", ["self", "ngram"])
@pytest.mark.parametrize("levels", [2, 3])
def test_greedy_identity_with_trees(family, draft, levels):
    model = make_model(family)
    prompt = random_prompt(150, period=37)
    stats = assert_identical(model, prompt, _config(draft, levels))
    assert stats.detail.tree_nodes > stats.detail.force1_proposed  # trees, not chains, were verified


@pytest.mark.parametrize("nodes, branch", [(1, 2), (4, 2), (16, 4), (32, 8)])
def test_greedy_identity_for_budgets(gqa_model, nodes, branch):
    side = 0
    for levels in (2, 3):
        ngram = _config("ngram", levels, nodes, branch, gamma1=4, gamma2=6)
        side += assert_identical(gqa_model, random_prompt(120, period=17), ngram).detail.tree_side_accepts
        own = _config("self", levels, nodes, branch)
        side += assert_identical(gqa_model, random_prompt(120), own).detail.tree_side_accepts
    assert side > 0 or nodes == 1  # siblings beyond the chain were accepted (trees did something)


def test_draft_model_trees():
    target = make_model("qwen2", num_hidden_layers=3)
    draft = make_model("qwen2", num_hidden_layers=1, seed=5)
    assert_identical(target, random_prompt(100), _config(draft, 2))


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("draft, nodes", [("self", 0), ("ngram", 6)])
def test_greedy_identity_with_force2_trees(family, draft, nodes):
    """Force 2 hands Force 3 a tree (`force2_tree_nodes`), alone or with Force 1's trees below it."""
    model = make_model(family)
    config = _config(draft, 3, nodes, 3, force2_tree_nodes=9)
    stats = assert_identical(model, random_prompt(150, period=37), config)
    assert stats.detail.tree_nodes > 0


def test_force2_trees_accept_alternatives(gqa_model):
    side = sum(assert_identical(gqa_model, random_prompt(120, seed=seed), _config("self", 3, 0, 3,
                                                                                 force2_tree_nodes=10)).detail.tree_side_accepts
               for seed in range(3))
    assert side > 0, "Force 3 never accepted one of Force 2's alternatives"


def test_drafter_forgets_force2_chain_past_an_accepted_alternative(gqa_model, monkeypatch):
    """Where Force 3 accepts one of Force 2's alternatives, Force 1's cache must hold the committed tokens'
    entries, not Force 2's chain's: after every commit its next scores equal a fresh drafter's (a window that
    never evicts, so that a fresh prefill and the incremental cache hold the same entries)."""
    from transformers import LogitsProcessorList

    from hf_triforce.decoding.levels import Force2Level
    from hf_triforce.drafters.model import ModelDrafter
    from hf_triforce.forwards.forward import run_inline

    commit, checked = Force2Level.commit, []

    def checking_commit(self, sequence, *args):
        commit(self, sequence, *args)
        _, rows, _ = run_inline(self.drafter._draft_steps(sequence, 1))
        fresh = ModelDrafter(self.drafter.model, 4, 256, LogitsProcessorList(), False, None)
        fresh.prefill(sequence)
        _, expected, _ = run_inline(fresh._draft_steps(sequence, 1))
        torch.testing.assert_close(rows[0], expected[0], rtol=1e-4, atol=1e-5)
        self.drafter.rollback(sequence.shape[1] - 1)
        checked.append(sequence.shape[1])

    monkeypatch.setattr(Force2Level, "commit", checking_commit)
    # the target's own weights draft (not a lean copy): entries copied from the full cache at the fill are what
    # a fresh drafter's forward computes
    config = _config("self", 3, 0, 3, force2_tree_nodes=10, window=256, draft_precision="model")
    side = sum(assert_identical(gqa_model, random_prompt(60, seed=seed), config).detail.tree_side_accepts
               for seed in range(3))
    assert side > 0 and checked


def test_trees_are_refused_where_unsupported():
    with pytest.raises(ValueError, match="suffix"):
        TriForceConfig(draft="suffix", policy="fixed", tree_nodes=8)
    with pytest.raises(ValueError, match="tree_nodes must be at most"):
        TriForceConfig(policy="fixed", tree_nodes=64)
    with pytest.raises(ValueError, match="tree_branch"):
        TriForceConfig(policy="fixed", tree_nodes=8, tree_branch=0)
    with pytest.raises(ValueError, match="tree_nodes > 0 needs tree_branch >= 2"):
        TriForceConfig(tree_nodes=8, tree_branch=1)
    with pytest.raises(ValueError, match="force2_tree_nodes > 0 needs levels=3"):
        TriForceConfig(policy="fixed", levels=2, force2_tree_nodes=8)
    with pytest.raises(ValueError, match=r"force2_tree_nodes must be 0 or between gamma2 \+ 1 \(7"):
        TriForceConfig(policy="fixed", gamma2=6, force2_tree_nodes=6)
    with pytest.raises(ValueError, match="force2_tree_nodes must be"):
        TriForceConfig(policy="fixed", force2_tree_nodes=64)
    with pytest.raises(ValueError, match="force2_tree_nodes > 0 needs tree_branch >= 2"):
        TriForceConfig(policy="fixed", force2_tree_nodes=8, tree_branch=1)
    model = make_model("mistral", sliding_window=16)
    with pytest.raises(ValueError, match="sliding-window"):
        model.generate(random_prompt(40), max_new_tokens=4, triforce_config=_config("ngram"))
    with pytest.raises(ValueError, match="sliding-window"):
        model.generate(random_prompt(40), max_new_tokens=4, triforce_config=_config("ngram", 3, 0,
                                                                                  force2_tree_nodes=8))
    with pytest.raises(ValueError, match="sliding-window"):  # policy="auto" too
        model.generate(random_prompt(40), max_new_tokens=4, triforce_config=TriForceConfig(tree_nodes=8))


def test_ngram_tree_holds_distinct_continuations():
    from hf_triforce.drafters.ngram import NgramDrafter

    sequence = torch.tensor([[1, 2, 3, 9, 1, 2, 4, 8, 1, 2, 5, 7, 1, 2]])
    tree = NgramDrafter(3, 1).propose_tree(sequence, 3, 16, 4)
    chain, _ = NgramDrafter(3, 1).propose(sequence, 3)
    assert tree.path_tokens(2) == chain == [5, 7, 1]  # the first path is the chain
    assert sorted(tree.tokens[c] for c in tree.children(-1)) == [3, 4, 5]


class Argmax:
    """A sampler that always takes the most likely token (the drafter then returns its laws)."""

    def categorical(self, probs):
        return int(probs.argmax())

    def device_categorical(self, probs):
        return probs.argmax()


def test_model_drafter_forgets_its_chain_past_an_accepted_side_node():
    """After a side node (not the drafted chain's token) is committed, the draft cache must hold the committed
    token's entries, not the chain's: the next laws equal a fresh drafter's on the committed sequence."""
    from transformers import LogitsProcessorList

    from hf_triforce.drafters.model import ModelDrafter

    model = make_model("llama-gqa")
    sequence = random_prompt(30, seed=3)

    def drafter():
        return ModelDrafter(model, 4, 64, LogitsProcessorList(), True, Argmax())

    with torch.no_grad():
        used = drafter()
        used.prefill(sequence)
        tree = used.propose_tree(sequence, 3, 6, 2)
        side = next(node for node in tree.children(-1) if node != tree.children(-1)[0])
        committed = torch.cat((sequence, sequence.new_tensor([[tree.tokens[side], 7]])), dim=1)
        used.rollback(committed.shape[1] - 1)
        _, laws = used.propose(committed, 3)
        fresh = drafter()
        fresh.prefill(committed)
        _, expected = fresh.propose(committed, 3)
    torch.testing.assert_close(laws, expected, rtol=1e-5, atol=1e-6)


def test_offloaded_full_cache_with_trees(gqa_model):
    """The full cache in host memory (`full_cache_device="cpu"`): compaction moves the host entries."""
    assert_identical(gqa_model, random_prompt(120, period=17), _config("ngram", 2, full_cache_device="cpu"))
    assert_identical(gqa_model, random_prompt(120), _config("self", 3, full_cache_device="cpu"))


def not_shallowest_first(tree, most: int) -> bool:
    """Whether ``tree`` (a model drafter's chain plus leaf alternatives) has alternatives at a position deeper than
    one with fewer than ``most``: a shape a shallowest-first rule (fill each position from the root down) never builds
    (the tiny models' laws give every token mass, so every position has alternatives to take)."""
    chain = tree.path(max(range(len(tree)), key=lambda node: (tree.depths()[node], -node)))
    counts = [len(tree.children(parent)) - 1 for parent in [-1] + chain[:-1]]
    return any(counts[i] < most and any(counts[i + 1 :]) for i in range(len(counts)))


@pytest.mark.parametrize("levels", [2, 3])
def test_greedy_identity_when_branching_at_the_least_certain_positions(monkeypatch, levels):
    """Budgets that bind (depth x (branch - 1) > nodes - depth) on a sharpened model, so that some positions are
    confident and the alternatives go deeper: output still identical to plain `generate`."""
    from hf_triforce.drafters.model import ModelDrafter

    trees = []
    propose_tree = ModelDrafter.propose_tree

    def recorded(self, *args):
        trees.append(propose_tree(self, *args))
        return trees[-1]

    monkeypatch.setattr(ModelDrafter, "propose_tree", recorded)
    model = make_model("llama-gqa", logit_scale=30.0)  # sharp: some positions confident, others not
    config = _config("self", levels, nodes=10, branch=4, gamma1=5, gamma2=6)
    stats = assert_identical(model, random_prompt(120, seed=2), config)
    assert stats.detail.tree_side_accepts > 0
    assert any(not_shallowest_first(tree, 3) for tree in trees), "every tree branched shallowest first"
