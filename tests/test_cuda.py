"""CUDA-only checks (skipped where no GPU is present; CI has none): the flash-attn verification route, torch's
varlen_attn and FlexAttention routes (`kernels/native_attention.py`), greedy identity on CUDA."""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.kernels import attention, native_attention

from .conftest import make_model, random_prompt

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
flash = pytest.mark.skipif(attention.flash_varlen() is None, reason="needs flash-attn (pip install .[cuda])")


class _Module(torch.nn.Module):
    pass


@cuda
@flash
@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (7, 300), (2, 4096)])
def test_flash_verify_matches_gqa_sdpa(q_len, kv_len):
    torch.manual_seed(0)
    query = torch.randn(1, 12, q_len, 64, device="cuda", dtype=torch.float16)
    key, value = (torch.randn(1, 2, kv_len, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device="cuda").tril(kv_len - q_len)[None, None]
    module = _Module().eval()
    expected, _ = attention.gqa_sdpa(module, query.float(), key.float(), value.float(), mask, scaling=0.125)
    got, _ = attention.flash_verify(module, query, key, value, mask, scaling=0.125)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, atol=2e-3, rtol=2e-3)


@cuda
@flash
def test_triforce_on_cuda_takes_the_flash_route(monkeypatch):
    calls = []
    real = attention.flash_verify
    monkeypatch.setattr(attention, "flash_verify", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = make_model("llama-gqa", logit_scale=8.0).to("cuda", torch.float16)
    prompt = random_prompt(300, period=37).to("cuda")
    config = TriForceConfig(draft="self", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=2,
                            gamma2=4, policy="fixed", force3_compile="off")  # transformers' forward verifies
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    out = model.generate(prompt, max_new_tokens=24, do_sample=False, triforce_config=config)
    assert calls, "the flash-attn route was not taken"
    # fp16: multi-token verification may round differently from one-token decoding; peaked logits keep the
    # argmax stable, so the continuations agree.
    assert torch.equal(out, expected)


@cuda
def test_triforce_on_cuda_fp32_is_exact():
    model = make_model("qwen2").to("cuda")
    prompt = random_prompt(200, period=29).to("cuda")
    config = TriForceConfig(policy="fixed", draft="ngram", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24)
    expected = model.generate(prompt, max_new_tokens=32, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=32, do_sample=False, triforce_config=config), expected)


def _cuda_exact(family, draft, prompt_len=600, new_tokens=40, levels=3, force3_compile="auto"):
    """Greedy TriForce on CUDA (fp32) equals plain generate; the prompt exceeds the budget, so retrieval selects.
    Force 3 verifies as ``force3_compile`` says: by default, CUDA graphs of the native forward where the lean forward
    covers the family (Llama, Qwen2), transformers' forward elsewhere."""
    model = make_model(family).to("cuda")
    prompt = random_prompt(prompt_len, period=53).to("cuda")
    if draft == "model":
        draft = make_model(family, num_hidden_layers=1, seed=5).to("cuda")
    config = TriForceConfig(draft=draft, retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=2,
                            gamma2=6, levels=levels, policy="fixed", force3_compile=force3_compile)
    expected = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False)
    out = model.generate(prompt, max_new_tokens=new_tokens, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected), (out.sequences[0, prompt_len:], expected[0, prompt_len:])
    stats = out.triforce_stats
    assert stats.force3_steps > 0 and not stats.detail.force2_sees_whole_cache
    return model, prompt, config, expected


@cuda
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2", "gemma"])
@pytest.mark.parametrize("draft", ["self", "ngram", "model"])
def test_cuda_fp32_greedy_identity(family, draft):
    _cuda_exact(family, draft)


@cuda
@pytest.mark.parametrize("family", ["llama-gqa", "qwen2"])
def test_cuda_force3_verifies_in_cuda_graphs(family):
    """The default on CUDA: Force 3's chains verified by CUDA graphs of the target's native forward (one capture per
    row count and call), greedy identical in fp32, across prompt lengths; its queries feed Force 2's selection."""
    model = make_model(family, logit_scale=3.0).to("cuda")
    config = TriForceConfig(draft="self", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=2,
                            gamma2=6, policy="fixed")
    for prompt_len in (600, 437):
        prompt = random_prompt(prompt_len, period=53).to("cuda")
        expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, triforce_config=config,
                             return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected)
        stats, detail = out.triforce_stats, out.triforce_stats.detail
        assert detail.tier_forwards["force3"] == "graph (native)" and detail.tier_compile["force3"]["mode"] == "graph"
        assert detail.tier_compile["force3"]["forwards"] == stats.force3_steps > 3 and stats.force2_accepted > 0


@cuda
def test_cuda_fp32_two_levels_and_prefilled_cache():
    from transformers import DynamicCache

    model, prompt, config, expected = _cuda_exact("llama-gqa", "self", levels=2)
    prefix = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=prompt[:, :-1], cache=prefix, use_cache=True)
    cached = prefix.get_seq_length()
    config = TriForceConfig(policy="fixed", draft="self", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24)
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, triforce_config=config, cache=prefix)
    assert torch.equal(out, expected)
    assert prefix.get_seq_length() == cached, "cache= must be read, never modified"


@cuda
def test_cuda_sampling_is_seeded_and_runs():
    model = make_model("llama-gqa", logit_scale=4.0).to("cuda")
    prompt = random_prompt(400, period=31).to("cuda")
    config = TriForceConfig(policy="fixed", draft="self", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24)
    runs = []
    for _ in range(2):
        torch.manual_seed(7)
        runs.append(model.generate(prompt, max_new_tokens=32, do_sample=True, temperature=0.8, top_p=0.9,
                                   triforce_config=config))
    assert runs[0].shape == (1, 432) and torch.equal(runs[0], runs[1])


@cuda
@pytest.mark.parametrize("policy", ["fixed", "auto"])
def test_cuda_fp32_trees_at_both_levels_are_exact(policy):
    """Candidate trees on CUDA (fp32: the prefix part through one matmul, the tree block masked, merged by
    log-sum-exp): greedy output identical to plain generate, alternatives accepted."""
    model = make_model("llama-gqa").to("cuda")
    prompt = random_prompt(600, period=53).to("cuda")
    config = TriForceConfig(draft="ngram", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=3,
                            gamma2=6, tree_nodes=8, tree_branch=3, force2_tree_nodes=10, policy=policy,
                            explore_every=2)
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.triforce_stats.detail.tree_nodes > 0


@cuda
@flash
def test_tree_prefix_through_flash_attn_matches_fp32():
    """The prefix part of tree attention through flash-attn's varlen kernel (fp16) against fp32 matmul."""
    from hf_triforce.kernels.tree_attention import flash_prefix_attention, prefix_attention

    torch.manual_seed(0)
    query = torch.randn(12, 9, 64, device="cuda", dtype=torch.float16)
    keys, values = (torch.randn(2, 3000, 64, device="cuda", dtype=torch.float16) for _ in range(2))
    out, lse = flash_prefix_attention(query, keys, values, 0.125)
    rows = query.reshape(2, 6 * 9, 64)
    expected_out, expected_lse = prefix_attention(rows.float(), keys.float(), values.float(), 0.125)
    torch.testing.assert_close(out.float(), expected_out, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(lse, expected_lse, atol=2e-3, rtol=2e-3)


# ---------------------------------------------------------------- GPU attention without flash-attn (native_attention)

varlen = pytest.mark.skipif(native_attention.varlen_function() is None,
                            reason=f"torch {torch.__version__}: no varlen_attn with return_aux, scale and window_size")
flex = pytest.mark.skipif(native_attention._flex_module() is None or not native_attention._triton(),
                          reason="needs FlexAttention and Triton")
# fp16 / bf16 against the fp32 reference: flash-attn's test above (fp16), test_cpu_kernels' bf16 test
LOW = {torch.float16: dict(atol=2e-3, rtol=2e-3), torch.bfloat16: dict(atol=2e-2, rtol=2e-2),
       torch.float32: dict(atol=1e-5, rtol=1e-5)}


def _verify_inputs(q_len, kv_len, dtype, heads=12, kv_heads=2, dim=64):
    torch.manual_seed(0)
    query = torch.randn(1, heads, q_len, dim, device="cuda", dtype=dtype)
    key, value = (torch.randn(1, kv_heads, kv_len + 40, dim, device="cuda", dtype=dtype)[:, :, :kv_len]
                  for _ in range(2))
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device="cuda").tril(kv_len - q_len)[None, None]
    expected, _ = attention.gqa_sdpa(_Module().eval(), query.float(), key.float(), value.float(), mask, scaling=0.125)
    return query, key, value, mask, expected


@cuda
@varlen
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (7, 300), (2, 4096), (64, 1000)])
def test_varlen_verify_matches_fp32(q_len, kv_len, dtype):
    """torch's varlen_attn (bottom-right causal through window_size=(-1, 0), GQA 12/2) against masked fp32 SDPA."""
    query, key, value, mask, expected = _verify_inputs(q_len, kv_len, dtype)
    got, _ = native_attention.varlen_verify(_Module().eval(), query, key, value, mask, scaling=0.125)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, **LOW[dtype])


@cuda
@flex
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("q_len,kv_len", [(7, 7), (7, 300), (2, 4096), (64, 1000)])
def test_flex_verify_matches_fp32(q_len, kv_len, dtype):
    """Compiled FlexAttention with the bottom-right causal BlockMask against masked fp32 SDPA (fp32: torch's default
    "highest" matmul precision, no TF32)."""
    query, key, value, mask, expected = _verify_inputs(q_len, kv_len, dtype)
    got, _ = native_attention.flex_verify(_Module().eval(), query, key, value, mask, scaling=0.125)
    assert got.shape == expected.shape
    torch.testing.assert_close(got.float(), expected, **LOW[dtype])


def _prefix_inputs(dtype, m):
    from hf_triforce.kernels.tree_attention import prefix_attention

    torch.manual_seed(0)
    query = torch.randn(12, m, 64, device="cuda", dtype=dtype)
    keys, values = (torch.randn(2, 3000, 64, device="cuda", dtype=dtype) for _ in range(2))
    expected = prefix_attention(query.float().reshape(2, 6 * m, 64), keys.float(), values.float(), 0.125)
    return query, keys, values, expected


@cuda
@varlen
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [9, 12])  # 12 rows = 12 heads: a [T_q, H] log-sum-exp would still be caught
def test_tree_prefix_through_varlen_matches_fp32(dtype, m):
    """The prefix part of tree attention through varlen_attn, its log-sum-exp read as [heads, total_q]."""
    query, keys, values, (expected_out, expected_lse) = _prefix_inputs(dtype, m)
    out, lse = native_attention.varlen_prefix_attention(query, keys, values, 0.125)
    torch.testing.assert_close(out.float(), expected_out, **LOW[dtype])
    torch.testing.assert_close(lse, expected_lse, **LOW[dtype])


@cuda
@flex
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_prefix_through_flex_matches_fp32(dtype):
    query, keys, values, (expected_out, expected_lse) = _prefix_inputs(dtype, 9)
    out, lse = native_attention.flex_prefix_attention(query, keys, values, 0.125)
    torch.testing.assert_close(out.float(), expected_out, **LOW[dtype])
    torch.testing.assert_close(lse, expected_lse, **LOW[dtype])


@cuda
@flex
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_in_one_flex_call_matches_the_split(dtype):
    """The whole tree as one FlexAttention call (mask reading the visibility matrix) against tree_sdpa in fp32."""
    from hf_triforce.kernels.tree_attention import block_visibility, tree_sdpa

    from .test_tree_attention import TREE

    torch.manual_seed(0)
    visible = block_visibility(3, TREE, torch.device("cuda"))
    m = visible.shape[0]
    query = torch.randn(1, 9, m, 64, device="cuda", dtype=dtype)
    key, value = (torch.randn(1, 3, 3000 + m, 64, device="cuda", dtype=dtype) for _ in range(2))
    with native_attention.force_route("sdpa"):
        expected, _ = tree_sdpa(_Module().eval(), query.float(), key.float(), value.float(), visible, scaling=0.125)
    got = native_attention.flex_tree_sdpa(query, key, value, visible, 0.125)
    torch.testing.assert_close(got.float(), expected, **LOW[dtype])


@cuda
@pytest.mark.gpu
def test_automatic_routes_on_cuda():
    """Without flash-attn: fp16/bf16 take varlen_attn where this torch has it, fp32 FlexAttention (with Triton)."""
    if attention.flash_varlen() is not None:
        pytest.skip("flash-attn installed: it is preferred")
    key = torch.zeros(1, 2, 300, 64, device="cuda")
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        query = torch.zeros(1, 12, 7, 64, device="cuda", dtype=dtype)
        varlen_ok = dtype != torch.float32 and native_attention.varlen_function() is not None
        flex_ok = native_attention._flex_module() is not None and native_attention._triton()
        expected = "varlen" if varlen_ok else "flex" if flex_ok else None
        assert attention.fused_route(query, key.to(dtype), key.to(dtype)) == expected, dtype


@cuda
@flex
@pytest.mark.gpu
@pytest.mark.parametrize("route", ["flex", "sdpa"])
@pytest.mark.parametrize("family", ["qwen2", "gemma"])
def test_cuda_fp32_greedy_identity_with_the_route_forced(family, route):
    """Every multi-token call through the pinned route (FlexAttention compiled, or the masked SDPA path) in fp32:
    greedy output identical to plain generate."""
    calls = []
    real = native_attention.flex_verify
    with pytest.MonkeyPatch.context() as patch, native_attention.force_route(route):
        patch.setattr(native_attention, "flex_verify", lambda *a, **k: calls.append(1) or real(*a, **k))
        _cuda_exact(family, "self", force3_compile="off")  # transformers' forward verifies through the route
    assert bool(calls) == (route == "flex")


@cuda
@flex
@pytest.mark.gpu
@pytest.mark.parametrize("route", ["flex", "flex_tree"])
def test_cuda_fp32_trees_exact_with_flex(route):
    """Candidate trees with the prefix through FlexAttention (merged with the fp32 block), or the whole tree as one
    FlexAttention call: greedy output identical to plain generate."""
    model = make_model("llama-gqa", head_dim=16).to("cuda")
    prompt = random_prompt(600, period=53).to("cuda")
    config = TriForceConfig(draft="ngram", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=3,
                            gamma2=6, tree_nodes=8, tree_branch=3, force2_tree_nodes=10, policy="fixed")
    expected = model.generate(prompt, max_new_tokens=40, do_sample=False)
    with native_attention.force_route(route):
        out = model.generate(prompt, max_new_tokens=40, do_sample=False, triforce_config=config,
                             return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert out.triforce_stats.detail.tree_nodes > 0


@cuda
@varlen
@pytest.mark.gpu
def test_triforce_on_cuda_takes_the_varlen_route():
    """As test_triforce_on_cuda_takes_the_flash_route, through torch's varlen_attn (fp16 only: it has no fp32)."""
    calls = []
    real = native_attention.varlen_verify
    model = make_model("llama-gqa", logit_scale=8.0).to("cuda", torch.float16)
    prompt = random_prompt(300, period=37).to("cuda")
    config = TriForceConfig(draft="self", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24, gamma1=2,
                            gamma2=4, policy="fixed", force3_compile="off")  # transformers' forward verifies
    expected = model.generate(prompt, max_new_tokens=24, do_sample=False)
    with pytest.MonkeyPatch.context() as patch, native_attention.force_route("varlen"):
        patch.setattr(native_attention, "varlen_verify", lambda *a, **k: calls.append(1) or real(*a, **k))
        out = model.generate(prompt, max_new_tokens=24, do_sample=False, triforce_config=config)
    assert calls, "the varlen route was not taken"
    assert torch.equal(out, expected)


# ---------------------------------------------------------------- split-KV attention over whole buffers (split_kv)

@cuda
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("rows, capacity, head_dim", [(28, 9001, 128), (1, 8192, 64), (21, 20000, 64)])
def test_split_kv_attention_on_cuda_matches_fp32(dtype, rows, capacity, head_dim):
    """The memory-efficient kernel's spans (its bias's alignment, its padded log-sum-exp) merge to one masked call's
    result: rows seeing every span, only the first, only the remainder; replayed from a CUDA graph too."""
    from hf_triforce.kernels.split_kv import split_kv_attention, split_kv_mask, split_parts

    torch.manual_seed(0)
    kv_heads = 8 if head_dim == 128 else 3
    query = torch.randn(1, kv_heads, rows, head_dim, device="cuda", dtype=dtype)
    keys, values = (torch.randn(1, kv_heads, capacity, head_dim, device="cuda", dtype=dtype) for _ in range(2))
    write = torch.arange(capacity - rows - 3, capacity - 3, device="cuda")
    visible = torch.arange(capacity, device="cuda")[None] <= write[:, None]
    visible[0, 100:] = False  # the first span only
    if rows > 1:
        visible[1] = False
        visible[1, -2:] = True  # the remainder only
    parts = split_parts(kv_heads, rows, capacity, "cuda", head_dim=head_dim)
    assert parts > 1
    expected = torch.nn.functional.scaled_dot_product_attention(query.float(), keys.float(), values.float(),
                                                                attn_mask=visible, scale=head_dim**-0.5)
    mask = split_kv_mask(visible, parts, dtype)
    got = split_kv_attention(query, keys, values, mask, head_dim**-0.5, parts)
    torch.testing.assert_close(got.float(), expected, **LOW[dtype])
    graph = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        split_kv_attention(query, keys, values, mask, head_dim**-0.5, parts)
    torch.cuda.current_stream().wait_stream(side)
    with torch.cuda.graph(graph):
        captured = split_kv_attention(query, keys, values, mask, head_dim**-0.5, parts)
    graph.replay()
    torch.testing.assert_close(captured, got, rtol=0, atol=0)


# the offloaded full cache on a GPU (pinned host buffers, side-stream prefetch), collected here too so that the
# prepared GPU check (which runs this file) exercises it
from .test_offloaded_cache import test_cuda_offloaded_cache_streams_from_pinned_memory  # noqa: E402, F401


@cuda
def test_the_event_clock_times_without_a_synchronisation():
    """`clock.EventClock`: recording the events synchronises nothing (sync debug mode "error" raises on a
    synchronising call); after a readback the end event is passed, so reading the seconds waits for nothing."""
    from hf_triforce.forwards.forward import EventClock, device_clock

    model = make_model("llama-gqa").to("cuda")
    clock = device_clock(model)
    assert isinstance(clock, EventClock) and not clock.immediate
    x = torch.randn(512, 512, device="cuda")
    torch.cuda.set_sync_debug_mode("error")
    try:
        began = clock.start()
        y = x @ x
        seconds = clock.stop(began)
        total = seconds + 2 * seconds - 0.5
    finally:
        torch.cuda.set_sync_debug_mode(0)
    y.sum().item()  # the step's readback: the stream has passed the end event
    ((_, interval),) = seconds.terms
    assert interval.end.query()
    assert float(seconds) > 0 and float(total) == pytest.approx(3 * float(seconds) - 0.5)
