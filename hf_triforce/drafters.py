"""Force-1 proposers: a model on a `SinkWindowCache` (the target itself or a small draft), or n-gram lookup.

Contract: ``propose(sequence, n)`` returns up to ``n`` proposed tokens and, row by row, the exact
distribution each was drawn from (``None`` for a deterministic proposer: a point mass). ``rollback(length)``
is called with the length of a committed prefix of the sequence.
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessorList

from .caches.sink_window import SinkWindowCache, make_rerotate
from .sampling import sample, scores_to_probs
from .scoring import process_rows


class ModelDrafter:
    """A causal LM on a constant-size sink+window cache with in-cache positions."""

    def __init__(self, model, sink_tokens: int, window: int, processors: LogitsProcessorList, do_sample: bool):
        self.model = model
        self.cache = SinkWindowCache(model.config.num_hidden_layers, sink_tokens, window, make_rerotate(model))
        self.processors = processors
        self.do_sample = do_sample
        self.seen = 0  # tokens of the sequence whose entries the cache holds (or has evicted)
        self.seconds = 0.0
        self.forwards = 0

    def _forward(self, tokens: torch.Tensor) -> torch.Tensor:
        self.cache.make_room(tokens.shape[1])
        positions = self.cache.next_positions(tokens.shape[1], tokens.device)
        start = time.perf_counter()
        out = self.model(input_ids=tokens, cache=self.cache, position_ids=positions, use_cache=True, logits_to_keep=1)
        self.seconds += time.perf_counter() - start
        self.forwards += 1
        self.seen += tokens.shape[1]
        return out.logits[0]

    def prefill(self, prompt: torch.Tensor) -> None:
        """Fill the cache with the prompt's first ``sink_tokens`` and last ``window`` tokens, except the last."""
        body = prompt[:, :-1]
        sink, window = self.cache.sink_tokens, self.cache.window - self.cache.evict_block
        if body.shape[1] > sink + window:
            body = torch.cat((body[:, :sink], body[:, -window:]), dim=1)
        if body.shape[1]:
            self._forward(body)
        self.seen = prompt.shape[1] - 1

    def propose(self, sequence: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor | None]:
        tokens: list[int] = []
        rows = []
        pending = sequence[:, self.seen :]
        while len(tokens) < n:
            logits = self._forward(pending)
            current = torch.cat((sequence, sequence.new_tensor([tokens])), dim=1) if tokens else sequence
            scores = process_rows(self.processors, current, logits, current.shape[1])
            if self.do_sample:
                probs = scores_to_probs(scores)[0]
                token = sample(probs)
                rows.append(probs)
            else:
                token = int(scores[0].argmax())
            tokens.append(token)
            pending = sequence.new_tensor([[token]])
        return tokens, (torch.stack(rows) if rows else None)

    def rollback(self, length: int) -> None:
        if self.seen > length:
            self.cache.rollback(self.cache.length - (self.seen - length))
            self.seen = length

    def nbytes(self) -> int:
        return self.cache.nbytes()


class NgramDrafter:
    """Prompt-lookup drafting: continue the most recent earlier occurrence of the sequence's suffix."""

    def __init__(self, ngram_max: int, ngram_min: int):
        self.ngram_max, self.ngram_min = ngram_max, ngram_min
        self.seconds = 0.0
        self.forwards = 0

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
