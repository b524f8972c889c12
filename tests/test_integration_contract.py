"""Fails loudly when a transformers internal that `hf_triforce.integration` relies on changes."""

from __future__ import annotations

import inspect

import torch
import transformers
from packaging.specifiers import SpecifierSet
from transformers import GenerationMixin
from transformers.cache_utils import CacheLayerMixin
from transformers.masking_utils import _preprocess_mask_arguments

import hf_triforce
from hf_triforce.integration import _ORIGINAL_GENERATE, TESTED_TRANSFORMERS

from .conftest import make_model


def test_transformers_version_in_tested_range():
    assert transformers.__version__ in SpecifierSet(",".join(TESTED_TRANSFORMERS))


def test_generate_hands_custom_generate_its_own_kwargs():
    params = inspect.signature(_ORIGINAL_GENERATE).parameters
    assert "custom_generate" in params and "streamer" in params
    assert "triforce_config" not in inspect.signature(GenerationMixin._sample).parameters
    source = inspect.getsource(GenerationMixin._extract_generation_mode_kwargs)
    assert "inspect.signature(custom_generate)" in source


def test_generate_is_wrapped_and_can_be_restored():
    assert GenerationMixin.generate is not _ORIGINAL_GENERATE
    hf_triforce.disable()
    try:
        assert GenerationMixin.generate is _ORIGINAL_GENERATE
    finally:
        hf_triforce.enable()


def test_cache_layer_contract():
    abstract = {name for name, value in vars(CacheLayerMixin).items() if getattr(value, "__isabstractmethod__", False)}
    assert abstract == {"lazy_initialization", "update", "get_mask_sizes", "get_seq_length", "get_max_length"}
    source = inspect.getsource(_preprocess_mask_arguments)
    assert "get_mask_sizes" in source and "get_query_offset" in source


def test_attention_implementation_is_switchable_and_positions_are_honoured():
    model = make_model("llama-gqa")
    model.config._attn_implementation = "eager"
    assert model.config._attn_implementation == "eager"
    model.config._attn_implementation = "sdpa"
    # explicit position_ids drive RoPE: the same tokens at shifted positions give different logits
    ids = torch.arange(6)[None]
    with torch.no_grad():
        a = model(ids, position_ids=torch.arange(6)[None]).logits
        b = model(ids, position_ids=torch.arange(100, 106)[None]).logits
    assert not torch.allclose(a, b)
