"""A candidate tree: several proposed continuations of the committed sequence sharing their prefixes.

Node ``i`` proposes ``tokens[i]`` after its parent (``parents[i]``; ``-1``: after the last committed token,
the *root*). Nodes are listed parents first (``parents[i] < i``) and the children of one node in the order
they were drawn: that order is the order in which verification tries them (`verification.tree`).

``laws[i]`` is the distribution node ``i`` was actually drawn from, *conditional on its ancestors and on its
earlier siblings* (``None``: a point mass, a deterministic proposal such as an n-gram match or a top-k pick).
Siblings drawn without replacement from a draft distribution ``q`` therefore carry ``q`` renormalised
without the earlier siblings' tokens, not ``q`` (`draw_siblings`). A chain is a tree whose nodes each have
one child.

Verifying a tree takes one forward of all its nodes placed after the cached sequence: node ``i`` sits at
position ``cached + depth[i]`` and attends to the cached entries and to its ancestors and itself
(`visibility`). Row ``0`` of the verifier's scores is the root's (the last committed token's), row
``i + 1`` node ``i``'s.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class DraftTree:
    tokens: list[int]
    parents: list[int]
    laws: list[torch.Tensor | None] = field(default_factory=list)

    def __post_init__(self) -> None:
        if len(self.parents) != len(self.tokens):
            raise ValueError(f"DraftTree: {len(self.tokens)} tokens but {len(self.parents)} parents")
        if not self.laws:
            self.laws = [None] * len(self.tokens)
        if len(self.laws) != len(self.tokens):
            raise ValueError(f"DraftTree: {len(self.tokens)} tokens but {len(self.laws)} laws")
        for i, parent in enumerate(self.parents):
            if not -1 <= parent < i:
                raise ValueError(f"DraftTree: node {i} has parent {parent}; parents must be listed first (-1: root)")

    @classmethod
    def chain(cls, tokens: list[int], probs: torch.Tensor | None = None) -> DraftTree:
        """A chain as a tree: node ``i``'s parent is node ``i - 1``; ``probs[i]`` its law (None: point masses)."""
        laws = [None] * len(tokens) if probs is None else [probs[i] for i in range(len(tokens))]
        return cls(list(tokens), list(range(-1, len(tokens) - 1)), laws)

    def __len__(self) -> int:
        return len(self.tokens)

    def children(self, node: int) -> list[int]:
        """The children of ``node`` (``-1``: the root) in the order they were drawn."""
        return [i for i, parent in enumerate(self.parents) if parent == node]

    def depths(self) -> list[int]:
        """Depth of each node: 1 for the root's children."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return depths

    def path(self, node: int) -> list[int]:
        """The nodes from the root's child down to ``node`` (empty for the root)."""
        nodes = []
        while node >= 0:
            nodes.append(node)
            node = self.parents[node]
        return nodes[::-1]

    def path_tokens(self, node: int) -> list[int]:
        return [self.tokens[i] for i in self.path(node)]

    def side_nodes(self, path: list[int]) -> int:
        """Nodes of ``path`` that are not their parent's first child: what the tree gained over its first chain."""
        return sum(1 for node in path if self.children(self.parents[node])[0] != node)

    def as_chain(self) -> tuple[list[int], torch.Tensor | None] | None:
        """``(tokens, probs)`` when this tree is a chain whose laws are all point masses (``probs`` None) or all
        distributions (stacked), so that it can take the cheaper chain path; else None."""
        if not self.is_chain():
            return None
        if all(law is None for law in self.laws):
            return list(self.tokens), None
        if all(law is not None for law in self.laws):
            return list(self.tokens), torch.stack(self.laws)
        return None

    def leaves(self) -> list[int]:
        parents = set(self.parents)
        return [i for i in range(len(self)) if i not in parents]

    def is_chain(self) -> bool:
        return self.parents == list(range(-1, len(self) - 1))

    def visibility(self, device: torch.device | None = None) -> torch.Tensor:
        """``[n, n]`` bool: row ``i`` sees node ``j`` iff ``j`` is ``i`` or one of its ancestors."""
        n = len(self)
        visible = torch.zeros(n, n, dtype=torch.bool)
        for i, parent in enumerate(self.parents):
            if parent >= 0:
                visible[i] = visible[parent]
            visible[i, i] = True
        return visible.to(device) if device is not None else visible

    def positions(self, first: int, device: torch.device | None = None) -> torch.Tensor:
        """``[1, n]`` absolute positions: a node of depth ``d`` sits at ``first + d - 1`` (``first``: the position
        right after the root token)."""
        return torch.tensor([[first - 1 + depth for depth in self.depths()]], device=device)


def without(law: torch.Tensor, tokens: list[int]) -> torch.Tensor:
    """``law`` with ``tokens`` removed and renormalised: the law of the next draw without replacement.

    Raises when nothing is left (every token of the support was drawn already)."""
    rest = law.clone()
    if tokens:
        rest[tokens] = 0.0
    total = rest.sum()
    if not total > 0:
        raise ValueError("without replacement: the draft distribution has no tokens left to draw")
    return rest / total


def draw_siblings(law: torch.Tensor, count: int, sampler, drawn: list[int] | None = None
                  ) -> tuple[list[int], list[torch.Tensor]]:
    """Up to ``count`` distinct tokens drawn from ``law`` without replacement, after the earlier siblings
    ``drawn`` (already drawn from ``law`` the same way; none by default), each with the law it was drawn from
    (``law`` without every earlier draw, renormalised): what the exact tree rule needs. Stops early when the
    support is exhausted."""
    earlier = list(drawn or [])
    tokens: list[int] = []
    laws: list[torch.Tensor] = []
    support = int((law > 0).sum()) - len(set(earlier))
    for _ in range(min(count, support)):
        current = without(law, earlier + tokens)
        tokens.append(sampler.categorical(current))
        laws.append(current)
    return tokens, laws


class TreeBuilder:
    """Grows a `DraftTree` within a budget: at most ``nodes`` nodes, ``branch`` children per node."""

    def __init__(self, nodes: int, branch: int) -> None:
        self.nodes, self.branch = nodes, branch
        self.tokens: list[int] = []
        self.parents: list[int] = []
        self.laws: list[torch.Tensor | None] = []

    def child(self, parent: int, token: int) -> int | None:
        """The existing child of ``parent`` (``-1``: the root) proposing ``token``, if any."""
        return next((i for i, (t, p) in enumerate(zip(self.tokens, self.parents)) if p == parent and t == token), None)

    def add_child(self, parent: int, token: int, law: torch.Tensor | None = None) -> int | None:
        """Append a child (after its earlier siblings); None when the budget or the branching is exhausted."""
        if len(self.tokens) >= self.nodes or self.parents.count(parent) >= self.branch:
            return None
        self.tokens.append(token)
        self.parents.append(parent)
        self.laws.append(law)
        return len(self.tokens) - 1

    def add_path(self, tokens: list[int]) -> None:
        """Insert a deterministic continuation (point masses), sharing its existing prefix, as far as the budget
        allows."""
        node = -1
        for token in tokens:
            existing = self.child(node, token)
            node = existing if existing is not None else self.add_child(node, token)
            if node is None:
                return

    def tree(self) -> DraftTree:
        return DraftTree(list(self.tokens), list(self.parents), list(self.laws))
