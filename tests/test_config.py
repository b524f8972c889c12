"""`TriForceConfig`: validation, round trip, its three groups of fields, keyword-only construction, and the sizes
the decoder derives from it (`hf_triforce.decoding.sizing`)."""

from __future__ import annotations

import inspect
import re
from dataclasses import fields, replace
from pathlib import Path

import pytest

from hf_triforce import TriForceConfig
from hf_triforce.decoding.sizing import LOOKUP_GAMMA2, force3_rows, lookup_gamma2, proposal_rows, recent_tokens

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
    with pytest.raises(ValueError, match=r"Unknown TriForceConfig keys \['budget'\]; allowed: \[.*'retrieval_budget'"):
        TriForceConfig.from_dict({"budget": 3})


def test_round_trip_with_draft_model():
    draft = make_model("llama-gqa")
    config = TriForceConfig(draft=draft, retrieval_budget=64)
    data = config.to_dict()
    assert isinstance(data["draft"], str)
    with pytest.raises(ValueError, match="draft_model"):
        TriForceConfig.from_dict(data)
    assert TriForceConfig.from_dict(data, draft_model=draft).draft is draft


GROUPS = {"User settings": TriForceConfig.USER_FIELDS, "Tuning": TriForceConfig.TUNING_FIELDS,
          "Experimental": TriForceConfig.EXPERIMENTAL_FIELDS}
# every keyword TriForceConfig takes, each with a valid value (most not the default: trees need levels 3, chains)
KEYWORDS = dict(draft="ngram", levels=2, policy="fixed", gamma1=3, gamma2=5, retrieval_budget=512, window=64,
                draft_precision="lean-int8", tier_compile="fixed", full_cache_device="cpu", loop="assisted",
                show_progress=True, chunk_size=16, retrieval_recent=32, retrieval_dtype="bfloat16", refresh_every=2,
                refresh_below=0.5, sink_tokens=4, draft_positions="slots", ngram_max=4, ngram_min=2,
                prefill_chunk_size=256, explore_every=8, force3_compile="off", tree_nodes=0, tree_branch=3,
                force2_tree_nodes=0)


def test_groups_partition_the_fields_in_declaration_order():
    names = [f.name for f in fields(TriForceConfig)]
    grouped = [name for group in GROUPS.values() for name in group]
    assert sorted(grouped) == sorted(names) and len(set(grouped)) == len(grouped)
    assert grouped == names  # declared group by group, so repr and to_dict read in the same order
    assert len(TriForceConfig.USER_FIELDS) <= 12


def _sections(text: str, heading: str, entry: str) -> dict[str, set[str]]:
    """The field names documented under each group's heading: ``heading``, the regex of a heading line with the
    group's title as its group; ``entry``, that of an entry's start, its field names as its group."""
    parts = re.split(heading, text, flags=re.MULTILINE)
    return {title: set(re.findall(r"[a-z][a-z0-9_]*", " ".join(re.findall(entry, body, flags=re.MULTILINE))))
            for title, body in zip(parts[1::2], parts[2::2])}


def test_the_docstring_and_docs_document_each_group_under_its_heading():
    titles, name = "|".join(GROUPS), "[a-z][a-z0-9_]*"
    expected = {title: set(group) for title, group in GROUPS.items()}
    doc = inspect.cleandoc(TriForceConfig.__doc__)
    assert _sections(doc, rf"^({titles})\n-+$", rf"^({name}(?:, {name})*): ") == expected
    page = (Path(__file__).parent.parent / "docs" / "config.md").read_text().split("## The adaptive policy")[0]
    assert _sections(page, rf"^## ({titles})$", rf"^\| (`{name}`(?:, `{name}`)*) \|") == expected


def test_gamma2_doc_names_the_longer_lookup_chains():
    doc = inspect.cleandoc(TriForceConfig.__doc__)
    gamma2 = doc[doc.index("gamma2: "):doc.index("retrieval_budget: ")]
    assert "max(gamma2, LOOKUP_GAMMA2)" in gamma2 and f"{LOOKUP_GAMMA2} tokens" in gamma2


def test_keyword_only():
    with pytest.raises(TypeError, match="positional argument"):
        TriForceConfig("ngram")
    assert replace(TriForceConfig(), gamma1=3).gamma1 == 3


def test_every_keyword_keeps_its_name_and_value():
    """Each field's keyword is accepted and read back under the same name; repr and to_dict hold every one."""
    config = TriForceConfig(**KEYWORDS)
    assert {name: getattr(config, name) for name in KEYWORDS} == KEYWORDS
    assert config.to_dict() == KEYWORDS
    assert all(f"{name}={value!r}" in repr(config) for name, value in KEYWORDS.items())
    with pytest.raises(TypeError, match="budget"):
        TriForceConfig(budget=512)


def test_derived_sizes_are_not_fields():
    config = TriForceConfig()
    for name in ("force3_rows", "proposal_rows", "lookup_gamma2", "recent_tokens"):
        assert not hasattr(config, name)


@pytest.mark.parametrize(
    "kwargs, lookup, force3, proposal",
    [
        (dict(), 10, 10, 2),  # auto: lookup chains up to 10
        (dict(policy="fixed", gamma2=4), 4, 4, 2),
        (dict(gamma2=12), 12, 12, 2),
        (dict(gamma1=3, tree_nodes=20), 10, 20, 20),
        (dict(policy="fixed", gamma1=1, tree_nodes=5, force2_tree_nodes=30), 6, 30, 5),
    ],
)
def test_sizing(kwargs, lookup, force3, proposal):
    config = TriForceConfig(**kwargs)
    assert (lookup_gamma2(config), force3_rows(config), proposal_rows(config)) == (lookup, force3, proposal)


def test_default_recent_window_is_a_quarter_in_whole_chunks():
    assert recent_tokens(TriForceConfig(retrieval_budget=512, chunk_size=8)) == 128
    assert recent_tokens(TriForceConfig(retrieval_budget=40, chunk_size=8)) == 8
    assert recent_tokens(TriForceConfig(retrieval_budget=4080, chunk_size=48)) == 1008  # 1020 down to 21 chunks
    assert recent_tokens(TriForceConfig(retrieval_budget=512, retrieval_recent=16)) == 16


def test_refresh_every_defaults_by_the_retrieval_budget():
    """``refresh_every=None`` re-selects every 4 Force-3 steps from a 4096-entry budget, every step below; a given
    value is kept."""
    assert TriForceConfig().refresh_interval == 4
    assert TriForceConfig(retrieval_budget=2048).refresh_interval == 1
    assert TriForceConfig(retrieval_budget=512, refresh_every=3).refresh_interval == 3
    assert TriForceConfig(retrieval_budget=8192, refresh_every=1).refresh_interval == 1
    with pytest.raises(ValueError, match="refresh_every"):
        TriForceConfig(refresh_every=0)


@pytest.mark.parametrize("loop", ["triforce", "assisted"])
def test_a_draft_set_after_construction_is_checked_at_use(loop):
    """``config.draft = 'nonsense'`` after construction passes `__post_init__`'s checks: the call that uses the config
    checks it again (`TriForceConfig.validate`), and so does the drafter registry (`spec_of`), with the ValueError
    construction raises, naming ``draft`` and the names it takes, in either loop and when resolved without
    ``generate``."""
    from hf_triforce.decoding.resolved import resolve
    from hf_triforce.drafters.registry import spec_of

    from .conftest import random_prompt

    match = r"TriForceConfig\.draft must be one of \('self', 'ngram', 'suffix'\) or a PreTrainedModel, got 'nonsense'"
    model = make_model("llama-gqa")
    config = TriForceConfig(policy="fixed", retrieval_budget=32, loop=loop)
    config.draft = "nonsense"
    with pytest.raises(ValueError, match=match):
        model.generate(random_prompt(50), triforce_config=config, max_new_tokens=3, do_sample=False)
    with pytest.raises(ValueError, match=match):
        resolve(config, model)
    with pytest.raises(ValueError, match=match):
        spec_of("nonsense")
    with pytest.raises(ValueError, match=match):
        TriForceConfig(draft="nonsense")
