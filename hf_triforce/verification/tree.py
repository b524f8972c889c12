"""Exact verification of a candidate tree (`tree.DraftTree`): greedy and sampled.

**Greedy.** Accept the deepest node whose path matches the verifier's ``argmax`` at every step (the first
in node order among equals); emit the ``argmax`` after it: exactly greedy decoding's tokens.

**Sampled: recursive rejection sampling over siblings** (SpecInfer, arXiv:2305.09781; without replacement,
Recursive Speculative Decoding, arXiv:2402.14160). At a node whose target distribution is ``p`` and whose children
``x_1 .. x_k`` were drawn with the laws ``q_1 .. q_k`` (``q_j``: the law of ``x_j`` given the path and
``x_1 .. x_{j-1}``)::

    r_1 = p
    for j = 1 .. k:
        accept x_j with probability min(1, r_j(x_j) / q_j(x_j)) -> descend into x_j (its own p, its children)
        otherwise r_{j+1} = norm(max(r_j - q_j, 0))          # the residual, updated after every rejection
    all rejected: emit a draw from r_{k+1}                     # no children: a bonus draw from p

The proof, and what ``q_j`` must be (i.i.d. siblings: ``q``; drawn without replacement: ``q`` without the earlier
siblings, `draft_tree.draw_siblings`; deterministic siblings: point masses, ``None``), are in docs/exactness.md,
"Candidate trees". With one child per node this is the chain rule of `sampling.ChainVerifier`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..tokens import device_tokens
from .draft_tree import DraftTree
from .sampling import Resample, Sampler, acceptance_probability, residual_distribution, scores_to_probs
from .scoring import read_back


@dataclass
class TreeVerifier:
    """Verifies a `DraftTree` against ``len(tree) + 1`` rows of processed target scores (row 0: the root).

    ``resample(r, q)`` is the residual update after a rejected sibling (exact: `residual_distribution`), applied to
    rows ``[rows, vocab]``; a field, like `ChainVerifier`'s, so that tests can substitute a wrong rule and see it
    caught.

    Sampling, the walk runs on the device and the host reads its result once (`scoring.read_back`): every node's
    acceptance probabilities are computed before the walk (`acceptance`), and the walk takes one level per depth,
    tossing a node's children's rejection coins in order (`Sampler.leading_successes`: the same law as trying them
    one by one; docs/exactness.md, "On the device, one readback"); past the emitting node a level's coins are
    certain rejections, so a sampler that tosses coins one at a time draws nothing there.
    """

    do_sample: bool
    sampler: Sampler
    resample: Resample = residual_distribution

    def acceptance(self, tree: DraftTree, probs: torch.Tensor, tokens: torch.Tensor, children: torch.Tensor,
                   drawn: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(accept, residual)``: ``accept`` ``[n + 1, width]``, per node row (0: the root, ``i + 1``: node ``i``) and
        child slot, the probability that the child is accepted given that its earlier siblings were rejected (0 where
        the slot is empty); ``residual`` ``[n + 1, vocab]``, each row's law after all its children were rejected (its
        ``p`` where it has none). ``probs``: ``[n + 1, vocab]`` target probabilities; on their device, ``tokens``
        ``[max(n, 1)]`` the nodes' tokens, ``children`` ``[n + 1, width]`` node indices (-1 past a row's children),
        ``drawn`` the nodes that carry a law (the others are point masses). Computed in the laws' precision where it
        is wider than ``probs``' (as `ChainVerifier` does)."""
        laws = [law for law in tree.laws if law is not None]
        dtype = torch.promote_types(probs.dtype, laws[0].dtype) if laws else probs.dtype
        q_rows = torch.zeros(tokens.shape[0], probs.shape[1], dtype=dtype, device=probs.device)
        q_rows.scatter_(1, tokens[:, None], 1.0)
        if laws:
            q_rows.index_copy_(0, drawn, torch.stack(laws).to(q_rows))
        present, nodes = children >= 0, children.clamp(min=0)
        slots = zip(present.unsqueeze(-1).unbind(1), nodes.unbind(1), tokens[nodes].unsqueeze(-1).unbind(1))
        residual, chances = probs, []
        for here, node, token in slots:  # [n + 1, 1], [n + 1], [n + 1, 1]
            q = q_rows.index_select(0, node)
            chances.append(acceptance_probability(residual.gather(1, token), q.gather(1, token)))
            residual = torch.where(here, self.resample(residual, q), residual)
        accept = torch.where(present, torch.cat(chances, 1), 0.0)
        return accept, residual

    def verify(self, tree: DraftTree, target_scores: torch.Tensor) -> tuple[list[int], int]:
        """``(path, next_token)``: the accepted nodes from the root down, then the token emitted after them."""
        n = len(tree)
        if target_scores.shape[0] != n + 1:
            raise ValueError(f"verify needs {n + 1} rows of target scores (root + {n} nodes), "
                             f"got {target_scores.shape[0]}")
        if not self.do_sample:
            best = target_scores.argmax(-1).tolist()
            # a node stands if its token is its parent's argmax and its parent stands; the deepest standing node
            # (the first in node order among equals, should siblings repeat a token) ends the accepted path
            depth = {-1: 0}
            for i, (token, parent) in enumerate(zip(tree.tokens, tree.parents)):
                if parent in depth and token == best[parent + 1]:
                    depth[i] = depth[parent] + 1
            node = max(depth, key=lambda i: (depth[i], -i))
            return tree.path(node), best[node + 1]
        probs = scores_to_probs(target_scores)
        rows = [tree.children(node) for node in range(-1, n)]
        width = max(1, *map(len, rows))
        # the walk's states: node row r (0: the root, i + 1: node i), and `emitted + r` once row r emitted (every child
        # rejected; absorbing: its coins are certain rejections). From state s after k rejections it moves to
        # moves[s, k]: its k-th child's row, or `emitted + s` past its children
        emitted = n + 1
        parts = [tree.tokens or [0], [child for row in rows for child in row + [-1] * (width - len(row))],
                 [move for r, row in enumerate(rows) for move in [child + 1 for child in row]
                  + [emitted + r] * (width + 1 - len(row))]
                 + [emitted + r for r in range(n + 1) for _ in range(width + 1)],
                 [node for node, law in enumerate(tree.laws) if law is not None]]
        # the tree's structure in one transfer to the device: tokens, children, moves, the nodes that carry a law
        tokens, children, moves, drawn = device_tokens(sum(parts, []), probs.device).split(list(map(len, parts)))
        accept, residual = self.acceptance(tree, probs, tokens, children.view(n + 1, width), drawn)
        # [2n + 2, width] rejection coins, in float64 (1 - a is exact for a float32 a)
        rejection = torch.cat((1.0 - accept.double(), accept.new_ones(n + 1, width, dtype=torch.float64)))
        state, visited = tokens.new_zeros(1), []
        for _ in range(max(tree.depths(), default=0) + 1):
            rejected = self.sampler.leading_successes(rejection.index_select(0, state).view(-1))
            state = moves.index_select(0, torch.add(rejected, state, alpha=width + 1))
            visited.append(state)
        # at the end the walk has emitted (a leaf rejects every coin): the next token comes from that row's residual
        next_token = self.sampler.device_categorical(residual.index_select(0, state - emitted)[0])
        *states, next_token = read_back(torch.cat((*visited, next_token.view(1))))
        return [state - 1 for state in states if state < emitted], next_token
