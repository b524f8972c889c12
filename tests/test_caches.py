"""The tier caches: constant memory, exact re-rotation, retrieval that picks the chunks the query wants."""

from __future__ import annotations

import pytest
import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from hf_triforce import TriForceConfig
from hf_triforce.caches import BufferCache, RetrievalCache, SinkWindowCache
from hf_triforce.caches.sink_window import make_layer_rerotations

from .conftest import make_model, random_prompt


def test_a_buffers_first_write_leaves_every_other_entry_zero_and_finite(monkeypatch):
    """The first write allocates without zeroing the entries it writes (a full cache's prefix copy paid both) but
    zeroes the rest, whatever the allocator hands back: fixed-shape forwards read whole buffers under a mask, and a NaN
    left past the valid prefix would survive a masked softmax (0 * NaN)."""
    new_empty = torch.Tensor.new_empty
    monkeypatch.setattr(torch.Tensor, "new_empty",
                        lambda self, size, **kw: new_empty(self, size, **kw).fill_(float("nan")))
    cache = BufferCache(2, capacity=12)
    keys, values = torch.randn(1, 3, 5, 4), torch.randn(1, 3, 5, 4)
    for layer in cache.layers:
        layer.write(keys, values)
        assert torch.equal(layer.keys[:, :, :5], keys) and torch.equal(layer.values[:, :, :5], values)
        assert not layer.keys[:, :, 5:].any() and not layer.values[:, :, 5:].any()  # zero (a NaN is truthy)
    monkeypatch.undo()


def test_a_buffer_grows_only_where_allowed_and_keeps_its_entries():
    """A tier's buffer past its capacity raises (the call sized it); a cache handed to the caller grows: its entries
    kept, the rest zero, at least a quarter more room each time (a long decode copies each entry a bounded number of
    times), and no maximum length to report."""
    keys, values = torch.randn(1, 3, 10, 4), torch.randn(1, 3, 10, 4)
    strict = BufferCache(1, capacity=8)
    strict.layers[0].write(keys[:, :, :6], values[:, :, :6])
    with pytest.raises(RuntimeError, match="overflow: 6 \\+ 3 entries exceed its capacity 8"):
        strict.layers[0].write(keys[:, :, 6:9], values[:, :, 6:9])
    assert strict.get_max_length() == 8
    cache = BufferCache(1, capacity=8)
    layer = cache.layers[0]
    layer.write(keys[:, :, :6], values[:, :, :6])
    cache.allow_growth()
    layer.write(keys[:, :, 6:9], values[:, :, 6:9])  # one entry past: a quarter more
    assert layer.capacity == 10 and layer.length == 9 and cache.get_max_length() == -1
    assert torch.equal(layer.keys[:, :, :9], keys[:, :, :9]) and torch.equal(layer.values[:, :, :9], values[:, :, :9])
    assert not layer.keys[:, :, 9:].any() and not layer.values[:, :, 9:].any()
    cache.rollback(2)
    layer.write(keys, values)  # more than a quarter past: what it needs
    assert layer.capacity == 12 and torch.equal(layer.keys[:, :, 2:], keys)


def test_rerotation_equals_rotation_at_the_new_position():
    model = make_model("llama-gqa")
    rotary = model.model.rotary_emb
    keys = torch.randn(1, 2, 5, 8)
    positions = torch.arange(100, 105)[None]
    cos, sin = rotary(keys, positions)
    rotated, _ = apply_rotary_pos_emb(keys, keys, cos, sin)
    cos2, sin2 = rotary(keys, positions - 37)
    expected, _ = apply_rotary_pos_emb(keys, keys, cos2, sin2)
    torch.testing.assert_close(make_layer_rerotations(model)[0](rotated, -37), expected, rtol=1e-5, atol=1e-5)


def _stats(model, length, **cfg):
    config = TriForceConfig(**{"policy": "fixed", "draft": "self", "retrieval_budget": 32, "chunk_size": 8,
                               "sink_tokens": 4, "window": 24, **cfg})
    out = model.generate(random_prompt(length), max_new_tokens=8, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    return out.triforce_stats


def test_force1_memory_is_independent_of_context_and_force2_depends_only_on_budget():
    model = make_model("llama-gqa")
    short, long = _stats(model, 200), _stats(model, 1200)
    assert short.detail.draft_cache_bytes == long.detail.draft_cache_bytes > 0
    assert short.detail.retrieval_cache_bytes == long.detail.retrieval_cache_bytes > 0
    assert long.detail.full_cache_bytes > short.detail.full_cache_bytes
    bigger = _stats(model, 1200, retrieval_budget=64)
    assert bigger.detail.retrieval_cache_bytes > long.detail.retrieval_cache_bytes
    assert bigger.detail.draft_cache_bytes == long.detail.draft_cache_bytes


def test_short_prompt_lets_force2_see_the_whole_cache():
    model = make_model("llama-gqa")
    assert _stats(model, 20).detail.force2_sees_whole_cache
    assert not _stats(model, 200).detail.force2_sees_whole_cache


def test_sink_window_keeps_sinks_and_latest_entries():
    cache = SinkWindowCache(1, sink_tokens=2, window=8, rerotate=lambda keys, delta: keys)
    for token in range(30):
        cache.make_room(1)
        value = torch.full((1, 1, 1, 1), float(token))
        cache.update(value, value, 0)
        assert cache.length <= 10
    kept = cache.layers[0].valid()[1].flatten().tolist()
    assert kept[:2] == [0.0, 1.0] and kept[-1] == 29.0 and kept == sorted(kept)


def test_retrieval_selects_the_chunks_most_aligned_with_the_query():
    chunk, budget, length = 4, 16, 64
    full = BufferCache(1, length)
    keys = torch.zeros(1, 2, length, 2)
    keys[0, 0, 20:24, 0] = 5.0  # head 0: chunk 5 points along x
    keys[0, 1, 40:44, 1] = 5.0  # head 1: chunk 10 points along y
    full.layers[0].write(keys, keys.clone())
    cache = RetrievalCache(1, budget=budget, chunk_size=chunk, recent=4, tail_capacity=8)
    query = torch.tensor([[[1.0, 0.0], [1.0, 0.0], [0.0, 1.0], [0.0, 1.0]]])  # 4 query heads, GQA groups of 2
    cache.select(full, length, {0: query})
    kept = cache.layers[0].valid()[0]
    assert cache.layers[0].length == budget
    assert (kept[0, 0, :, 0] == 5.0).sum() == 4 and (kept[0, 1, :, 1] == 5.0).sum() == 4
    # sink chunk first, recent tokens last
    assert torch.equal(kept[0, :, :chunk], keys[0, :, :chunk])
    assert torch.equal(kept[0, :, -4:], keys[0, :, -4:])


def test_retrieval_layout_never_exceeds_the_budget():
    for recent in (0, 8, 24, 56):
        for upto in (65, 67, 70, 100, 131):
            full = BufferCache(1, upto)
            keys = torch.randn(1, 2, upto, 4)
            full.layers[0].write(keys, keys.clone())
            cache = RetrievalCache(1, budget=64, chunk_size=8, recent=recent, tail_capacity=4)
            cache.select(full, upto, {0: torch.randn(1, 4, 4)})
            assert cache.layers[0].length <= 64
            kept = cache.layers[0].valid()[0]
            if recent:
                assert torch.equal(kept[0, :, -recent:], keys[0, :, -recent:])


def test_retrieval_copies_exactly_the_top_chunks_of_keys_and_values():
    """Every selected entry is the key/value of the chunk the scores chose, per batch row and KV head (an
    independent element-wise reference; buffer capacity not a multiple of the chunk size)."""
    torch.manual_seed(0)
    chunk, budget, recent, upto = 8, 96, 16, 203
    full = BufferCache(2, upto + 5)
    for layer in full.layers:
        layer.write(torch.randn(2, 3, upto, 4), torch.randn(2, 3, upto, 4))
    cache = RetrievalCache(2, budget=budget, chunk_size=chunk, recent=recent, tail_capacity=4)
    queries = {i: torch.randn(2, 6, 4) for i in range(2)}
    cache.select(full, upto, queries)
    n_mid = (upto - recent - chunk) // chunk
    k = (budget - chunk - recent) // chunk
    for index, (layer, source) in enumerate(zip(cache.layers, full.layers)):
        keys, values = source.valid()
        summaries = keys[:, :, chunk : chunk * (1 + n_mid)].reshape(2, 3, n_mid, chunk, 4).mean(3)
        grouped = queries[index].reshape(2, 3, 2, 4).sum(2)
        chosen = torch.einsum("bhnd,bhd->bhn", summaries, grouped).topk(k, dim=-1).indices.sort(-1).values
        tokens = (chunk * (1 + chosen))[..., None] + torch.arange(chunk)
        index_ = tokens.reshape(2, 3, k * chunk, 1).expand(-1, -1, -1, 4)
        kept_keys, kept_values = layer.valid()
        assert torch.equal(kept_keys[:, :, chunk : chunk + k * chunk], keys.gather(2, index_))
        assert torch.equal(kept_values[:, :, chunk : chunk + k * chunk], values.gather(2, index_))
        assert torch.equal(kept_values[:, :, -recent:], values[:, :, -recent:])


def _entry_set(tensor: torch.Tensor) -> torch.Tensor:
    """``[batch, heads, n, dim]`` with each ``[b, h]``'s entries in one canonical order (sorted by every column)."""
    out = tensor.clone()
    for b in range(tensor.shape[0]):
        for h in range(tensor.shape[1]):
            rows = tensor[b, h]
            for column in reversed(range(rows.shape[1])):
                rows = rows[rows[:, column].argsort(stable=True)]
            out[b, h] = rows
    return out


def _selected(seed: int, capacity: int) -> tuple[BufferCache, RetrievalCache]:
    """A full cache (2 layers, capacity ``capacity``) of 203 random entries per row (2 rows, 3 KV heads) and a retrieval
    cache (budget 96, chunk 8, recent 16, tail 40) selected from it with random queries."""
    torch.manual_seed(seed)
    full = BufferCache(2, capacity)
    for layer in full.layers:
        layer.write(torch.randn(2, 3, 203, 4), torch.randn(2, 3, 203, 4))
    cache = RetrievalCache(2, budget=96, chunk_size=8, recent=16, tail_capacity=40)
    cache.select(full, 203, {i: torch.randn(2, 6, 4) for i in range(2)})
    return full, cache


def test_a_reselection_copies_only_new_chunks_and_holds_what_a_fresh_selection_holds():
    """Re-selecting with another query, after the context grew and speculative entries were written: the entry set
    of every layer, batch row and KV head equals a fresh cache's selection (order aside), and only the chunks that
    changed are copied."""
    chunk, budget, recent = 8, 96, 16
    full, incremental = _selected(seed=1, capacity=260)
    for layer in incremental.layers:  # Force 2's speculative entries past the selection
        layer.write(torch.randn(2, 3, 5, 4), torch.randn(2, 3, 5, 4))
    for layer in full.layers:  # the context grows by accepted tokens
        layer.write(torch.randn(2, 3, 20, 4), torch.randn(2, 3, 20, 4))
    queries = {i: torch.randn(2, 6, 4) for i in range(2)}
    before = sum(layer.chunks_copied for layer in incremental.layers)
    incremental.select(full, 223, queries)
    copied = sum(layer.chunks_copied for layer in incremental.layers) - before  # by `BufferLayer.replace_chunks`
    fresh = RetrievalCache(2, budget=budget, chunk_size=chunk, recent=recent, tail_capacity=40)
    fresh.select(full, 223, queries)
    k = (budget - chunk - recent) // chunk
    assert 0 < copied < 2 * 2 * 3 * k  # some chunks, not every chunk of every (layer, row, head)
    for mine, theirs in zip(incremental.layers, fresh.layers):
        assert mine.length == theirs.length == budget
        for a, b in zip(mine.valid(), theirs.valid()):
            assert torch.equal(_entry_set(a), _entry_set(b))


def test_reselections_renew_only_the_recent_tokens_that_entered_and_hold_a_fresh_selections_entries():
    """The recent region is a ring: a re-selection after the context grew by ``d <= recent`` tokens writes only those
    ``d`` tokens (into the slots of the ``d`` that left; the other slots keep their entries), more growth rewrites it
    all, and after every re-selection, wrap-arounds included, each layer, row and KV head holds a fresh selection's
    entries (order aside)."""
    chunk, budget, recent = 8, 96, 16
    full, cache = _selected(seed=2, capacity=400)
    region = slice(budget - recent, budget)
    for grown in (3, 7, 16, 20, 1, 5, 9):
        before = [layer.keys[:, :, region].clone() for layer in cache.layers]
        for layer in full.layers:
            layer.write(torch.randn(2, 3, grown, 4), torch.randn(2, 3, grown, 4))
        queries = {i: torch.randn(2, 6, 4) for i in range(2)}
        cache.select(full, full.length, queries)
        fresh = RetrievalCache(2, budget=budget, chunk_size=chunk, recent=recent, tail_capacity=40)
        fresh.select(full, full.length, queries)
        for mine, theirs, old in zip(cache.layers, fresh.layers, before):
            assert mine.length == theirs.length == budget
            for a, b in zip(mine.valid(), theirs.valid()):
                assert torch.equal(_entry_set(a), _entry_set(b))
            kept = (mine.keys[:, :, region] == old).all(-1)  # [2, 3, recent]: slots left as they were
            assert (kept.sum(-1) == max(recent - grown, 0)).all()  # more growth than the region rewrites it all


def test_a_reselection_after_new_chunks_keeps_the_top_chunks_of_all_chunks():
    """Chunks completed between selections get their summaries (written in place, the buffer grown where full): each
    re-selection keeps the sink chunk, the top-scored chunks of every complete chunk (an independent reference) and
    the recent tokens."""
    torch.manual_seed(1)
    chunk, budget, recent = 4, 64, 8
    keys, values = torch.randn(1, 2, 600, 4), torch.randn(1, 2, 600, 4)
    full = BufferCache(1, 600)
    cache = RetrievalCache(1, budget=budget, chunk_size=chunk, recent=recent, tail_capacity=8)
    written = 0
    for upto in (200, 204, 260, 330, 480, 600):
        full.layers[0].write(keys[:, :, written:upto], values[:, :, written:upto])
        written = upto
        query = torch.randn(1, 4, 4)
        cache.select(full, upto, {0: query})
        n_mid = (upto - recent - chunk) // chunk
        k = (budget - chunk - recent) // chunk
        summaries = keys[:, :, chunk : chunk * (1 + n_mid)].reshape(1, 2, n_mid, chunk, 4).mean(3)
        chosen = torch.einsum("bhnd,bhd->bhn", summaries, query.reshape(1, 2, 2, 4).sum(2)).topk(k, -1).indices
        for got, source in zip(cache.layers[0].valid(), (keys, values)):
            for head in range(2):
                kept = torch.cat((torch.arange(chunk), (chunk * (1 + chosen[0, head, :, None]) + torch.arange(chunk))
                                  .flatten(), torch.arange(upto - recent, upto)))
                want = source[:, head : head + 1, kept]
                assert torch.equal(_entry_set(got[:, head : head + 1]), _entry_set(want)), upto
    assert cache.summary_bytes() == 2 * (600 // chunk - 1 - recent // chunk) * 4 * 4


@pytest.mark.parametrize("budget, refresh_every, interval", [(64, 3, 3), (64, None, 1), (4096, None, 4)])
def test_force2_reselects_every_refresh_interval_steps(budget, refresh_every, interval):
    """Force 2 re-selects after every ``refresh_interval``-th Force-3 step it commits (the first selection before the
    first step; a finished call commits no last step): ``refresh_every``, or by default 4 from a 4096-entry budget."""
    model = make_model("llama-gqa", max_position_embeddings=8192)
    prompt = random_prompt(budget + 200, seed=5)
    config = TriForceConfig(policy="fixed", levels=3, draft="self", gamma1=2, gamma2=3, retrieval_budget=budget,
                            chunk_size=8, sink_tokens=4, window=32, refresh_every=refresh_every,
                            draft_precision="model")
    assert config.refresh_interval == interval
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    stats = out.triforce_stats
    assert stats.force3_steps > 2 * interval
    assert stats.detail.retrieval_selections == 1 + (stats.force3_steps - 1) // interval
