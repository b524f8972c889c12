"""`hf-triforce project`: the roofline cost of a forward, and plan speeds priced by the adaptive policy itself."""

from __future__ import annotations

import json

import pytest

from hf_triforce import TriForceConfig
from hf_triforce.decoding.policy import AdaptivePolicy, Plan, expected_tokens
from hf_triforce.tools.cli import main
from hf_triforce.tools.project import (
    Acceptance,
    Device,
    device,
    forward_seconds,
    model_shape,
    plain_generate_seconds,
    planning_policy,
    project_plans,
    rate_for_tokens,
    tier_seconds,
)

TINY = dict(num_hidden_layers=2, hidden_size=4, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
            head_dim=2, vocab_size=10, tie_word_embeddings=False, hidden_act="silu", dtype="float32")
UNIT = Device(name="unit", bandwidth=1e9, flops=1e9, attention_flops=1e9, layer_overhead=1e-3)


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


def test_smollm2_preset_reads_its_135m_weights():
    smollm2 = model_shape("smollm2-135m")
    assert smollm2.dtype == "float32"
    # 30 layers x (576 x 64 x (2 x 9 + 2 x 3) + 3 x 576 x 1536) + the tied output layer 49152 x 576
    assert smollm2.matrix_params == 30 * (576 * 64 * 24 + 3 * 576 * 1536) + 49152 * 576 == 134_479_872
    assert smollm2.kv_bytes_per_token == 46_080  # docs/bench/32k: full_cache_bytes 1480919040 = 32138 x 46080
    assert model_shape("smollm2-135m", "bf16").weight_bytes * 2 == smollm2.weight_bytes


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
                            config.gamma1, config.gamma2, explore_every=16)
    for tier, by_rows in tiers.items():
        for rows, seconds in by_rows.items():
            policy.observe_forward(tier, rows, seconds)
    policy.assume_rates(force3=0.9, direct={"self": 0.6, "draft": 0.65, "vanilla": 0.65},
                        force1={"self": 0.7, "draft": 0.65})
    best = {}
    for plan in policy.candidates():
        key = (plan.levels, plan.drafter)
        best[key] = max(best.get(key, 0.0), policy.tokens_per_second(plan))
    assert sorted(p.tokens_per_second for p in plans) == pytest.approx(sorted(best.values()), rel=1e-12)
    assert {p.plan for p in plans} >= {"plain"} and len(plans) == 6
    # triforce self g2/6 by hand: rounds of Force 1 (2 drafts) verified by Force 2 until 6 tokens, then Force 3
    g1, g2 = 2, 6
    rounds = g2 / expected_tokens(0.7, g1)
    seconds = (rounds * (g1 * tiers["draft:self"][1] + tiers["force2"][g1 + 1]) + tiers["force3"][g2 + 1]
               + tiers["select"][1])
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
    (lambda: device("cpu-this", "bfloat16"), "FLOP/s for \\['float32'\\] only"),
    (lambda: device("h200", "float32", speed=3.0), "unknown parameters"),
    (lambda: Acceptance(force3=1.5), "acceptance force3 must be in"),
    (lambda: tier_seconds(model_shape(TINY), UNIT, 0), "context must be a positive integer"),
    (lambda: forward_seconds(model_shape(TINY), UNIT, 10, offloaded=True), "no offload_bandwidth"),
])
def test_bad_input_names_the_parameter(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_assume_rates_checks_its_input():
    policy = AdaptivePolicy({"self": "model"}, ("self",), 2, 6, explore_every=16)
    with pytest.raises(ValueError, match="force3 rate"):
        policy.assume_rates(force3=1.2)
    with pytest.raises(ValueError, match="'ngram' is not among"):
        policy.assume_rates(direct={"ngram": 0.5})
    policy.assume_rates(force3=0.8, direct={"self": 0.5}, force1={"self": 0.6})
    assert (policy.force3_rate.rate, policy.direct["self"].rate, policy.force1_rate("self")) == (0.8, 0.5, 0.6)


def test_cli_prints_a_projection_and_json(capsys):
    assert main(["project", "--model", "smollm2-135m", "--device", "cpu-this", "--contexts", "4096",
                 "--budget", "512"]) == 0
    text = capsys.readouterr().out
    assert text.startswith("PROJECTION (not measured)") and "| plain decoding | plain |" in text
    assert main(["project", "--model", "llama-2-7b-128k", "--draft-model", "llama-68m", "--device", "rtx4090",
                 "--offload", "--contexts", "122880", "--gamma2", "12", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    plans = {p["plan"]: p for p in out["projections"][0]["plans"]}
    assert set(plans) >= {"plain"} and out["device"]["offload_bandwidth"] == 25e9
    assert max(p["speedup"] for p in plans.values()) > 1.0  # an offloaded full cache makes every step dear


def test_cli_bad_input_exits_with_the_parameter():
    with pytest.raises(SystemExit, match="hf-triforce project: .*acceptance force2 must be in"):
        main(["project", "--accept-force2", "2"])
    with pytest.raises(SystemExit, match="hf-triforce project: device 'mystery' is not one of"):
        main(["project", "--device", "mystery"])
