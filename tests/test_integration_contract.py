"""Fails loudly when a transformers internal that `hf_triforce.compat` relies on changes (one test per item)."""

from __future__ import annotations

import ast
import copy
import inspect
from pathlib import Path

import pytest
import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers import GenerationMixin, PrefixConstrainedLogitsProcessor
from transformers.masking_utils import _preprocess_mask_arguments

import hf_triforce
from hf_triforce import compat
from hf_triforce.kernels.attention import QueryRecorder
from hf_triforce.kernels.attention_function import wrapped_name

from .conftest import FAMILIES, make_model

PACKAGE = Path(hf_triforce.__file__).parent


def test_transformers_version_in_tested_range():
    assert transformers.__version__ in SpecifierSet(",".join(compat.TESTED_TRANSFORMERS))


def test_only_compat_touches_transformers_internals():
    """Every other module imports public names from the top-level ``transformers`` package only, reads no
    private attribute of another object (``x._name``, ``getattr(x, "_name")``) and none of the internals
    `compat` wraps; `compat` is the one place for the rest."""
    wrapped = ("hf_quantizer", "rotary_emb", "eager_attention_forward")
    # torch's own private ops (not transformers'), each checked by its kernel tests (test_cpu_kernels, test_lean,
    # test_fixed_shape, test_split_kv, test_cuda); ``torch._dynamo.mark_static_address``: CUDA graphs read cache
    # buffers in place, and torch 2.13 has no public name for it
    torch_ops = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_efficient_attention", "_int_mm",
                 "_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu", "_convert_weight_to_int4pack_for_cpu", "_dynamo"}
    offenders = []
    for path in PACKAGE.rglob("*.py"):
        if path.name == "compat.py":
            continue
        where = path.relative_to(PACKAGE)
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("transformers"):
                if node.module != "transformers" or any(alias.name.startswith("_") for alias in node.names):
                    offenders.append(f"{where}: from {node.module} import {[a.name for a in node.names]}")
            if isinstance(node, ast.Import) and any(a.name.startswith("transformers.") for a in node.names):
                offenders.append(f"{where}: import {[a.name for a in node.names]}")
            if isinstance(node, ast.Attribute):
                private = node.attr.startswith("_") and not node.attr.startswith("__")
                on_self = isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")
                on_torch = isinstance(node.value, ast.Name) and node.value.id == "torch" and node.attr in torch_ops
                if (private and not on_self and not on_torch) or node.attr in wrapped:
                    offenders.append(f"{where}:{node.lineno}: .{node.attr}")
            if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "getattr" and len(node.args) > 1:
                name = node.args[1]
                if isinstance(name, ast.Constant) and isinstance(name.value, str) and (
                        name.value.startswith("_") or name.value in wrapped) and name.value not in torch_ops:
                    offenders.append(f"{where}:{node.lineno}: getattr(..., {name.value!r})")
    assert not offenders, offenders


def test_generate_hands_custom_generate_its_own_kwargs():
    params = inspect.signature(compat.ORIGINAL_GENERATE).parameters
    assert "custom_generate" in params and "streamer" in params
    assert "triforce_config" not in inspect.signature(GenerationMixin._sample).parameters
    source = inspect.getsource(GenerationMixin._extract_generation_mode_kwargs)
    assert "inspect.signature(custom_generate)" in source


def test_generate_is_wrapped_and_can_be_restored():
    assert GenerationMixin.generate is not compat.ORIGINAL_GENERATE
    hf_triforce.disable()
    try:
        assert GenerationMixin.generate is compat.ORIGINAL_GENERATE
    finally:
        hf_triforce.enable()


def test_cache_layer_contract():
    abstract = {
        name for name, value in vars(compat.CacheLayerMixin).items() if getattr(value, "__isabstractmethod__", False)
    }
    assert abstract == {"lazy_initialization", "update", "get_mask_sizes", "get_seq_length", "get_max_length"}
    source = inspect.getsource(_preprocess_mask_arguments)
    assert "get_mask_sizes" in source and "get_query_offset" in source


def test_attention_implementation_is_switchable_and_positions_are_honoured():
    model = make_model("llama-gqa")
    with compat.attention_implementation(model, "eager") as before:
        assert compat.current_attention_implementation(model) == "eager"
    assert compat.current_attention_implementation(model) == before
    # explicit position_ids drive RoPE: a gap in the positions (what a cache holding a subset of the
    # sequence passes) changes the logits; a uniform shift does not (RoPE is relative)
    ids = torch.arange(6)[None]
    with torch.no_grad():
        a = model(ids, position_ids=torch.arange(6)[None]).logits
        shifted = model(ids, position_ids=torch.arange(100, 106)[None]).logits
        gap = model(ids, position_ids=torch.tensor([[0, 1, 2, 40, 41, 42]])).logits
    torch.testing.assert_close(a, shifted, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(a[:, 3:], gap[:, 3:], atol=1e-4)


def test_eager_attention_lives_in_each_model_file_and_registries_accept_ours():
    for family in FAMILIES:
        model = make_model(family)
        attention = model.get_decoder().layers[0].self_attn
        assert callable(compat.attention_function("eager", attention))
    assert callable(compat.attention_function("sdpa", None))
    name = wrapped_name("sdpa")
    assert compat.is_registered_attention(name) and name in compat.attention_names()


def test_forward_kwargs_reach_the_attention_function():
    """A call's `QueryRecorder` travels as a forward kwarg down to the attention function of every layer."""
    for family in FAMILIES:
        model = make_model(family)
        recorder = QueryRecorder()
        with compat.attention_implementation(model, wrapped_name("sdpa")), torch.no_grad():
            model(torch.arange(5)[None], triforce_recorder=recorder)
        assert sorted(recorder.queries) == list(range(model.config.num_hidden_layers)), family
        assert recorder.queries[0].shape[2] == 5


def test_rotary_embedding_module_contract():
    for family in FAMILIES:
        model = make_model(family)
        rotary = compat.rotary_embedding(model)
        assert rotary is not None, family
        cos, sin = rotary(torch.zeros(1, 1, 4), torch.tensor([[3]]))
        assert cos.shape[:2] == (1, 1) and sin.shape == cos.shape
        # cos and sin of one angle per frequency, both scaled by attention_scaling (a positive number; 1 without it)
        scaling = getattr(rotary, "attention_scaling", 1.0)
        assert isinstance(scaling, (int, float)) and scaling > 0, (family, scaling)
        torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, float(scaling) ** 2), msg=family)


def test_output_class_and_quantizer_marker():
    fields = {f for f in compat.GenerateDecoderOnlyOutput.__dataclass_fields__}
    assert {"sequences", "scores", "logits", "cache"} <= fields
    model = make_model("llama-gqa")
    compat.remove_quantization_config(model)  # no marker: a no-op
    assert getattr(model, "hf_quantizer", None) is None


def test_prefix_constraint_contract(monkeypatch):
    """``generate`` builds the processor with ``max(num_beams, num_return_sequences)`` rows per batch id."""
    seen = []
    model = make_model("llama-gqa")

    def allowed(batch_id, sentence):
        return [batch_id]

    real = GenerationMixin._get_logits_processor

    def spy(self, *args, **kwargs):
        processors = real(self, *args, **kwargs)
        seen.extend(compat.prefix_constraint(p) for p in processors if type(p) is PrefixConstrainedLogitsProcessor)
        return processors

    monkeypatch.setattr(GenerationMixin, "_get_logits_processor", spy)
    out = model.generate(torch.zeros(2, 3, dtype=torch.long), max_new_tokens=1, do_sample=True,
                         num_return_sequences=3, prefix_allowed_tokens_fn=allowed)
    assert seen == [(allowed, 3)] and out[:, -1].tolist() == [0, 0, 0, 1, 1, 1]


def test_per_layer_cache_structure_and_sliding_mask_contract():
    """Sliding layers: ``get_layer_types_and_kwargs`` is what ``DynamicCache(config=)`` follows; the sliding mask
    is built from the first ``is_sliding`` cache layer's ``get_mask_sizes`` / ``get_query_offset`` and lets query
    ``q`` see keys ``(q - W, q]``; a ``DynamicSlidingWindowLayer`` keeps the last ``W - 1`` entries."""
    from transformers import Gemma2Config
    from transformers.cache_utils import DynamicCache, DynamicSlidingWindowLayer, get_layer_types_and_kwargs
    from transformers.masking_utils import create_sliding_window_causal_mask, sliding_window_overlay

    config = Gemma2Config(num_hidden_layers=2, sliding_window=5)
    types, kwargs = get_layer_types_and_kwargs(config)
    assert types == ["sliding_attention", "full_attention"] and kwargs[0] == {"sliding_window": 5}
    assert compat.layer_windows(config) == [5, None]
    cache = DynamicCache(config=config)
    assert isinstance(cache.layers[0], DynamicSlidingWindowLayer) and cache.is_sliding == [True, False]
    cache.update(torch.zeros(1, 1, 12, 2), torch.zeros(1, 1, 12, 2), 0)
    assert cache.layers[0].keys.shape[2] == 4 and cache.layers[0].get_seq_length() == 12
    overlay = sliding_window_overlay(5)
    assert overlay(0, 0, 10, 6) and not overlay(0, 0, 10, 5)
    source = inspect.getsource(create_sliding_window_causal_mask)
    assert "is_sliding.index(True)" in source and "sliding_window_causal_mask_function" in source
    llama4 = transformers.Llama4TextConfig(num_hidden_layers=4, attention_chunk_size=8)
    assert "chunked_attention" in get_layer_types_and_kwargs(llama4)[0]


def test_rotary_embedding_takes_the_layer_type_where_bases_differ():
    """Gemma 3's ``rotary_emb(x, position_ids, layer_type)``: local and global layers rotate differently."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    model = Gemma3ForCausalLM(Gemma3TextConfig(num_hidden_layers=6, hidden_size=32, intermediate_size=32,
                                               num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                               vocab_size=32, sliding_window=4))
    assert "layer_type" in inspect.signature(compat.rotary_embedding(model).forward).parameters
    local, full = compat.layer_rotary(model, 0), compat.layer_rotary(model, 5)
    position = torch.tensor([[7]])
    assert not torch.allclose(local(torch.zeros(1, 1, 4), position)[0], full(torch.zeros(1, 1, 4), position)[0])
    llama = make_model("llama-gqa")
    assert compat.layer_rotary(llama, 0) is compat.rotary_embedding(llama)

def test_bitsandbytes_outlier_threshold_contract(tmp_path):
    """``Linear8bitLt.state.threshold`` is the LLM.int8 outlier threshold set by ``llm_int8_threshold``."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    make_model("llama-gqa").save_pretrained(tmp_path)
    for threshold in (6.0, 0.0):
        model = AutoModelForCausalLM.from_pretrained(
            tmp_path, device_map="cpu", quantization_config=BitsAndBytesConfig(load_in_8bit=True,
                                                                              llm_int8_threshold=threshold))
        assert compat.bnb_outlier_threshold(model.model.layers[0].self_attn.q_proj) == threshold
        assert compat.bnb_outlier_threshold(model.model.layers[0].input_layernorm) is None


def test_peft_adapter_state_contract():
    """PEFT's tuner layers expose the adapters they run (``active_adapters``), those merged into the base weight
    (``merged_adapters``) and whether adapters are off (``disable_adapters``): `adapter_state` follows each change."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(make_model("llama-gqa"), LoraConfig(r=2, target_modules=["q_proj"]), adapter_name="first")
    model.add_adapter("second", LoraConfig(r=2, target_modules=["q_proj"]))
    first = compat.adapter_state(model)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert any(entry[1] == ("first",) and entry[2] == () and entry[3] is False for entry in first)
    model.set_adapter("second")
    assert tuple(layer.active_adapters) == ("second",) and compat.adapter_state(model) != first
    layer.merge(adapter_names=["second"])
    assert tuple(layer.merged_adapters) == ("second",)
    with model.disable_adapter():
        assert layer.disable_adapters is True
    assert compat.adapter_state(make_model("llama-gqa")) == ()


def test_accelerate_dispatch_hook_contract(tmp_path):
    """Hooks of a dispatched model: execution devices, offloaded modules loaded by ``materialized``, the
    shared weight maps, and ``strip_hooks`` restoring the wrapped forward on a copy."""
    import copy

    from transformers import AutoModelForCausalLM

    make_model("llama-gqa").save_pretrained(tmp_path / "model")
    device_map = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk",
                  "model.norm": "cpu", "model.rotary_emb": "cpu", "lm_head": "cpu"}
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "model", device_map=device_map,
                                                 offload_folder=tmp_path / "offload")
    assert compat.execution_device(model.model.layers[1]) == torch.device("cpu")
    assert compat.execution_device(torch.nn.Linear(2, 2)) is None
    assert compat.layer_devices(model) == [torch.device("cpu")] * 2
    offloaded = compat.offloaded_modules(model)
    assert offloaded and all(name.startswith("model.layers.1") for name in offloaded)
    weight = model.model.layers[1].self_attn.q_proj
    assert weight.weight.device.type == "meta"
    with compat.materialized(model):
        assert weight.weight.device.type == "cpu" and float(weight.weight.detach().abs().sum()) > 0
        shared = compat.hook_state(model)
        assert shared
        clone = copy.deepcopy(model, shared)
    assert weight.weight.device.type == "meta"
    compat.strip_hooks(clone)
    assert not any(hasattr(module, "_hf_hook") for module in clone.modules())
    ids = torch.arange(5)[None]
    assert torch.equal(clone(ids).logits, model(ids).logits)


def test_hybrid_decoders_name_their_sliding_masks():
    """`compat.builds_sliding_masks` reads the decoder's source: hybrid models build their sliding-window masks by
    name in ``forward``; Moshi (sliding layers in its config, full masks in its decoder) does not."""
    from .families import HYBRID, make_family

    assert all(compat.builds_sliding_masks(make_family(name)) for name in HYBRID)
    moshi = transformers.MoshiForCausalLM(transformers.MoshiConfig(
        hidden_size=64, num_attention_heads=4, num_key_value_heads=4, num_hidden_layers=2, intermediate_size=96,
        vocab_size=96, sliding_window=16))
    assert not compat.builds_sliding_masks(moshi)


def test_compile_everywhere_makes_generate_compile_on_the_cpu():
    """`compat.compile_everywhere`: generate's auto-compile criteria accept the CPU with a StaticCache (and refuse
    it without the config), the check generate makes before decoding through ``torch.compile``."""
    from transformers import StaticCache

    model = make_model("llama-gqa")
    config = copy.deepcopy(model.generation_config)
    cache = StaticCache(config=model.config, max_cache_len=16)
    assert not model._valid_auto_compile_criteria({"cache": cache}, config)
    config.compile_config = compat.compile_everywhere()
    assert model._valid_auto_compile_criteria({"cache": cache}, config)



def test_assisted_loop_contract():
    """`compat.assisted_decoding` / `TriForceCandidateGenerator`: transformers' assisted loop asks
    ``_get_candidate_generator`` for its generator, calls ``get_candidates(input_ids)`` and, after cropping the cache
    by ``crop(-rejected)``, ``update_candidate_strategy(input_ids, new_logits, n_matches)``; its first iteration
    passes ``next_sequence_length=None`` to ``prepare_inputs_for_generation``; the verifier's logits are processed by
    the call's processors; sampled candidates with logits go through ``_speculative_sampling``, which compares
    ``softmax(candidate_logits)`` with ``softmax(new_logits)`` using torch's ``rand_like`` and ``multinomial`` (the
    draws tests/test_assisted_loop.py enumerates)."""
    from transformers.generation import utils as generation_utils

    source = inspect.getsource(GenerationMixin._assisted_decoding)
    for fragment in ("self._get_candidate_generator(", "candidate_generator.get_candidates(input_ids)",
                     "candidate_generator.update_candidate_strategy(input_ids, new_logits, n_matches",
                     "outputs.cache.crop(-number_of_tokens_to_crop)",
                     "next_sequence_length = candidate_length + 1 if not is_first_iteration else None",
                     "self.prepare_inputs_for_generation(", "next_sequence_length=next_sequence_length",
                     "logits_processor(candidate_input_ids[:, : cur_len + i], new_logits[:, i, :])",
                     "if do_sample and candidate_logits is not None:", "_speculative_sampling("):
        assert fragment in source, fragment
    sampling = inspect.getsource(generation_utils._speculative_sampling)
    for fragment in ("q = candidate_logits.softmax(dim=-1)", "p = new_logits.softmax(dim=-1)",
                     "probability_ratio = p_i / q_i", "torch.rand_like(probability_ratio)",
                     "torch.clamp((p_n_plus_1 - q_n_plus_1), min=0)", "torch.multinomial(p_prime, num_samples=1)"):
        assert fragment in sampling, fragment
    assert not compat.CandidateGenerator.requires_model_outputs


def test_assisted_loop_runs_a_generator_over_a_prefilled_cache():
    """Behaviour: a generator proposing plain greedy's own next tokens runs in the loop over a `BufferCache`
    pre-filled with all of the prompt but its last token (only the rest is fed on the first iteration; ``crop(0)``
    keeps everything), sees the committed sequence with the cache one token behind it, and the output is plain
    greedy's."""
    from transformers import GenerationConfig, LogitsProcessorList, MaxLengthCriteria, StoppingCriteriaList

    from hf_triforce.caches.buffer import BufferCache

    model = make_model("llama-gqa")
    prompt = torch.arange(30)[None] % 7
    expected = model.generate(prompt, max_new_tokens=12, do_sample=False)
    cache = BufferCache(compat.num_layers(model.config), 64)
    with torch.no_grad():
        model(prompt[:, :-1], cache=cache)
    seen = []

    class Replay(compat.CandidateGenerator):
        num_drafting_tokens = 3  # 5.25's loop reads it (the stock base class does not define it)

        def get_candidates(self, input_ids, **kwargs):
            seen.append(("get", input_ids.shape[1], cache.get_seq_length()))
            return expected[:, : min(input_ids.shape[1] + 3, expected.shape[1] - 1)], None

        def update_candidate_strategy(self, input_ids, scores, num_matches):
            seen.append(("update", input_ids.shape[1], cache.get_seq_length(), scores.shape[1], int(num_matches)))

    config = GenerationConfig(do_sample=False, max_length=expected.shape[1])
    criteria = StoppingCriteriaList([MaxLengthCriteria(expected.shape[1])])
    out = compat.assisted_decoding(model, Replay(), prompt, LogitsProcessorList(), criteria, config, cache=cache,
                                   use_cache=True)
    assert torch.equal(out, expected)
    updates = [event for event in seen if event[0] == "update"]
    assert updates and all(length == cached + 1 for _, length, cached, _, _ in updates)
    assert any(matches > 0 for *_, matches in updates)  # several tokens per verification: the cache was cropped
    assert seen[0] == ("get", 30, 29)


def test_gguf_tensor_map_and_version_counter_contract():
    """transformers' GGUF loading maps a Llama file's tensor names to the model's parameters (the tied output layer
    to the token embedding) and its processor puts llama.cpp's permuted query and key rows back in the model's order
    (a permutation, nothing else); an in-place write bumps a tensor's version counter."""
    import numpy as np

    model = make_model("llama-gqa", tie_word_embeddings=True)
    processor, names = compat.gguf_tensor_map(model, "llama")
    assert names["blk.0.attn_q.weight"] == "model.layers.0.self_attn.q_proj.weight"
    assert names["blk.1.ffn_down.weight"] == "model.layers.1.mlp.down_proj.weight"
    assert names["token_embd.weight"] == "model.embed_tokens.weight"
    rows = model.config.hidden_size
    index = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    for part in ("attn_q", "attn_v"):
        result = processor.process(weights=index, name=f"blk.0.{part}.weight", tensor_key_mapping=names,
                                   parsed_parameters={})
        assert result.name == f"blk.0.{part}.weight" and sorted(result.weights[:, 0]) == list(index[:, 0])
        assert (part == "attn_v") == bool((result.weights == index).all())  # only the query rows move
    weight = model.lm_head.weight
    before = compat.version_counter(weight)
    with torch.no_grad():
        weight.mul_(1.0)
    assert compat.version_counter(weight) == before + 1


def test_the_rust_tokenizer_behind_a_fast_one():
    """`compat.rust_tokenizer`: what the server's detokenizer steps (``PreTrainedTokenizerFast._tokenizer``)."""
    import tokenizers

    from hf_triforce.compat import rust_tokenizer

    from .tokenizer_util import word_tokenizer

    assert isinstance(rust_tokenizer(word_tokenizer()), tokenizers.Tokenizer)
    with pytest.raises(ValueError, match="fast"):
        rust_tokenizer(object())
