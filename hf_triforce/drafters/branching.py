"""Where a drafted chain branches: the node budget goes to the alternatives most likely to be accepted.

A model drafter drafts a chain ``x_1 .. x_d`` with laws ``q_1 .. q_d`` (``q_i``: the draft's distribution at
position ``i`` given the chain before it) and may add alternatives to ``x_i`` as extra children of the chain's
node ``i - 1`` (leaves: they cost no draft forward). An alternative ``a`` at position ``i`` lengthens the step by
one token exactly when verification accepts the chain's first ``i - 1`` tokens and then ``a``. Taking the draft
as an estimate of the verifier, that happens with probability about::

    value(i, a) = q_1(x_1) * ... * q_{i-1}(x_{i-1}) * q_i(a)      # P(reach position i) * P(a is right there)

the estimate EAGLE-2 ranks its draft tree's nodes by (Li et al. 2024, arXiv:2406.16858: a node's "global
acceptance probability", the product of the draft's confidences along its path). The expected tokens a tree
adds over its chain is then the sum of its alternatives' values, so the best ``budget`` alternatives are the
``budget`` highest values, at most ``most`` per position. This puts the alternatives where the chain is least
certain *and* still likely to be reached: a shallow position whose top-1 probability is low gets several, a
confident position gets none, and a deep position gets fewer as the chain's reach decays. Within a position the
values fall with the alternative's rank, so the choice is always a position's top alternatives.

Only the chain and its laws enter, so each alternative is a function of the chain (point masses) or a draw
made after it (`draft_tree.draw_siblings`): the exact tree rule's contract (`verification.tree`).
"""

from __future__ import annotations

import math

import torch

from ..verification.draft_tree import DraftTree, TreeBuilder, draw_siblings


def sibling_counts(laws: list[torch.Tensor], chain: list[int], budget: int, most: int) -> list[int]:
    """How many alternatives to add at each position of ``chain`` (``laws[i]``: the draft's law at position
    ``i``, ``chain[i]``: the token drafted there): the ``budget`` highest ``value(i, a)`` over the ``most``
    likeliest tokens ``a != chain[i]`` of each position with ``q_i(a) > 0`` (ties: the shallower position)."""
    counts = [0] * len(chain)
    if budget <= 0 or most <= 0 or not chain:
        return counts
    candidates: list[tuple[float, int, int]] = []  # (-log value, position, rank)
    log_reach = 0.0  # log P(reach position i): in log space, so that deep positions do not underflow to zero
    for position, (law, token) in enumerate(zip(laws, chain)):
        others = law.double().clone()
        others[token] = 0.0
        top = others.topk(min(most, others.shape[0])).values
        for rank, probability in enumerate(top.tolist()):
            if probability > 0.0:
                candidates.append((-(log_reach + math.log(probability)), position, rank))
        chosen = float(law[token])
        if not chosen > 0.0:  # nothing past a token the draft gives no mass (cannot happen for a drawn token)
            break
        log_reach += math.log(chosen)
    for _, position, _ in sorted(candidates)[:budget]:
        counts[position] += 1
    return counts


def branched_chain(chain: list[int], laws: list[torch.Tensor], chain_laws: list[torch.Tensor | None], nodes: int,
                   branch: int, sampler=None) -> DraftTree:
    """``chain`` (node ``i``'s law ``chain_laws[i]``: the law it was drawn from, ``None`` for a point mass) plus
    up to ``nodes - len(chain)`` alternatives as leaves where `sibling_counts` puts them (``laws``: the
    proposer's distributions along the chain), at most ``branch - 1`` per position.

    The alternatives are the position's likeliest tokens after the chain's, as point masses; with a
    ``sampler``, drawn from ``laws[i]`` without replacement after the chain's token, each carrying the law it
    was drawn with (`draft_tree.draw_siblings`). Either way each is a function of, or a fresh draw given, the chain
    and the siblings before it: the exact tree rule's contract (`verification.tree`)."""
    counts = sibling_counts(laws, chain, nodes - len(chain), branch - 1)
    builder = TreeBuilder(nodes, branch)
    parents, parent = [], -1
    for token, law in zip(chain, chain_laws):
        parents.append(parent)
        parent = builder.add_child(parent, token, law)
    for parent, token, law, count in zip(parents, chain, laws, counts):
        if count == 0:
            continue
        if sampler is not None:
            siblings, sibling_laws = draw_siblings(law, count, sampler, [token])
        else:
            others = law.clone()
            others[token] = 0.0
            siblings, sibling_laws = others.topk(count).indices.tolist(), [None] * count
        for sibling, sibling_law in zip(siblings, sibling_laws):
            builder.add_child(parent, sibling, sibling_law)
    return builder.tree()
