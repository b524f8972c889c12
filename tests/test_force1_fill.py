"""Force 1's sink+window cache filled by copying the full cache's entries, at in-cache or absolute positions."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessorList

from hf_triforce import TriForceConfig
from hf_triforce.caches import BufferCache
from hf_triforce.caches.sink_window import SinkWindowCache, copy_refusal, make_layer_rerotations
from hf_triforce.drafters.model import ModelDrafter, draft_positions
from hf_triforce.forwards.forward import forward_logits, prefill

from .conftest import make_model, random_prompt

SINK, WINDOW = 4, 32  # the cache keeps 4 + 30 entries at a fill (window - evict_block)


def full_cache(model, prompt: torch.Tensor) -> BufferCache:
    cache = BufferCache(model.config.num_hidden_layers, prompt.shape[1] + 8)
    with torch.no_grad():
        prefill(model, prompt, cache, chunk_size=64)
    return cache


@pytest.mark.parametrize("positions", ["slots", "absolute"])
def test_copied_entries_are_the_full_caches_moved_to_their_slots(positions):
    """The copy holds the sinks and the window's last entries of the full cache; at in-cache positions the window's
    keys are re-rotated to their slots: in the first layer (its input is the token alone) exactly the keys a forward
    at those slots computes; at absolute positions they are the full cache's unchanged."""
    model = make_model("llama-gqa")
    prompt = random_prompt(100, seed=2)
    full = full_cache(model, prompt)
    cache = SinkWindowCache(model.config.num_hidden_layers, SINK, WINDOW, make_layer_rerotations(model), positions)
    cache.copy_from(full, 100)
    kept = WINDOW - cache.evict_block
    assert cache.length == SINK + kept
    at_slots = BufferCache(model.config.num_hidden_layers, SINK + kept)
    with torch.no_grad():  # the same tokens fed at their slots 0 .. SINK + kept - 1
        forward_logits(model, torch.cat((prompt[:, :SINK], prompt[:, 100 - kept :]), 1), at_slots, 0, 1)
    for layer, held in zip(cache.layers, full.layers):
        torch.testing.assert_close(layer.keys[:, :, :SINK], held.keys[:, :, :SINK], rtol=0, atol=0)
        torch.testing.assert_close(layer.values[:, :, SINK : SINK + kept], held.values[:, :, 100 - kept : 100],
                                   rtol=0, atol=0)
        window_keys = layer.keys[:, :, SINK : SINK + kept]
        if positions == "absolute":
            torch.testing.assert_close(window_keys, held.keys[:, :, 100 - kept : 100], rtol=0, atol=0)
    first = cache.layers[0].keys[:, :, SINK : SINK + kept]
    if positions == "slots":
        torch.testing.assert_close(first, at_slots.layers[0].keys[:, :, SINK : SINK + kept], rtol=1e-5, atol=1e-5)
    else:
        assert (first - at_slots.layers[0].keys[:, :, SINK : SINK + kept]).abs().max() > 1e-2


def test_an_absolute_drafter_predicts_at_the_tokens_own_positions():
    """At absolute positions a drafter's next scores are the model's over the kept entries with the new token at its
    own position (at in-cache positions they are not: the token sits at slot ``length``)."""
    model = make_model("llama-gqa")
    sequence = random_prompt(101, seed=5)
    full = full_cache(model, sequence[:, :100])
    kept = WINDOW - max(1, WINDOW // 16)
    reference = BufferCache(model.config.num_hidden_layers, SINK + kept + 1)
    for layer, held in zip(reference.layers, full.layers):
        layer.write(torch.cat((held.keys[:, :, :SINK], held.keys[:, :, 100 - kept : 100]), 2),
                    torch.cat((held.values[:, :, :SINK], held.values[:, :, 100 - kept : 100]), 2))
    rows = {}
    with torch.no_grad():
        expected = forward_logits(model, sequence[:, 100:101], reference, 100, 1)
        for positions in ("absolute", "slots"):
            drafter = ModelDrafter(model, SINK, WINDOW, LogitsProcessorList(), False, None, source=full,
                                   positions=positions)
            drafter.prefill(sequence)
            assert drafter.forwards == 0 and drafter.fed == 100  # filled by a copy, no forward
            rows[positions] = _run(drafter, sequence)[1][0]
    torch.testing.assert_close(rows["absolute"], expected[0], rtol=1e-4, atol=1e-5)
    assert (rows["slots"] - expected[0]).abs().max() > 1e-3


def _run(drafter: ModelDrafter, sequence: torch.Tensor):
    from hf_triforce.forwards.forward import run_inline

    return run_inline(drafter._draft_steps(sequence, 1))


def test_a_drafter_far_behind_refills_by_copy_without_a_forward():
    model = make_model("llama-gqa")
    sequence = random_prompt(160, seed=7)
    full = full_cache(model, sequence[:, :150])
    drafter = ModelDrafter(model, SINK, WINDOW, LogitsProcessorList(), False, None, source=full)
    assert drafter.fill == "a copy of the full cache's entries"
    with torch.no_grad():
        drafter.prefill(sequence[:, :101])  # the full cache holds 150: the first 100 are copied
        assert drafter.fed == 100 and drafter.forwards == 0
        _run(drafter, sequence[:, :151])  # 51 behind (> COPY_REFILL_BEHIND): re-copied up to 150, then one forward
    assert drafter.forwards == 1 and drafter.fed == 151
    no_source = ModelDrafter(model, SINK, WINDOW, LogitsProcessorList(), False, None)
    assert no_source.fill.startswith("a forward (")


def test_copy_is_refused_for_sliding_window_layers_and_positions_resolve():
    windowed = make_model("mistral", sliding_window=16)
    from hf_triforce import compat

    cache = BufferCache(2, 64, compat.layer_windows(windowed.config))
    assert "sliding-window" in copy_refusal(cache)
    assert ModelDrafter(windowed, SINK, WINDOW, LogitsProcessorList(), False, None, source=cache).source is None
    target, short = make_model("llama-gqa"), make_model("llama-gqa", max_position_embeddings=512)
    auto = TriForceConfig()
    assert draft_positions(auto, target, target) == "absolute"
    assert draft_positions(auto, target, short) == "slots"  # fewer positions than the target: in-cache ones
    assert draft_positions(auto, target, make_model("llama-gqa", seed=1)) == "absolute"
    assert draft_positions(TriForceConfig(draft_positions="slots"), target, target) == "slots"
    with pytest.raises(ValueError, match="draft_positions must be one of"):
        TriForceConfig(draft_positions="relative")


def test_a_draft_model_fills_by_its_own_weights_and_drafts_by_its_lean_copy(monkeypatch):
    """A draft model (no entries to copy) fills its cache by a forward of its own weights, not of its int4 copy (whose
    kernels suit a few rows): the entries are those the eager draft model writes, bit for bit, and the drafting
    forwards after it run the lean copy."""
    from hf_triforce.decoding.tiers import tier_model
    from hf_triforce.drafters import DraftContext, build_drafter
    from hf_triforce.kernels.lean import LeanModel
    from hf_triforce.verification.sampling import TorchSampler

    target, draft = make_model("llama-gqa"), make_model("llama-gqa", seed=4)
    config = TriForceConfig(draft=draft, draft_precision="lean-int4", sink_tokens=SINK, window=WINDOW)
    force1 = lambda model: tier_model(model, config.draft_precision, 1)  # noqa: E731  (what the hierarchy hands)
    drafter = build_drafter(DraftContext(target, config, LogitsProcessorList(), False, TorchSampler(), None,
                                         force1_model=force1))
    assert isinstance(drafter.model, LeanModel) and drafter.fill_model is draft
    eager = ModelDrafter(draft, SINK, WINDOW, LogitsProcessorList(), False, None, positions="absolute")
    prompt = random_prompt(80, seed=3)
    lean_forwards = []
    real = LeanModel.__call__
    monkeypatch.setattr(LeanModel, "__call__", lambda self, *a, **k: lean_forwards.append(1) or real(self, *a, **k))
    with torch.no_grad():
        drafter.prefill(prompt)
        eager.prefill(prompt)
        assert not lean_forwards and drafter.fed == eager.fed == 79
        held = drafter.cache.length
        assert held == eager.cache.length == SINK + WINDOW - drafter.cache.evict_block
        for layer, reference in zip(drafter.cache.layers, eager.cache.layers):
            assert torch.equal(layer.keys[:, :, :held], reference.keys[:, :, :held])
            assert torch.equal(layer.values[:, :, :held], reference.values[:, :, :held])
        drafter.propose(prompt, 2)
    assert len(lean_forwards) == 2


@pytest.mark.parametrize("case", ["chain", "assisted", "tree", "batch", "draft model", "auto"])
def test_a_short_call_allocates_its_sink_window_cache_for_its_own_length(monkeypatch, case):
    """``window=300000`` on a 100-token prompt and 12 new tokens: Force 1's caches are allocated for the call's
    positions plus a step's rows (`sizing.sink_window_rows`), not for ``sink_tokens + window`` (77 MB each here), in
    each loop, with trees, in a batch, for a draft model and under the adaptive policy; the greedy output stays
    plain ``generate``'s."""
    from .test_greedy_identity import _config, assert_identical

    built = []
    init = SinkWindowCache.__init__
    monkeypatch.setattr(SinkWindowCache, "__init__", lambda self, *args, **kw: built.append(self) or
                        init(self, *args, **kw))
    model = make_model("llama-gqa")
    prompt = random_prompt(100, period=37)
    options = {"assisted": dict(loop="assisted"), "tree": dict(tree_nodes=6), "auto": dict(policy="auto"),
               "draft model": dict(draft=make_model("llama-gqa", num_hidden_layers=1, seed=5))}.get(case, {})
    config = _config(options.pop("draft", "self"), window=300000, **options)
    ids = torch.cat((prompt, prompt.roll(7, dims=1))) if case == "batch" else prompt
    assert_identical(model, ids, config, max_new_tokens=12)
    entries = ids.shape[1] + 12 + 64
    per_entry = model.config.num_hidden_layers * 2 * model.config.num_key_value_heads * model.config.head_dim * 4
    assert built and all(cache.capacity <= entries for cache in built)
    assert all(cache.nbytes() <= ids.shape[0] * entries * per_entry for cache in built)
