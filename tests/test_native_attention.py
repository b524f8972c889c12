"""GPU attention without flash-attn (`kernels/native_attention.py`), checked on the CPU.

FlexAttention runs here for real (eagerly: unfused, the same arithmetic contract as its compiled CUDA kernel;
compiled on the CPU it refuses the log-sum-exp, and compiling costs seconds, so the compiled kernels are left to
`tests/test_cuda.py`). ``varlen_attn`` has no CPU kernel: its route is checked against a CPU stand-in written
from the op's documented contract (as `test_tree_attention.py` does for flash-attn), and the real op's Python
wrapper and fake implementation run on meta tensors, which pins the keywords and the log-sum-exp layout the
route relies on.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_triforce.kernels import attention, native_attention
from hf_triforce.kernels.tree_attention import block_visibility, tree_sdpa

from .conftest import make_model, random_prompt
from .test_greedy_identity import _assert_identical_with_self_and_ngram_drafts, _config, assert_identical
from .test_tree_attention import TREE, chain, filled_cache

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")

MODULE = nn.Module().eval()


def cache_views(kv_heads: int, kv_len: int, dim: int = 64, dtype=torch.float32):
    """Keys and values as the cache hands them over: a preallocated buffer's strided prefix."""
    return (torch.randn(1, kv_heads, kv_len + 40, dim, dtype=dtype)[:, :, :kv_len] for _ in range(2))


def masked_reference(query, keys, values, scale):
    """The fp32 reference: SDPA with the bottom-right causal mask, ``[1, q, heads, dv]``."""
    q_len, kv_len = query.shape[2], keys.shape[2]
    mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)
    return torch.nn.functional.scaled_dot_product_attention(
        query.float(), keys.float(), values.float(), attn_mask=mask, scale=scale, enable_gqa=True).transpose(1, 2)


def prefix_reference(query, keys, values, scale):
    """Unmasked attention of ``query`` ``[heads, m, d]`` over ``[kv, c, d]`` by matmul, in the prefix layout."""
    kv_heads = keys.shape[0]
    rows = query.float().reshape(kv_heads, -1, query.shape[-1])
    scores = rows @ keys.float().transpose(-1, -2) * scale
    return (torch.softmax(scores, -1) @ values.float())[None], torch.logsumexp(scores, -1)[None]


SHAPES = [(9, 3, 7, 300), (8, 2, 5, 1000), (4, 4, 3, 129), (6, 2, 64, 200)]  # heads, kv heads, q rows, kv entries


# ------------------------------------------------------------------------------------- FlexAttention, run for real


@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", SHAPES)
def test_flex_verify_matches_masked_sdpa(heads, kv_heads, q_len, kv_len):
    torch.manual_seed(0)
    keys, values = cache_views(kv_heads, kv_len)
    query = torch.randn(1, heads, q_len, 64)
    got, _ = native_attention.flex_verify(MODULE, query, keys, values, None, scaling=0.125)
    expected = masked_reference(query, keys, values, 0.125)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_flex_verify_returns_the_values_width():
    """FlexAttention takes values narrower than keys (multi-head latent attention) where varlen cannot."""
    torch.manual_seed(0)
    query, keys, values = torch.randn(1, 6, 5, 24), torch.randn(1, 2, 300, 24), torch.randn(1, 2, 300, 16)
    got, _ = native_attention.flex_verify(MODULE, query, keys, values, None, scaling=0.2)
    torch.testing.assert_close(got, masked_reference(query, keys, values, 0.2), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", SHAPES)
def test_flex_prefix_matches_the_matmul_with_its_log_sum_exp(heads, kv_heads, q_len, kv_len):
    torch.manual_seed(0)
    keys, values = (t[0] for t in cache_views(kv_heads, kv_len))
    query = torch.randn(heads, q_len, 64)
    out, lse = native_attention.flex_prefix_attention(query, keys, values, 0.125)
    expected_out, expected_lse = prefix_reference(query, keys, values, 0.125)
    assert out.shape == expected_out.shape and lse.shape == expected_lse.shape and lse.dtype == torch.float32
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("uncached", [1, 3])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (9, 3), (4, 4)])
def test_flex_tree_in_one_call_matches_prefix_and_block_merged(heads, kv_heads, uncached):
    """The whole tree as one FlexAttention call whose mask reads the visibility matrix equals today's split
    (prefix and fp32 block merged by log-sum-exp); a leaky mask would not."""
    torch.manual_seed(0)
    visible = block_visibility(uncached, TREE)
    m = visible.shape[0]
    keys, values = cache_views(kv_heads, 300 + m, dim=16)
    query = torch.randn(1, heads, m, 16)
    expected, _ = tree_sdpa(MODULE, query, keys, values, visible, scaling=0.25)
    got = native_attention.flex_tree_sdpa(query, keys, values, visible, 0.25)
    assert got.shape == expected.shape == (1, m, heads, 16) and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    leaky = visible.clone()
    leaky[uncached + 2, uncached + 1] = True  # node 2 (child of node 0) also sees node 1
    assert not torch.allclose(native_attention.flex_tree_sdpa(query, keys, values, leaky, 0.25), expected,
                              rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("route", ["flex", "flex_tree"])
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
def test_tree_forward_through_flex_equals_each_path_as_a_chain(family, route):
    from hf_triforce.decoding.tree_forward import tree_logits
    from hf_triforce.integration import recording_attention

    model = make_model(family)
    sequence = random_prompt(300, seed=7)
    calls, masks = [], []
    name = "flex_tree_sdpa" if route == "flex_tree" else "flex_prefix_attention"
    real, build = getattr(native_attention, name), native_attention._build_tree_block_mask
    with torch.no_grad(), recording_attention(model):
        cache = filled_cache(model, sequence[:, :-1])
        with pytest.MonkeyPatch.context() as patch, native_attention.force_route(route):
            patch.setattr(native_attention, name, lambda *a, **k: calls.append(1) or real(*a, **k))
            patch.setattr(native_attention, "_build_tree_block_mask", lambda *a: masks.append(1) or build(*a))
            logits = tree_logits(model, cache, 299, sequence, TREE)
        for leaf in TREE.leaves():
            expected, _ = chain(model, sequence, 299, TREE.path_tokens(leaf))
            torch.testing.assert_close(logits[[0] + [node + 1 for node in TREE.path(leaf)]], expected,
                                       rtol=1e-5, atol=1e-5)
    assert len(calls) == model.config.num_hidden_layers
    assert len(masks) == (route == "flex_tree")  # one tree mask per forward, shared by its layers


def test_flex_route_forced_keeps_greedy_identity():
    """Every multi-token call (prefill chunks, Force 2 and Force 3 verification) through FlexAttention's
    bottom-right causal mask: greedy output identical to plain generate (self drafting: all three tiers)."""
    calls = []
    real = native_attention.flex_verify
    with pytest.MonkeyPatch.context() as patch, native_attention.force_route("flex"):
        patch.setattr(native_attention, "flex_verify", lambda *a, **k: calls.append(1) or real(*a, **k))
        assert_identical(make_model("llama-gqa", logit_scale=3.0), random_prompt(150, period=37),
                         _config("self", budget=48))
    assert calls


# ------------------------------------------------------------------------------------ varlen_attn: its contract


def varlen_stand_in(takes_gqa: bool = True, lse_layout: str = "heads_first"):
    """torch's ``varlen_attn`` as its docstring and fake implementation specify it, in fp32 on the CPU: ``query``
    ``[T_q, H, D]``, ``key``/``value`` ``[T_k, H_kv, D]`` (a query head ``h`` reads KV head ``h // groups``),
    sequences bounded by int32 ``cu_seq_*``; causal iff ``window_size == (-1, 0)`` (the wrapper's own comparison:
    a list is not causal), bottom-right aligned (FlashAttention 2); ``return_aux.lse``: the fp32 log-sum-exp as
    ``[H, T_q]`` (the fake's) or, ``lse_layout="docstring"``, ``(T_q, H)``. torch 2.13 (``takes_gqa``) refuses
    fewer KV heads without ``enable_gqa=True``; torch 2.11's signature has no ``enable_gqa``."""

    def attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux, scale, window_size, enable_gqa):
        if query.shape[1] != key.shape[1] and not enable_gqa:
            raise ValueError("Expect query and key/value to have the same number of heads")
        assert cu_seq_q.dtype == cu_seq_k.dtype == torch.int32
        assert cu_seq_q.tolist() == [0, query.shape[0]] == [0, max_q]  # one sequence, as TriForce calls it
        assert cu_seq_k.tolist() == [0, key.shape[0]] == [0, max_k]
        assert query.stride(-1) == key.stride(-1) == value.stride(-1) == 1
        assert query.shape[-1] == key.shape[-1] == value.shape[-1]
        is_causal = window_size == (-1, 0)
        assert is_causal or window_size == (-1, -1), window_size
        groups = query.shape[1] // key.shape[1]
        keys, values = key.float().repeat_interleave(groups, 1), value.float().repeat_interleave(groups, 1)
        scale = scale if scale is not None else query.shape[-1] ** -0.5
        scores = torch.einsum("qhd,khd->hqk", query.float(), keys) * scale
        if is_causal:
            tq, tk = query.shape[0], key.shape[0]
            allowed = torch.arange(tk)[None] <= torch.arange(tq)[:, None] + (tk - tq)
            scores = scores.masked_fill(~allowed, float("-inf"))
        lse = torch.logsumexp(scores, -1)  # [H, T_q]
        out = torch.einsum("hqk,khd->qhd", torch.softmax(scores, -1), values).to(query.dtype)
        if return_aux is not None and return_aux.lse:
            return out, lse if lse_layout == "heads_first" else lse.t().contiguous()
        return out

    if takes_gqa:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1), enable_gqa=False, seqused_k=None, block_table=None, num_splits=None):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux, scale, window_size,
                          enable_gqa)
    else:
        def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, *, return_aux=None, scale=None,
                        window_size=(-1, -1)):
            return attend(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, return_aux, scale, window_size, True)

    from torch.nn.attention.varlen import AuxRequest

    return native_attention.adapt_varlen(varlen_attn, AuxRequest)


@pytest.fixture
def stand_in(monkeypatch):
    """Installs a stand-in (``stand_in(takes_gqa, lse_layout)``) as this torch's varlen_attn, on a "CUDA" device."""
    calls = []

    def install(takes_gqa=True, lse_layout="heads_first"):
        fn = varlen_stand_in(takes_gqa, lse_layout)
        counted = fn._replace(call=lambda *a, **k: calls.append(k.get("return_aux")) or fn.call(*a, **k))
        monkeypatch.setattr(native_attention, "varlen_function", lambda: counted)
        monkeypatch.setattr(native_attention, "_varlen_device", lambda query: True)
        return calls

    return install


@pytest.mark.parametrize("takes_gqa", [True, False])
@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", SHAPES)
def test_varlen_verify_matches_masked_sdpa(stand_in, heads, kv_heads, q_len, kv_len, takes_gqa):
    calls = stand_in(takes_gqa)
    torch.manual_seed(0)
    keys, values = cache_views(kv_heads, kv_len)
    query = torch.randn(1, heads, q_len, 64)
    got, _ = native_attention.varlen_verify(MODULE, query, keys, values, None, scaling=0.125)
    expected = masked_reference(query, keys, values, 0.125)
    assert calls and got.shape == expected.shape
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("lse_layout,same", [("heads_first", True), ("docstring", False)])
@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len", SHAPES[:2])
def test_varlen_prefix_reads_the_kernel_layout(stand_in, heads, kv_heads, q_len, kv_len, lse_layout, same):
    """The log-sum-exp read as ``[heads, m]``; were it ``(T_q, H)`` as the docstring says, the values would differ
    and this comparison sees it (the CUDA test checks the real kernel)."""
    stand_in(lse_layout=lse_layout)
    torch.manual_seed(0)
    keys, values = (t[0] for t in cache_views(kv_heads, kv_len))
    query = torch.randn(heads, q_len, 64)
    out, lse = native_attention.varlen_prefix_attention(query, keys, values, 0.125)
    expected_out, expected_lse = prefix_reference(query, keys, values, 0.125)
    torch.testing.assert_close(out, expected_out, rtol=1e-5, atol=1e-6)
    assert lse.shape == expected_lse.shape and lse.dtype == torch.float32
    assert torch.allclose(lse, expected_lse, rtol=1e-5, atol=1e-6) == same


def test_varlen_route_keeps_greedy_identity(stand_in):
    """Chosen automatically (no flash-attn, a "CUDA" fp16/bf16 device): every multi-token call through the
    varlen contract, bottom-right causal, greedy output identical to plain generate."""
    calls = stand_in()
    _assert_identical_with_self_and_ngram_drafts()
    assert calls


@pytest.mark.parametrize("lse_layout,same", [("heads_first", True), ("docstring", False)])
@pytest.mark.parametrize("family", ["llama-gqa", "llama-mha"])
def test_tree_forward_through_varlen_reads_the_kernel_layout(monkeypatch, stand_in, family, lse_layout, same):
    """As `test_tree_attention.test_flash_prefix_path_reads_the_kernel_layout` for flash-attn: the tree forward's
    logits with its prefix through the varlen contract equal the CPU path's; a ``(T_q, H)`` log-sum-exp would
    give other logits."""
    from hf_triforce.decoding.tree_forward import tree_logits
    from hf_triforce.integration import recording_attention

    model = make_model(family, initializer_range=0.3)  # peaked attention: rows' log-sum-exps differ
    sequence = random_prompt(200, seed=10)
    with torch.no_grad(), recording_attention(model):
        expected = tree_logits(model, filled_cache(model, sequence[:, :-1]), 199, sequence, TREE)
        calls = stand_in(lse_layout=lse_layout)
        got = tree_logits(model, filled_cache(model, sequence[:, :-1]), 199, sequence, TREE)
    assert any(aux is not None and aux.lse for aux in calls), "the tree's prefix did not go through varlen"
    assert torch.allclose(got, expected, rtol=1e-4, atol=1e-4) == same


def test_varlen_route_calls_this_torch_op_as_its_fake_specifies(monkeypatch):
    """The real ``varlen_attn`` (its Python wrapper, then its fake implementation) on meta tensors: it takes the
    keywords the routes pass, and its log-sum-exp is ``[heads, total_q]`` fp32 (what the prefix route reads)."""
    fn = native_attention.varlen_function()
    if fn is None:
        pytest.skip(f"torch {torch.__version__} has no varlen_attn with return_aux, scale and window_size")
    monkeypatch.setattr(native_attention, "_varlen_device", lambda query: True)
    query = torch.empty(1, 9, 7, 64, device="meta", dtype=torch.bfloat16)
    keys = torch.empty(1, 3, 340, 64, device="meta", dtype=torch.bfloat16)[:, :, :300]
    out, _ = native_attention.varlen_verify(MODULE, query, keys, keys, None, scaling=0.125)
    assert out.shape == (1, 7, 9, 64) and out.dtype == torch.bfloat16
    bounds = torch.tensor([0, 7], dtype=torch.int32, device="meta"), torch.tensor([0, 300], dtype=torch.int32,
                                                                                  device="meta")
    gqa = {"enable_gqa": True} if fn.takes_gqa else {}
    _, lse = fn.call(query[0].transpose(0, 1), keys[0].transpose(0, 1), keys[0].transpose(0, 1), *bounds, 7, 300,
                     return_aux=fn.aux(lse=True), **gqa)
    assert lse.shape == (9, 7) and lse.dtype == torch.float32
    out, lse = native_attention.varlen_prefix_attention(query[0], keys[0], keys[0], 0.125)
    assert out.shape == (1, 3, 21, 64) and lse.shape == (1, 3, 21) and lse.dtype == torch.float32


def test_adapt_varlen_reads_the_signature():
    assert varlen_stand_in(takes_gqa=True).takes_gqa and not varlen_stand_in(takes_gqa=False).takes_gqa

    def torch_2_9(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
        raise AssertionError("not called")

    assert native_attention.adapt_varlen(torch_2_9, None) is None  # no scale: the routes pass the model's


# ------------------------------------------------------------------------------------------------------- dispatch


def test_dispatch_order_and_forced_routes(monkeypatch):
    query, keys = torch.zeros(1, 9, 7, 64), torch.zeros(1, 3, 300, 64)
    narrow = keys[..., :48]
    assert attention.fused_route(query, keys, keys) is None  # CPU: split_kv_sdpa / gqa_sdpa
    monkeypatch.setattr(native_attention, "flex_runs", lambda q, k, v: True)
    assert attention.fused_route(query, keys, keys) == "flex"
    monkeypatch.setattr(native_attention, "_varlen_device", lambda q: True)
    assert attention.fused_route(query, keys, keys) == ("varlen" if native_attention.varlen_function() else "flex")
    monkeypatch.setattr(native_attention, "varlen_function", lambda: varlen_stand_in())
    assert attention.fused_route(query, keys, keys) == "varlen"
    assert attention.fused_route(torch.zeros(1, 9, 7, 12), keys[..., :12], keys[..., :12]) == "flex"  # 12 % 8
    assert attention.fused_route(query, keys, keys, dropout=True) is None  # only flash-attn applies dropout
    monkeypatch.setattr(attention, "_flash_device", lambda q: True)
    monkeypatch.setattr(attention, "flash_varlen", lambda: object())
    assert attention.fused_route(query, keys, keys) == "flash_attn"
    assert attention.fused_route(query, keys, keys, dropout=True) == "flash_attn"
    assert attention.fused_route(query, keys, narrow) is None  # values narrower than keys: SDPA / matmul
    for name in ("varlen", "flex", "flex_tree", "flash_attn"):
        with native_attention.force_route(name):
            assert attention.fused_route(query, keys, keys) == name
    with native_attention.force_route("sdpa"):
        assert attention.fused_route(query, keys, keys) is None


def test_forced_routes_refuse_what_they_cannot_run():
    query, keys = torch.zeros(1, 9, 7, 64), torch.zeros(1, 3, 300, 64)
    with pytest.raises(ValueError, match="'cuda_graphs' is not one of flash_attn, varlen, flex, flex_tree, sdpa"):
        with native_attention.force_route("cuda_graphs"):
            pass
    with native_attention.force_route("varlen"), pytest.raises(ValueError, match="route 'varlen' cannot run"):
        attention.fused_route(query, keys, keys)  # no CUDA here
    assert native_attention.forced_route() is None


def test_a_flex_failure_is_raised_not_swallowed(monkeypatch):
    """An automatically chosen FlexAttention call that fails (a compiler error on an untested GPU) raises: nothing
    is swallowed, no process-wide switch; ``force_route("sdpa")`` is the documented way around it."""
    monkeypatch.setattr(native_attention, "flex_runs", lambda q, k, v: True)

    def broken(*args, **kwargs):
        raise RuntimeError("triton: no kernel for this head dim")

    monkeypatch.setattr(native_attention, "flex_verify", broken)
    model = make_model("llama-gqa", logit_scale=3.0)
    ids = random_prompt(40, seed=3)
    expected = model.generate(ids, max_new_tokens=6, do_sample=False)
    with pytest.raises(RuntimeError, match="no kernel"):
        model.generate(ids, max_new_tokens=6, do_sample=False, triforce_config=_config("self", budget=16))
    with native_attention.force_route("sdpa"):
        got = model.generate(ids, max_new_tokens=6, do_sample=False, triforce_config=_config("self", budget=16))
    assert torch.equal(got, expected)

