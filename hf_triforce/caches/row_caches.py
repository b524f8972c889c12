"""`RowCaches`: a batch's ``cache=`` given row by row, each row's prefill as it is, without padding.

``generate(left-padded ids, attention_mask=, cache=RowCaches([c_0, c_1, ...]), triforce_config=)``: ``c_b`` is a
transformers cache of batch size 1 holding the first ``k_b`` tokens of row ``b``'s prompt (its padding removed), any
``k_b`` below the prompt's length; None or an empty cache where row ``b`` has none; or a callable returning one of
these, called when row ``b``'s turn to prefill comes (rows prefill one after another, each committing its first token
before the next begins: a server that prefills each request's prompt in its callable streams row ``b``'s first token
after ``b + 1`` prefills, not after all of them). Each row's entries are copied once, into the row of Force 3's
batch cache (`decoding.force3.RaggedForce3.prefill`), and the rest of its prompt is prefilled there: no left-padded
batch cache is assembled. What the rows hold is only read.

Plain ``generate`` does not take it (it decodes on one cache of the padded batch); TriForce batches (batch size > 1)
only.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from ..compat import Cache
from .buffer import check_taken, full_attention_layer

Row = Cache | None | Callable[[], Cache | None]


class RowCaches(Cache):
    """Row ``b``'s cache ``rows[b]`` (batch size 1, None, or a callable making one) for a TriForce batch's
    ``cache=`` (module docstring)."""

    def __init__(self, rows: Sequence[Row]) -> None:
        super().__init__(layers=[])
        for b, row in enumerate(rows):
            if row is not None and not isinstance(row, Cache) and not callable(row):
                raise TypeError(f"RowCaches: row {b} must be a transformers Cache, None or a callable returning one, "
                                f"got {type(row).__name__}")
        if not rows:
            raise ValueError("RowCaches: rows must hold one cache (or None) per row of the batch, got none")
        self.rows: list[Row] = list(rows)
        self.prompt_lengths: list[int] | None = None  # set by `check`
        self.num_layers = 0

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row's held tokens among the rows made so far (rows differ; a callable's row is not made)."""
        return max((_held(row) for row in self.rows if not callable(row)), default=0)

    def check(self, prompt_lengths: list[int], num_layers: int) -> None:
        """ValueError naming ``cache=`` unless there is one row per prompt and every row given as a cache holds
        fewer tokens than its prompt (``prompt_lengths``, padding removed) in ``num_layers`` full-attention layers of
        batch size 1. A callable's row is checked alike when it is made (`entries`)."""
        if len(self.rows) != len(prompt_lengths):
            raise ValueError(f"cache=RowCaches of {len(self.rows)} rows; the batch has {len(prompt_lengths)} rows")
        self.prompt_lengths, self.num_layers = list(prompt_lengths), num_layers
        for b, row in enumerate(self.rows):
            if not callable(row):
                self._check_row(b, row)

    def entries(self, b: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Row ``b``'s keys and values per layer, ``[1, kv_heads, held, head_dim]`` (views; [] where it holds none);
        a callable's row is made now, and checked."""
        if self.prompt_lengths is None:
            raise RuntimeError("RowCaches.entries before check")
        row = self.rows[b]
        if callable(row):
            row = self.rows[b] = row()
            self._check_row(b, row)
        held = _held(row)
        if not held:
            return []
        return [(layer.keys[:, :, :held], layer.values[:, :, :held]) for layer in row.layers]

    def _check_row(self, b: int, row) -> None:
        if row is not None and not isinstance(row, Cache):
            raise TypeError(f"cache=RowCaches: row {b}'s callable returned a {type(row).__name__}, not a transformers "
                            "Cache or None")
        held, prompt = _held(row), self.prompt_lengths[b]
        if not held:
            return
        check_taken(row, f"cache=RowCaches row {b}")
        if held >= prompt:
            raise ValueError(f"cache=RowCaches: row {b}'s cache holds {held} tokens; its prompt has {prompt} and must "
                             "extend it by at least one")
        if len(row.layers) != self.num_layers:
            raise ValueError(f"cache=RowCaches: row {b}'s cache has {len(row.layers)} layers, the model "
                             f"{self.num_layers}")
        for index, layer in enumerate(row.layers):
            if not full_attention_layer(layer) or layer.keys is None or layer.keys.shape[0] != 1:
                raise ValueError(f"cache=RowCaches: row {b}'s layer {index} is a {type(layer).__name__}; a row "
                                 "holds the full-attention DynamicCache or StaticCache of its own prefill "
                                 "(batch size 1)")


def _held(row: Cache | None) -> int:
    return 0 if row is None else int(row.get_seq_length())
