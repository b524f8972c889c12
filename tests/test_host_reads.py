"""Host reads of tensor values per Force-3 step: on CUDA each is a device synchronisation.

A step may read values back only to accept: one readback per verification (each Force-2 round, and Force 3),
plus one for the stopping criteria of the tokens it commits. Every method that reads a tensor's value on the
host is patched to count (`HostReads`), and a call's count is bounded by its verifications: a read added
anywhere in a step fails the bound. The data-dependent retrieval re-selection the CPU keeps (a CPU read is no
sync, and it copies only the chunks that changed) is switched to its sync-free form (`buffer.sync_free`) here.

Greedy and sampled calls have the same bound. Sampling, every draw stays on the device until its verification's
readback (`Sampler.device_categorical` for each drafted token and the token after the accepted ones,
`Sampler.leading_successes` for the acceptance coins; a candidate tree's walk, level by level), which reads the
proposals, the accepted count (a tree: the accepted path) and that token in one transfer; the adaptive policy's
scoring of the free lookups against Force 3 (`report.LookupAcceptances`) and the tiers' NaN checks are read with it
(`scoring.Deferred`, `scoring.deferred_nan_checks`).
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
# reads per step besides the verifications' readbacks: the stopping criteria of the committed tokens (evaluated on
# the device for every token a verification emitted, read at once: `CommittedSequence.commit_verified`), greedy or
# sampled
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
    # the adaptive policy also scores the free n-gram lookup's proposal against Force 3 at every step
    "adaptive": dict(draft="self", levels=3, policy="auto"),
    # Force 3 on the native forward at fixed shapes (CUDA graphs by default on a GPU): its queries come out of the
    # forward, stacked, and Force 2's selection reads them on the device
    "Force 3 at fixed shapes": dict(draft="self", levels=3, force3_compile="fixed"),
    # Force 3 verifies the n-gram lookup's candidate trees (`TreeVerifier`: sampling, its walk on the device)
    "lookup trees": dict(draft="ngram", levels=2, tree_nodes=6, tree_branch=2),
}
BASE = dict(retrieval_budget=96, chunk_size=8, window=32, sink_tokens=4, gamma1=2, gamma2=6, policy="fixed",
            draft_precision="model")
MODES = {"greedy": dict(do_sample=False), "sampled": dict(do_sample=True, temperature=0.6, top_p=0.9)}


def count_reads(model, monkeypatch, prompt, mode="greedy", **config):
    """One call counted (``mode``: a key of `MODES`): ``(output, reads, marks, lookups)``; ``marks``: after each
    Force-3 step, the reads so far and the verifications so far (Force-2 rounds and Force-3 steps); ``lookups``:
    how many lookup proposals the adaptive policy scored."""
    config = TriForceConfig(**{**BASE, **config})
    reads, marks, lookups = HostReads().install(monkeypatch), [], []
    step, lookup_proposals = Decoder._step, Decoder._lookup_proposals

    def marked(decoder, active):
        step(decoder, active)
        (row,) = active
        stats = decoder.stats[row.index]
        marks.append((reads.total, stats.detail.force2_steps + stats.force3_steps))

    def proposals(decoder, row):
        proposed = lookup_proposals(decoder, row)
        lookups.extend(name for name, tokens in proposed.items() if tokens)
        return proposed

    monkeypatch.setattr(Decoder, "_step", marked)
    monkeypatch.setattr(Decoder, "_lookup_proposals", proposals)
    monkeypatch.setattr(buffer, "sync_free", lambda device: True)
    torch.manual_seed(0)
    reads.active = True
    out = model.generate(prompt, max_new_tokens=40, triforce_config=config, return_dict_in_generate=True,
                         **MODES[mode])
    reads.active = False
    return out, reads, marks, lookups


# Force 3's forward reads the same whether the step samples or not: greedy only for its own configuration
@pytest.mark.parametrize("name, mode", [(name, mode) for name in sorted(CONFIGS) for mode in sorted(MODES)
                                        if "force3_compile" not in CONFIGS[name] or mode == "greedy"])
def test_one_host_read_per_verification(model, monkeypatch, name, mode):
    """Every step after the first (its set-up: the drafter built, its cache filled, the first selection)."""
    prompt = random_prompt(400, period=97)
    out, reads, marks, lookups = count_reads(model, monkeypatch, prompt, mode, **CONFIGS[name])
    if mode == "greedy":
        assert torch.equal(out.sequences, model.generate(prompt, max_new_tokens=40, do_sample=False))
    stats = out.triforce_stats
    assert stats.force3_steps >= 8
    if "force3_compile" in CONFIGS[name]:
        assert stats.detail.tier_forwards["force3"] == "fixed (native)"
    if CONFIGS[name].get("policy") == "auto":
        assert len(lookups) >= stats.force3_steps // 2  # the lookup proposed (and was scored) on most steps
    else:
        assert stats.plan_steps == {CONFIGS[name]["levels"]: stats.force3_steps} and not lookups
    if CONFIGS[name].get("tree_nodes"):
        assert stats.detail.tree_nodes > stats.detail.force1_proposed  # trees with siblings were verified
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


def test_values_deferred_to_a_readback_arrive_exactly(monkeypatch):
    """`scoring.Deferred` values travel with the next readback, bit for bit (float32, float64 and bool beside its
    int64 values), in its one read; the adaptive policy's lookup scores (`report.LookupAcceptances`) are what
    reading them at once gives."""
    from hf_triforce.decoding.report import LookupAcceptances
    from hf_triforce.verification.sampling import scores_to_probs
    from hf_triforce.verification.scoring import Deferred, deferred_nan_checks, read_back

    torch.manual_seed(5)
    scores = torch.randn(10) * 3
    probs = scores_to_probs(scores)
    tensors = [torch.rand(4), torch.rand(3, dtype=torch.float64), torch.tensor([True, False])]
    best, worst = int(scores.argmax()), int(scores.argmin())
    reads = HostReads().install(monkeypatch)
    with deferred_nan_checks():
        reads.active = True
        held = [Deferred(tensor) for tensor in tensors]
        sampled = LookupAcceptances({"ngram": [7, 1], "none": [], "suffix": [2]}, scores, do_sample=True)
        greedy = LookupAcceptances({"ngram": [best], "suffix": [worst]}, scores, do_sample=False)
        assert read_back(torch.tensor([5, -3])) == [5, -3]
        reads.active = False
    assert reads.total == 1
    assert [deferred.values for deferred in held] == [tensor.tolist() for tensor in tensors]
    assert sampled.read() == {"ngram": float(probs[7]), "none": None, "suffix": float(probs[2])}
    assert greedy.read() == {"ngram": 1.0, "suffix": 0.0}
