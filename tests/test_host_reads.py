"""Host reads of tensor values per Force-3 step: on CUDA each is a device synchronisation.

A step may read values back only to accept: one readback per verification (each Force-2 round, and Force 3),
plus one for the stopping criteria of the tokens it commits. Every method that reads a tensor's value on the
host is patched to count (`HostReads`), and a call's count is bounded by its verifications: a read added
anywhere in a step fails the bound. The data-dependent retrieval re-selection the CPU keeps (a CPU read is no
sync, and it copies only the chunks that changed) is switched to its sync-free form (`buffer.sync_free`) here.
"""

from __future__ import annotations

import collections
import traceback

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.caches import buffer
from hf_triforce.decoding.loop import Decoder

from .conftest import make_model, random_prompt

READS = ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "cpu", "numpy")
# reads per step besides the verifications' readbacks: the stopping criteria of the committed tokens
STEP_READS = 1


class HostReads:
    """Counts host reads of tensor values while active, by the innermost `hf_triforce` frame that made them."""

    def __init__(self) -> None:
        self.where: collections.Counter = collections.Counter()
        self.active = False

    @property
    def total(self) -> int:
        return sum(self.where.values())

    def _counted(self, name, original):
        def read(*args, **kwargs):
            if self.active:
                frames = [f for f in traceback.extract_stack()[:-1] if "hf_triforce" in f.filename]
                frame = frames[-1] if frames else traceback.extract_stack()[-2]
                self.where[(name, frame.filename.rsplit("hf_triforce", 1)[-1], frame.lineno)] += 1
            return original(*args, **kwargs)
        return read

    def install(self, monkeypatch) -> HostReads:
        for name in READS:
            monkeypatch.setattr(torch.Tensor, name, self._counted(name, getattr(torch.Tensor, name)))
        monkeypatch.setattr(torch, "nonzero", self._counted("torch.nonzero", torch.nonzero))
        return self


@pytest.fixture(scope="module")
def model():
    return make_model("llama-gqa", vocab_size=96, logit_scale=4.0, num_hidden_layers=3)


CONFIGS = {
    "three levels": dict(draft="self", levels=3),
    "two levels": dict(draft="self", levels=2),
    "lookup": dict(draft="ngram", levels=2),
}


def count_reads(model, monkeypatch, prompt, **config):
    """One greedy call counted: ``(output, reads, marks)``; ``marks``: after each Force-3 step, the reads so far
    and the verifications so far (Force-2 rounds and Force-3 steps)."""
    config = TriForceConfig(retrieval_budget=96, chunk_size=8, window=32, sink_tokens=4, gamma1=2, gamma2=6,
                            policy="fixed", draft_precision="model", **config)
    reads, marks = HostReads().install(monkeypatch), []
    step = Decoder._step

    def marked(decoder, active):
        step(decoder, active)
        (row,) = active
        marks.append((reads.total, decoder.stats[row.index].force2_steps + decoder.stats[row.index].force3_steps))

    monkeypatch.setattr(Decoder, "_step", marked)
    monkeypatch.setattr(buffer, "sync_free", lambda device: True)
    reads.active = True
    out = model.generate(prompt, max_new_tokens=40, triforce_config=config, return_dict_in_generate=True)
    reads.active = False
    return out, reads, marks


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_one_host_read_per_verification(model, monkeypatch, name):
    """Every step after the first (its set-up: the drafter built, its cache filled, the first selection)."""
    prompt = random_prompt(400, period=97)
    out, reads, marks = count_reads(model, monkeypatch, prompt, **CONFIGS[name])
    assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=40, do_sample=False))
    stats = out.triforce_stats
    assert stats.force3_steps >= 8 and stats.plan_steps == {CONFIGS[name]["levels"]: stats.force3_steps}
    (first_reads, first_verifications), (last_reads, last_verifications) = marks[0], marks[-1]
    steps, counted = len(marks) - 1, last_reads - first_reads
    bound = last_verifications - first_verifications + STEP_READS * steps
    listing = "\n".join(f"{count} {where}" for where, count in reads.where.most_common())
    assert counted <= bound, f"{counted} host reads in {steps} steps > {bound}; in the whole call:\n{listing}"


def test_the_sync_free_reselection_lays_out_what_the_data_dependent_one_does(monkeypatch):
    """Both forms of `BufferLayer.replace_chunks` give the same slot order and the same entries, slot for slot."""
    from hf_triforce.caches.retrieval import RetrievalCache

    torch.manual_seed(3)
    full = buffer.BufferCache(2, 300)
    for layer in full.layers:
        layer.write(torch.randn(2, 3, 203, 4), torch.randn(2, 3, 203, 4))
    first = {i: torch.randn(2, 6, 4) for i in range(2)}
    caches = []
    for free in (False, True):
        monkeypatch.setattr(buffer, "sync_free", lambda device, free=free: free)
        cache = RetrievalCache(2, budget=96, chunk_size=8, recent=16, tail_capacity=40)
        cache.select(full, 203, first)
        caches.append(cache)
    torch.manual_seed(4)
    for grown in (11, 30):
        for layer in full.layers:
            layer.write(torch.randn(2, 3, grown, 4), torch.randn(2, 3, grown, 4))
        queries = {i: torch.randn(2, 6, 4) for i in range(2)}
        for free, cache in zip((False, True), caches):
            monkeypatch.setattr(buffer, "sync_free", lambda device, free=free: free)
            cache.select(full, full.length, queries)
        data_dependent, sync_free = caches
        assert all(torch.equal(a, b) for a, b in zip(data_dependent._held, sync_free._held))
        for mine, theirs in zip(data_dependent.layers, sync_free.layers):
            assert all(torch.equal(a, b) for a, b in zip(mine.valid(), theirs.valid()))
        assert any(layer.chunks_copied for layer in data_dependent.layers)  # the selection did change


def test_a_nan_noted_in_a_step_raises_at_the_verifications_readback():
    """Deferred, a tier's NaN check reads nothing until the next readback, which raises the same clear error."""
    from hf_triforce.verification.sampling import ChainVerifier
    from hf_triforce.verification.scoring import check_nan, deferred_nan_checks

    scores = torch.tensor([[0.0, 5.0, 1.0], [3.0, 0.0, 1.0]])
    with deferred_nan_checks():
        check_nan(torch.tensor([[float("nan"), 1.0]]))  # a draft tier's scores
        with pytest.raises(FloatingPointError, match="NaN in the scores"):
            ChainVerifier(False, None).verify(torch.tensor([1]), None, scores)
        assert ChainVerifier(False, None).verify(torch.tensor([1]), None, scores) == (1, 0)  # read: cleared
    with pytest.raises(FloatingPointError, match="NaN in the scores"), deferred_nan_checks():
        check_nan(torch.tensor([float("nan")]))  # still pending at the end: read then
