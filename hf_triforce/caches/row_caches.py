"""`RowCaches`: a batch's ``cache=`` given row by row, each row's prefill as it is, without padding.

``generate(left-padded ids, attention_mask=, cache=RowCaches([c_0, c_1, ...]), triforce_config=)``: ``c_b`` is a
transformers cache of batch size 1 holding the first ``k_b`` tokens of row ``b``'s prompt (its padding removed), any
``k_b`` below the prompt's length; None or an empty cache where row ``b`` has none. Each row's entries are copied
once, into the row of Force 3's batch cache (`decoding.force3.RaggedForce3.prefill`), and the rest of its prompt is
prefilled there: no left-padded batch cache is assembled. What the rows hold is only read.

Plain ``generate`` does not take it (it decodes on one cache of the padded batch); TriForce batches (batch size > 1)
only.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..compat import Cache, CacheLayerMixin
from .buffer import check_taken


class RowCaches(Cache):
    """Row ``b``'s cache ``rows[b]`` (batch size 1, or None) for a TriForce batch's ``cache=`` (module docstring)."""

    def __init__(self, rows: Sequence[Cache | None]) -> None:
        super().__init__(layers=[])
        for b, row in enumerate(rows):
            if row is not None and not isinstance(row, Cache):
                raise TypeError(f"RowCaches: row {b} must be a transformers Cache or None, got {type(row).__name__}")
        self.rows = [row if row is not None and row.get_seq_length() > 0 else None for row in rows]
        if not self.rows:
            raise ValueError("RowCaches: rows must hold one cache (or None) per row of the batch, got none")

    def lengths(self) -> list[int]:
        """Per row, the prompt tokens its cache holds (0: none)."""
        return [0 if row is None else int(row.get_seq_length()) for row in self.rows]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """The longest row's (rows differ: `lengths` gives each)."""
        return max(self.lengths())

    def check(self, prompt_lengths: list[int], num_layers: int) -> None:
        """ValueError naming ``cache=`` unless there is one row per prompt, each a cache of batch size 1 with
        ``num_layers`` full-attention layers holding fewer tokens than its prompt (``prompt_lengths``, padding
        removed)."""
        if len(self.rows) != len(prompt_lengths):
            raise ValueError(f"cache=RowCaches of {len(self.rows)} rows; the batch has {len(prompt_lengths)} rows")
        for b, (row, held, prompt) in enumerate(zip(self.rows, self.lengths(), prompt_lengths)):
            if row is None:
                continue
            check_taken(row, f"cache=RowCaches row {b}")
            if held >= prompt:
                raise ValueError(f"cache=RowCaches: row {b}'s cache holds {held} tokens; its prompt has {prompt} and "
                                 "must extend it by at least one")
            if len(row.layers) != num_layers:
                raise ValueError(f"cache=RowCaches: row {b}'s cache has {len(row.layers)} layers, the model "
                                 f"{num_layers}")
            for index, layer in enumerate(row.layers):
                if not isinstance(layer, CacheLayerMixin) or getattr(layer, "is_sliding", False) \
                        or getattr(layer, "keys", None) is None or layer.keys.shape[0] != 1:
                    raise ValueError(f"cache=RowCaches: row {b}'s layer {index} is a {type(layer).__name__}; a row "
                                     "holds the full-attention DynamicCache or StaticCache of its own prefill "
                                     "(batch size 1)")

    def entries(self, b: int, layer: int):
        """Row ``b``'s keys and values of ``layer``, ``[1, kv_heads, lengths()[b], head_dim]`` (views)."""
        held = self.lengths()[b]
        source = self.rows[b].layers[layer]
        return source.keys[:, :, :held], source.values[:, :, :held]
