"""A CPU kernel for attention of a few query rows over a long KV cache: decoding steps and verifications in fp32, bf16
or fp16 (docs/deployment.md, "The CPU kernels").

`csrc/decode_attention.c` reads each KV head's keys and values once for all its query rows (the group's query heads
times the new tokens), in spans run on torch's thread count and merged by their softmax maxima and sums, where ATen
runs many small matrix products per block of keys. Compiled on first use and kept (`native_build`), checked against a
float64 reference before first use (a failure leaves `status` saying why, and ATen's paths run); each class of calls
takes it only where it was timed cheaper on this CPU (`attention_routes`). ``HF_TRIFORCE_CPU_ATTENTION=off`` turns
it off.

Numerics: every score, weight and sum in fp32, in another summation order than ATen's; a bf16 or fp16 cache is read
as it is and widened in registers (``vdpbf16ps`` pairs with AVX512-BF16), each product exact in fp32, the output
rounded once to the cache's dtype (`tolerance`).
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .native_build import CSRC, INT, LONG, POINTER, bind, built, load_checked

SOURCES = (CSRC / "decode_attention.c", CSRC / "decode_attention_span.h", CSRC / "vectors.h")  # compiled, included
HEAD_DIMS = (64, 128)
# New tokens per call it takes: a decoding step, and verifications up to the longest chain the policy runs (a lookup's
# 10 tokens + 1), where it is cheaper than ATen's route (docs/experiments.md, "Attention over a long cache on the CPU:
# the library's kernel"). Longer calls (a prefill's chunks) keep ATen's route, which blocks many rows into one matrix
# product.
MAX_NEW_TOKENS = 11
# Cached entries from which the kernel runs a call (it is cheaper from 1024 on, the shortest measured)
MIN_CACHED = 1024
ENV = "HF_TRIFORCE_CPU_ATTENTION"
ELEMENTS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's element codes (csrc/vectors.h)
DTYPES = tuple(ELEMENTS)  # what the kernel reads and writes: query, keys and values of one of these, the output alike
# a KV head's query rows (its query heads times the new tokens) up to which the kernel takes them in pairs, a decoding
# step's; more, a verification's, go four at a time against each block's keys transposed (AVX-512 builds): the fours
# cost more than the pairs at 6 rows, about as much or less from 9 (docs/experiments.md, as above)
NARROW_ROWS = 8
FP32_TOLERANCE = 1e-5  # the fp32 result's error against float64 on random inputs of unit scale (far below it)
# half an ulp of an output rounded to bf16 / fp16, relative to the value
OUTPUT_ROUNDING = {torch.float32: 0.0, torch.bfloat16: 2.0 ** -8, torch.float16: 2.0 ** -11}


class _Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.attend = bind(library, "triforce_attend", INT, INT, INT, POINTER, POINTER, POINTER, LONG, LONG, LONG,
                           LONG, INT, INT, INT, INT, LONG, ctypes.c_float, INT, INT, POINTER, POINTER)
        self.workspace = bind(library, "triforce_attend_workspace", LONG, INT, INT, INT, INT, INT)


@functools.cache
def _load() -> tuple[_Kernel | None, str]:
    """The built kernel and "on", or None and why not (once per process)."""
    return load_checked(ENV, "decode_attention", SOURCES, _Kernel, _self_check)


def status() -> str:
    """``"on"``, or why the kernel does not run in this process."""
    return _load()[1]


def available() -> bool:
    return _load()[0] is not None


def supports(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether `attend` takes this call: CPU, one dtype of `DTYPES`, batch 1, equal head dims of 64 or 128, contiguous
    head rows, at most `MAX_NEW_TOKENS` new tokens, at least `MIN_CACHED` cached entries."""
    batch, heads, new, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    return (
        query.device.type == key.device.type == value.device.type == "cpu"
        and query.dtype == key.dtype == value.dtype
        and query.dtype in DTYPES
        and batch == 1
        and key.shape == value.shape
        and dim in HEAD_DIMS
        and key.shape[-1] == value.shape[-1] == dim
        and key.stride(-1) == 1
        and value.stride(-1) == 1
        and heads % kv_heads == 0
        and new <= MAX_NEW_TOKENS
        and kv_len - new >= MIN_CACHED
        and available()
    )


def attend(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None,
           narrow_rows: int | None = None) -> torch.Tensor:
    """Attention of ``query`` ``[1, heads, new, dim]`` over ``key``/``value`` ``[1, kv_heads, kv_len, dim]`` whose
    last ``new`` entries are the new tokens (bottom-right causal); returns ``[1, new, heads, dim]`` (transformers'
    layout), in their dtype. ValueError for inputs the kernel does not take (`check_inputs`); the kernel must be built
    (`available`). Which calls should take it is `supports`'s and the routes' choice (`attention_routes`).
    ``narrow_rows``: see `NARROW_ROWS`, its default (both paths give the same values up to summation order)."""
    kernel = built(_load, "cpu_attention.attend")
    if narrow_rows is not None and narrow_rows < 0:
        raise ValueError(f"cpu_attention.attend: narrow_rows must be >= 0, got {narrow_rows}")
    return _attend_with(kernel, query, key, value, scaling, narrow_rows)


def check_inputs(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> None:
    """ValueError naming the argument unless ``query`` ``[1, heads, new, dim]`` and ``key``/``value`` ``[1, kv_heads,
    kv_len, dim]`` are CPU tensors of one dtype of `DTYPES`, ``dim`` one of `HEAD_DIMS`, ``heads`` a multiple of
    ``kv_heads``, ``1 <= new <= kv_len``, and ``key``/``value`` read with unit stride along ``dim`` (their other
    strides are passed to the kernel; ``query`` may be any layout: the kernel reads a contiguous copy)."""
    allowed = ", ".join(str(dtype) for dtype in DTYPES)
    for label, tensor in (("query", query), ("key", key), ("value", value)):
        if tensor.device.type != "cpu":
            raise ValueError(f"cpu_attention.attend: {label} must be on the CPU, got {tensor.device}")
        if tensor.dtype not in DTYPES:
            raise ValueError(f"cpu_attention.attend: {label} dtype must be one of {allowed}, got {tensor.dtype}")
        if tensor.dim() != 4 or tensor.shape[0] != 1:
            raise ValueError(f"cpu_attention.attend: {label} must be [1, heads, length, dim], got "
                             f"{tuple(tensor.shape)}")
    if not query.dtype == key.dtype == value.dtype:
        raise ValueError(f"cpu_attention.attend: query, key and value must share a dtype, got {query.dtype}, "
                         f"{key.dtype}, {value.dtype}")
    _, heads, new, dim = query.shape
    if dim not in HEAD_DIMS:
        raise ValueError(f"cpu_attention.attend: head dim must be one of {HEAD_DIMS}, got {dim}")
    if key.shape != value.shape or key.shape[-1] != dim:
        raise ValueError(f"cpu_attention.attend: key {tuple(key.shape)} and value {tuple(value.shape)} must be "
                         f"[1, kv_heads, kv_len, {dim}] alike")
    kv_heads, kv_len = key.shape[1], key.shape[2]
    if heads % kv_heads:
        raise ValueError(f"cpu_attention.attend: query's {heads} heads are not a multiple of {kv_heads} KV heads")
    if not 1 <= new <= kv_len:
        raise ValueError(f"cpu_attention.attend: query's {new} new rows must be 1 to key's {kv_len} entries")
    if key.stride(-1) != 1 or value.stride(-1) != 1:
        raise ValueError(f"cpu_attention.attend: key and value need unit stride along the head dim, got "
                         f"{key.stride()} and {value.stride()}")


def _attend_with(kernel: _Kernel, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 scaling: float | None = None, narrow_rows: int | None = None) -> torch.Tensor:
    check_inputs(query, key, value)
    narrow_rows = NARROW_ROWS if narrow_rows is None else narrow_rows
    _, heads, new, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    rows = heads // kv_heads * new
    threads = torch.get_num_threads()
    parts = max(threads, 1)
    q = query.reshape(kv_heads, rows, dim).contiguous()
    out = torch.empty(kv_heads, rows, dim, dtype=query.dtype, device=query.device)
    # the kernel's scratch: fp32 partial sums and maxima whatever the inputs' dtype
    workspace = torch.empty(kernel.workspace(dim, kv_heads, rows, parts, threads), dtype=torch.float32,
                            device=query.device)
    scale = dim ** -0.5 if scaling is None else float(scaling)
    code = kernel.attend(ELEMENTS[query.dtype], dim, q.data_ptr(), key.data_ptr(), value.data_ptr(), key.stride(1),
                         key.stride(2), value.stride(1), value.stride(2), kv_heads, rows, new, narrow_rows, kv_len,
                         scale, parts, threads, workspace.data_ptr(), out.data_ptr())
    if code:
        raise ValueError(f"cpu_attention.attend: head dim {dim} is not one of {HEAD_DIMS}")
    return out.view(1, heads, new, dim).transpose(1, 2).contiguous()


def reference(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float | None) -> torch.Tensor:
    """The same attention in float64 by the definition: ``[1, new, heads, dim]``."""
    _, heads, new, dim = query.shape
    kv_heads, kv_len = key.shape[1], key.shape[2]
    scale = dim ** -0.5 if scaling is None else scaling
    keys = key.double().repeat_interleave(heads // kv_heads, 1)
    values = value.double().repeat_interleave(heads // kv_heads, 1)
    scores = query.double() @ keys.transpose(-1, -2) * scale
    visible = torch.ones(new, kv_len, dtype=torch.bool).tril(kv_len - new)
    weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
    return (weights @ values).transpose(1, 2)


def tolerance(expected: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Per output, how far the kernel's output in ``dtype`` may be from the float64 result ``expected`` (inputs of
    unit scale): `FP32_TOLERANCE`, plus the rounding to bf16 / fp16, half an ulp of the value (`OUTPUT_ROUNDING`)."""
    return FP32_TOLERANCE + OUTPUT_ROUNDING[dtype] * (expected.abs() + FP32_TOLERANCE)


def _self_check(kernel: _Kernel) -> str | None:
    """Run the kernel on random shapes it takes (a span shorter than a block, several spans, both head dims, strided
    cache views), in each of `DTYPES`, against `reference`; the first output outside `tolerance`, or None."""
    generator = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for dim, kv_heads, groups, new, kv_len in ((64, 3, 3, 1, 1100), (64, 3, 3, 5, 1537), (128, 2, 6, 3, 1200)):
            buffer = torch.randn(2, 1, kv_heads, kv_len + 40, dim, generator=generator).to(dtype)
            key, value = buffer[0, :, :, :kv_len], buffer[1, :, :, :kv_len]
            query = torch.randn(1, kv_heads * groups, new, dim, generator=generator).to(dtype)
            expected = reference(query, key, value, None)
            error = (_attend_with(kernel, query, key, value).double() - expected).abs()
            if not bool((error <= tolerance(expected, dtype)).all()):
                return f"{dtype}, head dim {dim}, {new} new of {kv_len}: max error {error.max().item():.2e}"
    return None
