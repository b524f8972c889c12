"""The projection's fit (`benchmarks/project_calibration.py`): synthetic timings made from known device numbers give
those numbers back, the fit weighs each point by its relative error, and a fitted device reads back through
``hf-triforce project --devices`` as fitted."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from hf_triforce_bench.roofline import device, forward_seconds, load_devices, model_shape

ROOT = Path(__file__).resolve().parents[1]
# a CPU of the size the fits find (bytes/s, FLOP/s, seconds a layer), none of them the fit's starting values
TRUE = dict(bandwidth=13e9, gemm_bandwidth=8e9, flops=45e9, attention_flops=120e9, layer_overhead=2.5e-4)
# cached entries x query rows: one-row decodes and multi-row verifications at short and long caches, so that every
# device number moves some point differently from the others
GRID = [(cached, rows) for cached in (272, 1024, 4096, 16000, 32000) for rows in (1, 2, 4, 7)]


@pytest.fixture(scope="module")
def calibration():
    spec = importlib.util.spec_from_file_location("project_calibration",
                                                  ROOT / "benchmarks" / "project_calibration.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def points(calibration, params: dict, grid=GRID, fit: bool = True) -> list:
    """One point per (cached, rows): a forward's milliseconds as the device of ``params`` takes them."""
    model = model_shape("smollm2-135m")
    out = []
    for cached, rows in grid:
        def seconds(p, c=cached, r=rows):
            return forward_seconds(model, calibration.device_of(p), c, r)

        out.append(calibration.Point("synthetic", "synthetic", f"F3 {rows} rows, {cached} cached", "ms",
                                     1e3 * seconds(params), seconds, fit))
    return out


def start(calibration) -> dict:
    return {name: calibration.CPU_START[name] for name in calibration.PLAIN}


def test_the_fit_recovers_the_device_numbers_that_made_the_timings(calibration):
    assert all(start(calibration)[name] != value for name, value in TRUE.items())
    fitted = calibration.fit(points(calibration, TRUE), start(calibration), calibration.PLAIN)
    assert set(fitted) == set(TRUE)
    for name, value in TRUE.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name
    rows = calibration.rows_of(points(calibration, TRUE), fitted)
    assert max(abs(row["error"]) for row in rows) < 1e-9


def test_the_fit_reads_only_its_fitting_points_and_keeps_the_fixed_numbers(calibration):
    wrong = {**TRUE, "bandwidth": TRUE["bandwidth"] / 3, "layer_overhead": 5 * TRUE["layer_overhead"]}
    # a point off by 3x that is only predicted (fit=False) moves nothing
    mixed = points(calibration, TRUE) + points(calibration, wrong, grid=[(8000, 1), (8000, 5)], fit=False)
    fixed = {**start(calibration), "gemm_bandwidth": TRUE["gemm_bandwidth"]}
    free = [name for name in calibration.PLAIN if name != "gemm_bandwidth"]
    fitted = calibration.fit(mixed, fixed, free)
    assert fitted["gemm_bandwidth"] == TRUE["gemm_bandwidth"]
    for name, value in TRUE.items():
        assert fitted[name] == pytest.approx(value, rel=1e-6), name


def test_a_number_the_timings_do_not_need_fits_to_zero_not_below(calibration):
    # no per-layer overhead: the fit finds none ...
    free_of_overhead = {**TRUE, "layer_overhead": 0.0}
    fitted = calibration.fit(points(calibration, free_of_overhead), start(calibration), calibration.PLAIN)
    assert 0.0 <= fitted["layer_overhead"] < 1e-12
    for name in ("bandwidth", "gemm_bandwidth", "flops", "attention_flops"):
        assert fitted[name] == pytest.approx(TRUE[name], rel=1e-6), name
    # ... and timings that an overhead of -0.1 ms a layer would fit exactly fit at 0, never below
    below = points(calibration, free_of_overhead)
    layers = model_shape("smollm2-135m").layers
    for point in below:
        point.measured -= 1e3 * layers * 1e-4
    fitted = calibration.fit(below, start(calibration), calibration.PLAIN)
    assert fitted["layer_overhead"] == 0.0
    assert all(0 < fitted[name] < 1e29 for name in ("bandwidth", "gemm_bandwidth", "flops", "attention_flops"))


def test_the_fit_minimizes_relative_not_absolute_error(calibration):
    # one forward measured twice, at lo and hi ms; only the per-layer overhead free: the least relative squared
    # error predicts (1/lo + 1/hi) / (1/lo^2 + 1/hi^2), below the mean an absolute fit would give
    base = {**TRUE, "layer_overhead": 0.0}
    floor = 1e3 * forward_seconds(model_shape("smollm2-135m"), calibration.device_of(base), 4096, 1)
    lo, hi = 2 * floor, 6 * floor
    twice = points(calibration, base, grid=[(4096, 1), (4096, 1)])
    twice[0].measured, twice[1].measured = lo, hi
    fitted = calibration.fit(twice, base, ["layer_overhead"])
    predicted = twice[0].predicted(fitted)
    assert predicted == pytest.approx((1 / lo + 1 / hi) / (1 / lo**2 + 1 / hi**2), rel=1e-9)
    assert predicted < (lo + hi) / 2 * 0.9


def test_a_fitted_device_reads_back_through_project_devices(calibration, tmp_path):
    fitted = calibration.fit(points(calibration, TRUE), start(calibration), calibration.PLAIN)
    presets = {"devices": calibration.fitted_devices({"synthetic-cpu": {"params": fitted}})}
    path = tmp_path / "devices.json"
    path.write_text(json.dumps(presets))
    dev = device("synthetic-cpu", "float32", load_devices(path))
    model = model_shape("smollm2-135m")
    for cached, rows in GRID:
        assert forward_seconds(model, dev, cached, rows) == pytest.approx(
            forward_seconds(model, calibration.device_of(TRUE), cached, rows), rel=1e-6)


FIT_ZERO = 1e-12  # below every fitted figure's scale (seconds a layer ~1e-4, relative errors ~1e-2)


def same(computed, published, where: str = "") -> list[str]:
    """Where two JSON values differ: numbers beyond float rounding (relative 1e-9, or 1e-12 absolute: a fit's zero
    residual is rounding noise of 1e-16 to 1e-15 whose digits move with the CPU's math library), anything else at
    all."""
    if isinstance(published, dict) and isinstance(computed, dict):
        keys = sorted(set(computed) | set(published))
        return [d for k in keys for d in same(computed.get(k), published.get(k), f"{where}/{k}")]
    if isinstance(published, list) and isinstance(computed, list) and len(published) == len(computed):
        return [d for i, (c, p) in enumerate(zip(computed, published)) for d in same(c, p, f"{where}[{i}]")]
    numbers = (int, float)
    if isinstance(published, numbers) and isinstance(computed, numbers) and not isinstance(published, bool):
        close = computed == pytest.approx(published, rel=1e-9, abs=FIT_ZERO)
        return [] if close else [f"{where}: {computed} != {published}"]
    return [] if computed == published else [f"{where}: {computed!r} != {published!r}"]


def test_the_comparison_takes_rounding_noise_and_catches_a_wrong_fit(calibration, tmp_path):
    """Across CPUs a fit's residuals of an exact point differ in their noise digits (1.1e-15 against 8.9e-16); a fitted
    figure or a point's error off by a millionth of itself, or an error of 1e-11 against none, is a difference."""
    calibration.main(["--out", str(tmp_path)])
    computed = json.loads((tmp_path / "calibration.json").read_text())
    host = next(iter(computed["hosts"]))
    assert not same({"error": 1.1102230246251565e-15}, {"error": 8.881784197001252e-16})
    wrong = json.loads(json.dumps(computed))
    wrong["hosts"][host]["params"]["bandwidth"] *= 1 + 1e-6
    assert [d for d in same(computed, wrong) if d.startswith(f"/hosts/{host}/params/bandwidth")]
    assert same({"error": 0.25}, {"error": 0.25 * (1 + 1e-6)}) and same({"error": 1e-11}, {"error": 0.0})


def test_the_published_calibration_is_what_the_script_computes(calibration, tmp_path):
    """docs/results.md and `hf-triforce project --devices` quote these files: the tree's script must give them."""
    calibration.main(["--out", str(tmp_path)])
    published = ROOT / "docs" / "bench" / "calibration"
    for name in ("calibration.json", "projections.json", "devices.json"):
        differences = same(json.loads((tmp_path / name).read_text()), json.loads((published / name).read_text()))
        assert not differences, (f"{name} differs from what `python benchmarks/project_calibration.py` writes "
                                 f"({len(differences)}: {differences[:3]}): rerun it and update the figures "
                                 "docs/results.md quotes")
    assert (tmp_path / "projections.md").read_text() == (published / "projections.md").read_text()
