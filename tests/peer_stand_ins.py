"""Stand-ins for a peer engine (llama.cpp) run by `hf_triforce_bench.peer_process.PeerProcess` in a child process:
importable by name there, and cheap."""

from __future__ import annotations

import os


class AbortingEngine:
    """Refuses a prefill with a Python error, answers its first decode, and aborts the process on the second (as a
    native library's crash kills its process)."""

    def __init__(self, tokens_per_second: float = 10.0) -> None:
        self.tokens_per_second = tokens_per_second
        self.decodes = 0

    def prefill(self, ids):
        raise ValueError("this stand-in has no prefill")

    def decode(self, ids, new_tokens, sampling, seed):
        import torch

        self.decodes += 1
        if self.decodes == 2:
            os.abort()
        return new_tokens / self.tokens_per_second, torch.cat((ids, ids.new_zeros(1, new_tokens)), dim=1)
