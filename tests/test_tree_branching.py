"""Where a model drafter's tree branches (`hf_triforce.drafters.branching`): at the least certain positions still
likely to be reached, and `ModelDrafter.propose_tree` builds exactly that shape (greedy: top-k alternatives;
sampling: the siblings drawn without replacement after the chain's token, each carrying the law it was drawn with)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from transformers import LogitsProcessorList

from hf_triforce.drafters.branching import sibling_counts
from hf_triforce.drafters.model import ModelDrafter
from hf_triforce.verification.draft_tree import draw_siblings, without

from .conftest import make_model, random_prompt


def law(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32)


def test_alternatives_go_to_the_least_certain_position():
    """Position 0 is confident (top-1 0.97), position 1 uncertain (0.4): the whole budget goes to position 1,
    although position 0 is shallower (a shallowest-first rule fills position 0 first)."""
    laws = [law(0.97, 0.01, 0.01, 0.01), law(0.4, 0.3, 0.2, 0.1), law(0.9, 0.05, 0.03, 0.02)]
    assert sibling_counts(laws, [0, 0, 0], budget=3, most=3) == [0, 3, 0]
    assert sibling_counts(laws, [0, 0, 0], budget=2, most=3) == [0, 2, 0]
    # more budget than position 1 takes: next the deeper position (reach 0.97 * 0.4 = 0.39, top alternative
    # 0.05: 0.019) before the confident shallow one (0.01)
    assert sibling_counts(laws, [0, 0, 0], budget=4, most=3) == [0, 3, 1]


def test_reach_decays_with_depth():
    """Equally uncertain positions: the shallower ones first (a deep position is less likely to be reached)."""
    laws = [law(0.5, 0.3, 0.2, 0.0)] * 4
    assert sibling_counts(laws, [0, 0, 0, 0], budget=3, most=1) == [1, 1, 1, 0]
    assert sibling_counts(laws, [0, 0, 0, 0], budget=3, most=2) == [2, 1, 0, 0]


def best_total_value(laws, chain, budget, most) -> tuple[float, list[list[float]], list[float]]:
    """Brute force: the largest sum of P(reach position) * q(alternative) over every choice of at most ``most``
    alternatives per position (a position's best first) and ``budget`` in all; with each position's ranked
    alternative probabilities and reach."""
    ranked = [sorted((float(p) for t, p in enumerate(law) if t != token and p > 0), reverse=True)[:most]
              for law, token in zip(laws, chain)]
    reach = [math.prod(float(laws[j][chain[j]]) for j in range(i)) for i in range(len(chain))]
    choices = itertools.product(*(range(len(r) + 1) for r in ranked))
    best = max(total_value(c, ranked, reach) for c in choices if sum(c) <= budget)
    return best, ranked, reach


def total_value(counts, ranked, reach) -> float:
    return sum(reach[i] * sum(ranked[i][:k]) for i, k in enumerate(counts))


def test_the_chosen_alternatives_have_the_highest_values():
    """Against brute force over every admissible choice: the counts maximise the sum of
    P(reach position) * q(alternative), never pick a zero-probability token, respect ``most`` and ``budget``."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(30):
        depth, vocab = 4, 5
        logits = torch.randn(depth, vocab, generator=generator) * 2
        logits[torch.rand(depth, vocab, generator=generator) < 0.2] = -float("inf")
        laws = list(torch.softmax(logits, -1))
        chain = [int(torch.multinomial(law, 1, generator=generator)) for law in laws]
        budget, most = 1 + trial % 6, 1 + trial % 3
        counts = sibling_counts(laws, chain, budget, most)
        best, ranked, reach = best_total_value(laws, chain, budget, most)
        assert sum(counts) == min(budget, sum(len(r) for r in ranked))
        assert all(k <= len(r) for k, r in zip(counts, ranked))
        assert total_value(counts, ranked, reach) == pytest.approx(best, rel=1e-9)


def test_no_budget_no_alternatives():
    assert sibling_counts([law(0.5, 0.5)], [0], budget=0, most=3) == [0]
    assert sibling_counts([law(0.5, 0.5)], [0], budget=4, most=0) == [0]
    assert sibling_counts([law(1.0, 0.0)], [0], budget=4, most=3) == [0]  # nothing else has mass


def test_draw_siblings_after_earlier_draws():
    q = torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0], dtype=torch.float64)

    class First:
        def categorical(self, probs):
            return int((probs > 0).nonzero()[0])

    tokens, laws = draw_siblings(q, 5, First(), drawn=[0])
    assert tokens == [1, 2, 3]  # the support is exhausted after three more: 0 was drawn, 4 has no mass
    torch.testing.assert_close(laws[0], without(q, [0]))
    torch.testing.assert_close(laws[2], without(q, [0, 1, 2]))


class Argmax:
    """A sampler that always takes the most likely token (deterministic 'sampling': the drafter returns laws)."""

    def categorical(self, probs):
        return int(probs.argmax())

    def device_categorical(self, probs):
        return probs.argmax()


@pytest.mark.parametrize("do_sample, sampled_siblings", [(False, False), (True, False), (True, True)])
def test_model_drafter_tree_has_the_chosen_shape(do_sample, sampled_siblings):
    """`ModelDrafter.propose_tree`: the chain first, then at each position as many alternatives as
    `sibling_counts` gives from the chain's laws; top-k point masses, or (sampled siblings) draws without
    replacement after the chain's token carrying ``q`` without the earlier draws."""
    model = make_model("llama-gqa", logit_scale=0.3)  # flat laws: every position is worth branching at
    sequence = random_prompt(30, seed=3)
    depth, nodes, branch = 4, 9, 3

    def drafter():
        made = ModelDrafter(model, 4, 64, LogitsProcessorList(), do_sample, Argmax(), sampled_siblings)
        made.prefill(sequence)
        return made

    with torch.no_grad():
        chain, probs = drafter().propose(sequence, depth)
        tree = drafter().propose_tree(sequence, depth, nodes, branch)
        if probs is None:  # greedy: the laws from a sampling twin (Argmax draws: the same chain)
            twin = ModelDrafter(model, 4, 64, LogitsProcessorList(), True, Argmax())
            twin.prefill(sequence)
            chain_twin, probs = twin.propose(sequence, depth)
            assert chain_twin == chain
    laws = list(probs)
    counts = sibling_counts(laws, chain, nodes - depth, branch - 1)
    assert sum(counts) == nodes - depth  # the budget binds: depth * (branch - 1) > nodes - depth
    assert tree.path_tokens(depth - 1) == chain  # the first path is the chain
    chain_nodes = tree.path(depth - 1)
    for position, (parent, count) in enumerate(zip([-1] + chain_nodes[:-1], counts)):
        children = tree.children(parent)
        assert children[0] == chain_nodes[position] and len(children) == 1 + count
        alternatives = [tree.tokens[c] for c in children[1:]]
        expected_law = laws[position]
        if do_sample and sampled_siblings:  # Argmax draws: the likeliest left, each with q without the earlier
            drawn = [chain[position]]
            for child in children[1:]:
                torch.testing.assert_close(tree.laws[child], without(expected_law, drawn))
                drawn.append(tree.tokens[child])
        else:
            others = expected_law.clone()
            others[chain[position]] = 0
            assert alternatives == others.topk(count).indices.tolist()
            assert all(tree.laws[c] is None for c in children[1:])
