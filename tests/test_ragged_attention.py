"""A ragged batch's attention row by row on the CPU kernel (`hf_triforce.kernels.ragged_attention`).

* within a ragged forward, each row's output is bit for bit the batch-1 kernel's over the row's own columns (its
  entries, then its real tokens; dummy queries and rows without tokens get zeros); outside one, or where a row's
  call is not the kernel's (timed slower, too short a cache), the layer keeps its masked path;
* a batch over caches long enough for the kernel takes it in every tier's batched forwards (Force 3's and the
  lockstep Force-1 and Force-2 forwards, transformers' attention and the lean forward alike) and each row stays
  token-identical to plain ``generate`` of that row alone.
"""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.kernels import attention_routes, cpu_attention, ragged_attention

from .conftest import make_model, random_prompt
from .test_batch import left_padded
from .test_cpu_attention import needs_kernel


def _routes(route: str) -> attention_routes.AttentionRoutes:
    routes = attention_routes.AttentionRoutes()
    routes.calibrate = lambda shape, rows, length: route
    return routes


def _batch(lengths: list[int], counts: list[int], kv_heads: int = 3, groups: int = 3, dim: int = 64):
    """A ragged forward's layer: queries ``[batch, heads, n, dim]`` and the first ``width`` columns of shared
    ``[batch, kv_heads, capacity, dim]`` buffers."""
    generator = torch.Generator().manual_seed(0)
    n, width = max(counts), max(length + count for length, count in zip(lengths, counts))
    keys, values = torch.randn(2, len(lengths), kv_heads, width + 40, dim, generator=generator)
    query = torch.randn(len(lengths), kv_heads * groups, n, dim, generator=generator)
    return query, keys[:, :, :width], values[:, :, :width]


@needs_kernel
def test_each_row_is_its_batch_1_kernel_call():
    lengths, counts = [1500, 1203, 1350, 1100], [5, 3, 0, 1]
    query, key, value = _batch(lengths, counts)
    with _routes("kernel").installed(make_model(), 2048), ragged_attention.rows_of(lengths, counts):
        out = ragged_attention.attend_rows(query, key, value, 0.125)
    assert out.shape == (4, 5, 9, 64)
    for b, (length, count) in enumerate(zip(lengths, counts)):
        if count:
            alone = cpu_attention.attend(query[b : b + 1, :, :count], key[b : b + 1, :, : length + count],
                                         value[b : b + 1, :, : length + count], 0.125)
            assert torch.equal(out[b, :count], alone[0]), b
        assert torch.equal(out[b, count:], torch.zeros_like(out[b, count:])), b  # dummies, a row without tokens


@needs_kernel
def test_the_masked_path_stays_where_a_row_is_not_the_kernels():
    lengths, counts = [1500, 1203], [5, 3]
    query, key, value = _batch(lengths, counts)
    with _routes("kernel").installed(make_model(), 2048):
        assert ragged_attention.attend_rows(query, key, value, None) is None  # not a ragged forward
    with _routes("aten").installed(make_model(), 2048), ragged_attention.rows_of(lengths, counts):
        assert ragged_attention.attend_rows(query, key, value, None) is None  # the kernel timed slower
    short, short_counts = [1500, 400], [5, 3]  # row 1's cache is below cpu_attention.MIN_CACHED
    query, key, value = _batch(short, short_counts)
    with _routes("kernel").installed(make_model(), 2048), ragged_attention.rows_of(short, short_counts):
        assert ragged_attention.attend_rows(query, key, value, None) is None
    with ragged_attention.rows_of(lengths, counts), pytest.raises(RuntimeError, match="2 rows over"):
        ragged_attention.attend_rows(*_batch(lengths, [5, 310]), None)  # columns the rows do not account for


def _long_model():
    """Head dim 64 (the kernel's), one KV head of two query heads."""
    return make_model("llama-gqa", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                      max_position_embeddings=4096)


@needs_kernel
@pytest.mark.parametrize("draft_precision", ["model", "lean-int4"])
def test_a_long_batch_takes_the_kernel_row_by_row_and_each_row_equals_it_alone(monkeypatch, draft_precision):
    monkeypatch.setattr(attention_routes.AttentionRoutes, "calibrate", lambda self, shape, rows, length: "kernel")
    batches: list[tuple[int, int, bool]] = []  # per layer call: rows, columns, whether the kernel took it
    real = ragged_attention.attend_rows

    def counting(query, key, value, scaling):
        out = real(query, key, value, scaling)
        batches.append((query.shape[0], key.shape[2], out is not None))
        return out

    monkeypatch.setattr(ragged_attention, "attend_rows", counting)
    model = _long_model()
    prompts = [random_prompt(cpu_attention.MIN_CACHED + 180, period=61, seed=1),
               random_prompt(cpu_attention.MIN_CACHED + 90, period=37, seed=2),
               random_prompt(cpu_attention.MIN_CACHED + 130, seed=3)]
    ids, mask = left_padded(prompts)
    config = TriForceConfig(draft="self", policy="fixed", levels=3, retrieval_budget=cpu_attention.MIN_CACHED + 64,
                            chunk_size=32, sink_tokens=4, window=1100, gamma1=2, gamma2=4,
                            draft_precision=draft_precision)
    out = model.generate(ids, attention_mask=mask, triforce_config=config, max_new_tokens=24, do_sample=False,
                         pad_token_id=0, return_dict_in_generate=True)
    for row, prompt in enumerate(prompts):
        alone = model.generate(prompt, max_new_tokens=24, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out.sequences[row, ids.shape[1]:], alone), row
    # every batched forward over the caches took the kernel (a set-up probe of a few columns aside)
    batched = [took for rows, columns, took in batches if rows > 1 and columns >= cpu_attention.MIN_CACHED]
    assert len(batched) >= 20 and all(batched), batches
    assert len({(s.force3_steps, s.force3_accepted) for s in out.triforce_row_stats}) > 1  # ragged steps
