"""Exact verification of a candidate tree (`tree.DraftTree`): greedy and sampled.

**Greedy.** Accept the deepest node whose path matches the verifier's ``argmax`` at every step (the first
in node order among equals); emit the ``argmax`` after it. This accepts the longest root-to-node path that plain greedy
decoding would produce, and the emitted tokens are exactly greedy decoding's.

**Sampled: recursive rejection sampling over siblings** (SpecInfer's multi-step speculative sampling, Miao et
al. 2023, arXiv:2305.09781; its without-replacement form is Recursive Speculative Decoding, Jeon et al. 2024,
arXiv:2402.14160). At a node whose target distribution is ``p`` and whose children ``x_1 .. x_k`` were drawn
with the laws ``q_1 .. q_k`` (``q_j``: the law of ``x_j`` given the path and ``x_1 .. x_{j-1}``)::

    r_1 = p
    for j = 1 .. k:
        accept x_j with probability min(1, r_j(x_j) / q_j(x_j)) -> descend into x_j (its own p, its children)
        otherwise r_{j+1} = norm(max(r_j - q_j, 0))          # the residual, updated after every rejection
    all rejected: emit a draw from r_{k+1}                     # no children: a bonus draw from p

*Exactness.* Claim: given the history ``h_j`` (path and ``x_1 .. x_{j-1}``), the token this node emits is
distributed as ``r_j``. For ``j = k + 1`` it is drawn from ``r_{k+1}``. For ``j <= k``: ``x_j ~ q_j`` given
``h_j`` (the drafter's contract) and the coin is fresh, so the token is ``y = x_j`` accepted with mass
``min(r_j, q_j)(y)``, or, with probability ``1 - sum min(r_j, q_j) = sum max(r_j - q_j, 0)``, a rejection after
which (induction: ``r_{j+1}`` does not depend on ``x_j``) it is distributed as ``r_{j+1} = max(r_j - q_j, 0) /
sum max(r_j - q_j, 0)``. Together: ``min(r_j, q_j) + max(r_j - q_j, 0) = r_j``. At ``j = 1`` the emitted token
is distributed as ``p``; given an accepted child, the next token is emitted by the same rule one level down,
with that child's ``p``. So every emitted token has the target's law given the tokens before it.

The rule needs ``q_j`` to be the law ``x_j`` was *actually* drawn with given ``h_j``: i.i.d. siblings carry
``q``; siblings drawn without replacement carry ``q`` without the earlier siblings, renormalised
(`tree.draw_siblings`); deterministic siblings (n-gram matches, top-k picks) are point masses (``None``), for
which a rejection removes the token's mass: ``r_{j+1} = norm(r_j`` without ``x_j)``. Precisely, ``q_j`` is the law
of ``x_j`` given everything drawn before it that it depends on; that may include the earlier siblings' subtrees
(and whether ``x_j`` exists may depend on them too): the proof holds with ``h_j`` extended by those subtrees,
since all drafting precedes the coins, the coins are fresh and ``r_{j+1}`` depends on ``h_j`` and ``q_j`` only
(docs/exactness.md). With one child per node this is the chain rule of `sampling.ChainVerifier`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .draft_tree import DraftTree
from .sampling import Resample, Sampler, acceptance_probability, point_mass, residual_distribution, scores_to_probs


@dataclass
class TreeVerifier:
    """Verifies a `DraftTree` against ``len(tree) + 1`` rows of processed target scores (row 0: the root).

    ``resample(r, q)`` is the residual update after a rejected sibling (exact: `residual_distribution`); a
    field, like `ChainVerifier`'s, so that tests can substitute a wrong rule and see it caught.
    """

    do_sample: bool
    sampler: Sampler
    resample: Resample = residual_distribution

    def choose_child(self, tree: DraftTree, children: list[int], p: torch.Tensor) -> tuple[int | None, int]:
        """Recursive rejection sampling over ``children`` against ``p``: ``(accepted child, its token)`` or
        ``(None, token drawn from the final residual)``."""
        residual = p
        for child in children:
            token = tree.tokens[child]
            q = tree.laws[child]
            if q is None:
                q = point_mass(token, p)
            if self.sampler.bernoulli(acceptance_probability(residual[token], q[token])):
                return child, token
            residual = self.resample(residual, q)
        return None, self.sampler.categorical(residual)

    def verify(self, tree: DraftTree, target_scores: torch.Tensor) -> tuple[list[int], int]:
        """``(path, next_token)``: the accepted nodes from the root down, then the token emitted after them."""
        n = len(tree)
        if target_scores.shape[0] != n + 1:
            raise ValueError(f"verify needs {n + 1} rows of target scores (root + {n} nodes), "
                             f"got {target_scores.shape[0]}")
        path: list[int] = []
        node = -1
        if not self.do_sample:
            best = target_scores.argmax(-1).tolist()
            # a node stands if its token is its parent's argmax and its parent stands; the deepest standing node
            # (the first in node order among equals, should siblings repeat a token) ends the accepted path
            depth = {-1: 0}
            for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
                if parent in depth and token == best[parent + 1]:
                    depth[i] = depth[parent] + 1
            node = max(depth, key=lambda i: (depth[i], -i))
            path = tree.path(node)
            return path, best[node + 1]
        probs = scores_to_probs(target_scores)
        while True:
            child, token = self.choose_child(tree, tree.children(node), probs[node + 1])
            if child is None:
                return path, token
            path.append(child)
            node = child
