"""`TriForceConfig` validation and round trip."""

from __future__ import annotations

import pytest

from hf_triforce import TriForceConfig

from .conftest import make_model


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(draft="tiny"), "draft must be one of"),
        (dict(retrieval_budget=0), "retrieval_budget must be an integer >= 1"),
        (dict(retrieval_budget=-8), "retrieval_budget"),
        (dict(retrieval_budget=100, chunk_size=8), "multiple of chunk_size"),
        (dict(retrieval_budget=8, chunk_size=8), "at least two chunks"),
        (dict(chunk_size=0), "chunk_size"),
        (dict(window=0), "window"),
        (dict(gamma1=0), "gamma1"),
        (dict(gamma2=0), "gamma2"),
        (dict(gamma1=2.5), "gamma1"),
        (dict(sink_tokens=-1), "sink_tokens"),
        (dict(refresh_every=0), "refresh_every"),
        (dict(refresh_below=1.5), "refresh_below"),
        (dict(retrieval_recent=12), "retrieval_recent"),
        (dict(retrieval_budget=64, retrieval_recent=64), "retrieval_recent"),
        (dict(ngram_min=3, ngram_max=2), "ngram_min"),
        (dict(window=4, gamma1=3, gamma2=6), "window must exceed"),
        (dict(prefill_chunk_size=0), "prefill_chunk_size"),
        (dict(show_progress="yes"), "show_progress"),
        (dict(levels=1), "levels must be 2 or 3"),
        (dict(levels=3.0), "levels must be 2 or 3"),
        (dict(refresh_below=True), "refresh_below"),
        (dict(policy="smart"), r"policy must be one of \('auto', 'fixed'\)"),
        (dict(explore_every=0), "explore_every"),
        (dict(draft_precision="fp8"),
         r"draft_precision must be one of \('auto', 'model', 'int8', 'lean', 'lean-int8', 'lean-int4', 'native'\)"),
    ],
)
def test_invalid_values_name_the_parameter(kwargs, match):
    with pytest.raises(ValueError, match=match):
        TriForceConfig(**kwargs)


def test_draft_of_wrong_type():
    with pytest.raises(TypeError, match="draft"):
        TriForceConfig(draft=3)


def test_round_trip():
    config = TriForceConfig(draft="ngram", retrieval_budget=512, chunk_size=16, gamma1=3, refresh_below=0.5)
    assert TriForceConfig.from_dict(config.to_dict()) == config
    with pytest.raises(ValueError, match="Unknown TriForceConfig keys"):
        TriForceConfig.from_dict({"budget": 3})


def test_round_trip_with_draft_model():
    draft = make_model("llama-gqa")
    config = TriForceConfig(draft=draft, retrieval_budget=64)
    data = config.to_dict()
    assert isinstance(data["draft"], str)
    with pytest.raises(ValueError, match="draft_model"):
        TriForceConfig.from_dict(data)
    assert TriForceConfig.from_dict(data, draft_model=draft).draft is draft


def test_default_recent_window_is_a_quarter_in_whole_chunks():
    assert TriForceConfig(retrieval_budget=512, chunk_size=8).recent_tokens == 128
    assert TriForceConfig(retrieval_budget=40, chunk_size=8).recent_tokens == 8
