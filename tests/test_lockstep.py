"""`hf_triforce.decoding.lockstep`: rows whose caches share storage run one forward, each row exactly its own.

A batched forward of requests of different widths (and a row taking no part) gives every row the logits of its
own batch-1 forward (fp32 tolerance) and writes exactly its real entries: the next forward on each row still
matches. A mask that lets a row's dummy entries be written, or lets a row see another row's columns, fails.
"""

from __future__ import annotations

import pytest
import torch

from hf_triforce.caches.buffer import BufferCache
from hf_triforce.caches.sink_window import SinkWindowCache, make_layer_rerotations
from hf_triforce.compat import num_layers
from hf_triforce.decoding.lockstep import Lockstep
from hf_triforce.forwards.forward import ForwardRequest
from hf_triforce.integration import recording_attention

from .conftest import make_model, random_prompt


def _prefilled(model, caches, prompts):
    for cache, prompt in zip(caches, prompts):
        ForwardRequest(model, cache, prompt, 0, 1).run()  # one batch-1 forward per row
        assert cache.length == prompt.shape[1]


def _requests(model, caches, tokens):
    return {b: ForwardRequest(model, caches[b], t, caches[b].length, t.shape[1]) for b, t in tokens.items()}


@pytest.mark.parametrize("family,attention", [("llama-gqa", "sdpa"), ("llama-mha", "eager"), ("qwen2", "sdpa")])
def test_shared_forward_equals_each_row_alone(family, attention):
    model = make_model(family, attn_implementation=attention)
    prompts = [random_prompt(n, seed=n) for n in (23, 9, 17, 12)]
    lockstep = Lockstep(4)
    shared = [BufferCache(num_layers(model.config), 64) for _ in prompts]
    alone = [BufferCache(num_layers(model.config), 64) for _ in prompts]
    lockstep.share(shared, "t")
    with torch.no_grad(), recording_attention(model):
        _prefilled(model, shared, prompts)
        _prefilled(model, alone, prompts)
        for step in range(2):  # the second forward reads the entries the first one wrote
            tokens = {0: random_prompt(3, seed=40 + step), 1: random_prompt(1, seed=50 + step),
                      3: random_prompt(5, seed=60 + step)}  # row 2 takes no part
            batched = lockstep.forward(_requests(model, shared, tokens))
            for b, t in tokens.items():
                expected = ForwardRequest(model, alone[b], t, alone[b].length, t.shape[1]).run()
                torch.testing.assert_close(batched[b], expected, atol=1e-5, rtol=1e-5)
            assert [c.length for c in shared] == [c.length for c in alone]
    assert (lockstep.forwards, lockstep.requests) == (2, 6)


def test_sink_window_rows_share_and_evict():
    """Force-1 caches: rows evict and re-rotate through their views; a shared forward still equals each row's."""
    model = make_model("llama-gqa")
    rerotations = make_layer_rerotations(model)
    make = [lambda: SinkWindowCache(num_layers(model.config), 4, 16, rerotations) for _ in range(2)]
    shared, alone = [m() for m in make], [m() for m in make]
    lockstep = Lockstep(2)
    lockstep.share(shared, "t")
    prompts = [random_prompt(18, seed=3), random_prompt(11, seed=4)]
    with torch.no_grad(), recording_attention(model):
        _prefilled(model, shared, prompts)
        _prefilled(model, alone, prompts)
        for step in range(4):
            tokens = {0: random_prompt(2, seed=70 + step), 1: random_prompt(3, seed=80 + step)}
            for caches in (shared, alone):
                for b, t in tokens.items():
                    caches[b].make_room(t.shape[1])
            batched = lockstep.forward(_requests(model, shared, tokens))
            for b, t in tokens.items():
                expected = ForwardRequest(model, alone[b], t, alone[b].length, t.shape[1]).run()
                torch.testing.assert_close(batched[b], expected, atol=1e-5, rtol=1e-5)


def test_drive_batches_rows_and_returns_each_result():
    model = make_model("llama-gqa")
    caches = [BufferCache(num_layers(model.config), 64) for _ in range(3)]
    lockstep = Lockstep(3)
    lockstep.share(caches, "t")

    def row_steps(b, widths):
        out = []
        for width in widths:
            tokens = random_prompt(width, seed=b * 10 + width)
            logits = yield ForwardRequest(model, caches[b], tokens, caches[b].length, 1)
            out.append(int(logits[0].argmax()))
        return out

    plan = {0: [4, 1, 1], 1: [2, 1], 2: [3, 1, 1]}
    with torch.no_grad(), recording_attention(model):
        results = lockstep.drive({b: row_steps(b, widths) for b, widths in plan.items()})
    assert sorted(results) == [0, 1, 2] and [len(results[b]) for b in range(3)] == [3, 2, 3]
    assert lockstep.forwards == 3 and lockstep.requests == 8  # rows advance together
    assert [c.length for c in caches] == [6, 3, 5]


def test_share_refuses_filled_or_mismatched_caches():
    model = make_model("llama-gqa")
    caches = [BufferCache(num_layers(model.config), 64), BufferCache(num_layers(model.config), 32)]
    with pytest.raises(ValueError, match="capacity"):
        Lockstep(2).share(caches, "t")
    with pytest.raises(ValueError, match="3 caches for a batch of 2"):
        Lockstep(2).share(caches + caches[:1], "t")
