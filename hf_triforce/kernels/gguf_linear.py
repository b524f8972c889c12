"""A CPU kernel for a few fp32 rows times a weight matrix kept in GGUF's quantized blocks (`TYPES`): the linear layers
of a GGUF model's decoding and verification forwards, read at their stored width (docs/deployment.md, "The CPU
kernels").

`csrc/gguf_rows_linear.c` reads the blocks as the file stores them (`BlockMatrix`) and widens each 32 values to fp32
in registers, up to 8 rows a pass over the weights, the output columns split among torch's threads.

Exactness: the values it multiplies by are exactly the dequantized fp32 matrix's, bit for bit (what
``gguf.dequantize`` computes and transformers loads; `reference_dequantize`, and `dequantize` reads them back from
the kernel's own code). Each output is an fp32 dot product of one row with one weight row (rows never mix), in another
summation order than ``F.linear``'s (`error_bound`).

Built on first use (`native_build`), checked against float64 and the reference values before first use (a failure
leaves `status` saying why, and `linear_routes` does not offer the route). ``HF_TRIFORCE_CPU_GGUF=off`` turns it off.
"""

from __future__ import annotations

import ctypes
import functools
from dataclasses import dataclass

import torch

from .native_build import CSRC, INT, LONG, POINTER, bind, built, load_checked

SOURCES = (CSRC / "gguf_rows_linear.c", CSRC / "vectors.h")  # compiled, included
ENV = "HF_TRIFORCE_CPU_GGUF"
# GGMLQuantizationType name -> (its code, bytes per block, values per block, offsets of the block's fp16 scales)
TYPES = {"Q4_0": (2, 18, 32, (0,)), "Q4_1": (3, 20, 32, (0, 2)), "Q5_0": (6, 22, 32, (0,)),
         "Q5_1": (7, 24, 32, (0, 2)), "Q8_0": (8, 34, 32, (0,)), "Q4_K": (12, 144, 256, (0, 2)),
         "Q6_K": (14, 210, 256, (208,))}


@dataclass(frozen=True)
class BlockMatrix:
    """A weight matrix ``[out, in]`` as GGUF stores it: ``blocks`` uint8 ``[out, in / values * bytes]`` (`TYPES`: values
    and bytes per block), each row its blocks of type ``kind`` in order, contiguous."""

    kind: str
    blocks: torch.Tensor
    in_features: int

    def __post_init__(self) -> None:
        if self.kind not in TYPES:
            raise ValueError(f"BlockMatrix: kind must be one of {', '.join(TYPES)}, got {self.kind!r}")
        _, size, values, _ = TYPES[self.kind]
        if self.in_features < values or self.in_features % values:
            raise ValueError(f"BlockMatrix: in_features must be a positive multiple of {values} for {self.kind}, got "
                             f"{self.in_features}")
        width = self.in_features // values * size
        blocks = self.blocks
        if (blocks.dtype != torch.uint8 or blocks.dim() != 2 or blocks.shape[1] != width
                or blocks.device.type != "cpu" or not blocks.is_contiguous()):
            raise ValueError(f"BlockMatrix: blocks must be a contiguous CPU uint8 [out, {width}] tensor for "
                             f"{self.in_features} inputs of {self.kind}, got {blocks.dtype} {tuple(blocks.shape)} "
                             f"on {blocks.device}")

    @property
    def out_features(self) -> int:
        return self.blocks.shape[0]

    @property
    def nbytes(self) -> int:
        return self.blocks.nbytes


class _Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.multiply = bind(library, "triforce_gguf_linear", INT, INT, INT, POINTER, POINTER, POINTER, LONG, LONG, INT)
        self.dequantize = bind(library, "triforce_gguf_dequantize", INT, INT, POINTER, POINTER, LONG, LONG)


@functools.cache
def _load() -> tuple[_Kernel | None, str]:
    """The built kernel and "on", or None and why not (once per process)."""
    return load_checked(ENV, "gguf_rows_linear", SOURCES, _Kernel, _self_check)


def status() -> str:
    """``"on"``, or why the kernel does not run in this process."""
    return _load()[1]


def available() -> bool:
    return _load()[0] is not None


def multiply(rows: torch.Tensor, matrix: BlockMatrix) -> torch.Tensor:
    """``rows`` ``[n, in]`` fp32 (n >= 1) times the matrix's values transposed -> ``[n, out]`` fp32. ValueError for
    rows the kernel does not take (`check_rows`); the kernel must be built (`available`)."""
    return _multiply_with(built(_load, "gguf_linear.multiply"), rows, matrix)


def dequantize(matrix: BlockMatrix) -> torch.Tensor:
    """``[out, in]`` fp32: the values `multiply` multiplies by, written by the kernel's own code."""
    return _dequantize_with(built(_load, "gguf_linear.dequantize"), matrix)


def check_rows(rows: torch.Tensor, matrix: BlockMatrix) -> None:
    """ValueError naming the argument unless ``rows`` is a CPU fp32 ``[n >= 1, matrix.in_features]`` tensor (any
    layout: the kernel reads a contiguous copy) and ``matrix`` a `BlockMatrix`."""
    if not isinstance(matrix, BlockMatrix):
        raise ValueError(f"gguf_linear.multiply: matrix must be a BlockMatrix, got {type(matrix).__name__}")
    if rows.device.type != "cpu":
        raise ValueError(f"gguf_linear.multiply: rows must be on the CPU, got {rows.device}")
    if rows.dtype != torch.float32:
        raise ValueError(f"gguf_linear.multiply: rows dtype must be torch.float32, got {rows.dtype}")
    if rows.dim() != 2:
        raise ValueError(f"gguf_linear.multiply: rows must be 2-D, got shape {tuple(rows.shape)}")
    if rows.shape[1] != matrix.in_features:
        raise ValueError(f"gguf_linear.multiply: rows are {rows.shape[1]} wide, matrix [out, in] takes "
                         f"{matrix.in_features}")
    if rows.shape[0] < 1:
        raise ValueError("gguf_linear.multiply: rows must hold at least 1 row, got 0")


def _multiply_with(kernel: _Kernel, rows: torch.Tensor, matrix: BlockMatrix) -> torch.Tensor:
    check_rows(rows, matrix)
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], matrix.out_features, dtype=torch.float32)
    code = kernel.multiply(TYPES[matrix.kind][0], rows.shape[0], rows.data_ptr(), matrix.blocks.data_ptr(),
                           out.data_ptr(), matrix.out_features, matrix.in_features, torch.get_num_threads())
    if code:
        raise RuntimeError(f"gguf_linear.multiply: the kernel refused its inputs (code {code})")
    return out


def _dequantize_with(kernel: _Kernel, matrix: BlockMatrix) -> torch.Tensor:
    out = torch.empty(matrix.out_features, matrix.in_features, dtype=torch.float32)
    code = kernel.dequantize(TYPES[matrix.kind][0], matrix.blocks.data_ptr(), out.data_ptr(), matrix.out_features,
                             matrix.in_features)
    if code:
        raise RuntimeError(f"gguf_linear.dequantize: the kernel refused its inputs (code {code})")
    return out


def _halves(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """The fp16 values at byte ``offset`` of each block (``blocks`` ``[..., bytes]``), widened to fp32 ``[..., 1]``."""
    return blocks[..., offset : offset + 2].contiguous().view(torch.float16).float()


def _nibbles(packed: torch.Tensor) -> torch.Tensor:
    """``[..., 2n]``: the low nibbles of ``packed`` ``[..., n]`` then its high ones."""
    return torch.cat([packed & 15, packed >> 4], dim=-1)


def _high_bits(packed: torch.Tensor) -> torch.Tensor:
    """``[..., 32]``: bit ``i`` of the little-endian 32 bits ``packed`` ``[..., 4]``, times 16."""
    bits = torch.stack([(packed >> shift) & 1 for shift in range(8)], dim=-1)  # [..., byte, bit]
    return bits.reshape(*packed.shape[:-1], 32) << 4


def reference_dequantize(matrix: BlockMatrix) -> torch.Tensor:
    """``[out, in]`` fp32 computed in torch as gguf's dequantization computes it (``gguf.quants``): fp16 scales and
    minimums widened to fp32, each product of scales and values in fp32, then the one sum or product gguf makes."""
    _, _, values, _ = TYPES[matrix.kind]
    blocks = matrix.blocks.reshape(matrix.out_features, matrix.in_features // values, -1)
    kind, lead = matrix.kind, blocks.shape[:-1]
    if kind == "Q8_0":
        out = blocks[..., 2:].contiguous().view(torch.int8).float() * _halves(blocks, 0)
    elif kind in ("Q4_0", "Q4_1"):
        q = _nibbles(blocks[..., 4:] if kind == "Q4_1" else blocks[..., 2:]).float()
        out = _halves(blocks, 0) * q + _halves(blocks, 2) if kind == "Q4_1" else _halves(blocks, 0) * (q - 8)
    elif kind in ("Q5_0", "Q5_1"):
        start = 4 if kind == "Q5_1" else 2
        q = (_nibbles(blocks[..., start + 4 :]) | _high_bits(blocks[..., start : start + 4])).float()
        out = _halves(blocks, 0) * q + _halves(blocks, 2) if kind == "Q5_1" else _halves(blocks, 0) * (q - 16)
    elif kind == "Q4_K":
        s = blocks[..., 4:16]
        scale = torch.cat([s[..., 0:4] & 63, (s[..., 8:12] & 15) | ((s[..., 0:4] >> 6) << 4)], dim=-1).float()
        low = torch.cat([s[..., 4:8] & 63, (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)], dim=-1).float()
        chunks = blocks[..., 16:].reshape(*lead, 4, 32)
        q = torch.stack([chunks & 15, chunks >> 4], dim=-2).reshape(*lead, 8, 32).float()
        out = (_halves(blocks, 0) * scale)[..., None] * q - (_halves(blocks, 2) * low)[..., None]
    else:  # Q6_K
        low = blocks[..., :128].reshape(*lead, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8)[:, None]
        high = blocks[..., 128:192].reshape(*lead, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8)[:, None]
        q = (low & 15).reshape(*lead, 8, 32) | ((high & 3).reshape(*lead, 8, 32) << 4)
        scales = blocks[..., 192:208].contiguous().view(torch.int8).float()
        out = (_halves(blocks, 208) * scales)[..., None] * (q.float() - 32).reshape(*lead, 16, 16)
    return out.reshape(matrix.out_features, matrix.in_features)


def error_bound(rows: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """Per output, a bound on the kernel's error against the exact product of ``rows`` ``[n, in]`` and the matrix's
    ``values`` ``[out, in]`` (float64 ``[n, out]``): an fp32 dot product's rounding, ``in x 2^-23`` times the sum of
    the absolute products (a sum of ``in`` terms in any order, each product rounded once or fused)."""
    return values.shape[1] * 2.0 ** -23 * (rows.double().abs() @ values.double().abs().T)


def random_matrix(kind: str, out_features: int, in_features: int, generator: torch.Generator) -> BlockMatrix:
    """A `BlockMatrix` of random bytes but for finite random fp16 scales (and minimums) of either sign."""
    _, size, values, halves = TYPES[kind]
    blocks = torch.randint(0, 256, (out_features, in_features // values, size), dtype=torch.uint8,
                           generator=generator)
    for offset in halves:
        scales = (torch.randn(out_features, in_features // values, 1, generator=generator) * 0.05).half()
        blocks[..., offset : offset + 2] = scales.view(torch.uint8)
    return BlockMatrix(kind, blocks.reshape(out_features, -1).contiguous(), in_features)


def _self_check(kernel: _Kernel) -> str | None:
    """Each type on shapes it takes (1-11 rows: one pass and two; 1-5 blocks a row; outputs not a multiple of its
    blocks of rows): the values equal `reference_dequantize`'s bit for bit, and the products are within `error_bound`
    of float64; the first failure, or None."""
    generator = torch.Generator().manual_seed(0)
    for kind in TYPES:
        for rows, out_features, blocks in ((1, 37, 2), (3, 50, 5), (8, 29, 3), (11, 101, 1)):
            in_features = blocks * TYPES[kind][2]
            matrix = random_matrix(kind, out_features, in_features, generator)
            values = reference_dequantize(matrix)
            if not torch.equal(_dequantize_with(kernel, matrix).view(torch.int32), values.view(torch.int32)):
                return f"{kind}: the kernel's values differ from gguf's dequantization"
            x = torch.randn(rows, in_features, generator=generator)
            error = (_multiply_with(kernel, x, matrix).double() - x.double() @ values.double().T).abs()
            if not bool((error <= error_bound(x, values)).all()):
                return f"{kind}, {rows} rows of {in_features} x {out_features}: max error {error.max().item():.2e}"
    return None
