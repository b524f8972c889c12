"""Tiny random-weight models of several families, built from configs (no hub access)."""

from __future__ import annotations

import os

import pytest
import torch
from transformers import (
    GemmaConfig,
    GemmaForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import hf_triforce  # noqa: F401  (installs triforce_config= on generate)


def pytest_configure(config):
    """Under pytest-xdist (scripts/test.sh: ``-n auto``, a worker per core), one torch thread per worker: the
    workers' thread pools would otherwise oversubscribe the cores. Subprocesses that tests start inherit it, so they
    compute with the threads their worker computes references with; tests about threads set their own counts."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        os.environ["OMP_NUM_THREADS"] = "1"
        torch.set_num_threads(1)


COMMON = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=2048,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)

FAMILIES = {
    "llama-mha": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=4)),
    "llama-gqa": (LlamaConfig, LlamaForCausalLM, dict(num_attention_heads=8, num_key_value_heads=2)),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, dict(num_attention_heads=4, num_key_value_heads=2)),
    "mistral": (
        MistralConfig, MistralForCausalLM, dict(num_attention_heads=4, num_key_value_heads=1, sliding_window=None)
    ),
    "gemma": (GemmaConfig, GemmaForCausalLM, dict(num_attention_heads=4, num_key_value_heads=1, head_dim=16)),
}


def make_model(family: str = "llama-gqa", vocab_size: int = 96, seed: int = 0, logit_scale: float = 1.0, **overrides):
    """A tiny random causal LM in fp32; ``logit_scale`` sharpens its distributions."""
    config_cls, model_cls, extra = FAMILIES[family]
    torch.manual_seed(seed)
    config = config_cls(vocab_size=vocab_size, **{**COMMON, **extra, **overrides})
    model = model_cls(config).eval()
    if logit_scale != 1.0:
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(logit_scale)
    return model


def random_prompt(length: int, vocab_size: int = 96, seed: int = 1, period: int | None = None) -> torch.Tensor:
    """Random tokens; with ``period`` the prompt repeats so that n-gram lookup finds matches."""
    generator = torch.Generator().manual_seed(seed)
    if period is None:
        return torch.randint(0, vocab_size, (1, length), generator=generator)
    base = torch.randint(0, vocab_size, (1, period), generator=generator)
    return base.repeat(1, length // period + 1)[:, :length]


@pytest.fixture(scope="module")
def gqa_model():
    return make_model("llama-gqa")


@pytest.fixture(scope="module")
def model():
    """A tiny GQA Llama (modules may define their own ``model``)."""
    return make_model("llama-gqa")


@pytest.fixture(scope="module")
def prompt():
    """100 tokens repeating with period 23, so that n-gram lookups find matches."""
    return random_prompt(100, period=23)
