"""The few-rows linear kernel (`hf_triforce.kernels.few_rows_linear`, `csrc/few_rows_linear.c`).

* `multiply` equals the product computed in float64 within `error_bound` (an fp32 dot product's rounding, and for bf16
  and fp16 one rounding of each output to their dtype), in fp32, bf16 and fp16, for 1 to 16 rows (one pass of up to 8
  and two), input widths with and without a tail past the last 16 or 32, output widths that end inside a block of
  weight rows and that leave a thread without columns, on 1-3 threads; the bound catches a dropped term in each dtype;
* each row's outputs are its own: bit for bit the same whatever the other rows hold and however many rows there are
  (a verification row computes what a one-row step computes), in each dtype;
* the TriForce loop with every linear layer on the kernel keeps its greedy output identical to plain ``generate``, in
  fp32 and in bf16 (against plain ``generate`` in bf16);
* the kernel is off under ``HF_TRIFORCE_CPU_LINEAR=off``, and a failing build leaves it off with the compiler's error
  in `status` (the routes then time ATen's only), never a silent stop: `tests/test_native_build.py`.
"""

from __future__ import annotations

import pytest
import torch

from hf_triforce.kernels import few_rows_linear, linear_routes

from .conftest import make_model, random_prompt
from .test_cpu_attention import build_label, needs_kernel
from .test_greedy_identity import _config, assert_identical


@needs_kernel
def test_builds_here():
    assert few_rows_linear.status() == "on"


@needs_kernel
@pytest.mark.parametrize("dtype", few_rows_linear.DTYPES)
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("in_features", [16, 37, 576, 1000])
@pytest.mark.parametrize("out_features", [1, 7, 50, 257])
def test_matches_float64(threads, in_features, out_features, dtype):
    generator = torch.Generator().manual_seed(in_features * 1000 + out_features)
    weight = torch.randn(out_features, in_features, generator=generator).to(dtype)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for rows in range(1, 17):
            x = torch.randn(rows, in_features, generator=generator).to(dtype)
            got = few_rows_linear.multiply(x, weight)
            error = (got.double() - x.double() @ weight.double().T).abs()
            assert got.shape == (rows, out_features) and got.dtype == dtype
            assert bool((error <= few_rows_linear.error_bound(x, weight)).all()), (rows, error.max().item())
    finally:
        torch.set_num_threads(previous)


@needs_kernel
@pytest.mark.parametrize("dtype", few_rows_linear.DTYPES)
def test_the_bound_catches_a_dropped_term(dtype):
    """The float64 check is not loose: leaving out one input column (as a kernel that lost its tail would) puts the
    outputs far outside `error_bound`, in each dtype (bf16's and fp16's bounds include the output's rounding)."""
    generator = torch.Generator().manual_seed(1)
    x, weight = (torch.randn(n, 37, generator=generator).to(dtype) for n in (3, 20))
    wrong = x[:, :36].double() @ weight[:, :36].double().T
    assert not bool(((wrong - x.double() @ weight.double().T).abs() <= few_rows_linear.error_bound(x, weight)).all())


@needs_kernel
@pytest.mark.parametrize("dtype", few_rows_linear.DTYPES)
def test_each_row_is_its_own_bit_for_bit(dtype):
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(300, 577, generator=generator).to(dtype)
    x = torch.randn(11, 577, generator=generator).to(dtype)
    whole = few_rows_linear.multiply(x, weight)
    for row in range(11):
        assert torch.equal(few_rows_linear.multiply(x[row : row + 1], weight)[0], whole[row]), (row, build_label())
    other = x.clone()
    other[1:] = torch.randn(10, 577, generator=generator).to(dtype)
    assert torch.equal(few_rows_linear.multiply(other, weight)[0], whole[0]), build_label()


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triforce_on_the_kernel_keeps_greedy_identity(monkeypatch, dtype):
    """Every eligible layer on the kernel (whatever this CPU times fastest): the loop's greedy output is plain
    ``generate``'s in the model's dtype, and the stats name the route."""
    monkeypatch.setattr(linear_routes.LinearRoutes, "calibrate", lambda self, group, rows: "stream")
    model = make_model("qwen2").to(dtype)
    stats = assert_identical(model, random_prompt(150, period=37), _config("self"))
    assert stats.force3_steps > 0
    assert set(stats.detail.linear_routes["decoder"].values()) == {"stream"}


@needs_kernel
def test_routes_timed_in_fp32_are_timed_again_after_double(monkeypatch):
    """Routes timed on fp32 weights (the kernel's) are kept for the model's later calls only while the weights are
    those they were timed on: after ``model.double()`` (weights the kernel does not take) the next call times them
    again, and its greedy output is plain ``generate``'s in fp64, as a fresh fp64 model's is."""
    monkeypatch.setattr(linear_routes.LinearRoutes, "calibrate",
                        lambda self, group, rows: linear_routes.routes_for(self.groups[group])[-1])
    model = make_model("llama-gqa")
    prompt = random_prompt(150, period=37)
    stats = assert_identical(model, prompt, _config("self"), max_new_tokens=12)
    assert {route for by_rows in stats.detail.linear_routes.values() for route in by_rows.values()} == {"stream"}
    model.double()
    stats = assert_identical(model, prompt, _config("self"), max_new_tokens=12)
    assert {route for by_rows in stats.detail.linear_routes.values() for route in by_rows.values()} == {"left"}


@needs_kernel
def test_inputs_the_kernel_does_not_take_are_refused():
    """Rows or weight of a dtype it has no code for, rows of another dtype than the weight's (bf16 rows read beside
    fp32 weights would be garbage), another width than the weight's (the kernel would read past the rows), no rows, a
    non-contiguous weight, another device: a ValueError naming the argument, never a wrong result."""
    weight = torch.randn(40, 64)
    rows = torch.randn(3, 64)
    cases = {
        "rows \\(torch.bfloat16\\) and weight \\(torch.float32\\) must share a dtype": (rows.bfloat16(), weight),
        "weight dtype must be one of torch.float32, torch.bfloat16, torch.float16, got torch.float64":
            (rows, weight.double()),
        "rows are 32 wide, weight \\[out, in\\] takes 64": (torch.randn(3, 32), weight),
        "at least 1 row, got 0": (torch.randn(0, 64), weight),
        "weight must be contiguous": (rows, torch.randn(64, 40).T),
        "rows must be 2-D": (torch.randn(64), weight),
        "rows must be on the CPU, got meta": (torch.empty(3, 64, device="meta"), weight),
    }
    for message, (x, w) in cases.items():
        with pytest.raises(ValueError, match=message):
            few_rows_linear.multiply(x, w)
    assert torch.equal(few_rows_linear.multiply(rows.T.contiguous().T, weight), few_rows_linear.multiply(rows, weight))


@needs_kernel
@pytest.mark.parametrize("default", [torch.float16, torch.float64])
def test_the_output_dtype_does_not_follow_the_default_dtype(default):
    """Under ``torch.set_default_dtype(torch.float16)`` an output allocated by default would be half the bytes the
    kernel writes; under float64 the kernel's floats would be read as doubles."""
    generator = torch.Generator().manual_seed(3)
    rows = torch.randn(4, 256, generator=generator, dtype=torch.float32)
    weight = torch.randn(64, 256, generator=generator, dtype=torch.float32)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(default)
    try:
        got = few_rows_linear.multiply(rows, weight)
    finally:
        torch.set_default_dtype(previous)
    assert got.dtype == torch.float32
    error = (got.double() - rows.double() @ weight.double().T).abs()
    assert bool((error <= few_rows_linear.error_bound(rows, weight)).all())


def test_routes_leave_autocast_and_foreign_rows_to_f_linear():
    """Under CPU autocast a layer's rows arrive in bf16 and ``F.linear`` casts as the model's own forward does: a
    route other than ``"linear"`` gives such calls to ``F.linear`` and counts them (`LinearRoutes.bypassed`)."""
    model = make_model("llama-gqa")
    routes = linear_routes.LinearRoutes(model)
    routes.calibrate = lambda group, rows: "left"  # a route that is not the layer's own forward
    layer = model.model.layers[0].mlp.down_proj
    x = torch.randn(2, layer.in_features)
    with routes.installed(), torch.autocast("cpu", dtype=torch.bfloat16):
        got = layer(x)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = layer(x)
    assert got.dtype == torch.bfloat16 and torch.equal(got, expected)
    assert routes.bypassed == {"autocast (torch.bfloat16)": 1}
    with routes.installed(), pytest.raises(RuntimeError):  # what the layer's own forward raises for such rows
        layer(x.double())
    assert routes.bypassed["torch.float64 rows, torch.float32 weight"] == 1


@needs_kernel
def test_triforce_under_autocast_runs_where_plain_generate_runs(monkeypatch):
    """Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the layers' rows arrive in bf16: with the kernel's route
    chosen, they take ``F.linear`` (as in plain ``generate``) instead of being read as fp32 (NaN logits)."""
    monkeypatch.setattr(linear_routes.LinearRoutes, "calibrate", lambda self, group, rows: "stream")
    model = make_model("qwen2")
    prompt = random_prompt(150, period=37)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = model.generate(prompt, max_new_tokens=30, do_sample=False)
        out = model.generate(prompt, max_new_tokens=30, do_sample=False, triforce_config=_config("self"),
                             return_dict_in_generate=True)
    assert out.sequences.shape == plain.shape
    assert linear_routes.linear_routes(model).bypassed["autocast (torch.bfloat16)"] > 0
