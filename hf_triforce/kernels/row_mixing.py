"""Target layers whose output rows depend on each other: run one row at a time while TriForce decodes.

Exactness needs each row's scores to be what a one-row decoding step computes (plain ``generate``'s p):
Force 3 scores ``gamma2 + 1`` rows in one forward, Force 2 ``gamma1 + 1``. Most layers compute each row
on its own (up to summation order). bitsandbytes' LLM.int8 (``Linear8bitLt`` with ``llm_int8_threshold >
0``, the default 6.0) does not: it picks the outlier columns it keeps in 16 bits from *all* rows of the
call, so a draft row with an activation above the threshold changes the other rows' output. Measured on a
tiny Llama whose norms produce such outliers: greedy output diverged from plain ``generate`` of the same
8-bit model (tests/test_quantized_targets.py), and the sampled law would depend on the drafts.

`RowByRowMixingLayers` makes those layers run calls of 2 to `ROW_INDEPENDENT_MAX_ROWS` rows one row at a time once
`enable` is called (after the prefill, which plain ``generate`` runs batched too); other layers are left
as they are. 4-bit bitsandbytes layers, torchao weight-only int8 and the LLM.int8 layers with threshold 0
quantize per row already.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compat import bnb_outlier_threshold

ROW_INDEPENDENT_MAX_ROWS = 64  # >= gamma1 + 1, gamma2 + 1 (checked before decoding) and tree sizes (TriForceConfig)


def row_mixing_layers(model: nn.Module) -> list[str]:
    """Names of the layers of ``model`` whose output rows depend on the other rows of the call."""
    return [name for name, module in model.named_modules() if (bnb_outlier_threshold(module) or 0.0) > 0.0]


class RowByRowMixingLayers:
    """A context: while enabled, the row-mixing layers of ``model`` run calls of 2..64 rows row by row."""

    def __init__(self, model: nn.Module) -> None:
        self.modules = [model.get_submodule(name) for name in row_mixing_layers(model)]
        self.enabled = False
        self._saved: list[tuple[nn.Module, object]] = []

    def enable(self) -> None:
        self.enabled = True

    def _wrap(self, module: nn.Module) -> None:
        had = module.__dict__.get("forward")  # an instance forward (accelerate hooks install one) or None
        batched = module.forward

        def forward(hidden: torch.Tensor, *args, **kwargs) -> torch.Tensor:
            rows = hidden.reshape(-1, hidden.shape[-1])
            if not self.enabled or not 1 < rows.shape[0] <= ROW_INDEPENDENT_MAX_ROWS:
                return batched(hidden, *args, **kwargs)
            out = torch.cat([batched(rows[i : i + 1], *args, **kwargs) for i in range(rows.shape[0])])
            return out.reshape(*hidden.shape[:-1], out.shape[-1])

        self._saved.append((module, had))
        module.forward = forward

    def __enter__(self) -> RowByRowMixingLayers:
        for module in self.modules:
            self._wrap(module)
        return self

    def __exit__(self, *exc) -> None:
        for module, had in reversed(self._saved):
            if had is None:
                del module.forward
            else:
                module.forward = had
        self._saved.clear()
        self.enabled = False
