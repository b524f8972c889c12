"""sha256 of tensors' bytes: what ties data to the values it was made from (a saved prefill to the weights that
computed it, GGUF blocks to the weight they hold), however those values are written afterwards (in place, through
``.data``, by a merge of adapters).

Every byte is hashed: a sample would miss an edit between its samples (rows in the middle of an embedding). The cost
is a read of the tensors at sha256's speed: ~1.7 GB/s per core, i.e. ~0.6 s per GB on one core (an AVX2 EPYC with
SHA instructions, measured roughly on a machine shared with other work), divided among torch's threads (hashlib
releases the GIL while it hashes).
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """sha256 of ``tensor``'s bytes in its own dtype, in row-major order (read in place where it is a contiguous CPU
    tensor; copied to one otherwise)."""
    values = tensor.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy()
    return hashlib.sha256(memoryview(values)).digest()


def tensor_digests(tensors: Sequence[torch.Tensor]) -> list[bytes]:
    """`tensor_digest` of each of ``tensors``, in their order, hashed over torch's threads."""
    if len(tensors) <= 1:
        return [tensor_digest(tensor) for tensor in tensors]
    with ThreadPoolExecutor(max_workers=max(1, min(len(tensors), torch.get_num_threads()))) as pool:
        return list(pool.map(tensor_digest, tensors))
