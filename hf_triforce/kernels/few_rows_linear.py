"""A CPU kernel for a few rows times a weight matrix in fp32, bf16 or fp16: the linear layers of decoding and
verification forwards (docs/deployment.md, "The CPU kernels").

`csrc/few_rows_linear.c` reads each block of weight rows once and multiplies it into every input row (up to 8 a pass),
the output columns split among torch's threads, where MKL reads the weights at a fraction of the memory's speed for a
few rows. Built on first use and kept (`native_build`), checked against a float64 reference before first use (a
failure leaves `status` saying why, and `linear_routes` times ATen's routes only). ``HF_TRIFORCE_CPU_LINEAR=off``
turns it off.

Numerics: each output is its own fp32 dot product of one row with one weight row (rows never mix), summed by fused
multiply-adds in 16 lanes (8 on AVX2) then across them, in the same order for every number of rows and on every
build, so a row's outputs are bit for bit the same alone and beside others. bf16 and fp16 weights are read as they
are and widened in registers (each product exact in fp32; with AVX512-BF16, bf16 pairs by ``vdpbf16ps``, which takes
values below fp32's normal range as 0), each output rounded once to the weights' dtype. `error_bound` bounds it all.
"""

from __future__ import annotations

import ctypes
import functools

import torch

from .native_build import CSRC, INT, LONG, POINTER, bind, built, load_checked

SOURCES = (CSRC / "few_rows_linear.c", CSRC / "vectors.h")  # compiled, included
ENV = "HF_TRIFORCE_CPU_LINEAR"
ELEMENTS = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}  # the kernel's element codes (csrc/vectors.h)
DTYPES = tuple(ELEMENTS)  # what the kernel multiplies: rows and weight of one of these, the output the same
# half an ulp of an output rounded to bf16 / fp16: relative to the value in the normal range, absolute below it
OUTPUT_ROUNDING = {torch.bfloat16: (2.0 ** -8, 2.0 ** -134), torch.float16: (2.0 ** -11, 2.0 ** -25)}
FP32_NORMAL = 2.0 ** -126  # the smallest normal fp32 value: vdpbf16ps takes smaller inputs and sums as 0


class _Kernel:
    def __init__(self, library: ctypes.CDLL) -> None:
        self.multiply = bind(library, "triforce_few_rows_linear", INT, INT, INT, POINTER, POINTER, POINTER, LONG, LONG,
                             INT)


@functools.cache
def _load() -> tuple[_Kernel | None, str]:
    """The built kernel and "on", or None and why not (once per process)."""
    return load_checked(ENV, "few_rows_linear", SOURCES, _Kernel, _self_check)


def status() -> str:
    """``"on"``, or why the kernel does not run in this process."""
    return _load()[1]


def available() -> bool:
    return _load()[0] is not None


def supports(weight: torch.Tensor) -> bool:
    """Whether `multiply` takes products with ``weight`` ``[out, in]``: a contiguous CPU matrix of one of `DTYPES`
    (built kernel)."""
    return (weight.device.type == "cpu" and weight.dtype in DTYPES and weight.dim() == 2
            and weight.is_contiguous() and available())


def multiply(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[n, in]`` (n >= 1) times ``weight.T`` (``weight`` ``[out, in]``) -> ``[n, out]`` in their dtype.
    ValueError for inputs the kernel does not take (`check_inputs`); the kernel must be built (`available`)."""
    return _multiply_with(built(_load, "few_rows_linear.multiply"), rows, weight)


def check_inputs(rows: torch.Tensor, weight: torch.Tensor) -> None:
    """ValueError naming the argument unless ``rows`` ``[n >= 1, in]`` and ``weight`` ``[out, in]`` are CPU tensors
    of one dtype of `DTYPES`, ``weight`` contiguous (``rows`` may be any layout: the kernel reads a contiguous
    copy)."""
    allowed = ", ".join(str(dtype) for dtype in DTYPES)
    for label, tensor in (("rows", rows), ("weight", weight)):
        if tensor.device.type != "cpu":
            raise ValueError(f"few_rows_linear.multiply: {label} must be on the CPU, got {tensor.device}")
        if tensor.dtype not in DTYPES:
            raise ValueError(f"few_rows_linear.multiply: {label} dtype must be one of {allowed}, got {tensor.dtype}")
        if tensor.dim() != 2:
            raise ValueError(f"few_rows_linear.multiply: {label} must be 2-D, got shape {tuple(tensor.shape)}")
    if rows.dtype != weight.dtype:
        raise ValueError(f"few_rows_linear.multiply: rows ({rows.dtype}) and weight ({weight.dtype}) must share a "
                         "dtype")
    if rows.shape[1] != weight.shape[1]:
        raise ValueError(f"few_rows_linear.multiply: rows are {rows.shape[1]} wide, weight [out, in] takes "
                         f"{weight.shape[1]}")
    if rows.shape[0] < 1:
        raise ValueError("few_rows_linear.multiply: rows must hold at least 1 row, got 0")
    if not weight.is_contiguous():
        raise ValueError(f"few_rows_linear.multiply: weight must be contiguous, got strides {weight.stride()}")


def _multiply_with(kernel: _Kernel, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    check_inputs(rows, weight)
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=weight.dtype, device=weight.device)
    code = kernel.multiply(ELEMENTS[weight.dtype], rows.shape[0], rows.data_ptr(), weight.data_ptr(), out.data_ptr(),
                           weight.shape[0], weight.shape[1], torch.get_num_threads())
    if code:
        raise ValueError(f"few_rows_linear.multiply: rows must be at least 1, got {rows.shape[0]}")
    return out


def error_bound(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Per output, a bound on the kernel's error against the exact product of ``rows`` ``[n, in]`` and ``weight``
    ``[out, in]`` (float64 ``[n, out]``): an fp32 dot product's rounding, ``in x 2^-23`` times the sum of the absolute
    products (a sum of ``in`` terms in any order; a product of two bf16 or fp16 values is exact in fp32); for bf16,
    what ``vdpbf16ps`` takes as 0 (each product with a factor below fp32's normal range, and ``2^-126`` per sum); then
    the rounding of bf16 and fp16 outputs, half an ulp (`OUTPUT_ROUNDING`) of the computed value."""
    x, w = rows.double(), weight.double()
    bound = weight.shape[1] * 2.0 ** -23 * (x.abs() @ w.abs().T)
    if weight.dtype == torch.bfloat16:
        x_tiny, w_tiny = (t.abs() * (t.abs() < FP32_NORMAL) for t in (x, w))
        bound = bound + x_tiny @ w.abs().T + x.abs() @ w_tiny.T + weight.shape[1] * FP32_NORMAL
    if weight.dtype in OUTPUT_ROUNDING:
        relative, absolute = OUTPUT_ROUNDING[weight.dtype]
        bound = bound + relative * ((x @ w.T).abs() + bound) + absolute
    return bound


def _self_check(kernel: _Kernel) -> str | None:
    """Run the kernel on shapes it takes (1-11 rows: one pass and two, inputs not a multiple of 16 or 32, outputs not
    a multiple of its blocks), in each of `DTYPES`, against float64; the first output outside `error_bound`, or
    None."""
    generator = torch.Generator().manual_seed(0)
    for dtype in DTYPES:
        for rows, out_features, in_features in ((1, 37, 64), (3, 50, 1000), (8, 29, 576), (11, 101, 200)):
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
            error = (_multiply_with(kernel, x, weight).double() - x.double() @ weight.double().T).abs()
            if not bool((error <= error_bound(x, weight)).all()):
                return f"{dtype}, {rows} rows of {in_features} x {out_features}: max error {error.max().item():.2e}"
    return None
