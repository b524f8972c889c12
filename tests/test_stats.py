"""`TriForceStats`: the figures a user reads at the top level (at most 15 fields), everything else in its
`TriForceDetail`, which `to_dict` nests under ``"detail"`` and ``repr`` leaves out; a batch's rows summed level by
level; both drivers end a row's statistics the same way (`Hierarchy.finish_row`)."""

from __future__ import annotations

import json
from dataclasses import fields

import pytest

from hf_triforce import TriForceConfig, TriForceDetail, TriForceStats
from hf_triforce.decoding.report import aggregate

from .conftest import make_model, random_prompt

PROPERTIES = ("force2_acceptance", "force3_acceptance", "force2_position_acceptance", "force3_position_acceptance",
              "tokens_per_force3_step")


def test_the_top_level_holds_at_most_15_fields_and_the_detail():
    names = [f.name for f in fields(TriForceStats)]
    assert len(names) <= 15, names
    assert isinstance(TriForceStats().detail, TriForceDetail)
    assert not set(names) & {f.name for f in fields(TriForceDetail)}  # each figure in one place


def test_to_dict_nests_the_detail_and_repr_shows_the_top_level_only():
    stats = TriForceStats(force3_proposed=4, force3_accepted=3, force3_steps=2, force3_tokens=5)
    stats.detail.tier_forwards = {"force3": "eager"}
    stats.detail.force1_proposed = 7
    out = stats.to_dict()
    top = [f.name for f in fields(TriForceStats) if f.name != "detail"]
    assert list(out) == [*top, *PROPERTIES, "detail"]
    assert out["detail"] == {f.name: getattr(stats.detail, f.name) for f in fields(TriForceDetail)}
    assert out["detail"]["force1_proposed"] == 7 and out["force3_acceptance"] == 0.75
    assert out["tokens_per_force3_step"] == 2.5
    json.dumps(out)  # JSON-ready: what serving returns
    shown = repr(stats)
    assert "force3_proposed=4" in shown and "detail" not in shown and "tier_forwards" not in shown
    assert str(stats) == shown


def test_setting_a_figure_the_stats_do_not_hold_raises():
    with pytest.raises(AttributeError):
        TriForceStats().tier_forwards = {}  # a detail's field, not the top level's


def test_a_batch_sums_its_rows_detail_too():
    rows = [TriForceStats(force3_steps=3, force2_seconds=1.0), TriForceStats(force3_steps=5, force2_seconds=2.0)]
    rows[0].detail.force1_proposed, rows[1].detail.force1_proposed = 4, 6
    rows[1].detail.force2_sees_whole_cache = True
    for row in rows:
        row.detail.draft_precision, row.detail.linear_bypassed = "model", {"autocast": 2}
    total = aggregate(rows, force3_seconds=0.5, prefill_seconds=0.25)
    assert (total.force3_steps, total.force2_seconds, total.force3_seconds) == (5, 3.0, 0.5)
    assert total.detail.force1_proposed == 10 and total.detail.force2_sees_whole_cache
    assert total.detail.draft_precision == "model" and total.detail.linear_bypassed == {"autocast": 4}


@pytest.mark.parametrize("extra", [{}, {"draft": "ngram", "levels": 2}], ids=["self, three levels", "ngram, two"])
def test_both_drivers_describe_a_call_alike(extra):
    """The library's loop and transformers' assisted loop end each row through one function: the same call (fixed
    plan, greedy) is described alike, down to what its plans could draft with (``"none"`` for a lookup drafter
    verified by Force 3 alone)."""
    model, prompt = make_model("llama-gqa"), random_prompt(150, period=37)
    base = {"draft": "self", "policy": "fixed", "retrieval_budget": 64, "chunk_size": 8, "sink_tokens": 4,
            "window": 24, "gamma1": 2, "gamma2": 4, "draft_precision": "model", **extra}
    details = {}
    for loop in ("triforce", "assisted"):
        out = model.generate(prompt, max_new_tokens=30, do_sample=False, return_dict_in_generate=True,
                             triforce_config=TriForceConfig(**{**base, "loop": loop}))
        assert out.triforce_stats.new_tokens == 30
        details[loop] = out.triforce_stats.detail
    described = ("draft_precision", "tier_forwards", "draft_caches", "retrieval_dtype", "force2_sees_whole_cache",
                 "full_cache_bytes", "retrieval_cache_bytes", "draft_cache_bytes", "retrieval_summary_bytes",
                 "device_resident_bytes")
    mine, theirs = details["triforce"], details["assisted"]
    assert {name: getattr(theirs, name) for name in described} == {name: getattr(mine, name) for name in described}
    assert mine.draft_precision == ("none" if extra else "model")
    assert mine.full_cache_bytes > 0 and mine.device_resident_bytes >= mine.full_cache_bytes
