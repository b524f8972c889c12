"""`Scheduler` and `Engine.run_batch` in one process: concurrent requests decode as one batch, each row answered as
the same request alone (greedy, TriForce), on its own ``max_tokens`` and stop strings, the moment it stops; a
cancelled row leaves the others decoding; a batch ``generate`` refuses runs its requests one by one, each told why."""

import threading
import time

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.serving import Engine, Job, PrefixStore
from hf_triforce.serving.engine import Cancelled
from hf_triforce.serving.joining import JoiningBatch
from hf_triforce.serving.scheduler import Scheduler

from .conftest import make_model, random_prompt
from .tokenizer_util import word_tokenizer

CONFIG = TriForceConfig(retrieval_budget=64, chunk_size=8, window=32)


@pytest.fixture(scope="module")
def sharp_model():
    return make_model("llama-gqa", logit_scale=4.0)


def _questions() -> list[torch.Tensor]:
    """Two questions on one document, two on documents of their own (ragged lengths)."""
    document = random_prompt(260, period=23)
    return [torch.cat([document, random_prompt(9, seed=5)], dim=1),
            torch.cat([document, random_prompt(6, seed=6)], dim=1), random_prompt(200, period=29, seed=10),
            random_prompt(230, period=31, seed=8)]


def _submit_together(scheduler: Scheduler, jobs: list[Job]):
    """Submit ``jobs`` at once; returns their futures, the tokens each streamed and when each future completed."""
    streamed: list[list[int]] = [[] for _ in jobs]
    completed: dict[int, float] = {}
    futures = []
    for index, job in enumerate(jobs):
        future = scheduler.submit(job, streamed[index].append)
        future.add_done_callback(lambda _, index=index: completed.setdefault(index, time.perf_counter()))
        futures.append(future)
    return futures, streamed, completed


@pytest.mark.parametrize("triforce", [CONFIG, None], ids=["triforce", "plain"])
def test_concurrent_requests_decode_as_one_batch_each_row_its_own(sharp_model, triforce):
    tokenizer = word_tokenizer()
    store = PrefixStore(1 << 30, 16, sharp_model.config)
    engine = Engine(sharp_model, tokenizer, store, prefill_chunk_size=128)
    scheduler = Scheduler(engine, max_batch_size=8, batch_wait_seconds=0.5)
    prompts = _questions()
    limits = [10, 40, 24, 40]
    reference = sharp_model.generate(prompts[2], max_new_tokens=40, do_sample=False, triforce_config=triforce)
    reference = reference[0, prompts[2].shape[1]:].tolist()
    stop_at = next(i for i in range(3, 24) if reference[i] not in reference[:i])  # row 2 stops at its first
    stop = tokenizer.decode(reference[stop_at : stop_at + 1])
    jobs = [Job(ids, {"max_new_tokens": limit, "do_sample": False, **({"stop_strings": [stop]} if b == 2 else {})},
                triforce) for b, (ids, limit) in enumerate(zip(prompts, limits))]
    prefills_began, real_prefill = [], engine.prefill_steps if triforce is not None else engine.prefill
    if triforce is not None:
        def traced(ids):  # the prefill begins with its first chunk
            prefill = real_prefill(ids)
            run_chunk = prefill.run_chunk

            def first_chunk():
                if prefill.done == prefill.reused:
                    prefills_began.append(time.perf_counter())
                return run_chunk()

            prefill.run_chunk = first_chunk
            return prefill

        engine.prefill_steps = traced
    try:
        futures, streamed, completed = _submit_together(scheduler, jobs)
        answers = [future.result(timeout=300) for future in futures]
    finally:
        scheduler.close(timeout=300)
    if triforce is not None:  # row 0's first token streamed before the last row's prefill began
        assert len(prefills_began) == 4
        assert jobs[0].submitted + answers[0].figures["time_to_first_token_seconds"] < prefills_began[3]
    assert all(set(answer.figures["batch"]) == {"rows", "started"} for answer in answers)  # not the batch's record
    assert len({answer.figures["batch"]["started"] for answer in answers}) == 1  # one batch
    if triforce is not None:  # rows joined as they were prefilled, each answered with its own statistics
        assert engine.batches[-1]["requests"] == 4 and engine.batches[-1]["rows"] >= 2
        assert all(answer.figures["stats"]["new_tokens"] == len(answer.tokens) for answer in answers)
        alone = [sharp_model.generate(ids, max_new_tokens=40, do_sample=False,
                                      triforce_config=triforce)[0, ids.shape[1]:] for ids in prompts]
    else:  # plain batched generate's own rows: padded matmuls may round apart from a row alone
        assert all(answer.figures["batch"]["rows"] == 4 for answer in answers)
        from hf_triforce.serving.padded_batch import left_padded

        ids, mask = left_padded(prompts, 0)
        plain = sharp_model.generate(ids, attention_mask=mask, max_new_tokens=40, do_sample=False, pad_token_id=0)
        alone = [row[ids.shape[1]:] for row in plain]
    for b, answer in enumerate(answers):
        expected = alone[b][: limits[b]].tolist()
        if b == 2:
            expected = expected[: stop_at + 1]
        assert answer.tokens == expected, b
        assert streamed[b] == answer.tokens
        assert answer.finish_reason == ("stop" if b == 2 else "length")
    assert completed[0] < completed[1] and completed[2] < completed[3]  # a short row answers before a long one
    assert answers[1].figures["prefix_reused_tokens"] >= 260 or answers[0].figures["prefix_reused_tokens"] >= 260


def test_a_cancelled_row_leaves_the_others_decoding(sharp_model):
    engine = Engine(sharp_model, word_tokenizer(), None)
    scheduler = Scheduler(engine, batch_wait_seconds=0.5)
    prompts = _questions()[1:]
    jobs = [Job(ids, {"max_new_tokens": 40, "do_sample": False}, CONFIG) for ids in prompts]
    cancel_after = threading.Event()
    seen = []

    def leave(token: int) -> None:
        seen.append(token)
        if len(seen) == 3:
            jobs[0].cancelled.set()
            cancel_after.set()

    try:
        futures = [scheduler.submit(jobs[0], leave)] + [scheduler.submit(job) for job in jobs[1:]]
        with pytest.raises(Cancelled):
            futures[0].result(timeout=300)
        answers = [future.result(timeout=300) for future in futures[1:]]
    finally:
        scheduler.close()
    assert cancel_after.is_set()
    for ids, answer in zip(prompts[1:], answers):
        alone = sharp_model.generate(ids, max_new_tokens=40, do_sample=False, triforce_config=CONFIG)
        assert answer.tokens == alone[0, ids.shape[1]:].tolist() and answer.figures["batch"]["rows"] >= 2


def test_seeded_requests_run_alone_and_refused_batches_run_one_by_one(sharp_model):
    engine = Engine(sharp_model, word_tokenizer(), None)
    scheduler = Scheduler(engine, batch_wait_seconds=0.5)
    prompts = _questions()
    try:
        seeded = [scheduler.submit(Job(ids, {"max_new_tokens": 8, "do_sample": True}, CONFIG, seed=3))
                  for ids in prompts[:2]]
        refused = [scheduler.submit(Job(ids, {"max_new_tokens": 8, "num_beams": 2}, CONFIG)) for ids in prompts[2:]]
        for future in seeded:
            assert "batch" not in future.result(timeout=300).figures
        for future in refused:
            with pytest.raises(ValueError, match="num_beams"):
                future.result(timeout=300)
    finally:
        scheduler.close()


def test_a_joining_prefill_stalls_the_decoding_rows_by_one_chunk_at_most(sharp_model):
    """A long prompt joins while a row decodes: between two steps of the batch at most ``prefill_chunk_size``
    tokens are prefilled, several short prefills share one step's turn, and both answers equal each request alone."""
    engine = Engine(sharp_model, word_tokenizer(), None, prefill_chunk_size=64)
    prompts = [random_prompt(40, seed=11), random_prompt(300, period=17, seed=12), random_prompt(20, seed=13),
               random_prompt(25, seed=14)]
    jobs = [Job(ids, {"max_new_tokens": 40 if b == 0 else 12, "do_sample": False}, CONFIG)
            for b, ids in enumerate(prompts)]
    events, answers = [], {}
    real_prefill = engine.prefill_steps

    def traced(ids):
        prefill = real_prefill(ids)
        run_chunk = prefill.run_chunk
        prefill.run_chunk = lambda: events.append(run_chunk()) or events[-1]
        return prefill

    engine.prefill_steps = traced
    batch = JoiningBatch(engine, jobs[0], max_rows=4)
    real_step = batch.batch.step
    batch.batch.step = lambda: events.append("step") or real_step()
    with batch:
        batch.join(jobs[0], None, lambda answer: answers.setdefault(0, answer))
        batch.advance()  # row 0 prefilled and decoding
        for b in (1, 2, 3):
            batch.join(jobs[b], None, lambda answer, b=b: answers.setdefault(b, answer))
        while not batch.idle:
            batch.advance()
    assert events.count("step") > 5
    decoding = events[events.index("step"):]
    turns, turn = [], 0
    for event in decoding + ["step"]:
        if event == "step":
            turns.append(turn)
            turn = 0
        else:
            turn += event
    # the prompts but their last tokens: 299 = 4 x 64 + 43 tokens over several steps, none stalled more than a chunk
    assert max(turns) <= 64 and sum(turns) == 299 + 19 + 24
    assert sum(1 for turn in turns if turn) < 7  # of the 7 chunks, two that fit one chunk's budget shared a turn
    for b, ids in enumerate(prompts):
        alone = sharp_model.generate(ids, max_new_tokens=jobs[b].generate_kwargs["max_new_tokens"], do_sample=False,
                                     triforce_config=CONFIG)
        assert answers[b].tokens == alone[0, ids.shape[1]:].tolist(), b


def test_requests_waiting_together_share_a_batch_whatever_their_lengths(sharp_model):
    """The batch's rows hold the longest of the requests waiting when it opens: a request a few tokens longer than the
    first (past the first's rows, rounded up to 1024 tokens) joins the same batch instead of waiting for it to end."""
    engine = Engine(sharp_model, word_tokenizer(), None, prefill_chunk_size=512)
    scheduler = Scheduler(engine, max_batch_size=4)
    prompts = [random_prompt(1000, period=41, seed=21), random_prompt(1010, period=43, seed=22)]
    jobs = [Job(ids, {"max_new_tokens": 24, "do_sample": False}, CONFIG) for ids in prompts]
    try:
        with scheduler._changed:  # both wait before the scheduler's thread takes the first
            futures = [scheduler.submit(job) for job in jobs]
        answers = [future.result(timeout=300) for future in futures]
    finally:
        scheduler.close(timeout=300)
    assert len({answer.figures["batch"]["started"] for answer in answers}) == 1
    assert engine.batches[-1]["requests"] == 2 and engine.batches[-1]["max_length"] == 2048


def test_a_request_arriving_while_a_batch_decodes_joins_it(sharp_model):
    """A request submitted after the batch's first row streamed its first token joins that batch (one batch record,
    one start, both rows decoding together) and each answer equals the request alone."""
    engine = Engine(sharp_model, word_tokenizer(), None, prefill_chunk_size=128)
    scheduler = Scheduler(engine, max_batch_size=4)
    prompts = [random_prompt(120, period=19, seed=31), random_prompt(90, period=37, seed=32)]
    jobs = [Job(ids, {"max_new_tokens": 60 if b == 0 else 12, "do_sample": False}, CONFIG)
            for b, ids in enumerate(prompts)]
    decoding = threading.Event()
    try:
        first = scheduler.submit(jobs[0], lambda token: decoding.set())
        assert decoding.wait(timeout=300)
        second = scheduler.submit(jobs[1])
        answers = [first.result(timeout=300), second.result(timeout=300)]
    finally:
        scheduler.close(timeout=300)
    assert len(engine.batches) == 1 and engine.batches[0]["requests"] == 2
    assert [answer.figures["batch"]["rows"] for answer in answers] == [2, 2]
    for job, answer in zip(jobs, answers):
        alone = sharp_model.generate(job.ids, max_new_tokens=job.generate_kwargs["max_new_tokens"], do_sample=False,
                                     triforce_config=CONFIG)
        assert answer.tokens == alone[0, job.ids.shape[1]:].tolist()
