"""CUDA-only checks (skipped where no GPU is present; CI has none): the flash-attn verification route."""

from __future__ import annotations

import pytest
import torch

from hf_triforce import TriForceConfig, attention

from .conftest import make_model, random_prompt

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
flash = pytest.mark.skipif(attention._flash_attn_varlen_func() is None, reason="needs flash-attn (pip install .[cuda])")


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
                            gamma2=4)
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
    config = TriForceConfig(draft="ngram", retrieval_budget=64, chunk_size=8, sink_tokens=4, window=24)
    expected = model.generate(prompt, max_new_tokens=32, do_sample=False)
    assert torch.equal(model.generate(prompt, max_new_tokens=32, do_sample=False, triforce_config=config), expected)
