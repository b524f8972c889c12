"""Frequency lookup drafting (``"suffix"``): the continuation most often seen after the sequence's suffix.

Where ``"ngram"`` copies what followed the most recent occurrence of the suffix, this drafter walks every
earlier occurrence at once, as a suffix trie would: at each step it proposes the token that most of the
still-matching occurrences continue with (ties: the smallest token id) and keeps only those occurrences.
Repeated phrasing in a long document then drafts its usual continuation rather than its latest one.
Deterministic: point-mass proposals. Uses ``ngram_max`` / ``ngram_min`` for the suffix length.
"""

from __future__ import annotations

import time

import numpy as np
import torch

from .ngram import LookupDrafter, occurrences
from .registry import DraftContext, host_row, register_drafter


class SuffixDrafter(LookupDrafter):
    def _continuations(self, seq: np.ndarray) -> np.ndarray:
        """Positions right after each earlier occurrence of the longest matching suffix (empty: no match)."""
        for size in self.suffix_sizes(seq.shape[0]):
            hits = occurrences(seq, size)
            if hits.size:
                return hits + size
        return np.empty(0, dtype=np.int64)

    def propose(self, sequence: torch.Tensor | np.ndarray, n: int) -> tuple[list[int], None]:
        start = time.perf_counter()
        seq = host_row(sequence)
        starts = self._continuations(seq)
        tokens: list[int] = []
        while len(tokens) < n:
            starts = starts[starts < seq.shape[0]]
            if not starts.size:
                break
            following = seq[starts]
            values, counts = np.unique(following, return_counts=True)
            best = values[counts.argmax()]
            tokens.append(int(best))
            starts = starts[following == best] + 1
        self.seconds += time.perf_counter() - start
        return tokens, None


def _build(context: DraftContext) -> SuffixDrafter:
    return SuffixDrafter(context.config.ngram_max, context.config.ngram_min)


register_drafter("suffix", _build, "lookup",
                 "frequency lookup: the continuation most earlier occurrences of the suffix share")
