"""Prompt-lookup drafting (``"ngram"``): continue the most recent earlier occurrence of the sequence's suffix."""

from __future__ import annotations

import time

import torch

from .registry import register_drafter


class NgramDrafter:
    """The longest suffix of ``ngram_max`` .. ``ngram_min`` tokens that occurred earlier (prompt or output)
    is continued as it continued at its most recent occurrence. Deterministic: point-mass proposals."""

    def __init__(self, ngram_max: int, ngram_min: int):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.seconds = 0.0

    def prefill(self, prompt: torch.Tensor) -> None:
        pass

    def propose(self, sequence: torch.Tensor, n: int) -> tuple[list[int], None]:
        start = time.perf_counter()
        seq = sequence[0]
        length = seq.shape[0]
        try:
            for size in range(min(self.ngram_max, length - 1), self.ngram_min - 1, -1):
                windows = seq[: length - 1].unfold(0, size, 1)  # candidates that have a continuation
                hits = (windows == seq[length - size :]).all(1).nonzero()
                if hits.numel():
                    begin = int(hits[-1]) + size
                    return seq[begin : begin + n].tolist(), None
            return [], None
        finally:
            self.seconds += time.perf_counter() - start

    def rollback(self, length: int) -> None:
        pass

    def nbytes(self) -> int:
        return 0


register_drafter("ngram", lambda context: NgramDrafter(context.config.ngram_max, context.config.ngram_min),
                 "lookup", "n-gram lookup: the most recent earlier occurrence of the suffix (prompt and output)")
