"""The tree rule (`verification.tree.TreeVerifier`), enumerated exactly over one drafted-and-verified tree.

A target ``p`` and a draft ``q`` are random functions of the context (vocabulary 4, some zero-probability
tokens). One step drafts a tree from ``q`` (siblings i.i.d., without replacement, deterministic top-k, or a
point mass followed by draws without replacement), verifies it against ``p``, and completes the emitted
tokens to a fixed length with draws from ``p``; every random choice of the step — drafting, coins, residual
and bonus draws — goes through a `ReplaySampler` and the completion's law is ``p``'s own (summed in closed
form), so the law of the output is known exactly and must equal ``p``'s sequence law within 1e-6. The
mutation tests substitute wrong rules and assert they are caught.
"""

from __future__ import annotations

import functools
import itertools
import random
from collections import defaultdict

import pytest
import torch

from hf_triforce.verification.draft_tree import DraftTree, draw_siblings, without
from hf_triforce.verification.sampling import residual_distribution
from hf_triforce.verification.tree import TreeVerifier

from .enumeration_util import enumerate_outcomes


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Tens of thousands of tiny-tensor calls: a second intra-op thread only waits (ms per call on a busy host)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


VOCAB, TOLERANCE = 4, 1e-6  # the verifier works in fp32 (`scores_to_probs`)


@functools.cache
def law_of(context: tuple[int, ...], salt: int, sharpness: float = 1.5) -> torch.Tensor:
    """A fixed random distribution per context (float64), with one zero-probability token in some contexts."""
    generator = torch.Generator().manual_seed(hash((salt,) + context) % (2**31))
    logits = torch.randn(VOCAB, generator=generator, dtype=torch.float64) * sharpness
    if int(torch.randint(0, 3, (1,), generator=generator)) == 0:
        logits[int(torch.randint(0, VOCAB, (1,), generator=generator))] = -float("inf")
    return torch.softmax(logits, -1)


def target(context):
    return law_of(context, 1)


def draft(context):
    return law_of(context, 2, sharpness=0.7)


def draw_children(context, count, kind, sampler):
    """``count`` siblings after ``context`` and the laws they were drawn with."""
    q = draft(context)
    if kind == "iid":
        tokens = [sampler.categorical(q) for _ in range(count)]
        return tokens, [q] * count
    if kind == "without replacement":
        return draw_siblings(q, count, sampler)
    if kind == "top-k":  # deterministic: point masses
        tokens = q.argsort(descending=True)[:count].tolist()
        return tokens, [None] * len(tokens)
    if kind == "match then sampled":  # a lookup's deterministic match, then model draws without replacement
        first = int(q.argmin()) if q.min() > 0 else int(q.argmax())
        tokens, laws = [first], [None]
        for _ in range(count - 1):
            law = without(q, tokens)
            tokens.append(sampler.categorical(law))
            laws.append(law)
        return tokens, laws
    if kind == "wrong: q for draws without replacement":
        tokens, _ = draw_siblings(q, count, sampler)
        return tokens, [q] * len(tokens)
    raise ValueError(kind)


def draw_tree(context, shape, kind, sampler) -> DraftTree:
    """Breadth first: ``shape`` is the nested list of each node's children (``[[[], []], []]``: the root has two
    children, the first of which has two)."""
    tokens, parents, laws = [], [], []
    frontier = [(-1, context, shape)]
    while frontier:
        parent, ctx, children = frontier.pop(0)
        if not children:
            continue
        drawn, drawn_laws = draw_children(ctx, len(children), kind, sampler)
        for token, law, grandchildren in zip(drawn, drawn_laws, children):
            tokens.append(token)
            parents.append(parent)
            laws.append(law)
            frontier.append((len(tokens) - 1, ctx + (token,), grandchildren))
    return DraftTree(tokens, parents, laws)


def depth_of(shape) -> int:
    return 1 + max((depth_of(child) for child in shape), default=0)


def continuation_law(emitted: tuple[int, ...], new: int) -> dict[tuple[int, ...], float]:
    """``emitted`` completed to ``new`` tokens with ``p``'s draws: every completion and its probability under ``p``."""
    law = {}
    for completion in itertools.product(range(VOCAB), repeat=new - len(emitted)):
        probability, context = 1.0, (0,) + emitted
        for token in completion:
            probability *= float(target(context)[token])
            context += (token,)
        law[emitted + completion] = probability
    return law


def one_step_law(shape, kind, verifier_class=TreeVerifier, resample=residual_distribution):
    """``(distance to p's law, total probability, paths)`` of one step's emission completed to a fixed length.

    The step's random choices are enumerated; the completion's draws from ``p`` are summed in closed form (the
    law of ``emitted + completion`` is the law of ``emitted`` times ``p``'s law of the completion)."""
    new = depth_of(shape)  # the longest emission: every level accepted, then the bonus token

    def run(sampler):
        context = (0,)
        tree = draw_tree(context, shape, kind, sampler)
        scores = torch.log(torch.stack([target(context + tuple(tree.path_tokens(node)))
                                        for node in range(-1, len(tree))]))
        path, token = verifier_class(True, sampler, resample).verify(tree, scores)
        return tuple(tree.tokens[node] for node in path) + (token,)

    emissions, paths = enumerate_outcomes(run)
    law = defaultdict(float)
    for emitted, probability in emissions.items():
        for sequence, completion in continuation_law(emitted, new).items():
            law[sequence] += probability * completion
    exact = continuation_law((), new)
    distance = max(abs(law.get(key, 0.0) - exact[key]) for key in exact)
    return distance, sum(law.values()), paths


SHAPES = {
    "three siblings": [[], [], []],
    "two levels, uneven": [[[], []], [[]]],
    "three levels": [[[[]], []], []],
}
KINDS = ["iid", "without replacement", "top-k", "match then sampled"]


@pytest.mark.parametrize("shape, kind", list(itertools.product(SHAPES, KINDS)))
def test_one_tree_step_emits_the_target_law(shape, kind):
    distance, total, paths = one_step_law(SHAPES[shape], kind)
    assert abs(total - 1.0) < 1e-9 and paths > 8
    assert distance < TOLERANCE


class ResidualFromTheOriginalTarget(TreeVerifier):
    """Wrong: each rejected sibling's residual is taken from the node's p, not from the running residual."""

    def acceptance(self, tree, probs, *tables):
        self.resample = lambda residual, q: residual_distribution(probs, q)
        return super().acceptance(tree, probs, *tables)


MUTATIONS = {
    "residual not updated after a rejected sibling": (TreeVerifier, lambda r, q: r, "without replacement"),
    "residual from the original p": (ResidualFromTheOriginalTarget, residual_distribution, "without replacement"),
    "residual not updated, point masses": (TreeVerifier, lambda r, q: r, "top-k"),
    "q instead of the without-replacement law": (TreeVerifier, residual_distribution,
                                                 "wrong: q for draws without replacement"),
}


@pytest.mark.parametrize("mutation", sorted(MUTATIONS))
@pytest.mark.parametrize("shape", ["three siblings", "two levels, uneven"])
def test_each_wrong_rule_is_caught(shape, mutation):
    verifier_class, resample, kind = MUTATIONS[mutation]
    distance, total, _ = one_step_law(SHAPES[shape], kind, verifier_class, resample)
    assert abs(total - 1.0) < 1e-9
    assert distance > 100 * TOLERANCE, f"the enumeration did not catch: {mutation}"


def test_greedy_accepts_the_longest_path_matching_argmax():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(0, 12)
        parents = [rng.randint(-1, i - 1) for i in range(n)]
        tree = DraftTree([rng.randrange(3) for _ in range(n)], parents)
        scores = torch.randn(n + 1, 3, generator=torch.Generator().manual_seed(rng.randrange(10**6)))
        best = scores.argmax(-1).tolist()
        path, token = TreeVerifier(False, None).verify(tree, scores)
        # brute force: the deepest node whose every path token is its parent's argmax (first in node order)
        matching = [node for node in range(n)
                    if all(tree.tokens[i] == best[tree.parents[i] + 1] for i in tree.path(node))]
        deepest = max(matching, key=lambda node: len(tree.path(node)), default=None)
        expected = [] if deepest is None else tree.path(deepest)
        assert len(path) == len(expected)
        assert [tree.tokens[i] for i in path] == [tree.tokens[i] for i in expected]
        assert token == best[(path[-1] if path else -1) + 1]


def test_a_chain_tree_verifies_as_the_chain_rule():
    """One child per node: the tree rule is `ChainVerifier`'s, draw for draw."""
    from hf_triforce.verification.sampling import ChainVerifier

    g = torch.Generator().manual_seed(5)
    scores = torch.randn(4, 6, generator=g, dtype=torch.float64)
    probs = torch.softmax(torch.randn(3, 6, generator=g, dtype=torch.float64), -1)
    tokens = [1, 4, 2]
    chain, _ = enumerate_outcomes(lambda sampler: ChainVerifier(True, sampler).verify(tokens, probs, scores))
    tree = DraftTree.chain(tokens, probs)

    def tree_run(sampler):
        path, token = TreeVerifier(True, sampler).verify(tree, scores)
        return len(path), token

    law, _ = enumerate_outcomes(tree_run)
    assert law.keys() == chain.keys() and all(abs(law[k] - chain[k]) < 1e-12 for k in law)


def test_without_replacement_laws():
    q = torch.tensor([0.5, 0.3, 0.2, 0.0], dtype=torch.float64)
    assert torch.allclose(without(q, [0]), torch.tensor([0.0, 0.6, 0.4, 0.0], dtype=torch.float64))
    with pytest.raises(ValueError, match="no tokens left"):
        without(q, [0, 1, 2])


def test_tree_structure():
    tree = DraftTree([5, 6, 7, 8], [-1, -1, 0, 2])
    assert tree.depths() == [1, 1, 2, 3]
    assert tree.children(-1) == [0, 1] and tree.path(3) == [0, 2, 3] and tree.leaves() == [1, 3]
    assert tree.positions(10).tolist() == [[10, 10, 11, 12]]
    assert tree.visibility().tolist() == [[True, False, False, False], [False, True, False, False],
                                          [True, False, True, False], [True, False, True, True]]
    assert DraftTree.chain([1, 2, 3]).is_chain() and not tree.is_chain()
    assert tree.side_nodes([0, 2, 3]) == 0 and tree.side_nodes([1]) == 1
    assert tree.as_chain() is None and DraftTree.chain([4, 5]).as_chain() == ([4, 5], None)
    with pytest.raises(ValueError, match="parents must be listed first"):
        DraftTree([1, 2], [1, -1])
