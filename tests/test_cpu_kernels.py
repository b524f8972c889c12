"""The CPU speed paths: the weight-left output layer, the int8 drafting copy, split-cache verification."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from hf_triforce.kernels import attention, few_rows_linear
from hf_triforce.kernels import linear_routes as linear_routes_module
from hf_triforce.kernels.quantized import Int8Linear, forget_int8_copy, int8_copy, int8_layer_names

from .conftest import make_model
from .test_cpu_attention import BUILDS


# "gguf" reads blocks attached from a GGUF file: tests/test_gguf_weights.py runs this check on a GGUF model
@pytest.mark.parametrize("route", [route for route in linear_routes_module.ROUTES if route != "gguf"])
def test_each_linear_route_gives_each_row_its_own_products_and_is_restored(route):
    """Under each route every eligible layer computes each row's own dot products (rows never mix: a row's output
    is the same whatever the other rows hold), one row included; the layers are restored after the block. Layers
    whose every route is ``"linear"`` (the layer's own forward) are not switched at all."""
    if route == "stream" and not few_rows_linear.available():
        assert not BUILDS, few_rows_linear.status()  # where a C compiler builds it, it must run
        pytest.skip(f"the few-rows kernel: {few_rows_linear.status()}")
    model = make_model("qwen2")  # q/k/v biases
    routes = linear_routes_module.LinearRoutes(model)
    routes.calibrate = lambda group, rows: route  # the route under test, whatever this CPU times fastest
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    inputs = {n: torch.randn(1, n, layers[0].in_features) for n in (1, 2, 7)}
    expected = {n: layers[0](x) for n, x in inputs.items()}  # the plain layer, before the block
    with routes.installed():
        assert all(("forward" in vars(layer)) == (route != "linear") for layer in layers)
        if route != "linear":
            with linear_routes_module.LinearRoutes(model).installed() as nested:  # already switched: left alone
                assert not any(nested.groups.values())
        got = {n: layers[0](x) for n, x in inputs.items()}
        other = inputs[7].clone()
        other[:, 1:] = torch.randn_like(other[:, 1:])  # other rows changed: row 0's output is unchanged
        assert torch.equal(layers[0](other)[:, 0], got[7][:, 0])
        head = model.get_output_embeddings()
        hidden = torch.randn(1, 5, head.in_features)
        rowwise = torch.cat([head(hidden[:, i : i + 1]) for i in range(5)], dim=1)
        torch.testing.assert_close(head(hidden), rowwise, rtol=1e-5, atol=1e-5)
    assert not any("forward" in vars(layer) for layer in layers)
    for n in inputs:
        torch.testing.assert_close(got[n], expected[n], rtol=1e-5, atol=1e-5)
        assert got[n].shape == expected[n].shape
    calibrated = dict.fromkeys(linear_routes_module.CALIBRATED_ROWS, route)
    assert routes.used() == {"decoder": calibrated, "head": calibrated}


def test_linear_routes_are_timed_once_per_model_before_any_forward_and_restored_on_error():
    """Every group's routes are timed when first installed, before any forward (none is timed inside a forward the
    adaptive policy times), and kept for the model (`linear_routes` returns the same object); a row count takes the
    route of the largest calibrated count not above it, more than MAX_ROUTED_ROWS rows F.linear; an exception
    restores the layers."""
    model = make_model("llama-gqa")
    routes = linear_routes_module.linear_routes(model)
    assert linear_routes_module.linear_routes(model) is routes
    timed = []
    real = routes.calibrate
    routes.calibrate = lambda group, rows: timed.append((group, rows)) or real(group, rows)
    layer = model.model.layers[0].mlp.down_proj
    pairs = [(group, rows) for group in ("head", "decoder") for rows in linear_routes_module.CALIBRATED_ROWS]
    for _ in range(2):  # the second call's block times nothing
        with routes.installed():
            assert sorted(timed) == sorted(pairs)
            for rows in (1, 3, 7, 16, linear_routes_module.MAX_ROUTED_ROWS + 1):
                layer(torch.randn(rows, layer.in_features))
        assert sorted(timed) == sorted(pairs)
    assert routes.calibration_seconds > 0
    routes.routes = {("decoder", 1): "linear", ("decoder", 2): "left", ("decoder", 4): "linear", ("decoder", 8): "left"}
    assert [routes.route("decoder", n) for n in (0, 1, 2, 3, 4, 7, 8, 16, 17)] == \
        ["linear", "linear", "left", "left", "linear", "linear", "left", "left", "linear"]
    try:
        with routes.installed():
            raise KeyboardInterrupt
    except KeyboardInterrupt:
        pass
    assert "forward" not in vars(layer) and "forward" not in vars(model.get_output_embeddings())
    plain = nn.Sequential(nn.Linear(2, 2))  # no output layer: every linear layer is a "decoder" one
    groups = linear_routes_module.LinearRoutes(plain).find_groups()
    assert groups["head"] == [] and groups["decoder"] == [plain[0]]


def test_int8_copy_shares_all_but_the_linear_layers():
    model = make_model("llama-gqa")
    copy = int8_copy(model)
    assert int8_copy(model) is copy  # cached
    assert copy.config is model.config
    assert copy.model.embed_tokens.weight is model.model.embed_tokens.weight
    assert copy.model.norm.weight is model.model.norm.weight
    assert type(copy.lm_head) is Int8Linear
    assert type(model.lm_head) is nn.Linear
    ids = torch.randint(0, 96, (1, 20))
    with torch.no_grad():
        full, quantized = model(ids).logits.softmax(-1), copy(ids).logits.softmax(-1)
    assert (full - quantized).abs().sum(-1).max() < 0.2  # close, not equal: a cheaper drafter
    forget_int8_copy(model)
    assert int8_copy(model) is not copy


def test_int8_copy_keeps_the_mlp_output_projections_in_fp32():
    model = make_model("qwen2")
    copy = int8_copy(model)
    down = [m for name, m in copy.named_modules() if name.endswith("mlp.down_proj")]
    assert down and all(type(m) is nn.Linear and m.weight is not None for m in down)
    quantized = [name for name, m in copy.named_modules() if type(m) is Int8Linear]
    assert any(name.endswith("mlp.up_proj") for name in quantized) and "lm_head" in quantized
    forget_int8_copy(model)


@pytest.mark.parametrize("heads,kv_heads,q_len,kv_len",
                         [(9, 3, 1, 300), (9, 3, 9, 1000), (8, 2, 7, 5000), (4, 4, 3, 777)])
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_split_kv_sdpa_matches_one_masked_call(heads, kv_heads, q_len, kv_len, threads):
    """Same values as masked SDPA over the whole cache, read from a preallocated buffer's strided prefix."""
    torch.manual_seed(0)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        keys, values = (torch.randn(1, kv_heads, kv_len + 40, 64)[:, :, :kv_len] for _ in range(2))
        query = torch.randn(1, heads, q_len, 64)
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=0.125, enable_gqa=True).transpose(1, 2)
        got, _ = attention.split_kv_sdpa(nn.Module().eval(), query, keys, values, mask, scaling=0.125)
    finally:
        torch.set_num_threads(before)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_split_kv_route_taken_only_for_few_rows_over_a_long_cpu_cache():
    module = nn.Module().eval()
    query, long_keys = torch.zeros(1, 9, 8, 64), torch.zeros(1, 3, attention.SPLIT_KV_MIN_CACHED + 8, 64)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert attention._wants_split_kv(query, long_keys, long_keys, 0.0, module)
        short = long_keys[:, :, :-1]
        assert not attention._wants_split_kv(query, short, short, 0.0, module)  # cache one entry short
        assert not attention._wants_split_kv(torch.zeros(1, 9, 1024, 64), long_keys, long_keys, 0.0, module)  # prefill
        # values narrower than keys (multi-head latent attention): ATen's CPU flash kernel refuses them
        assert not attention._wants_split_kv(query, long_keys, long_keys[..., :48], 0.0, module)
        assert not attention._wants_split_kv(query[:, :, :1], long_keys, long_keys, 0.0, module)  # one row
        two_kv_heads = long_keys[:, :2]  # one work item per thread already
        assert not attention._wants_split_kv(query[:, :6], two_kv_heads, two_kv_heads, 0.0, module)
        torch.set_num_threads(1)
        assert not attention._wants_split_kv(query, long_keys, long_keys, 0.0, module)
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("kv_len", [300, 9000])
def test_routes_return_the_values_width(kv_len):
    """Values narrower than keys (DeepSeek-V3's MLA: 128 against 192): a decoding step (`one_row_sdpa`; at 9000
    entries, past `SPLIT_KV_MIN_CACHED`, not split: ATen's kernel refuses the widths), a masked GQA verification
    (`gqa_sdpa`) and a tree forward (`tree_sdpa`) return ``[b, q, heads, dv]``, equal to SDPA."""
    from hf_triforce.kernels.tree_attention import tree_sdpa

    torch.manual_seed(0)
    module = nn.Module().eval()
    keys, values = torch.randn(1, 2, kv_len, 24), torch.randn(1, 2, kv_len, 16)
    for q_len in (1, 5):
        query = torch.randn(1, 6, q_len, 24)
        mask = torch.ones(q_len, kv_len, dtype=torch.bool).tril(kv_len - q_len)[None, None]
        expected = torch.nn.functional.scaled_dot_product_attention(
            query, keys, values, attn_mask=mask, scale=0.2, enable_gqa=True).transpose(1, 2)
        routes = {"tree": tree_sdpa(module, query, keys, values, mask[0, 0, :, -q_len:], scaling=0.2)[0]}
        if q_len == 1:
            routes["one_row"] = attention.one_row_sdpa(module, query, keys, values, None, scaling=0.2)[0]
        else:
            routes["gqa"] = attention.gqa_sdpa(module, query, keys, values, mask, scaling=0.2)[0]
        for route, got in routes.items():
            assert got.shape == (1, q_len, 6, 16), route
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6, msg=route)


@pytest.mark.parametrize("shape", [(7,), (64,), (65,), (300,), (2, 40)])
def test_int8_copy_rows_do_not_depend_on_each_other(shape):
    """Force 2's q for one row must not change with the drafts verified beside it, or with the other rows of a
    batch (exactness): each quantized layer's output row is the same, bit for bit, whatever values the other rows
    of the call hold, for calls below and above 64 rows and batched ``[2, n]`` inputs."""
    model = make_model("llama-gqa")
    copy = int8_copy(model)
    generator = torch.Generator().manual_seed(0)
    names = int8_layer_names(model)
    assert names and all(not isinstance(copy.get_submodule(name), nn.Linear) for name in names)
    with torch.no_grad():
        for name in names:
            layer = copy.get_submodule(name)
            calls = torch.randn(*shape, model.get_submodule(name).in_features, generator=generator)
            for kept in (0, calls[..., 0].numel() - 1):  # the first row, the last row
                others = calls.clone()
                rows = others.view(-1, others.shape[-1])
                changed = torch.arange(rows.shape[0]) != kept
                rows[changed] = 10 * torch.randn(rows[changed].shape, generator=generator)  # a larger max there
                out, beside_others = (layer(x).reshape(-1, layer.out_features)[kept] for x in (calls, others))
                assert torch.equal(out, beside_others), (name, shape, kept)
    forget_int8_copy(model)


@pytest.mark.parametrize("heads,kv_heads,kv_len", [(9, 3, 300), (8, 2, 9000), (4, 4, 777)])
def test_one_row_sdpa_matches_sdpa_over_the_whole_cache(heads, kv_heads, kv_len):
    """A decoding step's row sees every cached entry: the same values as SDPA with enable_gqa (split across
    threads from SPLIT_KV_MIN_CACHED entries), read from a preallocated buffer's strided prefix."""
    torch.manual_seed(0)
    keys, values = (torch.randn(1, kv_heads, kv_len + 40, 64)[:, :, :kv_len] for _ in range(2))
    query = torch.randn(1, heads, 1, 64)
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, keys, values, scale=0.125, enable_gqa=True).transpose(1, 2)
    got, _ = attention.one_row_sdpa(nn.Module().eval(), query, keys, values, None, scaling=0.125)
    assert got.shape == expected.shape and got.is_contiguous()
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    assert attention._wants_one_row("sdpa", query, None, {})
    assert not attention._wants_one_row("eager", query, None, {})
    assert not attention._wants_one_row("sdpa", torch.zeros(1, heads, 2, 64), None, {})
    assert not attention._wants_one_row("sdpa", query, None, {"softcap": 30.0})


def test_split_route_keeps_the_dtype():
    """The log-sum-exp merge weights are fp32: a bf16 model must get bf16 back (o_proj's input)."""
    keys, values = (torch.randn(1, 3, 300, 64, dtype=torch.bfloat16) for _ in range(2))
    query = torch.randn(1, 9, 1, 64, dtype=torch.bfloat16)
    got, _ = attention.split_kv_sdpa(nn.Module().eval(), query, keys, values, None, scaling=0.125)
    expected = torch.nn.functional.scaled_dot_product_attention(query.float(), keys.float(), values.float(),
                                                                scale=0.125, enable_gqa=True).transpose(1, 2)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=2e-2, atol=2e-2)
