"""``cache=RowCaches([...])`` (`hf_triforce.caches.row_caches`): a TriForce batch continues from each row's own
prefill, without a left-padded batch cache.

Rows holding different numbers of their prompt's tokens (none, a DynamicCache, a StaticCache) each equal the row
alone, and the rows' caches are only read; what cannot be continued is refused by name.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache, StoppingCriteria, StoppingCriteriaList

from hf_triforce import RowCaches
from hf_triforce.decoding import force3

from .conftest import make_model
from .test_batch import PROMPTS, _config, left_padded


def _prefilled(model, prompt: torch.Tensor, tokens: int, kind: str = "dynamic"):
    cache = DynamicCache(config=model.config) if kind == "dynamic" else StaticCache(config=model.config,
                                                                                      max_cache_len=256)
    with torch.no_grad():
        model(prompt[:, :tokens], cache=cache)
    return cache


@pytest.mark.parametrize("draft,levels", [("self", 3), ("ngram", 2)])
def test_rows_continue_from_their_own_caches(monkeypatch, draft, levels):
    prefilled = []  # tokens of each Force-3 row prefill
    real = force3.prefill_steps
    monkeypatch.setattr(force3, "prefill_steps", lambda model, ids, *args, **kwargs: prefilled.append(ids.shape[1]) or
                        real(model, ids, *args, **kwargs))
    model = make_model("llama-gqa")
    ids, mask = left_padded(PROMPTS)
    rows = [_prefilled(model, PROMPTS[0], 149), None, _prefilled(model, PROMPTS[2], 70, "static")]
    before = [None if row is None else row.layers[0].keys.clone() for row in rows]
    out = model.generate(ids, attention_mask=mask, cache=RowCaches(rows), triforce_config=_config(draft, levels),
                         max_new_tokens=30, do_sample=False, pad_token_id=0, return_dict_in_generate=True)
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out.sequences[row, ids.shape[1]:], alone), row
    for row, keys in zip(rows, before):  # read, not written
        assert row is None or torch.equal(row.layers[0].keys, keys)
    # each row prefilled what its cache does not hold: 1 token after 149, its whole prompt, 50 after 70
    assert prefilled[:3] == [1, 97, 50]


def test_what_cannot_be_continued_is_refused_by_name():
    model = make_model("llama-gqa")
    ids, mask = left_padded(PROMPTS)
    gen = dict(attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0, triforce_config=_config())
    whole = _prefilled(model, PROMPTS[1], PROMPTS[1].shape[1])
    with pytest.raises(ValueError, match="row 1's cache holds 97 tokens; its prompt has 97"):
        model.generate(ids, cache=RowCaches([None, whole, None]), **gen)
    with pytest.raises(ValueError, match="RowCaches of 2 rows; the batch has 3 rows"):
        model.generate(ids, cache=RowCaches([None, None]), **gen)
    batched = DynamicCache(config=model.config)
    with torch.no_grad():
        model(ids[:2, :20], cache=batched)
    with pytest.raises(ValueError, match="row 0's layer 0 .*batch size 1"):
        model.generate(ids, cache=RowCaches([batched, None, None]), **gen)
    with pytest.raises(ValueError, match="continues a batch"):
        model.generate(PROMPTS[0], cache=RowCaches([_prefilled(model, PROMPTS[0], 10)]), max_new_tokens=4,
                       triforce_config=_config())
    with pytest.raises(TypeError, match="row 0 must be a transformers Cache, None or a callable"):
        RowCaches([torch.zeros(1)])


def test_rows_made_in_their_turn_commit_their_first_token_before_the_next_row_prefills():
    """A row given as a callable is made when its row prefills; each row's first token is committed (its stopping
    criteria asked) before the next row's cache is made."""
    model = make_model("llama-gqa")
    ids, mask = left_padded(PROMPTS)
    events: list[str] = []

    def made(b: int, tokens: int):
        def make():
            events.append(f"row {b}")
            return _prefilled(model, PROMPTS[b], tokens) if tokens else None
        return make

    class Asked(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            events.append("token")
            return torch.zeros(input_ids.shape[0], dtype=torch.bool)

    rows = RowCaches([made(0, 120), made(1, 0), made(2, 60)])
    out = model.generate(ids, attention_mask=mask, cache=rows, triforce_config=_config(), max_new_tokens=12,
                         do_sample=False, pad_token_id=0, stopping_criteria=StoppingCriteriaList([Asked()]))
    assert events[:6] == ["row 0", "token", "row 1", "token", "row 2", "token"]
    for row, prompt in enumerate(PROMPTS):
        alone = model.generate(prompt, max_new_tokens=12, do_sample=False)[0, prompt.shape[1]:]
        assert torch.equal(out[row, ids.shape[1]:], alone), row
    whole = RowCaches([made(0, 0), lambda: _prefilled(model, PROMPTS[1], 97), made(2, 0)])
    with pytest.raises(ValueError, match="row 1's cache holds 97 tokens"):
        model.generate(ids, attention_mask=mask, cache=whole, triforce_config=_config(), max_new_tokens=4,
                       pad_token_id=0)
