"""The stored-width GGUF kernel (`hf_triforce.kernels.gguf_linear`, `csrc/gguf_rows_linear.c`).

* the values it multiplies by are gguf's dequantization's (what transformers loads), bit for bit, for blocks gguf's
  own quantizers wrote (where gguf has one for the type) and for random blocks (any scale, minimum and value), in each
  type (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K);
* `multiply` equals the float64 product with those values within `error_bound` (an fp32 dot product's rounding),
  for 1 to 11 rows (one pass of up to 8 and two), input widths of 1, 3 and 7 blocks, output widths that end inside a
  block of weight rows and that leave a thread without columns, on 1 and 3 threads; the bound catches a dropped
  block;
* each row's outputs are its own, bit for bit, whatever the other rows hold and however many there are;
* the AVX2 build (8 lanes) and the AVX-512 one (16) both build and pass;
* inputs it does not take are refused with a ValueError naming the argument.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_triforce.kernels import gguf_linear, native_build
from hf_triforce.kernels.gguf_linear import TYPES, BlockMatrix

from .test_cpu_attention import build_label, needs_kernel

gguf = pytest.importorskip("gguf")


def _quantized(kind: str, out_features: int, blocks: int, seed: int) -> BlockMatrix:
    """Random normal weights of ``blocks`` blocks a row quantized by gguf's own quantizer, where it has one for
    ``kind``; else random blocks (`gguf_linear.random_matrix`)."""
    in_features = blocks * TYPES[kind][2]
    values = np.random.default_rng(seed).standard_normal((out_features, in_features)).astype(np.float32)
    try:
        packed = gguf.quantize(values, gguf.GGMLQuantizationType[kind])
    except NotImplementedError:
        return gguf_linear.random_matrix(kind, out_features, in_features, torch.Generator().manual_seed(seed))
    return BlockMatrix(kind, torch.from_numpy(np.ascontiguousarray(packed)), in_features)


def _gguf_values(matrix: BlockMatrix) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(gguf.dequantize(matrix.blocks.numpy(),
                                                                 gguf.GGMLQuantizationType[matrix.kind])))


def _bits(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(torch.int32)


@needs_kernel
def test_builds_here():
    assert gguf_linear.status() == "on"


@needs_kernel
@pytest.mark.parametrize("kind", TYPES)
def test_values_are_gguf_dequantization_bit_for_bit(kind):
    generator = torch.Generator().manual_seed(0)
    for matrix in (_quantized(kind, 37, 5, 1), gguf_linear.random_matrix(kind, 53, 3 * TYPES[kind][2], generator)):
        expected = _gguf_values(matrix)
        assert torch.equal(_bits(gguf_linear.reference_dequantize(matrix)), _bits(expected))
        assert torch.equal(_bits(gguf_linear.dequantize(matrix)), _bits(expected))


@needs_kernel
@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("threads", [1, 3])
@pytest.mark.parametrize("blocks", [1, 3, 7])
@pytest.mark.parametrize("out_features", [1, 7, 257])
def test_matches_float64(kind, threads, blocks, out_features):
    generator = torch.Generator().manual_seed(blocks * 1000 + out_features)
    in_features = blocks * TYPES[kind][2]
    matrix = gguf_linear.random_matrix(kind, out_features, in_features, generator)
    values = _gguf_values(matrix)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, 12):
            x = torch.randn(rows, in_features, generator=generator)
            got = gguf_linear.multiply(x, matrix)
            error = (got.double() - x.double() @ values.double().T).abs()
            assert got.shape == (rows, out_features) and got.dtype == torch.float32
            assert bool((error <= gguf_linear.error_bound(x, values)).all()), (rows, error.max().item())
    finally:
        torch.set_num_threads(previous)


@needs_kernel
@pytest.mark.parametrize("kind", TYPES)
def test_the_bound_catches_a_dropped_block(kind):
    """The float64 check is not loose: leaving out 32 inputs (as a kernel that stopped a block early would) puts the
    outputs far outside `error_bound`."""
    matrix = _quantized(kind, 20, 3, 2)
    values = _gguf_values(matrix)
    x = torch.randn(3, matrix.in_features, generator=torch.Generator().manual_seed(3))
    wrong = x[:, 32:].double() @ values[:, 32:].double().T
    assert not bool(((wrong - x.double() @ values.double().T).abs() <= gguf_linear.error_bound(x, values)).all())


@needs_kernel
@pytest.mark.parametrize("kind", TYPES)
def test_each_row_is_its_own_bit_for_bit(kind):
    generator = torch.Generator().manual_seed(4)
    matrix = _quantized(kind, 300, 3, 5)
    x = torch.randn(11, matrix.in_features, generator=generator)
    whole = gguf_linear.multiply(x, matrix)
    for row in range(11):
        assert torch.equal(gguf_linear.multiply(x[row : row + 1], matrix)[0], whole[row]), (row, build_label())
    other = x.clone()
    other[1:] = torch.randn(10, matrix.in_features, generator=generator)
    assert torch.equal(gguf_linear.multiply(other, matrix)[0], whole[0]), build_label()


@needs_kernel
@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v4"])
def test_each_build_target_builds_and_passes(monkeypatch, tmp_path, march):
    """The AVX2 build (8-lane vectors, what an AVX2-only CPU runs) on any CPU, the AVX-512 one where the CPU has
    AVX-512 (else refused with what it lacks): each passes its self-check and keeps gguf's values and the bound."""
    monkeypatch.setenv("HF_TRIFORCE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv(native_build.MARCH_ENV, march)
    kernel, why = gguf_linear._load.__wrapped__()
    lacking = native_build.unsupported_target()
    assert (kernel is not None and why == "on") if lacking is None else why == f"unavailable ({lacking})"
    assert march == "x86-64-v4" or lacking is None
    if kernel is None:
        return
    for kind in TYPES:
        matrix = _quantized(kind, 43, 3, 6)
        values = _gguf_values(matrix)
        assert torch.equal(_bits(gguf_linear._dequantize_with(kernel, matrix)), _bits(values))
        x = torch.randn(11, matrix.in_features, generator=torch.Generator().manual_seed(7))
        error = (gguf_linear._multiply_with(kernel, x, matrix).double() - x.double() @ values.double().T).abs()
        assert bool((error <= gguf_linear.error_bound(x, values)).all()), (kind, error.max().item())


@needs_kernel
def test_inputs_the_kernel_does_not_take_are_refused():
    matrix = _quantized("Q4_1", 40, 2, 8)
    rows = torch.randn(3, 64)
    cases = {
        "rows dtype must be torch.float32, got torch.bfloat16": (rows.bfloat16(), matrix),
        "rows dtype must be torch.float32, got torch.float64": (rows.double(), matrix),
        "rows are 32 wide, matrix \\[out, in\\] takes 64": (torch.randn(3, 32), matrix),
        "at least 1 row, got 0": (torch.randn(0, 64), matrix),
        "rows must be 2-D": (torch.randn(64), matrix),
        "rows must be on the CPU, got meta": (torch.empty(3, 64, device="meta"), matrix),
        "matrix must be a BlockMatrix, got Tensor": (rows, torch.randn(40, 64)),
    }
    for message, (x, m) in cases.items():
        with pytest.raises(ValueError, match=message):
            gguf_linear.multiply(x, m)
    assert torch.equal(gguf_linear.multiply(rows.T.contiguous().T, matrix), gguf_linear.multiply(rows, matrix))
    blocks = matrix.blocks
    matrices = {
        "kind must be one of Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q6_K, got 'Q5_K'": ("Q5_K", blocks, 64),
        "in_features must be a positive multiple of 32 for Q4_1, got 48": ("Q4_1", blocks, 48),
        "in_features must be a positive multiple of 256 for Q4_K, got 64": ("Q4_K", blocks, 64),
        "blocks must be a contiguous CPU uint8 \\[out, 40\\] tensor": ("Q4_1", blocks[:, :20], 64),
        "got torch.int8": ("Q4_1", blocks.view(torch.int8), 64),
        "blocks must be a contiguous": ("Q4_1", blocks.T.contiguous().T, 64),
    }
    for message, arguments in matrices.items():
        with pytest.raises(ValueError, match=message):
            BlockMatrix(*arguments)
