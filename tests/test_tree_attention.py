"""One tree forward equals running each root-to-leaf path as its own chain; the compacted cache equals the chain's."""

from __future__ import annotations

import pytest
import torch

from hf_triforce import compat
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.decoding.tree_forward import tree_logits
from hf_triforce.forwards.forward import forward_logits, prefill
from hf_triforce.integration import recording_attention
from hf_triforce.kernels.tree_attention import block_visibility
from hf_triforce.verification.draft_tree import DraftTree

from .conftest import make_model, random_prompt

# the root has three children; node 0 two, node 3 one, node 1 one: paths of depth 1 to 3
TREE = DraftTree([5, 9, 7, 3, 11, 2, 8], [-1, -1, 0, 0, 1, 3, -1])


def filled_cache(model, tokens: torch.Tensor) -> BufferCache:
    cache = BufferCache(model.config.num_hidden_layers, 512, compat.layer_windows(model.config))
    if tokens.shape[1]:
        prefill(model, tokens, cache, 64)
    return cache


def chain(model, sequence: torch.Tensor, cached: int, path: list[int]) -> tuple[torch.Tensor, BufferCache]:
    """Logits of the root and each path token, run as a plain chain, and the cache after it."""
    cache = filled_cache(model, sequence[:, :cached])
    tokens = torch.cat((sequence[:, cached:], sequence.new_tensor([path])), dim=1) if path else sequence[:, cached:]
    return forward_logits(model, tokens, cache, cached, len(path) + 1), cache


@pytest.mark.parametrize("family", ["llama-mha", "llama-gqa", "qwen2", "mistral", "gemma"])
@pytest.mark.parametrize("prompt_length, uncached", [(20, 1), (300, 1), (300, 3)])
def test_tree_forward_equals_each_path_as_a_chain(family, prompt_length, uncached):
    """300 cached entries split the prefix across threads (`prefix_attention`), 20 do not; an uncached tail of
    3 committed tokens rides along causally before the tree."""
    model = make_model(family)
    sequence = random_prompt(prompt_length, seed=7)
    cached = prompt_length - uncached
    with torch.no_grad(), recording_attention(model):
        cache = filled_cache(model, sequence[:, :cached])
        logits = tree_logits(model, cache, cached, sequence, TREE)
        assert cache.length == prompt_length + len(TREE)
        for leaf in TREE.leaves():
            nodes = TREE.path(leaf)
            expected, _ = chain(model, sequence, cached, TREE.path_tokens(leaf))
            got = logits[[0] + [node + 1 for node in nodes]]
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ["llama-gqa", "gemma"])
@pytest.mark.parametrize("path", [[], [1], [0, 3, 5], [0, 2]])
def test_compacted_cache_equals_the_accepted_chains(family, path):
    model = make_model(family)
    sequence = random_prompt(120, seed=8)
    with torch.no_grad(), recording_attention(model):
        cache = filled_cache(model, sequence[:, :-1])
        tree_logits(model, cache, 119, sequence, TREE)
        cache.keep_rows(120, path)
        _, expected = chain(model, sequence, 119, [TREE.tokens[node] for node in path])
    assert cache.length == expected.length == 120 + len(path)
    for layer, reference in zip(cache.layers, expected.layers):
        for got, want in zip(layer.valid(), reference.valid()):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_wrong_block_mask_is_caught():
    """The comparison above tells masks apart: a node that also sees its uncle differs from its chain."""
    import hf_triforce.decoding.tree_forward as tree_forward

    model = make_model("llama-gqa")
    sequence = random_prompt(40, seed=9)

    def leaky(uncached, tree, device=None):
        visible = block_visibility(uncached, tree, device)
        visible[uncached + 2, uncached + 1] = True  # node 2 (child of node 0) also sees node 1
        return visible

    with torch.no_grad(), recording_attention(model):
        cache = filled_cache(model, sequence[:, :-1])
        original = tree_forward.block_visibility
        tree_forward.block_visibility = leaky
        try:
            logits = tree_logits(model, cache, 39, sequence, TREE)
        finally:
            tree_forward.block_visibility = original
        expected, _ = chain(model, sequence, 39, TREE.path_tokens(2))
    assert not torch.allclose(logits[[0, 1, 3]], expected, rtol=1e-5, atol=1e-5)


def test_sliding_window_layers_are_refused():
    model = make_model("mistral", sliding_window=16)
    sequence = random_prompt(40, seed=9)
    with torch.no_grad(), recording_attention(model), pytest.raises(ValueError, match="sliding-window"):
        cache = filled_cache(model, sequence[:, :-1])
        tree_logits(model, cache, 39, sequence, TREE)


def test_keep_rows_refuses_bad_offsets():
    model = make_model("llama-gqa")
    with torch.no_grad():
        cache = filled_cache(model, random_prompt(10, seed=1))
    with pytest.raises(ValueError, match="must increase"):
        cache.keep_rows(5, [2, 1])
    with pytest.raises(ValueError, match="must increase"):
        cache.keep_rows(5, [7])


def varlen_stand_in(lse_layout: str):
    """flash-attn's ``flash_attn_varlen_func`` as its docstring specifies it, in fp32 on the CPU: ``q``
    ``[total_q, heads, d]``, ``k``/``v`` ``[total_k, kv_heads, d]`` (GQA: query head ``h`` reads KV head
    ``h // groups``), bottom-right causal if asked; with ``return_attn_probs`` also ``softmax_lse`` as
    ``[heads, total_q]`` (flash-attn >= 2.4) or ``[batch, heads, max_seqlen_q]`` (older)."""

    def varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
               softmax_scale=None, causal=False, return_attn_probs=False, **_):
        assert cu_seqlens_q.numel() == 2 and cu_seqlens_k.numel() == 2  # one sequence, as TriForce calls it
        assert q.shape[-1] == k.shape[-1] == v.shape[-1], "flash-attn 2: one head dim for q, k and v"
        groups = q.shape[1] // k.shape[1]
        keys, values = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
        scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
        scores = torch.einsum("qhd,khd->hqk", q.float(), keys.float()) * scale
        if causal:
            tq, tk = q.shape[0], k.shape[0]
            allowed = torch.arange(tk)[None] <= torch.arange(tq)[:, None] + (tk - tq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, -1)  # [heads, total_q]
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values.float()).to(q.dtype)
        if not return_attn_probs:
            return out
        layouts = {"unpadded": lse, "padded": lse[None], "transposed": lse.t().contiguous()}
        return out, layouts[lse_layout], None

    return varlen


@pytest.mark.parametrize("lse_layout,same", [("unpadded", True), ("padded", True), ("transposed", False)])
@pytest.mark.parametrize("family", ["llama-gqa", "llama-mha"])
def test_flash_prefix_path_reads_the_kernel_layout(monkeypatch, family, lse_layout, same):
    """The CUDA path (`flash_prefix_attention`) against a CPU stand-in of the kernel's documented contract:
    the tree forward's logits equal the CPU path's; a kernel whose log-sum-exp came ``[total_q, heads]`` (not
    the documented layout) would give other logits, and the comparison sees it. (This path has not run on a
    GPU in this project's CI: the CUDA test below does that where a GPU with flash-attn is present.)"""
    import hf_triforce.kernels.attention as attention

    model = make_model(family, initializer_range=0.3)  # peaked attention: rows' log-sum-exps differ
    sequence = random_prompt(200, seed=10)
    with torch.no_grad(), recording_attention(model):
        expected = tree_logits(model, filled_cache(model, sequence[:, :-1]), 199, sequence, TREE)
        calls = []
        stand_in = varlen_stand_in(lse_layout)
        monkeypatch.setattr(attention, "flash_varlen", lambda: lambda *a, **k: calls.append(
            k.get("return_attn_probs", False)) or stand_in(*a, **k))
        monkeypatch.setattr(attention, "_flash_device", lambda query: True)
        got = tree_logits(model, filled_cache(model, sequence[:, :-1]), 199, sequence, TREE)
    assert any(calls), "the tree's prefix did not go through the varlen kernel"
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4) == same


def test_flash_routes_leave_values_narrower_than_keys_to_sdpa(monkeypatch):
    """flash-attn 2 takes one head dim for q, k and v: DeepSeek-V3's narrower values (MLA) must not reach it,
    neither from the prefill's multi-token calls (`flash_verify`) nor from a tree's prefix
    (`flash_prefix_attention`): the tree forward is then the CPU path's."""
    import hf_triforce.kernels.attention as attention

    from .families import make_family

    model = make_family("deepseek-v3-narrow-values")
    sequence = random_prompt(200, vocab_size=96, seed=10)
    with torch.no_grad(), recording_attention(model):
        expected = tree_logits(model, filled_cache(model, sequence[:, :-1]), 199, sequence, TREE)
        calls = []
        stand_in = varlen_stand_in("unpadded")
        monkeypatch.setattr(attention, "flash_varlen", lambda: lambda *a, **k: calls.append(1) or stand_in(
            *a, **k))
        monkeypatch.setattr(attention, "_flash_device", lambda query: True)
        got = tree_logits(model, filled_cache(model, sequence[:, :-1]), 199, sequence, TREE)
    assert not calls
    assert torch.equal(got, expected)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and flash-attn")
def test_flash_prefix_path_on_cuda():
    pytest.importorskip("flash_attn")
    model = make_model("llama-gqa").to("cuda", torch.bfloat16)
    sequence = random_prompt(300, seed=11).cuda()
    with torch.no_grad(), recording_attention(model):
        logits = tree_logits(model, filled_cache(model, sequence[:, :-1]), 299, sequence, TREE)
        for leaf in TREE.leaves():
            expected, _ = chain(model, sequence, 299, TREE.path_tokens(leaf))
            got = logits[[0] + [node + 1 for node in TREE.path(leaf)]]
            assert (got.float().argmax(-1) == expected.float().argmax(-1)).float().mean() >= 0.75
            torch.testing.assert_close(got.float(), expected.float(), rtol=5e-2, atol=5e-2)
