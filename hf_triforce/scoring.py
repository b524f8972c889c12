"""Applying the generation config's logits processors row by row, identically at every tier."""

from __future__ import annotations

import torch
from transformers import LogitsProcessorList


def process_rows(
    processors: LogitsProcessorList, sequence: torch.Tensor, logits: torch.Tensor, first_prefix: int
) -> torch.Tensor:
    """Processed fp32 scores ``[n, vocab]`` for ``n`` logit rows.

    Row ``i`` predicts the token after ``sequence[:, :first_prefix + i]`` and is processed with exactly that
    prefix, as `generate` would process it when decoding one token at a time.
    """
    logits = logits.float()
    if not processors:
        return logits
    rows = [
        processors(sequence[:, : first_prefix + i], logits[i : i + 1].clone())[0] for i in range(logits.shape[0])
    ]
    return torch.stack(rows)
