"""Split-KV attention over whole cache buffers (`hf_triforce.kernels.split_kv`).

* `split_kv_attention` equals one masked SDPA call up to fp32 rounding: GQA (a group's query heads as rows), spans
  that divide the capacity and spans that leave a remainder, one row and several, arbitrary masks;
* a span a row does not see gets weight exactly 0 (no NaN), whatever its kernel returned for it; a row that sees
  nothing gets 0;
* ``torch.compile(fullgraph=True)`` of a forward calling it compiles once across write positions and mask patterns;
* `split_parts`: enough spans for the SMs on CUDA (fake SM counts), a span per thread on the CPU, 1 where one call
  pays as well;
* `LeanModel.fixed_shape_layers` takes it where it pays: the same logits as one masked call, greedy output identical
  to plain ``generate`` when the tiers are compiled, no recompilation across calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from hf_triforce import TriForceConfig
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.decoding.tiers import lean_model
from hf_triforce.kernels import fixed_shape, lean, split_kv
from hf_triforce.kernels.split_kv import split_kv_attention, split_kv_mask, split_parts

from .conftest import make_model, random_prompt
from .test_greedy_identity import assert_identical

SCALE = 0.125


def _buffers(kv_heads: int, capacity: int, dim: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    keys = torch.randn(1, kv_heads, capacity, dim, generator=generator)
    return keys, torch.randn(1, kv_heads, capacity, dim, generator=generator)


def _assert_like_one_call(got, query, keys, values, visible, **gqa):
    expected = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=SCALE, **gqa)
    torch.testing.assert_close(got.reshape(expected.shape), expected, rtol=0, atol=1e-6)


def _causal(write: torch.Tensor, capacity: int) -> torch.Tensor:
    """Row ``r`` sees the entries at indices ``<= write[r]`` (what the fixed-shape forward builds)."""
    return torch.arange(capacity)[None] <= write[:, None]


@pytest.mark.parametrize("kv_heads, groups, tokens, capacity, parts", [
    (3, 3, 7, 1000, 2),  # SmolLM2's layout: 21 rows
    (2, 4, 1, 333, 4),  # one token (4 rows)
    (1, 1, 1, 256, 4),  # one row
    (2, 2, 3, 4097, 8),  # spans of 512 and one entry past them
])
def test_equals_one_masked_sdpa_call(kv_heads, groups, tokens, capacity, parts):
    dim = 16
    keys, values = _buffers(kv_heads, capacity, dim)
    query = torch.randn(1, kv_heads * groups, tokens, dim, generator=torch.Generator().manual_seed(1))
    for write in (torch.arange(capacity - tokens - 5, capacity - 5), torch.arange(tokens) + 3):
        visible = _causal(write, capacity)  # [tokens, capacity]
        got = split_kv_attention(query.reshape(1, kv_heads, groups * tokens, dim), keys, values,
                                 visible.repeat(groups, 1), SCALE, parts)
        _assert_like_one_call(got, query, keys, values, visible, enable_gqa=True)
    scattered = torch.rand(groups * tokens, capacity, generator=torch.Generator().manual_seed(2)) < 0.3
    rows = query.reshape(1, kv_heads, groups * tokens, dim)
    _assert_like_one_call(split_kv_attention(rows, keys, values, scattered, SCALE, parts), rows, keys, values,
                          scattered)


def test_spans_a_row_does_not_see_weigh_nothing():
    """Rows that see only some spans (ATen's CPU kernel returns 0 and a log-sum-exp of 0 for a span it sees nothing
    of: taken as is, that span would weigh exp(0 - lse) of the rest) and a row that sees nothing at all (0)."""
    kv_heads, rows, capacity, dim, parts = 2, 5, 1024, 16, 4
    keys, values = _buffers(kv_heads, capacity, dim)
    query = torch.randn(1, kv_heads, rows, dim, generator=torch.Generator().manual_seed(3)) * 3
    visible = torch.zeros(rows, capacity, dtype=torch.bool)
    visible[0, :10] = True  # the first span only
    visible[1, 300:700] = True  # the middle spans
    visible[2, 1020:] = True  # the last span only
    visible[3] = True
    got = split_kv_attention(query, keys, values, visible, SCALE, parts)
    assert not got.isnan().any()
    expected = F.scaled_dot_product_attention(query[:, :, :4], keys, values, attn_mask=visible[:4], scale=SCALE)
    torch.testing.assert_close(got[:, :, :4], expected, rtol=0, atol=1e-6)
    assert torch.equal(got[:, :, 4], torch.zeros_like(got[:, :, 4]))
    # a remainder past the spans that only one row sees, and spans that no row sees
    capacity = 1001
    keys, values = _buffers(kv_heads, capacity, dim, seed=4)
    visible = torch.zeros(rows, capacity, dtype=torch.bool)
    visible[:, 995:] = True
    visible[0, :3] = True
    got = split_kv_attention(query, keys, values, visible, SCALE, parts)
    expected = F.scaled_dot_product_attention(query, keys, values, attn_mask=visible, scale=SCALE)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_scores_in_the_hundreds_merge_without_overflow():
    """Each row's best key scores 125, every other at most ~50 below it: the exact answer is the best key's value
    (the rest weigh < 1e-20), and each span's log-sum-exp is past fp32's exp range (exp(89) is inf), so the merge
    must weigh spans relative to the largest log-sum-exp."""
    kv_heads, rows, capacity, dim, parts = 2, 3, 1001, 16, 4
    keys, values = _buffers(kv_heads, capacity, dim, seed=7)
    keys = keys.clamp(-1, 1)
    directions = F.normalize(torch.randn(kv_heads, rows, dim, generator=torch.Generator().manual_seed(8)), dim=-1)
    best = torch.tensor([[10, 400, 1000], [700, 999, 260]])  # other spans, and the entry past them
    for head in range(kv_heads):
        keys[0, head, best[head]] = 10 * directions[head]
    query = 100 * directions[None]  # scores: 100 * 10 * SCALE = 125 at the best key, |100 * u.k| * SCALE <= 50
    got = split_kv_attention(query, keys, values, torch.ones(rows, capacity, dtype=torch.bool), SCALE, parts)
    expected = torch.stack([values[0, head, best[head]] for head in range(kv_heads)])[None]
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-6)


def test_bf16_and_a_shared_mask():
    """The bias is made in the query's dtype (ATen's CPU kernel takes no other); a mask made once serves every call
    with the same parts and refuses others."""
    kv_heads, rows, capacity, dim, parts = 3, 6, 777, 32, 2
    keys, values = (t.bfloat16() for t in _buffers(kv_heads, capacity, dim))
    query = torch.randn(1, kv_heads, rows, dim, generator=torch.Generator().manual_seed(5)).bfloat16()
    visible = _causal(torch.arange(700, 700 + rows), capacity)
    mask = split_kv_mask(visible, parts, torch.bfloat16)
    got = split_kv_attention(query, keys, values, mask, SCALE, parts)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, split_kv_attention(query, keys, values, visible, SCALE, parts))
    expected = F.scaled_dot_product_attention(query.float(), keys.float(), values.float(), attn_mask=visible,
                                              scale=SCALE)
    torch.testing.assert_close(got.float(), expected, rtol=0, atol=2e-2)
    with pytest.raises(ValueError, match="made for 2 parts, called with 3"):
        split_kv_attention(query, keys, values, mask, SCALE, 3)
    with pytest.raises(ValueError, match=r"parts must be between 1 and \(capacity - 1\) / 8 \(97 here\), got 200"):
        split_kv_mask(visible, 200, torch.float32)
    with pytest.raises(ValueError, match="visible must be a bool tensor"):
        split_kv_mask(visible.float(), 2, torch.float32)


def test_compiles_once_across_positions_masks_and_capacities():
    """fullgraph=True (no graph break, no data-dependent shape, no host read: what a CUDA graph capture needs too):
    one graph serves every write position, mask pattern and buffer capacity (compiled as a dynamic dimension, as
    Force 3's cache is: spans and remainder are then symbolic, and no guard asks whether the parts divide it)."""
    graphs = []

    def counting(graph, example_inputs):  # dynamo's graphs, run as traced (tests/test_fixed_shape.py: inductor's)
        graphs.append(graph)
        return graph.forward

    kv_heads, groups, tokens, dim = 3, 3, 4, 16

    def forward(query, keys, values, write, extra):
        capacity = keys.shape[2]
        visible = ((torch.arange(capacity)[None] <= write[:, None]) | extra).repeat(groups, 1)
        parts = split_parts(kv_heads, groups * tokens, capacity, query.device, processors=2)
        return split_kv_attention(query.reshape(1, kv_heads, groups * tokens, dim), keys, values, visible, SCALE,
                                  max(parts, 3))

    compiled = torch.compile(forward, fullgraph=True, backend=counting)
    generator = torch.Generator().manual_seed(6)
    for capacity, start in ((1001, 5), (1001, 480), (1001, 997), (1500, 1200), (2048, 2044)):
        keys, values = _buffers(kv_heads, capacity, dim, seed=capacity)
        query = torch.randn(1, kv_heads * groups, tokens, dim, generator=generator)
        write = torch.arange(start, start + tokens)
        extra = torch.rand(tokens, capacity, generator=generator) < 0.05 * (start % 3)
        for tensor, index in ((keys, 2), (values, 2), (extra, 1)):
            torch._dynamo.mark_dynamic(tensor, index)
        visible = (torch.arange(capacity)[None] <= write[:, None]) | extra
        _assert_like_one_call(compiled(query, keys, values, write, extra), query, keys, values, visible,
                              enable_gqa=True)
    assert len(graphs) == 1


def test_split_parts():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    # an H200's 132 SMs: 8 KV heads x 1 block of 28 rows -> 33 spans for 2 blocks per SM, no shorter than 512 entries
    assert split_parts(8, 28, 32768, cuda, processors=132) == 33
    assert split_parts(8, 28, 8192, cuda, processors=132) == 16
    assert split_parts(8, 28, 8191, cuda, processors=132) == 1  # short: one call
    assert split_parts(8, 28, 131072, cuda, processors=32) == 8
    assert split_parts(8, 40, 32768, cuda, processors=132) == 17  # 2 blocks of 32 rows per head
    assert split_parts(8, 40, 32768, cuda, processors=132, head_dim=64) == 33  # 64 rows per block
    assert split_parts(128, 28, 32768, cuda, processors=132) == 1  # the heads alone fill the SMs
    assert split_parts(1, 1, 1 << 20, cuda, processors=132) == split_kv.MAX_PARTS
    # the CPU: a span per thread where the KV heads leave threads idle
    assert split_parts(3, 21, 8192, cpu, processors=2) == 2
    assert split_parts(3, 21, 32768, cpu, processors=4) == 4
    assert split_parts(3, 21, 8191, cpu, processors=2) == 1
    assert split_parts(2, 21, 32768, cpu, processors=2) == 1  # both threads busy already
    assert split_parts(3, 21, 32768, cpu, processors=1) == 1
    assert split_parts(3, 21, 32768, "cpu") == (2 if torch.get_num_threads() in (2, 4) else
                                                 split_parts(3, 21, 32768, cpu, torch.get_num_threads()))


def _split_everywhere(monkeypatch) -> None:
    """The CPU rule at every capacity the tests' caches reach, with 4 threads (2 KV heads leave them idle)."""
    monkeypatch.setattr(split_kv, "CPU_MIN_CAPACITY", 0)
    monkeypatch.setattr(split_kv, "_processors", lambda device: 4)


def test_fixed_shape_layers_take_the_split(monkeypatch):
    """A buffer the rule splits gives the logits one masked call gives, up to fp32 rounding."""
    model = make_model("llama-gqa", logit_scale=3.0)
    fixed = lean_model(model, "lean").compiled("fixed")
    prompt = random_prompt(80, period=13)
    logits = []
    for split in (False, True):
        calls = []
        if split:
            _split_everywhere(monkeypatch)
            real = lean.split_kv_attention
            monkeypatch.setattr(lean, "split_kv_attention",
                                lambda *a, real=real, calls=calls, **k: calls.append(1) or real(*a, **k))
        cache = BufferCache(model.config.num_hidden_layers, 128)
        fixed(input_ids=prompt[:, :70], cache=cache, position_ids=torch.arange(70)[None])
        logits.append(fixed(input_ids=prompt[:, 70:76], cache=cache, position_ids=torch.arange(70, 76)[None],
                            logits_to_keep=6).logits)
        assert len(calls) == (model.config.num_hidden_layers if split else 0)  # the prefill runs the lean forward
    torch.testing.assert_close(logits[1], logits[0], rtol=0, atol=1e-5)


def test_compiled_tiers_with_the_split_keep_greedy_identity(monkeypatch):
    """Force 1's sink+window cache split in every layer, the tier compiled (fullgraph: a host read or a data-dependent
    shape in the split fails here): greedy output identical to plain generate, and a later call (another prompt
    length) compiles nothing. What the split computes is checked above: a drafter's values cannot change the output."""
    _split_everywhere(monkeypatch)
    traced = []  # the operators of every graph the tiers compile
    counting = fixed_shape._counting_inductor

    def inspecting(forward, cuda_graphs):
        backend = counting(forward, cuda_graphs)
        return lambda graph, inputs: traced.extend(str(node.target) for node in graph.graph.nodes) or \
            backend(graph, inputs)

    monkeypatch.setattr(fixed_shape, "_counting_inductor", inspecting)
    model = make_model("llama-gqa", logit_scale=3.0, num_hidden_layers=2, seed=11)
    config = TriForceConfig(draft="self", policy="fixed", levels=2, sink_tokens=4, window=92, gamma1=3,
                            draft_precision="native", tier_compile="compile")
    first = assert_identical(model, random_prompt(150, period=37), config, max_new_tokens=24)
    assert first.detail.tier_compile["compiles"] >= 1 and first.force3_accepted > 0
    later = assert_identical(model, random_prompt(97, period=29, seed=97), config, max_new_tokens=16)
    compiled = later.detail.tier_compile
    assert compiled["compiles"] == 0 and compiled["forwards"] > 10, compiled
    assert "aten._scaled_dot_product_flash_attention_for_cpu" in traced  # the split's kernel, compiled in
