"""benchmarks/seed_table.py: the YaRN factor per context and the merged tables, on recorded results."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def seed_table():
    spec = importlib.util.spec_from_file_location("seed_table", ROOT / "benchmarks" / "seed_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rope_factor_is_the_smallest_power_of_two_that_holds_the_sequence(seed_table):
    assert seed_table.rope_factor(8000, 64, 8192) is None  # 8080 of 8192 positions
    assert seed_table.rope_factor(8150, 64, 8192) == 2
    assert seed_table.rope_factor(32000, 64, 8192) == 4
    assert seed_table.rope_factor(64000, 64, 8192) == 8
    assert seed_table.rope_factor(32000, 64, 32768) is None
    assert seed_table.rope_factor(64000, 64, 32768) == 2


def _stats(force1, prefill, force3_steps, proposed, tokens):
    return dict(force1_seconds=force1, force2_seconds=0.0, force3_seconds=1.0, new_tokens=tokens,
                force3_steps=force3_steps, force3_proposed=proposed, force2_acceptance=0.0, force3_acceptance=0.5,
                tokens_per_force3_step=tokens / force3_steps, plan_steps={"2": force3_steps},
                detail=dict(draft_prefill_seconds=prefill, retrieval_seconds=0.0))


def _method(speed, ids, stats=None):
    return {"decode_tokens_per_second": speed, "new_token_ids": ids, "stats": stats}


def test_tables_give_ratios_to_the_best_plain_decoding_and_tier_seconds_without_the_draft_prefill(seed_table):
    results = [{"context": 64000, "sampling": None, "best_plain": "static", "rope_factor": 2, "identical": True,
                "methods": {"static": _method(2.0, [1, 2]),
                            "vanilla": _method(3.0, [1, 2], _stats(5.0, 4.0, 4, 16, 10))}}]
    table = seed_table.summary(results)
    assert "| 64000 (YaRN 2) | greedy | 2.00 | 1.00x | 1.50x | yes |" in table
    # Force 1's seconds per token leave out the draft's pass over the prompt: (5 - 4) / 10
    assert "| 64000 | greedy | vanilla | 3.00 | 1.50x | 0.100 / 0.000 / 0.100 / 0.000 | 0.00 | 0.50 | 4.00 / 2.50 " \
           "| 0/4/0 |" in seed_table.breakdown(results)


def test_the_breakdown_gives_each_levels_acceptance_per_position_where_counted(seed_table):
    stats = _stats(1.0, 0.0, 4, 16, 10)
    results = [{"context": 8000, "sampling": None, "best_plain": "static", "identical": True,
                "methods": {"static": _method(2.0, [1, 2]),
                            "default": _method(3.0, [1, 2], {**stats, "force2_position_acceptance": 0.75,
                                                             "force3_position_acceptance": 0.8})}}]
    assert "| 0.00 (0.75) | 0.50 (0.80) | 4.00 / 2.50 |" in seed_table.breakdown(results)
    results[0]["methods"]["default"]["stats"] = stats  # statistics without per-position acceptance
    assert "| 0.00 | 0.50 | 4.00 / 2.50 |" in seed_table.breakdown(results)
