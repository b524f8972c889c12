"""Sizes derived from a `TriForceConfig`, once per call by `resolved.resolve`: how many rows a verification
scores, how many tokens a lookup chain may hold, how many recent tokens the retrieval cache keeps, how many entries
Force 1's sink+window cache is allocated for. Functions of the
configuration, not fields of it: a user sets ``gamma1``, ``gamma2``, the tree sizes and the retrieval fields; these
follow."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ..config import TriForceConfig

# the longest lookup chain the adaptive policy verifies in one two-level step, HF prompt lookup's default: lookups cost
# nothing to draft, and chains capped at gamma2 fell far behind it (docs/config.md, "Choosing budgets and gammas")
LOOKUP_GAMMA2 = 10


def lookup_gamma2(config: TriForceConfig) -> int:
    """Most tokens a lookup drafter (``"ngram"``, ``"suffix"``) proposes straight to Force 3: at least `LOOKUP_GAMMA2`
    under ``policy="auto"`` (drafting them costs nothing; the policy prices their rows), else ``gamma2``."""
    return max(config.gamma2, LOOKUP_GAMMA2) if config.policy == "auto" else config.gamma2


def force3_rows(config: TriForceConfig) -> int:
    """At least the most proposals one Force-3 verification scores: a chain of ``gamma2`` (a lookup's
    `lookup_gamma2`), or a tree of ``tree_nodes`` / ``force2_tree_nodes``."""
    return max(config.gamma2, lookup_gamma2(config), config.tree_nodes, config.force2_tree_nodes)


def proposal_rows(config: TriForceConfig) -> int:
    """Most rows Force 1 proposes for one Force-2 verification: ``gamma1``, or a tree's ``tree_nodes``."""
    return max(config.gamma1, config.tree_nodes)


def recent_tokens(config: TriForceConfig) -> int:
    """Recent tokens the retrieval cache always keeps: ``retrieval_recent``, or by default a quarter of
    ``retrieval_budget`` rounded down to whole chunks."""
    if config.retrieval_recent is not None:
        return config.retrieval_recent
    return (config.retrieval_budget // 4) // config.chunk_size * config.chunk_size


def round_rows(config: TriForceConfig) -> int:
    """Tail room a step's Force-2 rounds need in the retrieval cache: Force 1's most proposals (`proposal_rows`),
    Force 2's chain of up to ``gamma2`` tokens, and two rows more."""
    return proposal_rows(config) + config.gamma2 + 2


def sink_window_rows(config: TriForceConfig, max_length: int | None) -> int:
    """Entries Force 1's sink+window cache is allocated for in a call whose sequence reaches ``max_length`` positions
    (None: unknown): ``sink_tokens + window``, or fewer where the call never fills them -- ``max_length`` plus the
    most entries a step feeds a drafter past the committed tokens (a Force-2 round's tail, `round_rows`, and a
    proposal of up to `force3_rows` for Force 3, its bonus token and one more). The cache evicts at
    ``sink_tokens + window`` either way (`caches.sink_window.SinkWindowCache`), so a call that stays below it keeps
    every entry in both sizes."""
    limit = config.sink_tokens + config.window
    if max_length is None:
        return limit
    return min(limit, max_length + force3_rows(config) + 2 + round_rows(config))
