"""A GGUF model's linear layers read at their stored width (`hf_triforce.kernels.gguf_weights`, the ``"gguf"`` route).

* `load_gguf` attaches every linear weight of a GGUF file of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K and Q6_K tensors
  (llama.cpp's permuted query and key rows put back in the model's order, the tied output layer included), each
  checked bit for bit against the fp32 weight transformers loaded;
* TriForce with every linear layer on that route keeps its greedy output identical to plain ``generate`` on the
  same (dequantized) model, and its stats and the bench's heading say what the target read;
* a model of other values, another dtype, a missing file, and ``load_gguf`` in another dtype are refused with an
  error naming the argument; a weight written after attaching (in place, through ``.data``, by peft's
  ``merge_and_unload``, converted to another dtype) is refused at the next call, and runs on the fp32 routes once
  detached.
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

from hf_triforce import attach_gguf, detach_gguf, load_gguf
from hf_triforce.kernels import gguf_linear, gguf_weights, linear_routes
from hf_triforce_bench import compare as bench

from .conftest import make_model, random_prompt
from .gguf_util import TYPES, VOCAB, write_tiny_llama
from .test_cpu_attention import needs_kernel
from .test_greedy_identity import _config, assert_identical

pytest.importorskip("gguf")


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return write_tiny_llama(tmp_path_factory.mktemp("gguf") / "tiny.gguf")


@pytest.fixture
def gguf_model(tiny_gguf):
    return load_gguf(tiny_gguf)[0]


@needs_kernel
def test_every_linear_weight_is_attached_bit_for_bit(gguf_model):
    layers = [module for module in gguf_model.modules() if isinstance(module, torch.nn.Linear)]
    assert gguf_model.lm_head.weight is gguf_model.model.embed_tokens.weight  # tied: the Q8_0 embedding
    for layer in layers:
        matrix = gguf_weights.matrix_of(layer.weight)
        assert matrix is not None and matrix.out_features == layer.out_features
        assert torch.equal(gguf_linear.dequantize(matrix).view(torch.int32), layer.weight.detach().view(torch.int32))
    expected = Counter(kind for kind in TYPES.values() for _ in range(2)) + Counter(["Q8_0"])  # 2 layers, the head
    assert gguf_weights.describe(gguf_model) == dict(sorted(expected.items()))
    assert gguf_weights.matrix_of(gguf_model.lm_head.weight).kind == "Q8_0"
    detach_gguf(gguf_model)
    assert gguf_weights.describe(gguf_model) == {} and gguf_weights.matrix_of(layers[0].weight) is None


@needs_kernel
def test_triforce_at_stored_width_keeps_greedy_identity(monkeypatch, gguf_model):
    """Every linear layer of the target (the head included) on the ``"gguf"`` route: the greedy output is plain
    ``generate``'s on the dequantized model, and the stats and the bench's heading name the route and the types."""
    monkeypatch.setattr(linear_routes.LinearRoutes, "calibrate", lambda self, group, rows: "gguf")
    prompt = random_prompt(150, vocab_size=VOCAB, period=37)
    stats = assert_identical(gguf_model, prompt, _config("self"))
    assert stats.force3_steps > 0
    assert {route for by_rows in stats.detail.linear_routes.values() for route in by_rows.values()} == {"gguf"}
    assert set(stats.detail.linear_routes) == {"head", "decoder"}
    assert stats.detail.cpu_kernels["gguf"] == {"kernel": "on", "layers": gguf_weights.describe(gguf_model)}
    note = bench.kernels_note([bench.Run("triforce", stats=stats)])
    assert ("target weights at GGUF stored width (Q4_0 2 layers, Q4_1 2 layers, Q4_K 4 layers, Q5_0 2 layers, "
            "Q5_1 2 layers, Q6_K 2 layers, Q8_0 1 layers; kernel on)") in note
    assert "decoder 1:gguf" in note


@needs_kernel
def test_the_route_gives_each_row_its_own_products_and_is_restored(gguf_model):
    """Under the ``"gguf"`` route each layer (the tied head included) computes each row's own dot products with the
    weight's values (within the fp32 bound of the plain layer's), a row's output the same whatever the other rows
    hold; the layers are restored after the block."""
    routes = linear_routes.LinearRoutes(gguf_model)
    routes.calibrate = lambda group, rows: "gguf"
    layers = [gguf_model.model.layers[0].mlp.down_proj, gguf_model.lm_head]
    inputs = {(i, n): torch.randn(1, n, layer.in_features) for i, layer in enumerate(layers) for n in (1, 2, 7)}
    expected = {(i, n): layers[i](x) for (i, n), x in inputs.items()}
    with routes.installed():
        assert all("forward" in vars(layer) for layer in layers)
        got = {(i, n): layers[i](x) for (i, n), x in inputs.items()}
        for i, layer in enumerate(layers):
            other = inputs[i, 7].clone()
            other[:, 1:] = torch.randn_like(other[:, 1:])
            assert torch.equal(layer(other)[:, 0], got[i, 7][:, 0])
    assert not any("forward" in vars(layer) for layer in layers)
    for (i, n), out in got.items():
        bound = gguf_linear.error_bound(inputs[i, n][0], layers[i].weight.detach()) * 2  # both sides' rounding
        assert out.shape == expected[i, n].shape
        assert bool(((out[0].double() - expected[i, n][0].double()).abs() <= bound).all())


@needs_kernel
def test_the_route_is_offered_only_where_every_layer_has_blocks(gguf_model):
    routes = linear_routes.LinearRoutes(gguf_model)
    groups = routes.find_groups()
    assert "gguf" in linear_routes.routes_for(groups["decoder"]) and "gguf" in linear_routes.routes_for(groups["head"])
    routes.groups = groups
    assert routes.calibrate("decoder", 2) in linear_routes.ROUTES  # the timing runs every route, "gguf" included
    other = make_model("llama-gqa")  # held: LinearRoutes keeps a weak reference
    plain = linear_routes.LinearRoutes(other).find_groups()["decoder"]
    assert "gguf" not in linear_routes.routes_for(plain)
    assert "gguf" not in linear_routes.routes_for([*groups["decoder"], plain[0]])  # one layer without blocks


@needs_kernel
def test_bad_inputs_are_refused(tiny_gguf, tmp_path, gguf_model):
    with pytest.raises(ValueError, match="attach_gguf: path .*missing.gguf' is not a file"):
        attach_gguf(gguf_model, tmp_path / "missing.gguf")
    other = write_tiny_llama(tmp_path / "other.gguf", seed=1)
    with pytest.raises(ValueError, match="model weight .* differs from the values of .* in other.gguf: model is not "
                                         "the model of this file"):
        attach_gguf(gguf_model, other)
    bf16 = load_gguf(tiny_gguf)[0].bfloat16()
    with pytest.raises(ValueError, match="model weight .* is torch.bfloat16 .*load the model in float32"):
        attach_gguf(bf16, tiny_gguf)
    with pytest.raises(ValueError, match="load_gguf: dtype must be torch.float32"):
        load_gguf(tiny_gguf, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="load_gguf: path"):
        load_gguf(tmp_path / "missing.gguf")
    weight = gguf_model.model.layers[0].mlp.down_proj.weight
    with torch.no_grad():
        weight.mul_(1.0)  # the same values, but written: the blocks cannot know
    with pytest.raises(RuntimeError, match="blk.0.ffn_down.weight was changed in place after attach_gguf"):
        gguf_weights.matrix_of(weight)
    with pytest.raises(RuntimeError, match="changed in place after attach_gguf"):
        linear_routes.routes_for([gguf_model.model.layers[0].mlp.down_proj])
    attach_gguf(gguf_model, tiny_gguf)  # attached again: offered again
    assert gguf_weights.matrix_of(weight) is not None


@needs_kernel
def test_the_timing_reads_its_working_set_at_the_packed_width(monkeypatch, gguf_model):
    """The route timing takes layers until `CALIBRATION_BYTES` counted at the blocks' width: counted in fp32 the
    blocks would be timed on a working set a sixth as large, read from the cache where a forward reads memory."""
    routes = linear_routes.LinearRoutes(gguf_model)
    routes.groups = routes.find_groups()
    packed = [gguf_weights.matrix_of(layer.weight).nbytes for layer in routes.groups["decoder"]]
    monkeypatch.setattr(linear_routes, "CALIBRATION_BYTES", sum(packed[:5]))
    seen = set()
    real = linear_routes.multiply
    monkeypatch.setattr(linear_routes, "multiply",
                        lambda route, rows, weight: seen.add(id(weight)) or real(route, rows, weight))
    routes.calibrate("decoder", 1)
    assert len(seen) == 5


def _last_offered(self, group, rows):
    """A route timing that takes the last route the group can take: ``"gguf"`` where its blocks are attached."""
    return linear_routes.routes_for(self.groups[group])[-1]


@needs_kernel
@pytest.mark.parametrize("write", ["data", "merge_and_unload", "double"])
def test_a_weight_written_through_data_is_refused_then_runs_detached(monkeypatch, tiny_gguf, write):
    """A write the version counter does not see (``weight.data += x``; peft's ``merge_and_unload``, which adds each
    adapter's product to ``base_layer.weight.data``; ``model.double()``) leaves the blocks holding other values than
    the weight: the next call refuses them, naming the tensor, and after `detach_gguf` the greedy output is plain
    ``generate``'s on the written model."""
    monkeypatch.setattr(linear_routes.LinearRoutes, "calibrate", _last_offered)
    model = load_gguf(tiny_gguf)[0]
    prompt = random_prompt(150, vocab_size=VOCAB, period=37)
    if write == "data":
        weight = model.model.layers[0].mlp.down_proj.weight
        weight.data += 0.05 * torch.randn(weight.shape, generator=torch.Generator().manual_seed(0))
        source = "blk.0.ffn_down.weight"
    else:
        from peft import LoraConfig, get_peft_model

        lora = LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj"], init_lora_weights=False)
        model = get_peft_model(model, lora).merge_and_unload()
        source = "blk.[01].attn_v.weight"
    if write == "double":
        model = model.double()
        message = r"GGUF tensor \S+ is torch.float64 .*its attached blocks hold float32"
    else:
        message = f"GGUF tensor {source} holds other values than its attached blocks"
    with pytest.raises(RuntimeError, match=message):
        model.generate(prompt, triforce_config=_config("self"), max_new_tokens=8, do_sample=False)
    detach_gguf(model)
    stats = assert_identical(model, prompt, _config("self"))
    assert "gguf" not in stats.detail.cpu_kernels
    assert "gguf" not in {route for by_rows in stats.detail.linear_routes.values() for route in by_rows.values()}


@needs_kernel
def test_routes_timed_on_the_blocks_are_timed_again_once_detached(monkeypatch, gguf_model):
    """A call on the ``"gguf"`` route keeps its routes for the model's later calls; after `detach_gguf` the next call
    times the layers again (the blocks are gone) and runs on the fp32 routes, its greedy output plain ``generate``'s."""
    monkeypatch.setattr(linear_routes.LinearRoutes, "calibrate", _last_offered)
    prompt = random_prompt(150, vocab_size=VOCAB, period=37)
    stats = assert_identical(gguf_model, prompt, _config("self"), max_new_tokens=12)
    assert {route for by_rows in stats.detail.linear_routes.values() for route in by_rows.values()} == {"gguf"}
    detach_gguf(gguf_model)
    stats = assert_identical(gguf_model, prompt, _config("self"), max_new_tokens=12)
    assert "gguf" not in {route for by_rows in stats.detail.linear_routes.values() for route in by_rows.values()}
    assert stats.detail.linear_routes and set(stats.detail.linear_routes) == {"head", "decoder"}
