"""A left-padded batch of prompts and the ``cache=`` that continues it in plain batched ``generate``, assembled from
each row's own prefilled cache (a TriForce batch takes the rows' caches as they are: `caches.row_caches.RowCaches`).

Row ``b``'s prompt of ``n_b`` tokens sits at columns ``[W - n_b, W)`` of the ``[B, W]`` ids (``W``: the longest
prompt), padding before it; its cache of ``n_b - 1`` positions (its prompt but the last token, from the prefix
store and the server's prefill) at columns ``[W - n_b, W - 1)`` of a ``[B, H, W - 1, D]`` cache per layer, zeros
before it. ``generate(ids, attention_mask=mask, cache=<it>, ...)`` then prefills each row's last token and decodes:
the layout ``generate`` itself builds with a forward of the left-padded batch's first ``W - 1`` columns
(``tests/test_batch.py``), where a padding column is masked and its entries never read.
"""

from __future__ import annotations

import torch
from transformers import DynamicCache


def left_padded(prompts: list[torch.Tensor], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(ids, attention_mask)``, both ``[B, W]``, of ``prompts`` (each ``[1, n_b]``), padded on the left."""
    width = max(prompt.shape[1] for prompt in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for b, prompt in enumerate(prompts):
        ids[b, width - prompt.shape[1]:] = prompt[0]
        mask[b, width - prompt.shape[1]:] = 1
    return ids, mask


def padded_cache(caches: list[DynamicCache | None], lengths: list[int], model_config) -> DynamicCache:
    """The batch's ``cache=``: row ``b``'s ``caches[b]`` (``lengths[b] - 1`` positions; None where that is 0) at
    columns ``[W - lengths[b], W - 1)`` (``W = max(lengths)``), zeros elsewhere. A copy: the rows' caches (views
    of the prefix store's entries among them) are only read."""
    width = max(lengths)
    batch = DynamicCache(config=model_config)
    template = next((cache for cache in caches if cache is not None), None)
    if template is None:
        raise ValueError("padded_cache: every row's cache is empty (prompts of one token need none)")
    for index, layer in enumerate(template.layers):
        shape = (len(caches), layer.keys.shape[1], width - 1, layer.keys.shape[3])
        keys = layer.keys.new_zeros(shape)
        values = layer.values.new_zeros((*shape[:3], layer.values.shape[3]))
        for b, (cache, length) in enumerate(zip(caches, lengths)):
            if cache is None:
                continue
            row = cache.layers[index]
            if row.keys.shape[2] != length - 1:
                raise ValueError(f"padded_cache: row {b}'s cache holds {row.keys.shape[2]} positions, its prompt "
                                 f"{length} tokens (the cache holds all but the last)")
            keys[b, :, width - length : width - 1] = row.keys[0]
            values[b, :, width - length : width - 1] = row.values[0]
        batch.update(keys, values, index)
    return batch
