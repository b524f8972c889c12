"""The GPU check's stages run end to end on the CPU (tiny shapes), so the first lent GPU spends no time on a bug."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gpu_check():
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "benchmarks" / "gpu_check.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_dry_run_every_stage(gpu_check, tmp_path):
    assert gpu_check.main(["--dry-run", "--out", str(tmp_path), "--stages", "tiers,projection,library"]) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert not data["errors"]
    tiers = {(r["tier"], r["context"], r["rows"]) for r in data["tiers"]}
    plan = gpu_check.DRY_PLAN
    for context in plan.contexts:
        assert ("static", context, 1) in tiers and ("select", context, 1) in tiers
        assert {("force3", context, rows) for rows in range(2, plan.gamma2 + 2)} <= tiers
    assert {("force2", 0, rows) for rows in range(1, plan.gamma1 + 2)} <= tiers
    kinds = {p["label"] for p in data["projection"]}
    assert "plain decoding" in kinds and "TriForce, Force 1 = draft" in kinds
    library = {row["config"]: row for row in data["library"]}
    assert set(library) == set(gpu_check.LIBRARY_CONFIGS)
    assert all(row["triforce_identical"] and row["static_identical"] for row in library.values())
    assert set(library["fixed, 3 levels"]["tier_ms"]) == {"force1", "force2", "force3"}
    assert set(library["fixed, 2 levels"]["tier_ms"]) == {"force1", "force3"}
    # off CUDA the fixed plans verify on Force 3's fixed-shape forward (CUDA: its graphs), one plan also eagerly
    assert library["fixed, 3 levels"]["force3_forward"] == library["fixed, 2 levels"]["force3_forward"] == \
        "fixed (native)"
    assert library["fixed, 3 levels, force3 eager"]["force3_forward"] == library["auto"]["force3_forward"] == "eager"
    assert "Tier forwards" in (tmp_path / "gpu_table.md").read_text()


def test_attention_routes_match_sdpa(gpu_check):
    """Every route the check times computes what one unmasked SDPA call computes: the library's split (4 and 7 spans,
    and its own choice) and its masked call."""
    import torch

    torch.manual_seed(0)
    q = torch.randn(1, 2, 6, 32)
    k, v = torch.randn(2, 1, 2, 1000, 32)
    reference = gpu_check.sdpa_attention(q, k, v)
    routes = [gpu_check.split_attention(4), gpu_check.split_attention(7), gpu_check.split_attention(),
              gpu_check.masked_attention]
    for route in routes:
        torch.testing.assert_close(route(q, k, v), reference, atol=1e-5, rtol=1e-5)
    assert {"sdpa", "masked", "split4", "split32"} <= set(gpu_check.attention_routes(8193 + 6, 2, 6))


def test_projection_from_a_measured_run(gpu_check, tmp_path):
    measured = ROOT / "docs" / "bench" / "gpu-h200-tier-costs" / "llama-3.1-8b.json"
    assert gpu_check.main(["--from-json", str(measured), "--stages", "projection", "--out", str(tmp_path),
                           "--accept-draft", "0.8", "--accept-force2", "0.8", "--accept-streaming", "0.8"]) == 0
    rows = json.loads((tmp_path / "gpu_check.json").read_text())["projection"]
    best = {(r["context"], r["label"]): r["speedup"] for r in rows}
    assert best[(32768, "draft on sink+window (2 levels)")] == pytest.approx(1.65, abs=0.01)  # docs/gpu_check.md
