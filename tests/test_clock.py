"""The tiers' timings on a device clock (`forwards.forward`): read after the readbacks, not by a synchronisation.

On CUDA a region's seconds come from events recorded on the stream and are read later; reading an event the device
has not passed yet waits for it (a synchronisation). A fake device clock stands in on the CPU: its region has
"finished" once a host read of a tensor value (on CUDA, what waits for the stream) came after the region's end, and
reading it earlier calls ``torch.cuda.synchronize`` (patched to count). The same call runs with a fake immediate
clock (seconds known at once, as on the CPU) whose regions last what the device clock's do: the policy must be told
the same timings, each once, a step later on the device clock, and no step may synchronise.
"""

from __future__ import annotations

import itertools
from operator import attrgetter
from types import SimpleNamespace

import pytest
import torch

from hf_triforce import TriForceConfig
from hf_triforce.decoding import loop, report
from hf_triforce.decoding.policy import AdaptivePolicy, Plan
from hf_triforce.drafters import ngram
from hf_triforce.forwards.forward import HostClock, Seconds, device_clock

from .conftest import make_model, random_prompt
from .test_host_reads import HostReads


class FakeInterval:
    """A region of the fake device clock lasting ``seconds``: finished once ``reads`` has counted a host read after
    its end; read earlier, it waits (``torch.cuda.synchronize``, counted by the test)."""

    def __init__(self, seconds: float, reads: HostReads, clock: FakeClock) -> None:
        self.seconds, self.reads, self.clock = seconds, reads, clock
        self.ended_at = reads.total
        self.value: float | None = None

    def read(self) -> float:
        if self.value is None:
            if self.reads.total <= self.ended_at:
                torch.cuda.synchronize()
            self.value = self.seconds
            self.clock.read.append(self.seconds)
        return self.value


class FakeClock:
    """The ``k``-th region (counted at its end) lasts ``k`` seconds. ``immediate``: a float at once (the CPU's
    clock), else `Seconds` of a `FakeInterval` (a CUDA device's events)."""

    def __init__(self, immediate: bool, reads: HostReads) -> None:
        self.immediate, self.reads = immediate, reads
        self.regions = itertools.count(1)
        self.read: list[float] = []  # seconds of each interval read, in reading order

    def start(self) -> None:
        return None

    def stop(self, started: None) -> float | Seconds:
        seconds = float(next(self.regions))
        if self.immediate:
            return seconds
        return Seconds(0.0, [(1.0, FakeInterval(seconds, self.reads, self))])


def test_seconds_stay_unread_through_arithmetic_and_fold_once_read(monkeypatch):
    """`Seconds` add, subtract and scale without reading; reading folds each interval into the constant once."""
    reads = HostReads().install(monkeypatch)
    clock = FakeClock(False, reads)
    first, second = clock.stop(None), clock.stop(None)
    total = 0.5 + first + 2 * second - first / 4
    assert clock.read == [] and len(total.terms) == 3
    reads.active = True
    torch.ones(1).tolist()  # the "readback": the device has passed both regions
    reads.active = False
    assert float(total) == 0.5 + 1 + 4 - 0.25 and clock.read == [1.0, 2.0]  # each interval read once
    assert (total + first).terms == () and float(total - total) == 0.0  # read intervals fold into the constant


def test_the_device_clock_follows_the_weights():
    model = make_model("llama-gqa")
    clock = device_clock(model)
    assert isinstance(clock, HostClock) and clock.immediate and clock.devices == ()


# a fixed plan per step, cycled, so that both clocks' calls run the same steps: every tier is timed
PLANS = [Plan(1), Plan(3, "self", 2, 4), Plan(2, "self", 0, 3), Plan(3, "", 0, 3), Plan(3, "self", 1, 3)]


def observed_call(model, prompt, monkeypatch, immediate: bool):
    """One greedy call with the policy's plans fixed (`PLANS`) on a fake clock. Returns the output, what the policy
    was told with the number of steps finished when it was told, the clock, and the ``torch.cuda.synchronize``
    calls made inside steps and in the whole call."""
    reads = HostReads().install(monkeypatch)
    clock = FakeClock(immediate, reads)
    monkeypatch.setattr(loop, "device_clock", lambda model: clock)
    syncs, steps, told = [0], [0, 0], []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: syncs.__setitem__(0, syncs[0] + 1))
    plans = itertools.cycle(PLANS)
    # the host's own timings (the step walls, the n-gram lookup's) fixed: both calls are told the same numbers
    for module in (loop, report, ngram):
        monkeypatch.setattr(module, "time", SimpleNamespace(perf_counter=lambda: 0.0))
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda policy, remaining=None: next(plans))
    observe_forward, observe_step = AdaptivePolicy.observe_forward, AdaptivePolicy.observe_step

    def forward(policy, tier, rows, seconds):
        told.append((steps[0], tier, rows, seconds))
        observe_forward(policy, tier, rows, seconds)

    def step_seconds(policy, plan, tokens, seconds, forward_seconds, choice=None):
        told.append((steps[0], "step", plan.name, forward_seconds))
        observe_step(policy, plan, tokens, seconds, forward_seconds, choice)

    step = loop.Decoder._step

    def counted(decoder, active):
        before = syncs[0]
        step(decoder, active)
        steps[0] += 1
        steps[1] += syncs[0] - before

    monkeypatch.setattr(AdaptivePolicy, "observe_forward", forward)
    monkeypatch.setattr(AdaptivePolicy, "observe_step", step_seconds)
    monkeypatch.setattr(loop.Decoder, "_step", counted)
    config = TriForceConfig(draft="self", levels=3, policy="auto", retrieval_budget=96, chunk_size=8, window=32,
                            sink_tokens=4, gamma1=2, gamma2=4, refresh_every=1, draft_precision="model")
    reads.active = True
    out = model.generate(prompt, max_new_tokens=30, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    reads.active = False
    return out, told, clock, steps, syncs[0]


@pytest.fixture(scope="module")
def model():
    return make_model("llama-gqa", vocab_size=96, logit_scale=4.0, num_hidden_layers=2)


def test_the_policy_is_told_every_timing_once_a_step_late_without_a_synchronisation(model, monkeypatch):
    prompt = random_prompt(300, period=97)
    now, told_now, clock_now, steps_now, _ = observed_call(model, prompt, monkeypatch, immediate=True)
    monkeypatch.undo()
    later, told_later, clock_later, steps_later, syncs = observed_call(model, prompt, monkeypatch, immediate=False)
    assert torch.equal(now.sequences, later.sequences)
    assert torch.equal(now.sequences, model.generate(prompt, max_new_tokens=30, do_sample=False))
    tiers = {entry[1] for entry in told_now}
    assert {"force3", "force2", "draft:self", "select", "step"} <= tiers, tiers
    # the same timings, in the same order, each told the step after the one that measured it (the last at the call's
    # end, after its last step)
    assert [(step + 1, *rest) for step, *rest in told_now] == told_later
    assert steps_later[0] == steps_now[0] >= len(PLANS) and told_later[-1][0] == steps_later[0]
    # every region the device clock timed was read once, and none made a step wait; the prefill's wall is read at
    # once (outside the steps), which waits, and its first chunk after the first token's readback, which does not
    assert sorted(clock_later.read) == [float(k) for k in range(1, len(clock_later.read) + 1)]
    assert steps_later[1] == 0 and syncs == 1
    # the statistics hold the same seconds
    for field in ("force1_seconds", "force2_seconds", "force3_seconds", "detail.retrieval_seconds"):
        assert attrgetter(field)(later.triforce_stats) == attrgetter(field)(now.triforce_stats) > 0, field


def test_a_timing_read_inside_its_step_is_caught(model, monkeypatch):
    """The check above can fail: a level that reads its Force-2 seconds as soon as its forward returns makes the
    step wait for the device."""
    from hf_triforce.decoding import levels

    score_steps = levels.Force2Level.score_steps

    def eager(level, sequence, proposals):
        q_scores = yield from score_steps(level, sequence, proposals)
        float(level.report.force2_seconds)
        return q_scores

    monkeypatch.setattr(levels.Force2Level, "score_steps", eager)
    _, _, _, steps, _ = observed_call(model, random_prompt(300, period=97), monkeypatch, immediate=False)
    assert steps[1] > 0


def test_a_step_observed_a_step_late_is_judged_against_its_own_choice():
    """On a device clock a step is observed after the next one was chosen: its calibration, exploration and record
    use what was decided for it (`policy.Choice`), as when it is observed at once."""

    def policy_with_force3_timed():
        policy = AdaptivePolicy({"ngram": "lookup"}, (), 2, 4, explore_every=100)
        policy.observe_forward("force3", 1, 0.1)
        return policy

    at_once = policy_with_force3_timed()
    at_once.observe_step(at_once.choose(100), 1, 0.12, 0.1)
    late, unaware = policy_with_force3_timed(), policy_with_force3_timed()
    for policy in (late, unaware):
        plan, choice = policy.choose(100), policy.choice()
        policy.observe_forward("force3", 1, 0.02)  # the next step's timings change the next prediction
        policy.choose(99)
        policy.observe_step(plan, 1, 0.12, 0.1, choice if policy is late else None)
    assert choice.predicted_seconds > 0
    assert late.calibration == at_once.calibration and late.summary() == at_once.summary()
    assert unaware.calibration != at_once.calibration  # the check can fail: the next step's prediction is not its
