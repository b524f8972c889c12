"""Exactness at the edges: what plain `generate` does with stops, padding, stateful processors, stop strings.

Each test here reproduces a bug an outside review found in the loop.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import GenerationConfig, SynthIDTextWatermarkingConfig, WatermarkingConfig
from transformers.generation.streamers import BaseStreamer

from hf_triforce import TriForceConfig

from .conftest import make_model, random_prompt
from .families import make_family
from .tokenizer_util import word_tokenizer

# fixed plans, so that multi-token verification and stops inside accepted runs really happen; AUTO checks
# the adaptive policy on the same cases
CFG = TriForceConfig(draft="self", retrieval_budget=32, chunk_size=8, sink_tokens=4, window=24, gamma1=2, gamma2=4,
                     policy="fixed")
NGRAM = TriForceConfig(draft="ngram", retrieval_budget=32, chunk_size=8, sink_tokens=4, window=24, gamma1=3,
                       gamma2=6, policy="fixed")
AUTO = TriForceConfig(draft="self", retrieval_budget=32, chunk_size=8, sink_tokens=4, window=24, gamma1=2, gamma2=4,
                      explore_every=2)
PAD = 5


def padded(prompt, pad=PAD, pad_id=0):
    ids = torch.cat((torch.full((1, pad), pad_id, dtype=torch.long), prompt), dim=1)
    mask = torch.cat((torch.zeros(1, pad, dtype=torch.long), torch.ones_like(prompt)), dim=1)
    return ids, mask


def test_returned_cache_holds_exactly_the_committed_sequence_after_a_stop(model, prompt):
    """A stop inside an accepted run: the cache must hold n - 1 entries, so a next turn continues exactly."""
    free = model.generate(prompt, max_new_tokens=40, do_sample=False)[0, prompt.shape[1]:].tolist()
    checked = 0
    for config in (CFG, NGRAM, AUTO):
        for stop_at in range(3, 30):
            eos = free[stop_at]
            if eos in free[:stop_at]:
                continue
            out = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=eos,
                                 triforce_config=config, return_dict_in_generate=True)
            n = out.sequences.shape[1]
            assert out.cache.get_seq_length() == n - 1, (stop_at, out.cache.get_seq_length(), n)
            checked += 1
    assert checked >= 15
    # continuing from the returned cache gives what plain generate gives on the whole conversation
    out = model.generate(prompt, max_new_tokens=40, do_sample=False, eos_token_id=free[17], triforce_config=NGRAM,
                         return_dict_in_generate=True)
    turn = torch.cat((out.sequences, random_prompt(9, seed=5)), dim=1)
    expected = model.generate(turn, max_new_tokens=20, do_sample=False)
    again = model.generate(turn, max_new_tokens=20, do_sample=False, cache=out.cache, triforce_config=NGRAM)
    assert torch.equal(again, expected)


@pytest.mark.parametrize("family, offloaded", [("llama", False), ("llama", True), ("qwen2-hybrid", False)])
def test_conversations_continue_from_the_returned_cache_under_plain_generate(family, offloaded):
    """Each turn's prompt (the conversation so far plus a new message) outgrows the cache the last call returned:
    plain generate continuing from it (it grows) and TriForce continuing from what plain generate left give what
    plain generate gives on the whole conversation."""
    model = make_family(family)
    config = replace(CFG, full_cache_device="cpu" if offloaded else None)
    sequences, cache = random_prompt(60, period=13), None
    for turn, (triforce, new) in enumerate([(True, 12), (False, 16), (True, 10)]):
        conversation = torch.cat((sequences, random_prompt(20 + 10 * turn, seed=turn)), dim=1) if turn else sequences
        expected = model.generate(conversation, max_new_tokens=new, do_sample=False)
        out = model.generate(conversation, max_new_tokens=new, do_sample=False, cache=cache,
                             triforce_config=config if triforce else None, return_dict_in_generate=True)
        assert torch.equal(out.sequences, expected), turn
        sequences, cache = out.sequences, out.cache
        assert cache.get_seq_length() == sequences.shape[1] - 1


@pytest.mark.parametrize("pad", [0, PAD])
@pytest.mark.parametrize(
    "gen",
    [
        dict(min_new_tokens=6),
        dict(min_length=100 + PAD + 8),
        dict(repetition_penalty=1.8),
        dict(forced_eos_token_id=7, max_new_tokens=12),
        dict(begin_suppress_tokens=[3, 5, 60]),
        dict(no_repeat_ngram_size=2),
        dict(exponential_decay_length_penalty=(4, 3.0)),
        dict(sequence_bias={(40,): 4.0, (41, 42): -3.0}),
        dict(suppress_tokens=[1, 2, 3]),
        dict(bad_words_ids=[[40], [41, 42]]),
        dict(renormalize_logits=True, repetition_penalty=1.3),
        dict(watermarking_config=WatermarkingConfig(greenlist_ratio=0.25, bias=3.0, context_width=1)),
    ],
    ids=lambda g: ",".join(k for k in g if k != "max_new_tokens"),
)
def test_length_and_padding_aware_processors_match_plain_generate(model, prompt, gen, pad):
    ids, mask = padded(prompt, pad) if pad else (prompt, torch.ones_like(prompt))
    free = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    gen = {"max_new_tokens": 30, "do_sample": False, "eos_token_id": free[2], "attention_mask": mask, **gen}
    expected = model.generate(ids, **gen)
    for config in (CFG, NGRAM, AUTO):
        out = model.generate(ids, triforce_config=config, **gen)
        assert torch.equal(out, expected), (config.draft, out[0, ids.shape[1]:], expected[0, ids.shape[1]:])


def test_repetition_penalty_counts_the_same_prompt_tokens_with_left_padding(model):
    """generate ignores the padding positions (``prompt_ignore_length``); stripping the padding before the
    processor sees the ids would leave the first real prompt tokens unpenalised."""
    prompt = random_prompt(60, seed=2)
    ids, mask = padded(prompt)
    gen = dict(max_new_tokens=30, do_sample=False, repetition_penalty=3.0, attention_mask=mask)
    assert torch.equal(model.generate(ids, triforce_config=CFG, **gen), model.generate(ids, **gen))


def test_max_time_stops_generation(model, prompt):
    out = model.generate(prompt, max_new_tokens=1900, max_time=0.3, do_sample=False, triforce_config=CFG,
                         return_dict_in_generate=True)
    assert out.sequences.shape[1] < prompt.shape[1] + 1900


@pytest.mark.parametrize(
    "gen, name",
    [
        (dict(guidance_scale=1.5), "guidance_scale"),
        (dict(watermarking_config=SynthIDTextWatermarkingConfig(ngram_len=2, keys=[1, 2, 3], sampling_table_size=2**8),
              do_sample=True), "SynthID"),
    ],
)
def test_stateful_processors_are_refused_clearly(model, prompt, gen, name):
    with pytest.raises(ValueError, match=name):
        model.generate(prompt, max_new_tokens=5, triforce_config=CFG, **gen)


def test_stop_strings_from_a_generation_config(model, prompt):
    tokenizer = word_tokenizer()
    free = model.generate(prompt, max_new_tokens=30, do_sample=False)[0, prompt.shape[1]:].tolist()
    config = GenerationConfig(max_new_tokens=30, do_sample=False, stop_strings=[f"t{free[11]}"])
    expected = model.generate(prompt, generation_config=config, tokenizer=tokenizer)
    out = model.generate(prompt, generation_config=config, tokenizer=tokenizer, triforce_config=CFG)
    assert torch.equal(out, expected) and out.shape[1] < prompt.shape[1] + 30
    assert config.stop_strings == [f"t{free[11]}"], "the caller's generation config must not be modified"


class Collect(BaseStreamer):
    def __init__(self):
        self.chunks = []

    def put(self, value):
        self.chunks.append(value.reshape(-1).tolist())

    def end(self):
        pass


def test_streamer_receives_what_plain_generate_sends(model, prompt):
    ids, mask = padded(prompt)
    plain, mine = Collect(), Collect()
    expected = model.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False, streamer=plain)
    out = model.generate(ids, attention_mask=mask, max_new_tokens=15, do_sample=False, streamer=mine,
                         triforce_config=CFG)
    assert torch.equal(out, expected)
    assert mine.chunks[0] == plain.chunks[0] == ids[0].tolist()
    assert sum(mine.chunks[1:], []) == sum(plain.chunks[1:], [])


def test_int8_eligibility_is_checked_before_the_prefill(prompt):
    """draft_precision='int8' on a bf16 model fails at once, even when the policy might never draft."""
    model = make_model("llama-gqa").to(torch.bfloat16)
    config = TriForceConfig(draft="ngram", draft_precision="int8", retrieval_budget=32, chunk_size=8)
    with pytest.raises(ValueError, match="draft_precision='int8' quantizes an fp32 model"):
        model.generate(prompt, max_new_tokens=4, triforce_config=config)


# sliding-window layers are supported (tests/test_hybrid.py); other layer types are refused by name
@pytest.mark.parametrize("family, extra, name", [
    ("llama-gqa", dict(attention_chunk_size=64), r"\['chunked_attention'\] layers"),
])
def test_layers_that_are_not_full_or_sliding_attention_are_refused(prompt, family, extra, name):
    model = make_model(family, **extra)
    with pytest.raises(ValueError, match=name):
        model.generate(prompt, max_new_tokens=4, triforce_config=CFG)


@pytest.mark.parametrize("given", ["filled", "empty", "batch", "assisted", "cache_implementation"])
def test_a_quantized_cache_is_refused_naming_cache_and_the_caches_taken(model, prompt, given):
    """A `QuantizedCache` keeps its entries quantized (its layers' ``keys`` hold the unquantized residual only):
    plain ``generate`` decodes on it, so TriForce on an unquantized copy would not be its output. Refused before any
    forward, filled or empty, batched, in either loop, or made by ``cache_implementation='quantized'``, with an error
    naming ``cache=`` and the caches TriForce takes."""
    from transformers import QuantizedCache

    ids = torch.cat((prompt, prompt.flip(1))) if given == "batch" else prompt
    gen = dict(max_new_tokens=4, do_sample=False)
    if given == "cache_implementation":
        gen.update(cache_implementation="quantized", cache_config={"backend": "fp8"})
    else:
        cache = QuantizedCache("fp8", model.config)
        if given != "empty":
            with torch.no_grad():
                model(ids[:, :60], cache=cache)
        gen["cache"] = cache
    config = replace(CFG, loop="assisted") if given == "assisted" else CFG
    message = r"cache=: layer 0 is a Fp8QuantizedLayer .*TriForce takes a DynamicCache or StaticCache"
    with pytest.raises(ValueError, match=message):
        model.generate(ids, triforce_config=config, **gen)
    if "cache" in gen:
        assert gen["cache"].get_seq_length() == (0 if given == "empty" else 60)  # refused before any forward
