"""A prefill saved to disk and read back: the same bytes, the same answers, and refused for another model."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from hf_triforce import TriForceConfig, load_prefill, save_prefill

from .conftest import make_model, random_prompt

CONFIG = TriForceConfig(draft="ngram", retrieval_budget=32, chunk_size=4, gamma1=2, gamma2=4, policy="fixed")


def _prefill(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids, cache=cache)
    return cache


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = make_model("llama-gqa")
    document = random_prompt(120, period=23)
    path = save_prefill(tmp_path_factory.mktemp("prefill") / "doc.safetensors", model, document,
                        _prefill(model, document))
    return model, document, path


def test_a_loaded_prefill_holds_the_same_bytes_and_ids(saved):
    model, document, path = saved
    ids, cache = load_prefill(path, model)
    fresh = _prefill(model, document)
    assert torch.equal(ids, document)
    assert cache.get_seq_length() == fresh.get_seq_length() == document.shape[1]
    for loaded, computed in zip(cache.layers, fresh.layers):
        assert torch.equal(loaded.keys, computed.keys) and torch.equal(loaded.values, computed.values)


@pytest.mark.parametrize("config", [CONFIG, None], ids=["triforce", "plain"])
def test_generate_from_a_loaded_prefill_is_identical_to_a_fresh_call(saved, config):
    model, document, path = saved
    question = random_prompt(9, seed=5)
    prompt = torch.cat([document, question], dim=1)
    kwargs = dict(max_new_tokens=24, do_sample=False)
    if config is not None:
        kwargs["triforce_config"] = config
    _, cache = load_prefill(path, model)
    from_file = model.generate(prompt, cache=cache, **kwargs)
    fresh = model.generate(prompt, **kwargs)
    plain = model.generate(prompt, max_new_tokens=24, do_sample=False)
    assert torch.equal(from_file, fresh) and torch.equal(fresh, plain)


def test_a_prefill_is_refused_for_other_weights_dtype_or_rope(saved):
    model, _, path = saved
    with pytest.raises(ValueError, match="another model"):
        load_prefill(path, make_model("llama-gqa", seed=1))
    with pytest.raises(ValueError, match="another dtype"):
        load_prefill(path, make_model("llama-gqa").to(torch.bfloat16))
    with pytest.raises(ValueError, match="another rope"):
        load_prefill(path, make_model("llama-gqa", rope_parameters={"rope_type": "linear", "factor": 2.0,
                                                                     "rope_theta": 10000.0}))


def test_a_rope_given_as_integers_or_floats_is_the_same_rope(tmp_path):
    def model(factor):
        return make_model("llama-gqa", rope_parameters={"rope_type": "linear", "factor": factor, "rope_theta": 10000.0})

    document = random_prompt(20, period=7)
    path = save_prefill(tmp_path / "doc.safetensors", model(2.0), document, _prefill(model(2.0), document))
    ids, _ = load_prefill(path, model(2))
    assert torch.equal(ids, document)
    with pytest.raises(ValueError, match="another rope"):
        load_prefill(path, model(3))


def test_a_damaged_file_is_refused(saved, tmp_path):
    model, _, path = saved
    data = bytearray(path.read_bytes())
    flipped = tmp_path / "flipped.safetensors"
    data[-3] ^= 0xFF  # a byte of the last tensor
    flipped.write_bytes(bytes(data))
    with pytest.raises(ValueError, match="checksum"):
        load_prefill(flipped, model)
    truncated = tmp_path / "truncated.safetensors"
    truncated.write_bytes(path.read_bytes()[:1000])
    with pytest.raises(ValueError, match="not a readable safetensors file"):
        load_prefill(truncated, model)


def test_saving_checks_the_ids_against_the_cache(saved, tmp_path):
    model, document, _ = saved
    with pytest.raises(ValueError, match="input_ids must be"):
        save_prefill(tmp_path / "x.safetensors", model, document[:, :-1], _prefill(model, document))


def _same_bytes(cache, other) -> bool:
    return cache.get_seq_length() == other.get_seq_length() and all(
        torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values) for a, b in zip(cache.layers, other.layers))


def test_an_interrupted_saved_prefill_resumes_from_its_checkpoint_to_the_same_bytes(tmp_path, monkeypatch):
    from hf_triforce_bench import compare as bench

    model = make_model("llama-gqa")
    ids = random_prompt(2601, seed=3)
    whole = bench.prefill_prefix(model, ids)
    real, calls = bench.prefill, []

    def interrupted(*args, **kwargs):
        calls.append(args[1].shape[1])
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(bench, "prefill", interrupted)
    with pytest.raises(KeyboardInterrupt):
        bench.saved_prefix(model, ids, tmp_path, checkpoint_tokens=1024)
    assert [path.name.endswith(".partial.safetensors") for path in tmp_path.iterdir()] == [True]
    calls.clear()
    monkeypatch.setattr(bench, "prefill", real)
    cache, _, source = bench.saved_prefix(model, ids, tmp_path, checkpoint_tokens=1024)
    assert "resumed from 1024 tokens" in source and "computed, saved to" in source
    assert _same_bytes(cache, whole)
    assert [path.name.endswith(".partial.safetensors") for path in tmp_path.iterdir()] == [False]
    loaded, _, source = bench.saved_prefix(model, ids, tmp_path, checkpoint_tokens=1024)
    assert source.startswith("loaded") and _same_bytes(loaded, whole)


def test_a_checkpoint_of_other_tokens_is_not_resumed(tmp_path):
    from hf_triforce_bench import compare as bench

    model = make_model("llama-gqa")
    ids = random_prompt(1500, seed=3)
    other = random_prompt(1500, seed=4)
    bench.saved_prefix(model, ids, tmp_path)  # a complete file, renamed as the other prompt's checkpoint
    (done,) = tmp_path.iterdir()
    digest = bench.hashlib.sha256(other[:, :-1].contiguous().numpy().tobytes()).hexdigest()[:16]
    done.rename(tmp_path / f"prefill-1499-{digest}.partial.safetensors")
    cache, _, source = bench.saved_prefix(model, other, tmp_path)
    assert "holds other tokens" in source and "resumed" not in source
    assert _same_bytes(cache, bench.prefill_prefix(model, other))
    with pytest.raises(ValueError, match="checkpoint_tokens must be a positive multiple of 1024"):
        bench.saved_prefix(model, other, tmp_path, checkpoint_tokens=1000)


def test_a_prefill_is_refused_under_another_active_adapter(tmp_path):
    """The fingerprint holds which adapters run and which are merged, not only every adapter's weights: a prefill
    saved under one adapter is refused under another one, a merge of it or adapters disabled, and read back under
    its own."""
    from peft import LoraConfig, get_peft_model

    def lora(targets):
        return LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)

    model = get_peft_model(make_model("llama-gqa"), lora(["q_proj", "v_proj"]), adapter_name="first")
    model.add_adapter("second", lora(["k_proj", "v_proj"]))
    model.eval()
    document = random_prompt(40, period=7)
    path = save_prefill(tmp_path / "doc.safetensors", model, document, _prefill(model, document))
    model.set_adapter("second")
    with pytest.raises(ValueError, match="another model"):
        load_prefill(path, model)
    with model.disable_adapter(), pytest.raises(ValueError, match="another model"):
        load_prefill(path, model)
    model.set_adapter("first")
    ids, cache = load_prefill(path, model)
    assert torch.equal(ids, document) and _same_bytes(cache, _prefill(model, document))
    model.merge_adapter()
    with pytest.raises(ValueError, match="another model"):
        load_prefill(path, model)


def test_a_prefill_is_refused_for_an_edit_anywhere_in_the_weights(tmp_path):
    """Every byte of the weights is in the fingerprint: rows edited in the middle of a 65536-value embedding (far
    from its first and last values) are seen."""
    model = make_model("llama-gqa", vocab_size=1024)
    document = random_prompt(30, vocab_size=1024)
    path = save_prefill(tmp_path / "doc.safetensors", model, document, _prefill(model, document))
    with torch.no_grad():
        model.model.embed_tokens.weight[400:700] += 0.01
    with pytest.raises(ValueError, match="another model"):
        load_prefill(path, model)


@pytest.mark.parametrize("flag", [("pad_token_id", 0), ("use_cache", False), ("eos_token_id", 3),
                                  ("output_hidden_states", True), ("return_dict", False)])
def test_runtime_config_flags_do_not_refuse_a_prefill(saved, flag):
    """A config flag that does not change the cache's values (token ids, output switches) leaves the prefill
    readable: the same weights, architecture, RoPE and dtype."""
    _, document, path = saved
    model = make_model("llama-gqa")  # the saved model's weights
    setattr(model.config, *flag)
    ids, cache = load_prefill(path, model)
    assert torch.equal(ids, document) and cache.get_seq_length() == document.shape[1]


def test_saving_refuses_a_quantized_cache(saved, tmp_path):
    """A `QuantizedCache`'s layers hold only their unquantized residual: refused by name, not read as a prefix."""
    from transformers import QuantizedCache

    model, document, _ = saved
    cache = QuantizedCache("fp8", model.config)
    with torch.no_grad():
        model(document, cache=cache)
    with pytest.raises(ValueError, match=r"save_prefill: cache: layer 0 is a Fp8QuantizedLayer .*TriForce takes"):
        save_prefill(tmp_path / "x.safetensors", model, document, cache)
    assert not (tmp_path / "x.safetensors").exists()


@pytest.mark.parametrize("loop", ["triforce", "assisted"])
def test_a_saved_batch_prefill_is_refused_for_a_prompt_of_another_batch_size(tmp_path, loop):
    """A prefill saved for a batch of 2 and a prompt of 1 row: refused before any forward, naming both batch sizes."""
    model = make_model("llama-gqa")
    documents = torch.cat((random_prompt(60, period=23), random_prompt(60, seed=3)))
    path = save_prefill(tmp_path / "batch.safetensors", model, documents, _prefill(model, documents))
    ids, cache = load_prefill(path, model)
    question = torch.cat((ids[:1], random_prompt(5, seed=9)), dim=1)
    config = TriForceConfig(draft="ngram", retrieval_budget=32, chunk_size=4, gamma1=2, gamma2=4, policy="fixed",
                            loop=loop)
    with pytest.raises(ValueError, match=r"cache= holds a prefill of batch size 2; the prompt \(input_ids\) has "
                                         r"batch size 1"):
        model.generate(question, cache=cache, max_new_tokens=4, do_sample=False, triforce_config=config)
    assert cache.get_seq_length() == 60  # refused before any forward
