"""`ContinuousBatch`: requests join a decoding batch between steps and leave when they stop, each exactly what it is
alone.

Greedy: every request, whether it starts the batch or joins a row another request left, mid-flight while the other
rows decode, is token-identical to plain ``generate`` of it alone. Sampled: the exact law of a request that joins a
batch mid-flight (enumerated over every path of the batch's random choices with a `ReplaySampler`, the other row
decoding beside it) is its target law alone; a wrong top-level rule is caught there.
"""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, LogitsProcessorList, TopKLogitsWarper

from hf_triforce import ContinuousBatch, TriForceConfig

from .conftest import make_model, random_prompt
from .enumeration_util import enumerate_outcomes
from .test_batch import ENUM_CONFIG, enum_setup  # noqa: F401 (a fixture)
from .test_exact_enumeration import target_law

PROMPTS = [random_prompt(150, period=37, seed=1), random_prompt(97, period=29, seed=2), random_prompt(120, seed=3),
           random_prompt(60, period=11, seed=4)]


def _config(draft="self", levels=3, **kw):
    return TriForceConfig(**{**dict(draft=draft, policy="fixed", levels=levels, retrieval_budget=64, chunk_size=8,
                                    sink_tokens=4, window=24, gamma1=2, gamma2=4), **kw})


def _run(batch: ContinuousBatch, requests: list[tuple[int, torch.Tensor, dict]]) -> tuple[list, list[int]]:
    """Add ``requests[i] = (step, prompt, kwargs)`` before step ``step`` of the batch; returns the requests and, per
    request, how many other requests were decoding when it joined."""
    added, beside, steps = [], [], 0
    with batch:
        while len(added) < len(requests) or not batch.idle:
            for when, prompt, kwargs in requests:
                if when == steps:
                    beside.append(sum(row is not None for row in batch.rows))
                    added.append(batch.add(prompt, **kwargs))
            batch.step()
            steps += 1
            assert steps < 500
    return added, beside


@pytest.mark.parametrize("family,draft,levels", [("llama-gqa", "self", 3), ("qwen2", "self", 2),
                                                 ("llama-gqa", "ngram", 2)])
def test_requests_joining_mid_flight_equal_each_request_alone(family, draft, levels):
    model = make_model(family)
    batch = ContinuousBatch(model, _config(draft, levels), max_rows=2, max_length=200, do_sample=False)
    # two rows: the third request waits for a free row and joins while the second decodes, the fourth after it
    plan = [(0, PROMPTS[0], dict(max_new_tokens=12)), (0, PROMPTS[1], dict(max_new_tokens=40)),
            (1, PROMPTS[2], dict(max_new_tokens=30)), (3, PROMPTS[3], dict(max_new_tokens=25))]
    added, _ = _run(batch, plan)
    for (_, prompt, kwargs), request in zip(plan, added):
        alone = model.generate(prompt, do_sample=False, **kwargs)
        assert torch.equal(request.sequences, alone)
        assert request.stats.new_tokens == kwargs["max_new_tokens"] and request.stats.force3_steps > 0
    assert all(request.row.index in (0, 1) for request in added)


def test_a_request_joins_a_row_while_the_other_row_decodes():
    model = make_model("llama-gqa")
    batch = ContinuousBatch(model, _config(), max_rows=2, max_length=200, do_sample=False)
    joined = []
    with batch:
        long = batch.add(PROMPTS[1], max_new_tokens=60)
        short = batch.add(PROMPTS[0], max_new_tokens=5)
        late = None
        while not batch.idle:
            for request in batch.step():
                if request is short:
                    late = batch.add(PROMPTS[2], max_new_tokens=20)
                    joined.append(len(long.new_tokens))
    assert late is not None and late.done and long.done
    assert 0 < joined[0] < 60  # the long request was mid-decode when the late one took the short one's row
    for request, prompt, new in ((long, PROMPTS[1], 60), (late, PROMPTS[2], 20)):
        assert torch.equal(request.sequences, model.generate(prompt, max_new_tokens=new, do_sample=False))


def test_a_request_continues_from_its_cache():
    model = make_model("llama-gqa")
    prompt = PROMPTS[0]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(prompt[:, :100], past_key_values=cache, use_cache=True)
    batch = ContinuousBatch(model, _config(), max_rows=2, max_length=200, do_sample=False)
    (request,), _ = _run(batch, [(0, prompt, dict(max_new_tokens=20, cache=cache))])
    assert torch.equal(request.sequences, model.generate(prompt, max_new_tokens=20, do_sample=False))
    assert cache.get_seq_length() == 100  # only read


def test_stop_strings_and_eos_stop_each_request_on_its_own():
    model = make_model("llama-gqa")
    alone = model.generate(PROMPTS[1], max_new_tokens=30, do_sample=False)[0, PROMPTS[1].shape[1]:]
    eos = int(alone[7])
    batch = ContinuousBatch(model, _config(), max_rows=2, max_length=200, do_sample=False)
    added, _ = _run(batch, [(0, PROMPTS[0], dict(max_new_tokens=30)),
                            (0, PROMPTS[1], dict(max_new_tokens=30, eos_token_id=eos))])
    assert added[0].stats.new_tokens == 30
    stop = alone.tolist().index(eos) + 1
    assert added[1].new_tokens == alone[:stop].tolist()


def test_refusals_name_the_parameter():
    model = make_model("llama-gqa")
    with pytest.raises(ValueError, match="max_rows"):
        ContinuousBatch(model, _config(), max_rows=1, max_length=200)
    with pytest.raises(ValueError, match="max_length"):
        ContinuousBatch(model, _config(), max_rows=2, max_length=0)
    with pytest.raises(ValueError, match="tree_nodes"):
        ContinuousBatch(model, _config(tree_nodes=4), max_rows=2, max_length=200)
    batch = ContinuousBatch(model, _config(), max_rows=2, max_length=200, do_sample=False)
    with pytest.raises(ValueError, match="max_length=200"):
        batch.add(PROMPTS[0], max_new_tokens=60)
    with pytest.raises(ValueError, match="do_sample"):
        batch.add(PROMPTS[0], max_new_tokens=5, do_sample=True)
    with pytest.raises(ValueError, match=r"\[1, n\]"):
        batch.add(torch.cat((PROMPTS[0], PROMPTS[0])), max_new_tokens=5)
    with pytest.raises(RuntimeError, match="with batch"):
        batch.step()


NEW = 5  # a joining request's tokens: room for chains of 2 after its first token


def joining_law(model, prompts, config, processors, mutate=None):
    """The exact law of ``prompts[1]``'s ``NEW`` tokens under ``processors``, joining a two-row batch in the row
    ``prompts[0]`` (2 tokens) leaves while ``prompts[2]`` decodes in the other row, over every path of the batch's
    random choices. The other requests draw from top-k 1 (one path each): the enumeration branches on the joining
    request's choices only."""
    stats, one = [], LogitsProcessorList([TopKLogitsWarper(1)])

    def run(sampler):
        batch = ContinuousBatch(model, config, max_rows=2, max_length=80, sampler=sampler, do_sample=True)
        if mutate is not None:
            mutate(batch.decoder)
        with batch:
            batch.add(prompts[0], max_new_tokens=2, logits_processor=one)
            beside = batch.add(prompts[2], max_new_tokens=NEW + 6, logits_processor=one)
            joining = None
            while not batch.idle:
                stopped = batch.step()
                if joining is None and stopped:
                    assert not beside.done  # it decodes while the joining request does
                    joining = batch.add(prompts[1], max_new_tokens=NEW, logits_processor=processors)
        stats.append(joining.stats)
        return tuple(joining.new_tokens)

    law, paths = enumerate_outcomes(run, max_paths=20000)
    return law, paths, stats


@pytest.fixture(scope="module")
def joining_setup(enum_setup):  # noqa: F811
    model, prompts = enum_setup
    return model, [prompts[0], prompts[1], random_prompt(33, vocab_size=4, seed=9)]


def test_enumerated_law_of_a_joining_request_is_its_target_law(joining_setup):
    model, prompts = joining_setup
    processors = LogitsProcessorList([TopKLogitsWarper(2)])
    config = TriForceConfig(draft="self", levels=3, **ENUM_CONFIG)
    law, paths, stats = joining_law(model, prompts, config, processors)
    exact = target_law(model, prompts[1], processors, NEW)
    assert abs(sum(law.values()) - 1.0) < 1e-6 and set(law) == {k for k, p in exact.items() if p > 0}
    assert any(0 < s.force3_accepted < s.force3_proposed for s in stats)  # rejections: the rule is exercised
    assert max(abs(law.get(k, 0.0) - exact[k]) for k in exact) < 1e-5


def test_a_wrong_top_level_rule_is_caught_on_a_joining_request(joining_setup):
    model, prompts = joining_setup
    processors = LogitsProcessorList([TopKLogitsWarper(2)])
    config = TriForceConfig(draft="self", levels=3, **ENUM_CONFIG)

    def top_resamples_from_p(decoder):
        decoder.force3_verifier.resample = lambda target, proposal: target

    law, _, _ = joining_law(model, prompts, config, processors, mutate=top_resamples_from_p)
    exact = target_law(model, prompts[1], processors, NEW)
    assert max(abs(law.get(k, 0.0) - exact[k]) for k in exact) > 1e-3


def test_a_joining_prefill_runs_one_chunk_per_step_while_a_row_decodes(monkeypatch):
    """A 150-token prompt joins while a row decodes: its prefill runs one chunk (``prefill_chunk_size``) per step, the
    other row stepping between its chunks, and both requests equal each alone."""
    from hf_triforce.decoding import force3

    model = make_model("llama-gqa")
    events = []
    real = force3.prefill_steps

    def traced(*args, **kwargs):
        steps = real(*args, **kwargs)
        while True:
            try:
                events.append(next(steps))
            except StopIteration as done:
                return done.value
            yield events[-1]

    monkeypatch.setattr(force3, "prefill_steps", traced)
    batch = ContinuousBatch(model, _config(prefill_chunk_size=32), max_rows=2, max_length=200, do_sample=False)
    real_step = batch.decoder.step
    batch.decoder.step = lambda active: events.append(f"step {len(active)}") or real_step(active)
    with batch:
        first = batch.add(PROMPTS[3], max_new_tokens=60)
        batch.step()
        joining = batch.add(PROMPTS[0], max_new_tokens=10)
        while not batch.idle:
            batch.step()
    chunks = [(i, event) for i, event in enumerate(events) if isinstance(event, int)]
    joined = [i for i, _ in chunks if i > events.index("step 1")]
    assert [events[i] for i in joined] == [32, 32, 32, 32, 22]  # the joining prompt's 150 tokens, chunk by chunk
    assert all(events[i + 1] == "step 1" for i in joined[:-1])  # the decoding row stepped after each chunk
    for request, prompt, new in ((first, PROMPTS[3], 60), (joining, PROMPTS[0], 10)):
        assert torch.equal(request.sequences, model.generate(prompt, max_new_tokens=new, do_sample=False))
