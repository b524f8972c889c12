"""What one call hands back, and the committed sequence of each row as ``generate`` shows it to its callbacks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from ..caches.buffer import BufferCache
from ..stats import TriForceStats
from ..tokens import append_tokens
from ..verification.scoring import read_back


@dataclass
class DecodeResult:
    """One call's output. ``stats`` is the call's: batch size 1, the row's own; a batch, counts summed over rows and
    each shared forward's seconds counted once (`report.aggregate`). ``scores``/``logits``/``cache``: batch size 1
    only."""

    sequences: list[torch.LongTensor]  # per row [1, n_b], without its left padding
    row_stats: list[TriForceStats]
    stats: TriForceStats
    scores: list[torch.Tensor] = field(default_factory=list)  # per new token [1, vocab] (output_scores)
    logits: list[torch.Tensor] = field(default_factory=list)  # per new token [1, vocab] (output_logits)
    cache: BufferCache | None = None  # the committed sequence but its last token (cache=, batch size 1)


class PaddedView:
    """Shows processors and stopping criteria the sequence as ``generate`` built them: padding first."""

    def __init__(self, padding: torch.Tensor) -> None:
        self.padding = padding  # [1, pad] token ids, possibly empty

    def __call__(self, sequence: torch.Tensor) -> torch.Tensor:
        return torch.cat((self.padding, sequence), dim=1) if self.padding.shape[1] else sequence

    def processors(self, processors: LogitsProcessorList) -> LogitsProcessorList:
        if not self.padding.shape[1] or not processors:
            return processors
        view = self

        class Padded(LogitsProcessorList):
            def __call__(self, input_ids, scores, **kwargs):
                return processors(view(input_ids), scores, **kwargs)

        return Padded(processors)


class Output:
    """One row's committed sequence, with what ``generate`` does per token: scores/logits, streamer, stop check."""

    def __init__(self, input_ids: torch.LongTensor, view: PaddedView, criteria: StoppingCriteriaList | None,
                 max_length: int, streamer=None, keep_scores: bool = False, keep_logits: bool = False) -> None:
        self.sequence = input_ids  # [1, n] without the left padding
        self.host = input_ids.cpu().numpy()  # the same on the host: lookups read it, not the device's
        self.scores: list[torch.Tensor] = []
        self.logits: list[torch.Tensor] = []
        self.view, self.criteria, self.max_length, self.streamer = view, criteria, max_length, streamer
        self.keep_scores, self.keep_logits = keep_scores, keep_logits
        if streamer is not None:
            streamer.put(view(input_ids).cpu())

    def commit(self, token: int, scores: torch.Tensor, logits: torch.Tensor) -> bool:
        """Append one token; True when generation must stop."""
        return self.commit_verified([token], scores[None], logits[None])[1]

    def commit_verified(self, tokens: list[int], scores: torch.Tensor, logits: torch.Tensor) -> tuple[int, bool]:
        """Commit the tokens one verification emitted (token ``i`` with row ``i`` of ``scores``/``logits``) until a
        stop; returns how many were committed and whether generation must stop. The stopping criteria of every
        token up to ``max_length`` are evaluated first and read back at once (one host read, not one per token):
        a criterion may so be asked about a token after the one it stops at, which is then not committed."""
        start = self.sequence.shape[1]
        extended = append_tokens(self.sequence, tokens)
        n = min(len(tokens), self.max_length - start)
        stops = [False] * n
        if self.criteria and n:
            stops = read_back(torch.stack([self.criteria(self.view(extended[:, : start + i + 1]), scores[i][None]).all()
                                           for i in range(n)]))
        committed = next((i + 1 for i, stop in enumerate(stops) if stop), n)
        self.sequence = extended[:, : start + committed]
        self.host = np.concatenate((self.host, [tokens[:committed]]), axis=1)
        for index, token in enumerate(tokens[:committed]):
            if self.keep_scores:
                self.scores.append(scores[index][None])
            if self.keep_logits:
                self.logits.append(logits[index][None].float())
            if self.streamer is not None:
                self.streamer.put(torch.tensor([token]))
        return committed, any(stops) or start + committed >= self.max_length

    def end(self) -> None:
        if self.streamer is not None:
            self.streamer.end()
