"""transformers conventions through `generate(triforce_config=...)`, the pipeline and `custom_generate=`."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import DynamicCache, StoppingCriteria, StoppingCriteriaList, pipeline
from transformers.generation.streamers import BaseStreamer

from hf_triforce import TriForceConfig, TriForceGenerateOutput, triforce_generate

from .conftest import make_model, random_prompt
from .tokenizer_util import text_of, word_tokenizer

CFG = TriForceConfig(draft="self", policy="fixed", retrieval_budget=32, chunk_size=8, sink_tokens=4,
                     window=24, gamma1=2, gamma2=4)


def both(model, prompt, **gen):
    gen = {"max_new_tokens": 30, "do_sample": False, **gen}
    return model.generate(prompt, **gen), model.generate(prompt, triforce_config=CFG, **gen)


def test_eos_int_and_list_stop_exactly_where_plain_generate_stops(model, prompt):
    free = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    eos = free[12]
    expected, out = both(model, prompt, eos_token_id=eos)
    assert torch.equal(out, expected) and out[0, -1] == eos and out.shape[1] <= prompt.shape[1] + 13
    expected, out = both(model, prompt, eos_token_id=[free[20], free[9]])
    assert torch.equal(out, expected) and out.shape[1] <= prompt.shape[1] + 10


def test_stop_strings(model, prompt):
    tokenizer = word_tokenizer()
    free = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    stop = f"t{free[15]}"
    expected, out = both(model, prompt, stop_strings=[stop], tokenizer=tokenizer)
    assert torch.equal(out, expected) and out.shape[1] < prompt.shape[1] + 30


class StopAfterToken(StoppingCriteria):
    def __init__(self, token):
        self.token = token

    def __call__(self, input_ids, scores, **kwargs):
        return input_ids[:, -1] == self.token


def test_custom_stopping_criteria(model, prompt):
    free = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    criteria = StoppingCriteriaList([StopAfterToken(free[7])])
    expected, out = both(model, prompt, stopping_criteria=criteria)
    assert torch.equal(out, expected) and out.shape[1] < prompt.shape[1] + 30


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks, self.ended = [], False

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        self.ended = True


def test_streamer_gets_prompt_then_each_accepted_token(model, prompt):
    streamer = Collect()
    out = model.generate(prompt, max_new_tokens=20, do_sample=False, triforce_config=CFG, streamer=streamer)
    assert streamer.chunks[0] == prompt[0].tolist()
    assert [c for chunk in streamer.chunks[1:] for c in chunk] == out[0, prompt.shape[1]:].tolist()
    assert all(len(chunk) == 1 for chunk in streamer.chunks[1:]) and streamer.ended


def test_left_padded_attention_mask(model, prompt):
    padded = torch.cat((torch.zeros(1, 3, dtype=torch.long), prompt), dim=1)
    mask = torch.cat((torch.zeros(1, 3, dtype=torch.long), torch.ones_like(prompt)), dim=1)
    expected, out = both(model, padded, attention_mask=mask)
    assert torch.equal(out, expected)
    with pytest.raises(ValueError, match="left padding"):
        model.generate(prompt, attention_mask=torch.ones_like(prompt).index_fill(1, torch.tensor([50]), 0),
                       triforce_config=CFG, max_new_tokens=3)


def test_prefilled_cache_prefix_is_used_and_not_modified(model, prompt):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :80], cache=cache)
    expected = model.generate(prompt, cache=copy.deepcopy(cache), max_new_tokens=25, do_sample=False)
    out = model.generate(prompt, cache=cache, max_new_tokens=25, do_sample=False, triforce_config=CFG)
    assert torch.equal(out, expected)
    assert cache.get_seq_length() == 80
    with pytest.raises(ValueError, match="at least one token"):
        model.generate(prompt[:, :80], cache=cache, max_new_tokens=3, triforce_config=CFG)


def test_return_dict_scores_and_stats(model, prompt):
    gen = dict(max_new_tokens=12, do_sample=False, return_dict_in_generate=True, output_scores=True,
               output_logits=True)
    expected = model.generate(prompt, **gen)
    out = model.generate(prompt, triforce_config=CFG, **gen)
    assert isinstance(out, TriForceGenerateOutput) and torch.equal(out.sequences, expected.sequences)
    assert len(out.scores) == len(expected.scores) == 12 and len(out.logits) == 12
    for mine, theirs in zip(out.scores, expected.scores):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    stats = out.triforce_stats.to_dict()
    for key in ("force2_acceptance", "force3_acceptance", "tokens_per_force3_step", "force1_seconds",
                "force2_seconds", "force3_seconds", "prefill_seconds"):
        assert key in stats
    assert 0 <= stats["force2_acceptance"] <= 1 and 0 <= stats["force3_acceptance"] <= 1
    assert stats["new_tokens"] == 12


def test_custom_generate_route_and_max_length(model, prompt):
    expected = model.generate(prompt, max_length=prompt.shape[1] + 15, do_sample=False)
    out = model.generate(prompt, max_length=prompt.shape[1] + 15, do_sample=False,
                         custom_generate=triforce_generate, triforce_config=CFG)
    assert torch.equal(out, expected)


def test_pipeline(model):
    tokenizer = word_tokenizer()
    text = text_of(random_prompt(60, period=17)[0].tolist())
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    plain = generator(text, max_new_tokens=12, do_sample=False)
    mine = generator(text, max_new_tokens=12, do_sample=False, triforce_config=CFG)
    assert mine == plain


@pytest.mark.parametrize("new", [1, 2])
def test_tiny_requests(model, new):
    for length in (1, 2, 50):
        p = random_prompt(length)
        expected, out = both(model, p, max_new_tokens=new)
        assert torch.equal(out, expected)


def test_sampling_is_reproducible_with_a_seed(model, prompt):
    runs = []
    for _ in range(2):
        torch.manual_seed(42)
        runs.append(model.generate(prompt, max_new_tokens=20, do_sample=True, top_k=10, triforce_config=CFG))
    assert torch.equal(*runs)


def test_bad_requests_fail_early_with_clear_errors(model, prompt):
    with pytest.raises(ValueError, match="tree_nodes=0"):  # batches: tests/test_batch.py
        model.generate(prompt.repeat(2, 1), max_new_tokens=3,
                       triforce_config=TriForceConfig(retrieval_budget=32, policy="fixed", tree_nodes=8))
    with pytest.raises(ValueError, match="num_beams"):
        model.generate(prompt, max_new_tokens=3, num_beams=2, triforce_config=CFG)
    with pytest.raises(TypeError, match="TriForceConfig"):
        model.generate(prompt, max_new_tokens=3, triforce_config={"draft": "self"})
    with pytest.raises(ValueError, match="max_position_embeddings"):
        model.generate(random_prompt(2040), max_new_tokens=20, triforce_config=CFG)
    with pytest.raises(ValueError, match="vocabulary"):
        other = make_model("llama-gqa", vocab_size=50)
        model.generate(prompt, max_new_tokens=3, triforce_config=TriForceConfig(draft=other, retrieval_budget=32))
    with pytest.raises(ValueError, match="use_cache"):
        model.generate(prompt, max_new_tokens=3, use_cache=False, triforce_config=CFG)
    with pytest.raises(ValueError, match="output_attentions"):
        model.generate(prompt, max_new_tokens=3, output_attentions=True, return_dict_in_generate=True,
                       triforce_config=CFG)


class Boom(StoppingCriteria):
    def __call__(self, input_ids, scores, **kwargs):
        raise KeyboardInterrupt


def test_no_state_leaks_between_calls_or_after_an_interrupt(model, prompt):
    reference = model.generate(prompt, max_new_tokens=20, do_sample=False, triforce_config=CFG)
    with pytest.raises(KeyboardInterrupt):
        model.generate(prompt, max_new_tokens=20, triforce_config=CFG, stopping_criteria=StoppingCriteriaList([Boom()]))
    assert model.config._attn_implementation == "sdpa"
    ngram = TriForceConfig(draft="ngram", retrieval_budget=16, chunk_size=8)
    for _ in range(3):
        other = model.generate(random_prompt(70, seed=9), max_new_tokens=10, do_sample=False, triforce_config=ngram)
        assert torch.equal(other, model.generate(random_prompt(70, seed=9), max_new_tokens=10, do_sample=False))
        assert torch.equal(model.generate(prompt, max_new_tokens=20, do_sample=False, triforce_config=CFG), reference)
