"""The output layer over several rows, weight on the left: ``(W @ x.T).T`` instead of ``x @ W.T`` (CPU).

With MKL on the 2-core AMD CPU this project measures on, ``F.linear`` over 2-16 rows of SmolLM2's
49152x576 output layer costs 30-50 ms, 2-3x one row, while the same products as ``W @ x.T`` cost 9-18 ms
(`docs/results.md`). Every verification (Force 2 and Force 3) scores several rows at once, so while
TriForce generates, a plain `nn.Linear` output layer on CPU computes multi-row inputs this way. The values
are the same dot products summed in another order (fp32 rounding, like any change of GEMM kernel); single
rows keep ``F.linear`` (one-token steps then differ from plain decoding only through the one-row attention
route of `attention.one_row_sdpa`, summation order again).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn


def _weight_left_linear(layer: nn.Linear):
    def forward(hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, hidden.shape[-1])
        if rows.shape[0] < 2:
            return nn.functional.linear(hidden, layer.weight, layer.bias)
        out = (layer.weight @ rows.T).T
        if layer.bias is not None:
            out = out + layer.bias
        return out.reshape(*hidden.shape[:-1], layer.weight.shape[0])

    return forward


@contextmanager
def weight_left_output_layer(model: nn.Module) -> Iterator[bool]:
    """For the duration of the block, the model's CPU `nn.Linear` output layer takes multi-row inputs weight-left.

    Yields whether the layer was switched (False for other layer types and devices). Nested use is safe.
    """
    layer = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    eligible = (type(layer) is nn.Linear and layer.weight.device.type == "cpu" and "forward" not in vars(layer))
    if eligible:
        layer.forward = _weight_left_linear(layer)
    try:
        yield eligible
    finally:
        if eligible:
            del layer.forward
