"""Token ids: appended to a sequence, copied to a device without waiting for it, compared with what was committed."""

from __future__ import annotations

import torch


def append_tokens(sequence: torch.Tensor, tokens: list[int] | list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """``sequence`` ``[1, n]`` followed by ``tokens``: ids (copied to the device), 0-d tensors or a ``[k]`` tensor
    on the device (no host read either way)."""
    if isinstance(tokens, torch.Tensor):
        row = tokens.to(sequence.device)
    elif tokens and isinstance(tokens[0], torch.Tensor):
        row = torch.stack(tokens).to(sequence.device)
    else:
        row = device_tokens(tokens, sequence.device)
    return torch.cat((sequence, row.view(1, -1)), dim=1)


def device_tokens(tokens: list[int], device: torch.device) -> torch.Tensor:
    """``tokens`` as a ``[k]`` long tensor on ``device``; to an accelerator by an asynchronous copy from pinned
    memory (a blocking copy from the host waits for the device)."""
    host = torch.tensor(tokens, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


def agreement(committed: list[int], tokens: list[int]) -> int:
    """How many of ``tokens`` (proposed from some position on) the ``committed`` tokens from that position on
    still hold: where a cache that holds their entries must roll back to after verification (that position +
    this). Host lists: the host knows every committed token from the verifications' readbacks."""
    agree = 0
    while agree < min(len(tokens), len(committed)) and committed[agree] == tokens[agree]:
        agree += 1
    return agree
