"""Prompt-lookup drafting (``"ngram"``): continue the most recent earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import time

import numpy as np
import torch

from ..verification.draft_tree import DraftTree, TreeBuilder
from .registry import Drafter, host_row, register_drafter

# occurrences of one suffix size a tree looks at, most recent first: bounds the per-occurrence Python work of a
# common short suffix in a long prompt (a budget, not a tuned value)
TREE_OCCURRENCES = 64


class LookupDrafter(Drafter):
    """A drafter that reads only the earlier occurrences of the sequence's suffix of ``ngram_max`` .. ``ngram_min``
    tokens (on the host): it holds no state, so there is nothing to prefill, roll back or count."""

    host_sequence = True

    def __init__(self, ngram_max: int, ngram_min: int):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min

    def suffix_sizes(self, length: int) -> range:
        """The suffix sizes to match in a sequence of ``length`` tokens, longest first."""
        return range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1)

    def prefill(self, prompt: torch.Tensor) -> None:
        pass

    def rollback(self, length: int) -> None:
        pass

    def nbytes(self) -> int:
        return 0


class NgramDrafter(LookupDrafter):
    """The longest suffix of ``ngram_max`` .. ``ngram_min`` tokens that occurred earlier (prompt or output)
    is continued as it continued at its most recent occurrence. Deterministic: point-mass proposals."""

    def propose(self, sequence: torch.Tensor | np.ndarray, n: int) -> tuple[list[int], None]:
        start = time.perf_counter()
        seq = host_row(sequence)
        try:
            for size in self.suffix_sizes(seq.shape[0]):
                hits = occurrences(seq, size)
                if hits.size:
                    begin = int(hits[-1]) + size
                    return seq[begin : begin + n].tolist(), None
            return [], None
        finally:
            self.seconds += time.perf_counter() - start

    def propose_tree(self, sequence: torch.Tensor | np.ndarray, depth: int, nodes: int, branch: int) -> DraftTree:
        """Distinct continuations of the suffix's occurrences as one tree: the longest suffix first, each size's
        occurrences most recent first, so the first path is `propose`'s chain; shorter suffixes add
        alternatives. Deterministic (point masses), no side effects."""
        start = time.perf_counter()
        seq = host_row(sequence)
        builder = TreeBuilder(nodes, branch)
        try:
            for size in self.suffix_sizes(seq.shape[0]):
                for hit in occurrences(seq, size)[::-1][:TREE_OCCURRENCES].tolist():
                    builder.add_path(seq[hit + size : hit + size + depth].tolist())
                    if len(builder.tokens) >= nodes:
                        return builder.tree()
            return builder.tree()
        finally:
            self.seconds += time.perf_counter() - start


def occurrences(seq: np.ndarray, size: int) -> np.ndarray:
    """Start positions, increasing, of the earlier occurrences of ``seq``'s last ``size`` tokens that have a
    continuation (``seq``: 1-D host token ids)."""
    windows = np.lib.stride_tricks.sliding_window_view(seq[: seq.shape[0] - 1], size)
    return np.flatnonzero((windows == seq[seq.shape[0] - size :]).all(1))


register_drafter("ngram", lambda context: NgramDrafter(context.config.ngram_max, context.config.ngram_min),
                 "lookup", "n-gram lookup: the most recent earlier occurrence of the suffix (prompt and output)",
                 trees=True)
