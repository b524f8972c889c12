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
    scores = logits.float()
    if processors:
        scores = torch.stack(
            [processors(sequence[:, : first_prefix + i], scores[i : i + 1].clone())[0] for i in range(scores.shape[0])]
        )
    if torch.isnan(scores).any():
        raise FloatingPointError(
            "NaN in the logits of a TriForce tier: the model produced NaN (overflow in float16? try bfloat16 "
            "or float32); refusing to pick tokens from garbage"
        )
    return scores
