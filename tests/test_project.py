"""`hf-triforce-bench project`: the roofline cost of a forward, and plan speeds priced by the adaptive policy itself."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from hf_triforce import TriForceConfig
from hf_triforce.decoding.policy import AdaptivePolicy, Plan, expected_tokens
from hf_triforce_bench.cli import main
from hf_triforce_bench.roofline import (
    DEVICES,
    Acceptance,
    Device,
    assume_costs,
    assume_rates,
    attention_seconds,
    cache_copy_seconds,
    device,
    fill_seconds,
    forward_seconds,
    load_devices,
    model_shape,
    plain_generate_seconds,
    planning_policy,
    project_plans,
    rate_for_tokens,
    tier_precision,
    tier_seconds,
)

from .test_policy import literal_force2_seconds

# the CPUs fitted on this project's runs (benchmarks/project_calibration.py), beside their measurements
FITTED_FILE = Path(__file__).resolve().parents[1] / "docs" / "bench" / "calibration" / "devices.json"
FITTED = load_devices(FITTED_FILE)
FITTED_CPU = ["--devices", str(FITTED_FILE), "--device", "epyc-avx2-2026-11-30"]
EPYC_FP32, EPYC_LEAN, ZEN4_BF16 = "epyc-avx2-2026-11-30", "epyc-avx2-2026-12-02", "zen4-2026-12-03-qwen-bf16"

TINY = dict(num_hidden_layers=2, hidden_size=4, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
            head_dim=2, vocab_size=10, tie_word_embeddings=False, hidden_act="silu", dtype="float32")
UNIT = Device(name="unit", bandwidth=1e9, flops=1e9, attention_flops=1e9, layer_overhead=1e-3)
# int4-able widths (the lean copies quantize groups of 32 inputs): q 2 x 32, k / v 32, hidden 64, MLP 128
WIDE = dict(num_hidden_layers=2, hidden_size=64, intermediate_size=128, num_attention_heads=2, num_key_value_heads=1,
            head_dim=32, vocab_size=100, tie_word_embeddings=True, hidden_act="silu", dtype="float32")


def test_bytes_and_seconds_of_a_forward_by_hand():
    tiny = model_shape(TINY)
    # per layer: q, o 4x(2x2) each, k, v 4x(1x2) each = 48; gate, up, down 3 x 4x8 = 96; output layer 10x4
    assert tiny.matrix_params == 2 * (48 + 96) + 40
    assert tiny.weight_bytes == 328 * 4
    assert tiny.kv_bytes_per_token == 2 * 2 * 1 * 2 * 4  # K and V, layers, KV heads, head dim, fp32
    # 3 rows over 100 cached entries: weights + KV bytes, 2 x rows x params, 4 x rows x heads x head dim x cached x
    # layers, 2 layers of overhead
    expected = (1312 + 3200) / 1e9 + 2 * 3 * 328 / 1e9 + 4 * 3 * 2 * 2 * 100 * 2 / 1e9 + 2e-3
    assert forward_seconds(tiny, UNIT, cached=100, rows=3) == pytest.approx(expected, rel=1e-12)
    # a DynamicCache step also reads and writes the whole cache once
    assert plain_generate_seconds(tiny, UNIT, 100) == pytest.approx(
        forward_seconds(tiny, UNIT, 100) + 2 * 3200 / 1e9, rel=1e-12)


def test_plain_generate_prices_its_maskless_gqa_attention_and_its_copy_at_their_own_rates():
    tiny = model_shape(TINY)  # 2 query heads over 1 KV head
    attention_flops = 4 * 1 * 2 * 2 * 100 * 2  # one row over 100 cached entries, 2 layers
    dev = Device(name="unit", bandwidth=1e9, flops=1e9, attention_flops=1e9, layer_overhead=1e-3,
                 gqa_attention_flops=1e8, copy_bandwidth=4e9)
    assert attention_seconds(tiny, dev, 100) == pytest.approx(3200 / 1e9 + attention_flops / 1e9, rel=1e-12)
    assert attention_seconds(tiny, dev, 100, maskless_gqa=True) == pytest.approx(
        3200 / 1e9 + attention_flops / 1e8, rel=1e-12)
    assert cache_copy_seconds(tiny, dev, 100) == pytest.approx(2 * 3200 / 4e9, rel=1e-12)
    assert plain_generate_seconds(tiny, dev, 100) == pytest.approx(
        forward_seconds(tiny, dev, 100) + 2 * 3200 / 4e9 + attention_flops * (1 / 1e8 - 1 / 1e9), rel=1e-12)
    # the static decode (every tier) never takes the maskless path
    assert forward_seconds(tiny, dev, 100) == forward_seconds(tiny, UNIT, 100)
    # a model without grouped queries has no such path: its attention keeps attention_flops
    mha = model_shape({**TINY, "num_key_value_heads": 2})
    assert attention_seconds(mha, dev, 100, maskless_gqa=True) == attention_seconds(mha, dev, 100)


def test_smollm2_preset_reads_its_135m_weights():
    smollm2 = model_shape("smollm2-135m")
    assert smollm2.dtype == "float32"
    # 30 layers x (576 x 64 x (2 x 9 + 2 x 3) + 3 x 576 x 1536) + the tied output layer 49152 x 576
    assert smollm2.matrix_params == 30 * (576 * 64 * 24 + 3 * 576 * 1536) + 49152 * 576 == 134_479_872
    # docs/bench/calibration/runs.csv, folder calibration/epyc-avx2-2026-11-29/32k: full_cache_bytes 1480919040
    # = 32138 x 46080
    assert smollm2.kv_bytes_per_token == 46_080
    assert model_shape("smollm2-135m", "bf16").weight_bytes * 2 == smollm2.weight_bytes


def test_drafting_precisions_read_their_copies_bytes():
    """lean-int4 (kernels.lean): the layers' projections int4 (half a byte a weight) with a bf16 scale and zero point
    per 32 inputs per output row, the output layer int8 with a bf16 scale per row; int8 (kernels.quantized): every
    linear int8 with an fp32 scale per output channel but the MLP down projections, kept in the model's dtype."""
    wide = model_shape(WIDE)
    # per layer: qkv 128 x 64, o 64 x 64, gate/up 256 x 64, down 64 x 128; the output layer 100 x 64
    layer_params = 2 * (128 * 64 + 64 * 64 + 256 * 64 + 64 * 128)
    assert wide.matrix_params == layer_params + 100 * 64 and wide.weight_bytes == 4 * wide.matrix_params
    groups = 2 * ((128 + 64 + 256) * 2 + 64 * 4)  # output rows x groups of 32 inputs: 64 wide 2 groups, down's 4
    assert wide.precision_weight_bytes("lean-int4") == layer_params // 2 + 4 * groups + 100 * 64 + 2 * 100
    assert wide.precision_weight_bytes("lean-int8") == wide.matrix_params + 2 * (2 * (128 + 64 + 256 + 64) + 100)
    assert wide.precision_weight_bytes("lean") == wide.precision_weight_bytes("model") == wide.weight_bytes
    down = 2 * 64 * 128
    assert wide.precision_weight_bytes("int8") == (wide.matrix_params - down) + 4 * (2 * (128 + 64 + 256) + 100) \
        + 4 * down
    # a real model: the layers at 5/32 of fp32 (0.5 + 4/32 bytes a weight against 4), the int8 output layer ~1/4
    qwen = model_shape("qwen2.5-coder-1.5b", "float32")
    head = 151936 * 1536
    layers = qwen.matrix_params - head
    assert qwen.precision_weight_bytes("lean-int4") == layers * 5 // 32 * 4 + head + 2 * 151936
    assert 0.17 < qwen.precision_weight_bytes("lean-int4") / qwen.weight_bytes < 0.171


def test_force1_and_force2_read_the_drafting_copy():
    """`tier_seconds` prices Force 1 / Force 2 at `TriForceConfig.draft_precision` (auto: lean-int4 on a CPU, the
    model on a GPU) and Force 3 at the model's own weights; int4 products at the device's quantized rates."""
    qwen = model_shape("qwen2.5-coder-1.5b", "float32")
    cpu = device(EPYC_FP32, "float32", FITTED, quantized_bandwidth=5e9, quantized_flops=40e9)
    lean = tier_seconds(qwen, cpu, 8000, TriForceConfig(draft_precision="lean-int4"))
    model = tier_seconds(qwen, cpu, 8000, TriForceConfig(draft_precision="model"))
    assert tier_seconds(qwen, cpu, 8000) == lean  # auto on a CPU: lean-int4
    assert lean["force3"] == model["force3"] and lean["select"] == model["select"]
    window = 16 + 1024  # TriForceConfig's sink_tokens + window
    assert lean["draft:self"][1] == forward_seconds(qwen, cpu, window, precision="lean-int4") < model["draft:self"][1]
    assert lean["force2"][3] == forward_seconds(qwen, cpu, 4096, 3, precision="lean-int4")
    # the int4 bytes at the quantized rate, the int8 output layer too; the KV cache (the model's dtype) at bandwidth
    weights = qwen.precision_weight_bytes("lean-int4") / 5e9 + 2 * qwen.matrix_params / 40e9
    kv = window * qwen.kv_bytes_per_token / cpu.bandwidth + qwen.attention_flops(window, 1) / cpu.attention_flops
    assert lean["draft:self"][1] == pytest.approx(weights + kv, rel=1e-12)
    h200 = device("h200", "bfloat16")
    bf16 = model_shape("qwen2.5-coder-1.5b")
    assert tier_seconds(bf16, h200, 8000) == tier_seconds(bf16, h200, 8000, TriForceConfig(draft_precision="model"))
    assert tier_precision("auto", h200, [bf16]) == "model" and tier_precision("auto", cpu, [bf16]) == "lean-int4"
    assert tier_precision("auto", cpu, [model_shape("qwen2.5-coder-1.5b", "float16")]) == "model"
    assert tier_precision("auto", cpu, [model_shape(TINY)]) == "model"  # widths the int4 group does not divide


def test_fitted_cpu_presets_price_the_int4_copies():
    assert "zen4" not in " ".join(DEVICES)  # the installed presets are public specs; fitted CPUs come from a file
    zen4 = device(ZEN4_BF16, "bfloat16", FITTED)
    assert zen4.cpu and zen4.quantized_bandwidth and zen4.quantized_flops and zen4.layer_overhead == 0.0
    qwen = model_shape("qwen2.5-coder-1.5b")
    tiers = tier_seconds(qwen, zen4, 8000)
    assert tiers["draft:self"][1] == forward_seconds(qwen, zen4, 1040, precision="lean-int4") < tiers["force3"][1]
    assert device(EPYC_LEAN, "float32", FITTED).quantized_bandwidth < device(EPYC_LEAN, "float32", FITTED).bandwidth
    with pytest.raises(ValueError, match=r"FLOP/s for \['bfloat16'\] only"):
        device(ZEN4_BF16, "float32", FITTED)


@pytest.mark.parametrize("content, message", [
    ("not json", "devices file .*: Expecting value"),
    ('{"cpu": {}}', "expected an object with a 'devices' object"),
    ('{"devices": {"box": {"bandwidth": 1e10, "flops": {"float32": 1e11}}}}', r"'box': missing \['layer_overhead'\]"),
    ('{"devices": {"box": {"bandwidth": 1e10, "flops": {"float32": 1e11}, "layer_overhead": 0, "speed": 1}}}',
     r"unknown \['speed'\]"),
    ('{"devices": {"box": {"bandwidth": 1e10, "flops": 1e11, "layer_overhead": 0}}}',
     r"\['flops'\] must map dtype names to numbers"),
])
def test_a_devices_file_is_checked_with_its_name_and_key(tmp_path, content, message):
    path = tmp_path / "devices.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        load_devices(path)


def test_a_fill_keeps_the_last_rows_logits():
    tiny = model_shape(TINY)
    # 100 rows over 50 cached entries on average: every layer's matrices for 100 rows, the output layer for one
    layers = 2 * (48 + 96)
    expected = (1312 + 50 * 32) / 1e9 + 2 * (100 * layers + 40) / 1e9 + 4 * 100 * 2 * 2 * 50 * 2 / 1e9 + 2e-3
    assert fill_seconds(tiny, UNIT, 100) == pytest.approx(expected, rel=1e-12)


def test_seconds_grow_with_context_rows_offloading_and_overhead():
    model = model_shape("llama-3.1-8b")
    h200 = device("h200", model.dtype)
    assert forward_seconds(model, h200, 1000) < forward_seconds(model, h200, 100_000)
    assert forward_seconds(model, h200, 1000, rows=1) < forward_seconds(model, h200, 1000, rows=8)
    assert forward_seconds(model, h200, 100_000) < forward_seconds(model, h200, 100_000, offloaded=True)
    bare = device("h200", model.dtype, layer_overhead=0.0)
    assert forward_seconds(model, h200, 1000) - forward_seconds(model, bare, 1000) == pytest.approx(
        model.layers * h200.layer_overhead)
    # at 128k in bf16 the KV cache read (131072 bytes per token: 2 x 32 layers x 8 KV heads x 128 x 2 bytes) costs
    # about what the weights cost (the layers' matrices and the output layer; the embedding lookup reads one row)
    assert model.kv_bytes_per_token * 131072 == 17_179_869_184
    assert model.weight_bytes == 2 * (32 * (4096 * 128 * (64 + 16) + 3 * 4096 * 14336) + 128256 * 4096)


def test_plans_are_priced_by_the_policy_itself():
    """The projection's tokens/s are `AdaptivePolicy.tokens_per_second` for the same tier costs and rates: a policy
    built here independently agrees on every plan, and one three-level plan is checked against the formula."""
    target, draft = model_shape("llama-3.1-8b"), model_shape("llama-3.2-1b")
    dev, context, config = device("h200", "bfloat16"), 131072, TriForceConfig(retrieval_budget=4096)
    acceptance = Acceptance(force3=0.9, force2=0.7, streaming=0.6, draft=0.65)
    tiers, plans = project_plans(target, dev, context, acceptance, config, draft)
    policy = AdaptivePolicy({"self": "model", "draft": "model", "vanilla": "model"}, ("self", "draft"),
                            config.gamma1, config.gamma2, explore_every=16, refresh_every=config.refresh_interval)
    assume_costs(policy, tiers)
    assume_rates(policy, force3=0.9, direct={"self": 0.6, "draft": 0.65, "vanilla": 0.65},
                 force1={"self": 0.7, "draft": 0.65})
    best = {}
    for plan in policy.candidates():
        key = (plan.levels, plan.drafter)
        best[key] = max(best.get(key, 0.0), policy.tokens_per_second(plan))
    assert sorted(p.tokens_per_second for p in plans) == pytest.approx(sorted(best.values()), rel=1e-12)
    assert {p.plan for p in plans} >= {"plain"} and len(plans) == 7  # 7: Force 2 drafting alone
    # triforce self g2/6 by hand: rounds of Force 1 (up to 2 drafts) verified by Force 2 until 6 tokens, then Force 3
    g1, g2 = 2, 6
    seconds = (literal_force2_seconds(g1, g2, 0.7, 1.0, tiers["draft:self"][1], tiers["force2"])
               + tiers["force3"][g2 + 1] + tiers["select"][1] / config.refresh_interval)  # a re-selection's share
    assert policy.predict(Plan(3, "self", g1, g2)) == pytest.approx((expected_tokens(0.9, g2), seconds), rel=1e-12)
    plain = next(p for p in plans if p.plan == "plain")
    assert plain.tokens_per_second == pytest.approx(1 / tiers["force3"][1]) and plain.speedup == 1.0


def test_planning_policy_prices_a_lookup_like_drafter_and_two_levels():
    tiers = {"force3": {1: 0.2, 7: 0.3}, "force2": {1: 0.05, 3: 0.08}, "draft:ngram": {1: 0.0}, "select": {1: 0.01}}
    config = TriForceConfig(retrieval_budget=512)
    policy = planning_policy(tiers, 8000, 0.8, {"ngram": 0.5}, {"ngram": 0.4}, config)
    tokens, seconds = policy.predict(Plan(2, "ngram", gamma2=6))
    assert (tokens, seconds) == pytest.approx((expected_tokens(0.5, 6), 0.3))
    # three levels only where the context exceeds the budget
    assert not [p for p in planning_policy(tiers, 500, 0.8, {"ngram": 0.5}, {"ngram": 0.4}, config).candidates()
                if p.levels == 3]


def test_rate_for_tokens_inverts_expected_tokens():
    for rate in (0.0, 0.3, 0.77, 0.95):
        assert rate_for_tokens(expected_tokens(rate, 6), 6) == pytest.approx(rate, abs=1e-9)
    with pytest.raises(ValueError, match="tokens per verification"):
        rate_for_tokens(8.0, 6)


def test_model_from_a_local_folder_and_from_a_config(tmp_path):
    from transformers import LlamaConfig

    LlamaConfig(**{k: v for k, v in TINY.items() if k != "dtype"}).save_pretrained(tmp_path)
    from_folder = model_shape(str(tmp_path), "bfloat16")
    assert from_folder.matrix_params == model_shape(TINY).matrix_params and from_folder.dtype == "bfloat16"
    assert model_shape(LlamaConfig(**{k: v for k, v in TINY.items() if k != "dtype"}), "fp16").dtype == "float16"


@pytest.mark.parametrize("call, message", [
    (lambda: model_shape("no-such-model"), "model must be one of"),
    (lambda: model_shape({**TINY, "num_local_experts": 8}), "mixture-of-experts"),
    (lambda: model_shape({**TINY, "num_key_value_heads": 3}), "multiple of kv_heads"),
    (lambda: model_shape(TINY, "int3"), "dtype must be one of"),
    (lambda: model_shape({**TINY, "num_hidden_layers": 0}), "num_hidden_layers"),
    (lambda: device("tpu-9", "float32"), r"give \['bandwidth', 'flops', 'layer_overhead'\]"),
    (lambda: device("h200", "float32", bandwidth=-1.0), "bandwidth must be a number above 0"),
    (lambda: device("h200", "float32", layer_overhead=-1.0), "layer_overhead must be a number >= 0"),
    (lambda: device(EPYC_FP32, "bfloat16", FITTED), "FLOP/s for \\['float32'\\] only"),
    (lambda: device("h200", "float32", speed=3.0), "unknown parameters"),
    (lambda: Acceptance(force3=1.5), "acceptance force3 must be in"),
    (lambda: tier_seconds(model_shape(TINY), UNIT, 0), "context must be a positive integer"),
    (lambda: forward_seconds(model_shape(TINY), UNIT, 10, offloaded=True), "no offload_bandwidth"),
    (lambda: tier_precision("int3", UNIT), r"draft_precision must be one of \('auto', 'model', 'int8', 'lean'"),
    (lambda: model_shape(TINY).precision_weight_bytes("auto"), "draft_precision must be one of"),
    (lambda: tier_seconds(model_shape("llama-3.1-8b"), device("h200", "bfloat16"), 1000,
                          TriForceConfig(draft_precision="lean-int4")),
     "draft_precision='lean-int4': it runs on CPU only and device h200 is not a CPU"),
    (lambda: tier_precision("int8", device(EPYC_FP32, "float32", FITTED), [model_shape("llama-3.2-1b")]),
     "draft_precision='int8': it copies float32 models; llama-3.2-1b is bfloat16"),
    (lambda: tier_precision("lean-int4", device(EPYC_FP32, "float32", FITTED), [model_shape(TINY)]),
     "not multiples of the int4 group size 32"),
    (lambda: device("h200", "float32", quantized_bandwidth=0.0), "quantized_bandwidth must be above 0 or None"),
    (lambda: device("h200", "float32", gqa_attention_flops=-1.0), "gqa_attention_flops must be above 0 or None"),
    (lambda: device("h200", "float32", copy_bandwidth=0.0), "copy_bandwidth must be above 0 or None"),
])
def test_bad_input_names_the_parameter(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_assume_rates_checks_its_input():
    policy = AdaptivePolicy({"self": "model"}, ("self",), 2, 6, explore_every=16)
    with pytest.raises(ValueError, match="force3 rate"):
        assume_rates(policy, force3=1.2)
    with pytest.raises(ValueError, match="'ngram' is not among"):
        assume_rates(policy, direct={"ngram": 0.5})
    assume_rates(policy, force3=0.8, direct={"self": 0.5}, force1={"self": 0.6})
    assert (policy.force3_rate.rate, policy.direct["self"].rate, policy.force1_rate("self")) == (0.8, 0.5, 0.6)


def test_cli_prints_a_projection_and_json(capsys):
    assert main(["project", "--model", "smollm2-135m", *FITTED_CPU, "--contexts", "4096", "--budget", "512"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("PROJECTION (not measured)") and "| plain decoding | plain |" in text
    assert main(["project", "--model", "llama-2-7b-128k", "--draft-model", "llama-68m", "--device", "rtx4090",
                 "--offload", "--contexts", "122880", "--gamma2", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plans = {p["plan"]: p for p in out["projections"][0]["plans"]}
    assert set(plans) >= {"plain"} and out["device"]["offload_bandwidth"] == 25e9
    assert max(p["speedup"] for p in plans.values()) > 1.0  # an offloaded full cache makes every step dear


def test_cli_draft_precision(capsys):
    assert main(["project", "--model", "qwen2.5-coder-1.5b", "--dtype", "float32", *FITTED_CPU,
                 "--contexts", "8000", "--json"]) == 0
    auto = json.loads(capsys.readouterr().out)
    assert auto["draft_precision"] == "lean-int4"
    assert main(["project", "--model", "qwen2.5-coder-1.5b", "--dtype", "float32", *FITTED_CPU,
                 "--contexts", "8000", "--json", "--draft-precision", "model"]) == 0
    model = json.loads(capsys.readouterr().out)
    assert model["draft_precision"] == "model"
    assert auto["projections"][0]["tiers"]["force3"] == model["projections"][0]["tiers"]["force3"]
    assert auto["projections"][0]["tiers"]["draft:self"]["1"] < model["projections"][0]["tiers"]["draft:self"]["1"]
    with pytest.raises(SystemExit):
        main(["project", "--draft-precision", "int3"])
    error = capsys.readouterr().err
    assert "--draft-precision: invalid choice: 'int3'" in error and "lean-int4" in error
    with pytest.raises(SystemExit, match="hf-triforce-bench project: draft_precision='lean-int4': it runs on CPU only"):
        main(["project", "--draft-precision", "lean-int4"])  # llama-3.1-8b on the h200 preset
    assert main(["project", "--device", "box", "--bandwidth", "1e10", "--flops", "1e11", "--layer-overhead", "0",
                 "--cpu", "--quantized-bandwidth", "5e9", "--draft-precision", "lean-int4", "--contexts",
                 "32768"]) == 0
    assert "Force 1 / Force 2 weights: lean-int4" in capsys.readouterr().out


def test_cli_bad_input_exits_with_the_parameter():
    with pytest.raises(SystemExit, match="hf-triforce-bench project: .*acceptance force2 must be in"):
        main(["project", "--accept-force2", "2"])
    with pytest.raises(SystemExit, match="hf-triforce-bench project: device 'mystery' is not one of"):
        main(["project", "--device", "mystery"])
