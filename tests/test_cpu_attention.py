"""The CPU attention kernel (`hf_triforce.kernels.cpu_attention`, `csrc/decode_attention.c`).

* `attend` equals attention computed in float64 by its definition within fp32 rounding (bf16 and fp16: plus one
  rounding of the output to their dtype), in fp32, bf16 and fp16: both head dims, GQA groups of 1 to 6, one new token
  and up to `MAX_NEW_TOKENS` (odd and even rows: the kernel pairs them), caches that end inside a block and on a
  block's edge, strided views of longer buffers, a custom scale;
* a verification's rows (more than ``narrow_rows`` a KV head, `NARROW_ROWS` by default) and a decoding step's take two
  paths in AVX-512 builds (fours against the keys transposed, pairs): both equal float64 within the tolerance at the
  same calls, and they are two paths (their outputs part in the last bits) where the build has 512-bit vectors and its
  scores are fp32 products;
* its causal rule is exercised in each dtype: where the new tokens' keys carry large scores, a rule that shows each
  new token one key more (or less) moves the result by far more than the tolerance;
* the attention wrapper routes fp32 and bf16 CPU calls over a long cache to it (a model with head dim 64 and a
  1100-token prompt), and TriForce's greedy output stays identical to plain ``generate`` in the model's dtype;
  `TriForceDetail.attention_kernel` says so;
* the kernel is off under ``HF_TRIFORCE_CPU_ATTENTION=off``, and a failing build leaves it off with the
  compiler's error in `status` (ATen's paths then run), never a silent stop: `tests/test_native_build.py`.
"""

from __future__ import annotations

import platform
import shutil

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.kernels import attention_routes, cpu_attention

from .conftest import make_model, random_prompt
from .test_greedy_identity import assert_identical

# The kernel builds wherever there is a C compiler on x86-64 Linux; elsewhere it is off by design (status says why)
BUILDS = platform.system() == "Linux" and platform.machine() == "x86_64" and shutil.which("cc") is not None
needs_kernel = pytest.mark.skipif(not BUILDS, reason="the CPU kernel is built on x86-64 Linux with a C compiler only")
TOLERANCE = 1e-6


def build_label() -> str:
    """The kernels' build and the CPU features their numerics depend on, for an assertion's message: a test that fails
    on some CPUs only says on which."""
    from hf_triforce.kernels import native_build

    features = native_build.cpu_features() or ()
    have = ", ".join(f"{name} {'yes' if name in features else 'no'}" for name in ("avx2", "fma", "avx512f",
                                                                                 "avx512_bf16", "amx_tile"))
    target = " ".join(flag for flag in native_build.compile_flags() if flag.startswith(("-march", "-mprefer")))
    return (f"build {target}, CPU: "
            f"{have}; ATen {torch.backends.cpu.get_cpu_capability()}")


def _case(dim: int, kv_heads: int, groups: int, new: int, kv_len: int, seed: int = 0, spare: int = 37,
          dtype: torch.dtype = torch.float32):
    generator = torch.Generator().manual_seed(seed)
    buffers = torch.randn(2, 1, kv_heads, kv_len + spare, dim, generator=generator).to(dtype)
    query = torch.randn(1, kv_heads * groups, new, dim, generator=generator).to(dtype)
    return query, buffers[0, :, :, :kv_len], buffers[1, :, :, :kv_len]  # views of longer buffers, like a cache's


def _bound(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`TOLERANCE` for fp32's rounding, plus half an ulp of the output's dtype (bf16, fp16) relative to the value."""
    return TOLERANCE + cpu_attention.OUTPUT_ROUNDING[dtype] * (expected.abs() + TOLERANCE)


@needs_kernel
def test_builds_here():
    assert cpu_attention.status() == "on"


@needs_kernel
@pytest.mark.parametrize("dtype", cpu_attention.DTYPES)
@pytest.mark.parametrize("dim, kv_heads, groups, new, kv_len", [
    (64, 3, 3, 1, 1024),  # SmolLM2's layout, one decoding step, spans on block edges
    (64, 3, 3, 7, 2085),  # a verification of 7 tokens, the cache ending inside a block
    (64, 3, 3, cpu_attention.MAX_NEW_TOKENS, 1057),
    (64, 1, 1, 3, 1100),  # one head
    (128, 2, 6, 1, 1537),  # Qwen2.5's layout
    (128, 4, 2, 5, 1300),
])
def test_matches_float64_reference(dim, kv_heads, groups, new, kv_len, dtype):
    query, key, value = _case(dim, kv_heads, groups, new, kv_len, dtype=dtype)
    for scaling in (None, 0.07):
        got = cpu_attention.attend(query, key, value, scaling)
        expected = cpu_attention.reference(query, key, value, scaling)
        error = (got.double() - expected).abs()
        assert got.shape == (1, new, kv_heads * groups, dim) and got.dtype == dtype
        assert bool((error < _bound(expected, dtype)).all()), error.max().item()


@needs_kernel
@pytest.mark.parametrize("dtype", cpu_attention.DTYPES)
@pytest.mark.parametrize("dim, kv_heads, groups, new, kv_len", [
    (64, 3, 3, 2, 1100),  # 6 rows a KV head
    (64, 3, 3, 11, 1537),  # 33 rows: fours and a remainder of one
    (128, 2, 6, 3, 1300),  # Qwen2.5's layout, 18 rows
])
def test_a_verifications_rows_in_fours_and_in_pairs_both_match_float64(dim, kv_heads, groups, new, kv_len, dtype):
    from hf_triforce.kernels import native_build

    query, key, value = _case(dim, kv_heads, groups, new, kv_len, seed=5, dtype=dtype)
    expected = cpu_attention.reference(query, key, value, None)
    fours = cpu_attention.attend(query, key, value, None, narrow_rows=0)
    pairs = cpu_attention.attend(query, key, value, None, narrow_rows=groups * new)
    for got in (fours, pairs):
        assert bool(((got.double() - expected).abs() < _bound(expected, dtype)).all())
    wide = "-mprefer-vector-width=512" in native_build.compile_flags()
    # bf16 scores by vdpbf16ps (an AVX512-BF16 build) stay in pairs and the values' sums keep their order: same bits
    paired_scores = dtype == torch.bfloat16 and native_build.build_target() == "native" and "avx512_bf16" in (
        native_build.cpu_features() or ())
    # two paths where the build has them
    assert torch.equal(fours, pairs) == (not wide or paired_scores), build_label()
    with pytest.raises(ValueError, match="narrow_rows must be >= 0"):
        cpu_attention.attend(query, key, value, None, narrow_rows=-1)


@needs_kernel
@pytest.mark.parametrize("dtype", cpu_attention.DTYPES)
def test_causal_rule_is_exercised(dtype):
    """The new tokens' keys score high: a row shown one key too many or too few differs by far more than the
    tolerance, and the kernel matches the right rule."""
    dim, kv_heads, groups, new, kv_len = 64, 3, 3, 6, 1500
    query, key, value = _case(dim, kv_heads, groups, new, kv_len, seed=3, dtype=dtype)
    key = key.clone()
    key[:, :, -new:] = query.reshape(1, kv_heads, groups, new, dim).mean(2) * 4  # the new keys dominate the scores
    got = cpu_attention.attend(query, key, value, None).double()
    expected = cpu_attention.reference(query, key, value, None)
    assert bool(((got - expected).abs() < _bound(expected, dtype)).all())
    for shift in (1, -1):  # row i sees keys [0, kv_len - new + 1 + i + shift)
        visible = torch.ones(new, kv_len, dtype=torch.bool).tril(kv_len - new + shift)
        scores = torch.einsum("bhnd,bhkd->bhnk", query.double(), key.double().repeat_interleave(groups, 1))
        weights = (scores * dim ** -0.5).masked_fill(~visible, float("-inf")).softmax(-1)
        wrong = (weights @ value.double().repeat_interleave(groups, 1)).transpose(1, 2)
        assert ((got - wrong).abs() / _bound(expected, dtype)).max().item() > 100


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_routed_and_greedy_identical(monkeypatch, dtype):
    """A model with head dim 64 and a prompt past `MIN_CACHED`: Force 3's steps and verifications take the kernel,
    and greedy output is plain ``generate``'s in the model's dtype."""
    model = make_model("llama-gqa", hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                       max_position_embeddings=4096).to(dtype)
    prompt = random_prompt(cpu_attention.MIN_CACHED + 80, period=61)
    # the kernel's route whatever this CPU times faster (the routes' timing: tests/test_attention_routes.py)
    monkeypatch.setattr(attention_routes.AttentionRoutes, "calibrate", lambda self, shape, rows, length: "kernel")
    calls = []
    attend = cpu_attention.attend
    monkeypatch.setattr(cpu_attention, "attend", lambda *args: calls.append(args[0].shape[2]) or attend(*args))
    stats = assert_identical(model, prompt, TriForceConfig(draft="ngram", levels=2, policy="fixed", gamma2=4),
                             max_new_tokens=24)
    assert stats.detail.attention_kernel == "cpu kernel"
    assert calls and max(calls) > 1 and 1 in calls  # verifications and the one-row first step


@needs_kernel
def test_inputs_the_kernel_does_not_take_are_refused():
    """Another dtype, mixed dtypes, a head dim it has no code for, query heads that are not a multiple of the KV
    heads, more new rows than entries, keys not of unit stride along the head dim, another device: a ValueError
    naming the argument, never a wrong result or a read out of bounds."""
    query, key, value = _case(64, 3, 3, 2, 1100)
    cases = {
        "query, key and value must share a dtype, got torch.bfloat16, torch.float32": (query.bfloat16(), key, value),
        "value dtype must be one of torch.float32, torch.bfloat16, torch.float16, got torch.float64":
            (query, key, value.double()),
        "head dim must be one of \\(64, 128\\), got 32": (query[..., :32], key[..., :32], value[..., :32]),
        "9 heads are not a multiple of 2 KV heads": (query, key[:, :2], value[:, :2]),
        "1200 new rows must be 1 to key's 1100 entries": (torch.randn(1, 9, 1200, 64), key, value),
        "unit stride along the head dim": (query, key.transpose(2, 3).contiguous().transpose(2, 3), value),
        "key \\(1, 3, 1100, 64\\) and value \\(1, 3, 1000, 64\\)": (query, key, value[:, :, :1000]),
        "query must be \\[1, heads, length, dim\\]": (query.expand(2, -1, -1, -1), key, value),
        "key must be on the CPU, got meta": (query, torch.empty(1, 3, 1100, 64, device="meta"), value),
    }
    for message, (q, k, v) in cases.items():
        with pytest.raises(ValueError, match=message):
            cpu_attention.attend(q, k, v, None)


@needs_kernel
@pytest.mark.parametrize("default", [torch.float16, torch.float64])
def test_the_output_dtype_does_not_follow_the_default_dtype(default):
    query, key, value = _case(64, 3, 3, 3, 1100)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = cpu_attention.attend(query, key, value, None)
    finally:
        torch.set_default_dtype(previous)
    assert got.dtype == torch.float32
    assert (got.double() - cpu_attention.reference(query, key, value, None)).abs().max().item() < TOLERANCE
