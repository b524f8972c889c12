"""The adaptive hierarchy (policy="auto"): exact whatever it chooses, and it chooses from what it measured."""

from __future__ import annotations

import types

import pytest
import torch
from transformers import LogitsProcessorList, TopKLogitsWarper

from hf_triforce import TriForceConfig
from hf_triforce.decoding.loop import Decoder
from hf_triforce.decoding.policy import (
    DEVICE_PRIORS,
    AcceptanceRate,
    AdaptivePolicy,
    Plan,
    PolicyPriors,
    TierCosts,
    expected_tokens,
)
from hf_triforce.decoding.tiers import weight_bytes
from hf_triforce.integration import recording_attention
from hf_triforce_bench.roofline import assume_costs, assume_rates

from .conftest import FAMILIES, make_model, random_prompt
from .test_exact_enumeration import CONFIG, decoded_law, distance, target_law

CPU = DEVICE_PRIORS["cpu"]  # the priors every policy here starts from

# Assumed seconds of each tier's one-row forward (a long context on a CPU: Force 2 and the self drafter cheap next to
# Force 3, lookups free), each extra row at the CPU's ``row_cost_slope`` of it, and of one row of a draft cache's fill
ASSUMED_SECONDS = {"force3": 0.1, "force3-tree": 0.1, "force2": 0.03, "force2-tree": 0.03, "select": 0.005,
                   "draft:self": 0.02, "draft:model": 0.02, "draft:ngram": 0.0, "draft:suffix": 0.0}
ASSUMED_FILL_ROW_SECONDS = 0.002


def assumed_timings(monkeypatch) -> None:
    """The adaptive policy chooses from `ASSUMED_SECONDS` instead of wall-clock timings, so a test of what it chooses
    in a live call holds on a loaded machine: every timing reaches the policy through `AdaptivePolicy.observe_forward`,
    `AdaptivePolicy.observe_step` and `AdaptivePolicy.set_up`, which here see the assumed seconds of each forward, each
    step's own predicted seconds (no overhead, calibration 1) and the assumed fill price. An unknown tier is an
    error, not a free forward."""
    observe_forward, observe_step, set_up = AdaptivePolicy.observe_forward, AdaptivePolicy.observe_step, \
        AdaptivePolicy.set_up

    def seconds(tier: str, rows: int) -> float:
        return ASSUMED_SECONDS[tier] * (1 + CPU.row_cost_slope * (rows - 1))

    def assumed_forward(self, tier, rows, measured):
        observe_forward(self, tier, rows, seconds(tier, rows))

    def assumed_step(self, plan, tokens, measured, forward_seconds, choice=None):
        choice = choice if choice is not None else self.choice()
        predicted = choice.predicted_seconds if plan == choice.plan and choice.predicted_seconds > 0 else \
            seconds("force3", 1)  # the first step: nothing predicted yet
        observe_step(self, plan, tokens, predicted, predicted, choice)

    def assumed_set_up(self, fill_rows, seconds_per_row, prior_fractions):
        set_up(self, fill_rows, None if seconds_per_row is None else ASSUMED_FILL_ROW_SECONDS, prior_fractions)

    monkeypatch.setattr(AdaptivePolicy, "observe_forward", assumed_forward)
    monkeypatch.setattr(AdaptivePolicy, "observe_step", assumed_step)
    monkeypatch.setattr(AdaptivePolicy, "set_up", assumed_set_up)


def auto(draft="self", **kw):
    base = dict(draft=draft, retrieval_budget=48, chunk_size=8, sink_tokens=4, window=24, gamma1=2, gamma2=6,
                explore_every=4)
    base.update(kw)
    return TriForceConfig(**base)


@pytest.mark.parametrize("family", sorted(FAMILIES))
@pytest.mark.parametrize("draft", ["self", "ngram", "suffix"])
def test_auto_policy_is_greedy_identical(monkeypatch, family, draft):
    assumed_timings(monkeypatch)  # which plans run: from assumed costs, whatever the machine's load
    model = make_model(family)
    prompt = random_prompt(160, period=37)
    expected = model.generate(prompt, max_new_tokens=50, do_sample=False)
    out = model.generate(prompt, max_new_tokens=50, do_sample=False, triforce_config=auto(draft),
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    stats = out.triforce_stats
    assert sum(stats.plan_steps.values()) == stats.force3_steps
    assert sum(p["steps"] for p in stats.detail.plans.values()) == stats.force3_steps
    assert sum(p["tokens"] for p in stats.detail.plans.values()) == stats.force3_tokens
    assert len(stats.plan_steps) >= 2, "exploration must try more than one kind of plan"


def run_cycle(monkeypatch, cycle: list[Plan], period: int, config: TriForceConfig):
    """Greedy ``generate`` with each step's plan taken from ``cycle`` (the next every ``period`` steps): identical
    to plain ``generate``; returns the output."""
    def choose(self, remaining_tokens=None):
        steps = sum(record.steps for record in self.records.values())
        self.current = cycle[(steps // period) % len(cycle)]
        return self.current

    monkeypatch.setattr(AdaptivePolicy, "choose", choose)
    model = make_model("llama-gqa")
    prompt = random_prompt(200, period=41)
    expected = model.generate(prompt, max_new_tokens=90, do_sample=False)
    out = model.generate(prompt, max_new_tokens=90, do_sample=False, return_dict_in_generate=True,
                         triforce_config=config)
    assert torch.equal(out.sequences, expected)
    return out


@pytest.mark.parametrize("period", [1, 2, 3, 7])
def test_plan_switches_keep_greedy_identity(monkeypatch, period):
    """Plans change every ``period`` steps, with runs of plain steps longer than half the draft window in
    between: dormant levels must catch up (draft cache refill, retrieval sync or re-selection)."""
    cycle = [Plan(3, "self", 2, 5), Plan(1), Plan(2, "ngram", gamma2=4), Plan(2, "self", gamma2=3), Plan(1),
             Plan(3, "self", 1, 3)]
    out = run_cycle(monkeypatch, cycle, period, auto("self", window=24))
    assert set(out.triforce_stats.plan_steps) == {1, 2, 3}


def test_a_drafter_shared_by_two_levels_fills_its_cache_once(monkeypatch):
    """Two-level and three-level plans share the call's self drafter: the level started second does not fill it
    again (a 272-row forward, 0.43 s at 16k on SmolLM2); drafting catches up with the tokens in between."""
    from hf_triforce.drafters.model import ModelDrafter

    fills = []
    fill = ModelDrafter._fill
    monkeypatch.setattr(ModelDrafter, "_fill", lambda self, prompt: (fills.append(prompt.shape[1]), fill(self, prompt)))
    cycle = [Plan(2, "self", gamma2=3), Plan(1), Plan(3, "self", 2, 5), Plan(2, "self", gamma2=2)]
    out = run_cycle(monkeypatch, cycle, 1, auto("self", window=64))
    assert set(out.triforce_stats.plan_steps) == {1, 2, 3} and len(fills) == 1, fills


@pytest.mark.parametrize("period", [1, 3])
def test_three_level_drafters_share_one_force2(monkeypatch, period):
    """Force 2 is the target on the retrieval cache whoever drafts for it: three-level plans of the self drafter,
    of the n-gram lookup and of none (Force 2 drafting alone) use one retrieval cache per row (one first selection,
    one cache's memory), greedy-identically, each drafter catching up after the steps it sat out."""
    from hf_triforce.decoding.levels import Force2Level

    built = []
    init = Force2Level.__init__
    monkeypatch.setattr(Force2Level, "__init__", lambda self, *a, **kw: (built.append(self), init(self, *a, **kw))[1])
    cycle = [Plan(3, "self", 2, 5), Plan(3, "ngram", 2, 4), Plan(1), Plan(3, "", 0, 4), Plan(3, "ngram", 1, 3),
             Plan(3, "self", 1, 3), Plan(3, "", 0, 2)]
    out = run_cycle(monkeypatch, cycle, period, auto("self", window=24))
    stats = out.triforce_stats
    detail = stats.detail
    assert {name.split(" g")[0] for name in detail.plans} >= {"triforce self", "triforce ngram", "force2"}, detail.plans
    assert len(built) == 1 and detail.retrieval_cache_bytes == built[0].nbytes(), (len(built), detail.plans)


def test_the_first_selection_is_set_up_not_a_step_cost(monkeypatch):
    """Only re-selections price a three-level step's selection: the first (every chunk summarised and copied) is
    one-time set-up, like a draft cache's fill."""
    observed = []
    observe = AdaptivePolicy.observe_forward
    monkeypatch.setattr(AdaptivePolicy, "observe_forward",
                        lambda self, tier, rows, seconds: (observed.append(tier), observe(self, tier, rows, seconds)))
    out = run_cycle(monkeypatch, [Plan(3, "self", 2, 5), Plan(3, "", 0, 4)], 1, auto("self", window=24))
    selections = out.triforce_stats.detail.retrieval_selections
    assert selections >= 3 and observed.count("select") == selections - 1, (selections, observed.count("select"))


def test_force2_timings_count_the_rows_their_forward_ran(monkeypatch):
    """The cost model learns each Force-2 forward at its own row count: one row when Force 2 drafts alone, Force 1's
    drafts + 1 when it verifies them (read after the forward, the cache's length would count no rows at all)."""
    observed = []
    observe = AdaptivePolicy.observe_forward
    monkeypatch.setattr(AdaptivePolicy, "observe_forward",
                        lambda self, tier, rows, seconds: (observed.append((tier, rows)),
                                                           observe(self, tier, rows, seconds)))
    run_cycle(monkeypatch, [Plan(3, "", 0, 4)], 1, auto("self", window=24))
    alone = [rows for tier, rows in observed if tier == "force2"]
    observed.clear()
    run_cycle(monkeypatch, [Plan(3, "self", 2, 5)], 1, auto("self", window=24))
    with_force1 = [rows for tier, rows in observed if tier == "force2"]
    assert alone and set(alone) == {1}, alone
    assert with_force1 and min(with_force1) >= 1 and 3 in with_force1, with_force1


@pytest.mark.parametrize("precision, positions, with_self", [("lean-int4", "auto", True), ("model", "auto", False),
                                                             ("lean-int4", "slots", False)])
def test_a_draft_model_config_also_drafts_with_the_target_s_lean_copy(monkeypatch, precision, positions, with_self):
    """Beside a draft model the auto policy may draft with the target's own lean copy (the copy Force 2 runs: no more
    weights), two- and three-level; not where Force 1 would run the target's eager forward, nor where the draft's
    tokens sit in slots (re-rotation, checked before the prefill for the configured drafter only). Plans switching
    between the draft model, the self drafter and the n-gram lookup keep greedy identity, each drafter catching up."""
    from hf_triforce.decoding.hierarchy import adaptive_policy
    from hf_triforce.decoding.resolved import resolve

    target, draft = make_model("llama-gqa"), make_model("llama-gqa", seed=4, num_hidden_layers=1)
    config = auto(draft, draft_precision=precision, draft_positions=positions)
    plans = adaptive_policy(resolve(config, target), 10_000, target).candidates()
    drafters = {p.drafter for p in plans if p.levels > 1}
    assert drafters == ({"", "model", "ngram", "self"} if with_self else {"", "model", "ngram"}), drafters
    assert adaptive_policy(resolve(auto("self", draft_precision=precision), target), 10_000, target).drafters == \
        {"self": "model", "ngram": "lookup"}  # a named drafter: no other model drafter added
    if not with_self:
        return
    cycle = [Plan(2, "model", gamma2=3), Plan(3, "self", 2, 5), Plan(1), Plan(2, "self", gamma2=2),
             Plan(3, "model", 2, 4), Plan(2, "ngram", gamma2=3)]
    out = run_cycle(monkeypatch, cycle, 2, config)
    names = {name.split(" g")[0] for name in out.triforce_stats.detail.plans}
    assert names >= {"model", "self", "triforce self", "triforce model"}, out.triforce_stats.detail.plans


def test_stats_count_and_name_per_tier_what_ran(monkeypatch):
    """Plans mixing two and three levels beside a Gemma draft the lean forward does not cover: Force 2's acceptance
    counts only the drafts Force 2 verified (Force 1's drafts of two-level steps went to Force 3), each level's
    rejections are its verifications that rejected a token, and each tier names the forward it ran (the draft's
    eager forward, the target's lean copy for the self drafter and Force 2)."""
    from hf_triforce.decoding.levels import Force2Level
    from hf_triforce.verification.sampling import ChainVerifier

    chains = []  # every chain verification: (verifier, proposed, accepted)
    chain_verify = ChainVerifier.verify

    def recording_verify(self, proposals, probs, scores):
        accepted, token = chain_verify(self, proposals, probs, scores)
        chains.append((self, len(proposals), accepted))
        return accepted, token

    monkeypatch.setattr(ChainVerifier, "verify", recording_verify)

    class Counting:  # Force 2's verifier, counting what it verified
        def __init__(self, inner):
            self.inner = inner
            force2_verifiers.append(inner)

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def verify(self, proposals, probs, scores):
            accepted, token = self.inner.verify(proposals, probs, scores)
            verified.append((len(proposals), accepted))
            return accepted, token

    verified, force2_verifiers = [], []
    init = Force2Level.__init__

    def counting_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.verifier = Counting(self.verifier)

    monkeypatch.setattr(Force2Level, "__init__", counting_init)
    draft = make_model("gemma", seed=4, num_hidden_layers=1)
    cycle = [Plan(2, "model", gamma2=3), Plan(3, "self", 2, 5), Plan(1), Plan(2, "self", gamma2=4),
             Plan(3, "model", 2, 4)]
    stats = run_cycle(monkeypatch, cycle, 1, auto(draft, draft_precision="lean-int4")).triforce_stats
    assert set(stats.plan_steps) == {1, 2, 3}
    assert stats.force2_verified == sum(n for n, _ in verified) and stats.force2_accepted == sum(a for _, a in verified)
    # two-level drafts are Force 1's, not Force 2's to verify
    assert 0 < stats.force2_verified < stats.detail.force1_proposed
    assert stats.force2_acceptance == stats.force2_accepted / stats.force2_verified
    assert stats.force2_rejections == sum(a < n for n, a in verified) > 0
    force2 = [(n, a) for verifier, n, a in chains if any(verifier is v for v in force2_verifiers)]
    assert force2 == verified  # Force 2's verifications are told apart from Force 3's
    force3 = [(n, a) for verifier, n, a in chains if not any(verifier is v for v in force2_verifiers)]
    assert stats.force3_rejections == sum(a < n for n, a in force3) > 0
    assert stats.force3_accepted == sum(a for _, a in force3)
    assert stats.force3_position_acceptance == stats.force3_accepted / (stats.force3_accepted
                                                                        + stats.force3_rejections)
    assert stats.detail.draft_precision == "lean-int4"
    assert set(stats.detail.tier_forwards) == {"force1 model", "force1 self", "force2", "force3"}
    assert stats.detail.tier_forwards["force1 model"].startswith("eager (GemmaForCausalLM is not one of")
    assert stats.detail.tier_forwards["force1 self"] == stats.detail.tier_forwards["force2"] == "lean"


def test_a_target_the_lean_forward_does_not_cover_does_not_self_draft_beside_a_draft_model():
    """An explicit lean precision on a target the lean forward does not cover leaves it its eager forward: no self
    drafter is added beside the draft model (it would be a second full-cost target forward per drafted token)."""
    from hf_triforce.decoding.tiers import lean_self_drafting, lean_support

    uncovered = make_model("gemma")
    assert lean_support(uncovered) is not None
    draft = make_model("llama-gqa", seed=4, num_hidden_layers=1)
    assert not lean_self_drafting(auto(draft, draft_precision="lean-int4"), uncovered)
    assert lean_self_drafting(auto(draft, draft_precision="lean-int4"), make_model("llama-gqa"))


def test_lookup_chains_may_be_longer_than_gamma2(monkeypatch):
    """Under the auto policy a lookup drafter's two-level chains go up to `LOOKUP_GAMMA2` (model drafters' stay within
    gamma2); on a repeating prompt it runs such chains, greedy-identically, and Force 3 keeps room for their rows. The
    policy chooses from assumed costs (`assumed_timings`): on a loaded machine measured ones may keep it on plain
    steps."""
    from hf_triforce.decoding.hierarchy import adaptive_policy
    from hf_triforce.decoding.resolved import resolve
    from hf_triforce.decoding.sizing import LOOKUP_GAMMA2, force3_rows

    config = auto("self", gamma2=4)
    assert force3_rows(config) == LOOKUP_GAMMA2 and force3_rows(TriForceConfig(policy="fixed", gamma2=4)) == 4
    model = make_model("llama-gqa")
    plans = adaptive_policy(resolve(config, model), 10_000).candidates()
    assert max(p.gamma2 for p in plans if p.levels == 2 and p.drafter == "ngram") == LOOKUP_GAMMA2
    assert max(p.gamma2 for p in plans if p.levels == 2 and p.drafter == "self") == 4
    assumed_timings(monkeypatch)
    prompt = random_prompt(200, period=23)
    expected = model.generate(prompt, max_new_tokens=60, do_sample=False)
    out = model.generate(prompt, max_new_tokens=60, do_sample=False, triforce_config=auto("ngram", gamma2=4),
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    longest = max(int(name.split(" g")[1]) for name in out.triforce_stats.detail.plans if name.startswith("ngram g"))
    assert longest > 4, out.triforce_stats.detail.plans


def test_a_drafter_that_fills_by_copy_has_no_setup_price(monkeypatch):
    """The self drafter copies its first entries from the full cache (a few milliseconds): the policy does not charge
    its first use a fill; a draft model, which must run a forward over them, is charged."""
    seen = []
    choose = AdaptivePolicy.choose
    monkeypatch.setattr(AdaptivePolicy, "choose", lambda self, *a: (seen.append(dict(self.setup_seconds)),
                                                                    choose(self, *a))[1])
    model, draft = make_model("llama-gqa"), make_model("llama-gqa", seed=4)
    prompt = random_prompt(120, period=41)
    for config in (auto("self"), auto(draft)):
        seen.clear()
        out = model.generate(prompt, max_new_tokens=8, do_sample=False, triforce_config=config,
                             return_dict_in_generate=True)
        name = "self" if config.draft == "self" else "model"
        assert (name in seen[0]) == (name == "model"), seen[0]
        assert out.triforce_stats.detail.draft_caches[name].startswith("absolute positions, filled by a ")


def rotation_law(monkeypatch, plans: list[Plan], top_k: int, new: int, mutate=None, **config):
    """The policy's choices depend on timings, which a replayed enumeration cannot hold fixed; here the plan of
    each step is ``plans[i]`` with ``i`` a deterministic function of the path so far (steps and tokens
    committed), which is the property exactness rests on. Returns the enumerated law's distance to the target's,
    the ``(previous plan, plan)`` switches made on any path (previous ``None`` on the first step), and each
    path's stats."""
    switches = set()

    def choose(self, remaining_tokens=None):
        steps = sum(record.steps for record in self.records.values())
        tokens = sum(record.tokens for record in self.records.values())
        plan = plans[(steps + (tokens > 2 * steps)) % len(plans)]  # depends on how the path went so far
        switches.add((self.current, plan))
        self.current = plan
        return plan

    monkeypatch.setattr(AdaptivePolicy, "choose", choose)
    model = make_model("llama-gqa", vocab_size=4, seed=3, initializer_range=0.3, num_hidden_layers=1)
    prompt = random_prompt(40, vocab_size=4, seed=4, period=13)
    processors = LogitsProcessorList([TopKLogitsWarper(top_k)])
    config = TriForceConfig(draft="self", **{**CONFIG, "policy": "auto", "explore_every": 1, **config})
    law, _, stats = decoded_law(model, prompt, config, processors, new, mutate)
    return distance(law, target_law(model, prompt, processors, new)), switches, stats


def test_plans_chosen_from_the_past_keep_the_law_exact(monkeypatch):
    """Whatever past-dependent rule picks the plans (`rotation_law`), the law is the target's."""
    plans = [Plan(3, "self", 1, 2), Plan(1), Plan(3, "ngram", 1, 2), Plan(2, "ngram", gamma2=2), Plan(3, "", 0, 2),
             Plan(2, "self", gamma2=2), Plan(3, "self", 1, 2)]
    gap, switches, _ = rotation_law(monkeypatch, plans, 2, 5)
    assert gap < 1e-5
    transitions = {(before.levels, after.levels) for before, after in switches if before is not None}
    assert {(1, 3), (3, 1), (3, 2)} <= transitions, transitions  # dormant levels caught up on some paths


@pytest.mark.parametrize("wrong", [False, True])
def test_force2_drafting_alone_keeps_the_law_exact(monkeypatch, wrong):
    """Force 2 drafting alone (no Force 1) samples its chain from q on the retrieval cache; Force 3 verifies it
    against p. The enumerated law is the target's, and it is not when Force 3 resamples a rejection from p instead
    of the residual (chains of 2 tokens: rejections on some paths)."""
    from .test_exact_enumeration import top_resamples_from_p

    gap, _, stats = rotation_law(monkeypatch, [Plan(3, "", 0, 2), Plan(1), Plan(3, "", 0, 2)], 3, 4,
                                 top_resamples_from_p if wrong else None)
    assert all(s.detail.force1_proposed == 0 for s in stats) and max(s.force3_proposed for s in stats) >= 2
    assert (gap > 1e-3) if wrong else (gap < 1e-5), gap


def test_expected_tokens_of_a_chain():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 5) == 6.0
    assert abs(expected_tokens(0.5, 2) - 1.75) < 1e-12


def test_acceptance_rate_is_geometric():
    rate = AcceptanceRate(prior=0.5, weight=1e-9, decay=1.0)
    for _ in range(100):
        rate.observe(3, 1)  # chains accepting 3 then rejecting: a = 3 / 4
    assert abs(rate.rate - 0.75) < 1e-6


def test_tier_costs_scale_unmeasured_rows():
    costs = TierCosts()
    costs.observe("force3", 1, 0.1)
    assert costs.estimate("force3", 1, 9.0) == pytest.approx(0.1)
    assert costs.estimate("force3", 9, 9.0) == pytest.approx(0.1 * 2.0)
    assert costs.estimate("force2", 3, 0.2) == pytest.approx(0.2 * 1.25)


def test_tier_costs_learn_a_tier_s_row_slope_once_its_timings_span_enough_rows():
    """Rows nearly free (a GPU forward bound by its reads): once timed over ``slope_span`` rows, longer chains are
    priced by the tier's own slope, not the prior; over fewer rows the prior still prices them."""
    costs = TierCosts()
    costs.observe("force3", 1, 0.100)
    costs.observe("force3", 2, 0.101)
    assert costs.estimate("force3", 11, 9.0) == pytest.approx(0.101 * (1 + 0.125 * 10) / (1 + 0.125))
    costs.observe("force3", 1 + CPU.slope_span, 0.103)
    assert costs.estimate("force3", 11, 9.0) == pytest.approx(0.103 + 0.001 * (11 - 1 - CPU.slope_span))
    costs.observe("force3", 1, 0.2)  # slower than the longest: never a negative per-row price
    costs.observe("force3", 1, 0.2)
    costs.observe("force3", 1, 0.2)
    assert costs.estimate("force3", 11, 9.0) == pytest.approx(0.103)


def test_priors_follow_the_device():
    from hf_triforce.decoding.hierarchy import policy_priors

    assert policy_priors(torch.nn.Linear(1, 1)) == CPU
    assert policy_priors(types.SimpleNamespace(device=torch.device("cuda", 0))) == DEVICE_PRIORS["cuda"]
    assert policy_priors(types.SimpleNamespace(device=torch.device("meta"))) == CPU
    assert DEVICE_PRIORS["cuda"].row_cost_slope < CPU.row_cost_slope  # a GPU's few rows bound by their reads


def _gpu_like_lookup_policy(priors: PolicyPriors) -> AdaptivePolicy:
    """Force 3's rows nearly free beyond the first two measured (a read-bound GPU forward), lookups that match."""
    policy = AdaptivePolicy({"ngram": "lookup"}, (), 2, 6, explore_every=1000, max_lookup_gamma2=10,
                            priors=priors)
    for rows in (1, 2):
        policy.observe_forward("force3", rows, 0.027 + 0.0003 * (rows - 1))
    policy.observe_forward("draft:ngram", 1, 0.0)
    for _ in range(30):
        policy.observe_lookup("ngram", True, 0.9)
    return policy


def test_gpu_prior_lets_lookup_chains_grow_where_cpu_prior_keeps_them_short():
    """With only one- and two-row Force-3 timings, the device's prior prices longer chains: on a GPU's (rows nearly
    free) the policy verifies long lookup chains; the CPU's (rows dear) keeps them shorter."""
    gpu = _gpu_like_lookup_policy(DEVICE_PRIORS["cuda"]).choose()
    cpu = _gpu_like_lookup_policy(CPU).choose()
    assert gpu.levels == cpu.levels == 2 and gpu.drafter == "ngram"
    assert gpu.gamma2 == 10 and cpu.gamma2 < gpu.gamma2, (gpu, cpu)


def test_policy_prefers_plain_when_drafts_are_rejected_and_lookup_when_they_pass():
    policy = AdaptivePolicy({"ngram": "lookup"}, (), 2, 6, explore_every=1000)
    policy.observe_forward("force3", 1, 0.1)
    for rows in range(2, 8):
        policy.observe_forward("force3", rows, 0.1 * (1 + 0.15 * (rows - 1)))
    for _ in range(50):
        policy.observe_lookup("ngram", True, 0.05)
    assert policy.choose() == Plan(1)
    for _ in range(200):
        policy.observe_lookup("ngram", True, 0.95)
    assert policy.choose().levels == 2


@pytest.mark.parametrize("calibrated", [True, False])
def test_a_plan_measured_dearer_than_predicted_loses_its_near_tie(calibrated):
    """One-token n-gram chains predicted 3% faster than plain decoding whose steps take 10% longer than predicted
    (what the tier costs leave out, e.g. Qwen2.5-Coder at 32k): the calibration by measured / predicted step
    seconds moves the choice to plain within a few steps; without it (bounds (1, 1)) the policy keeps them."""
    priors = CPU if calibrated else PolicyPriors(calibration_bounds=(1.0, 1.0))
    policy = AdaptivePolicy({"ngram": "lookup"}, (), 2, 6, explore_every=1000, priors=priors)
    for rows in range(1, 8):
        policy.observe_forward("force3", rows, 0.1 * (1 + 0.068 * (rows - 1)))
    for _ in range(200):
        policy.observe_lookup("ngram", True, 0.1)
    assert policy.choose() == Plan(2, "ngram", gamma2=1)
    chosen = []
    for _ in range(12):
        plan = policy.choose()
        chosen.append(plan)
        dearer = 1.1 if plan.levels == 2 else 1.0
        seconds = dearer * policy.predicted_seconds
        policy.observe_step(plan, 1, seconds, seconds)  # all of it in forwards: no overhead to learn it from
    if calibrated:
        assert chosen[-6:] == [Plan(1)] * 6, chosen
        assert policy.calibration[(2, "ngram", False, False)] == pytest.approx(1.03)
    else:
        assert chosen == [Plan(2, "ngram", gamma2=1)] * 12


def test_three_level_lookup_plan_when_force2_is_cheap_and_not_when_it_is_not():
    """Free lookups as Force 1 of three levels: chosen when Force 2 is much cheaper than Force 3 (long
    context), not when Force 2 costs as much (short context)."""
    def policy_with(force2_seconds: float) -> AdaptivePolicy:
        policy = AdaptivePolicy({"ngram": "lookup"}, ("ngram",), 3, 8, explore_every=1000)
        for rows in range(1, 10):
            policy.observe_forward("force3", rows, 0.2 * (1 + 0.1 * (rows - 1)))
            policy.observe_forward("force2", rows, force2_seconds * (1 + 0.1 * (rows - 1)))
        for _ in range(100):
            policy.observe_lookup("ngram", True, 0.5)
            policy.observe_three_level(Plan(3, "ngram"), 1, 1, 8, 8)  # Force 3 accepts all Force 2 hands up
        return policy

    cheap = policy_with(0.04).choose()
    assert cheap.levels == 3 and cheap.drafter == "ngram", cheap
    assert policy_with(0.2).choose().levels != 3


def test_unmeasured_tiers_are_priced_at_their_prior_fraction_of_force3():
    """Until a tier is timed, its one-row forward costs its given fraction of Force 3's (bytes read, from the
    decoder), else ``unmeasured_fraction``: a cheap self drafter (0.15) is predicted to pay and runs; priced at half
    a Force-3 step it never would (no plan with its set-up unpaid is explored)."""
    def policy_with(fractions: dict[str, float]) -> AdaptivePolicy:
        policy = AdaptivePolicy({"self": "model"}, (), 2, 6, explore_every=1000, prior_fractions=fractions)
        for rows in range(1, 8):
            policy.observe_forward("force3", rows, 0.1 * (1 + 0.3 * (rows - 1)))  # verification dear (CPU)
        return policy

    cheap = policy_with({"draft:self": 0.15})
    assert cheap._drafter_seconds("self", 2) == pytest.approx(2 * 0.15 * 0.1)
    assert cheap.choose(remaining_tokens=1000).drafter == "self"
    dear = policy_with({})
    assert dear._drafter_seconds("self", 2) == pytest.approx(2 * CPU.unmeasured_fraction * 0.1)
    assert dear.choose(remaining_tokens=1000) == Plan(1)
    cheap.observe_forward("draft:self", 1, 0.06)  # timed: the measurement replaces the prior
    assert cheap._drafter_seconds("self", 2) == pytest.approx(0.12)


def test_the_decoder_prices_a_draft_model_by_its_bytes_and_its_fill_by_its_rows():
    """A draft model's drafting forward is priced by the bytes its lean copy and cache read (not the flat
    ``unmeasured_fraction``), and its cache's first fill, unmeasured behind a prefilled prefix, by its rows in the
    target's rows (rows x its bytes as a fraction of the target's), each at ``fill_row_fraction`` of a Force-3
    forward."""
    target, draft = make_model("llama-gqa"), make_model("llama-gqa", seed=4, num_hidden_layers=1)
    prompt = random_prompt(300, period=37)
    config = TriForceConfig(draft=draft, retrieval_budget=64, window=24)
    decoder = Decoder(target, config, None, None, [prompt.shape[1] + 4], False)
    with torch.no_grad(), recording_attention(target):
        decoder.run([prompt])
    fractions = decoder.hierarchy.tier_fractions(prompt.shape[1])
    assert 0 < fractions["draft:model"] < fractions["draft:self"] < 1  # one layer of two: fewer bytes
    rows = decoder.policy.setup_rows["model"]
    assert rows == pytest.approx((config.sink_tokens + config.window) * weight_bytes(draft) / weight_bytes(target))
    policy = AdaptivePolicy({"model": "model"}, (), 2, 6, explore_every=100, setup_seconds={"model": None})
    policy.setup_rows = {"model": 400.0}
    policy.observe_forward("force3", 1, 0.1)
    plan = Plan(2, "model", gamma2=2)
    policy.remaining_tokens = 100
    tokens, seconds = policy.predict(plan)
    assert seconds - policy._predict(plan)[1] == pytest.approx(CPU.fill_row_fraction * 400 * 0.1 * tokens / 100)


def test_the_decoder_prices_the_target_s_tiers_by_the_bytes_they_read():
    model = make_model("llama-gqa")
    prompt = random_prompt(300, period=37)
    fractions = {}
    for precision, retrieval in (("model", "model"), ("int8", "model"), ("lean-int4", "model"),
                                 ("lean-int4", "bfloat16")):
        config = TriForceConfig(draft="self", draft_precision=precision, retrieval_budget=64, window=24,
                                retrieval_dtype=retrieval)
        decoder = Decoder(model, config, None, None, [prompt.shape[1] + 4], False)
        with torch.no_grad(), recording_attention(model):
            decoder.run([prompt])  # the prefill allocates the full cache
        fractions[precision, retrieval] = decoder.hierarchy.tier_fractions(prompt.shape[1])
    model_f, lean_f = fractions["model", "model"], fractions["lean-int4", "model"]
    assert 0 < lean_f["draft:self"] < model_f["draft:self"] < model_f["force2"] < 1  # smaller cache, fewer bytes
    assert lean_f["draft:self"] < lean_f["force2"] < model_f["force2"]
    assert lean_f["draft:self"] < fractions["int8", "model"]["draft:self"] < model_f["draft:self"]  # int8 buffers
    # a bf16 retrieval cache: Force 2's 64 entries at half the bytes (the weights and Force 1's cache unchanged)
    half_f = fractions["lean-int4", "bfloat16"]
    assert half_f["draft:self"] == lean_f["draft:self"]
    # both lean-int4 tiers read the same weights: Force 2's 64 entries against Force 1's 16 + 24 leave 24 entries'
    # bytes between them; halving Force 2's 64 saves 32 entries' bytes
    entry = (lean_f["force2"] - lean_f["draft:self"]) / 24
    assert lean_f["force2"] - half_f["force2"] == pytest.approx(32 * entry)


def literal_force2_seconds(gamma1: int, gamma2: int, rate: float, coverage: float, draft: float,
                           force2: dict[int, float]) -> float:
    """Expected Force-1 + Force-2 seconds of one three-level step, by walking every outcome of the rounds exactly
    as `Force2Level.candidate_steps` runs them (drafts ``min(gamma1, wanted - produced - 1)``; a lookup proposes with
    probability ``coverage``; accepted + 1 tokens a round; stop once ``gamma2`` are produced)."""
    def walk(produced: int) -> float:
        if produced >= gamma2:
            return 0.0
        k = min(gamma1, gamma2 - produced - 1)
        alone = force2[1] + walk(produced + 1)
        if k == 0:
            return alone
        outcomes = [(rate ** j * (1 - rate), j) for j in range(k)] + [(rate ** k, k)]
        chain = k * draft + force2[k + 1] + sum(p * walk(produced + j + 1) for p, j in outcomes)
        return coverage * chain + (1 - coverage) * alone
    return walk(0)


@pytest.mark.parametrize("gamma1, gamma2, rate, coverage", [(2, 6, 0.7, 1.0), (3, 8, 0.4, 1.0), (2, 2, 0.9, 1.0),
                                                            (3, 8, 0.6, 0.5), (1, 5, 0.8, 1.0)])
def test_three_level_rounds_are_priced_as_the_loop_drafts_them(gamma1, gamma2, rate, coverage):
    """A three-level step's Force-1 and Force-2 seconds are the expectation over the rounds the loop runs, the last
    ones drafting fewer than gamma1 tokens (priced at gamma1 every round they were 28-45% dearer than measured)."""
    drafter, kind = ("ngram", "lookup") if coverage < 1 else ("self", "model")
    policy = AdaptivePolicy({drafter: kind}, (drafter,), gamma1, gamma2, explore_every=1000)
    force2 = {rows: 0.05 * (1 + 0.2 * (rows - 1)) for rows in range(1, gamma1 + 2)}
    assume_costs(policy, {"force2": force2, "force3": {1: 0.3, gamma2 + 1: 0.4},
                          f"draft:{drafter}": {1: 0.0 if kind == "lookup" else 0.02}})
    plan = Plan(3, drafter, gamma1, gamma2)
    assume_rates(policy, force3=0.5, force1={drafter: rate} if kind == "model" else {},
                 direct={drafter: rate}, coverage={drafter: coverage} if kind == "lookup" else {})
    _, seconds = policy.predict(plan)
    draft = 0.0 if kind == "lookup" else 0.02
    assert seconds == pytest.approx(literal_force2_seconds(gamma1, gamma2, rate, coverage, draft, force2) + 0.4)


def test_three_level_drafters_must_be_known():
    with pytest.raises(ValueError, match="three_level"):
        AdaptivePolicy({"ngram": "lookup"}, ("self",), 2, 6, explore_every=16)


def test_first_step_measures_force3_and_unpaid_setups_are_not_explored():
    policy = AdaptivePolicy({"self": "model"}, (), 2, 6, explore_every=2, setup_seconds={"self": 2.0})
    assert policy.choose() == Plan(1)  # nothing measured yet
    for rows in range(1, 8):
        policy.observe_forward("force3", rows, 0.1 * (1 + 0.1 * (rows - 1)))
    # 20 tokens left: the 2 s fill would not be repaid, and exploring must not pay it for a one-step try
    assert [policy.choose(remaining_tokens=20) for _ in range(6)] == [Plan(1)] * 6
    # many tokens left and self drafts accepted: chosen on merit, its set-up counted
    for _ in range(30):
        policy.observe_direct("self", 6, 6)
    assert policy.choose(remaining_tokens=10_000).drafter == "self"


def test_exploration_runs_a_kind_not_yet_run_before_rerunning_a_measured_one():
    """Every plan kind gets measured once before exploration returns to kinds already run: here the three-level
    kinds are predicted below plain decoding (a dear Force 2 prior) and would never be explored by prediction."""
    policy = AdaptivePolicy({"self": "model", "ngram": "lookup"}, ("self", "ngram"), 2, 6, explore_every=2)
    for rows in range(1, 8):
        policy.observe_forward("force3", rows, 0.1 * (1 + 0.1 * (rows - 1)))
        policy.observe_forward("force2", rows, 0.09 * (1 + 0.1 * (rows - 1)))
    policy.observe_forward("draft:self", 1, 0.01)
    for _ in range(20):
        policy.observe_direct("self", 3, 6)
        policy.observe_lookup("ngram", True, 0.5)
    for plan in (Plan(1), Plan(2, "self", gamma2=3), Plan(2, "ngram", gamma2=2)):  # these kinds have run
        policy.observe_step(plan, 1, 0.1, 0.1)
    explored = []  # (exploring did not pay here: the interval doubles, 2 -> 4 -> 8)
    for _ in range(16):
        plan = policy.choose(remaining_tokens=1000)
        if policy.exploring:
            explored.append(plan.kind)
        policy.observe_step(plan, 1, 0.1, 0.1)
    three_level = {(3, "", False, False), (3, "self", False, False), (3, "ngram", False, False)}
    assert set(explored[:3]) == three_level, explored
    assert policy.tried >= three_level


# -- candidate trees under policy="auto" ----------------------------------------------------------------------

def test_trees_are_chosen_where_their_rows_are_cheap_and_not_where_they_are_dear():
    """A Force-2 tree accepts more than its chain (measured); it is chosen when a tree forward's extra rows
    cost almost nothing (a memory-bound verifier) and not when each row costs as on a compute-bound one."""
    def policy_with(seconds_per_tree_row: float) -> AdaptivePolicy:
        policy = AdaptivePolicy({"self": "model"}, ("self",), 2, 6, explore_every=1000, force2_tree_nodes=12)
        for rows in range(1, 14):
            policy.observe_forward("force3", rows, 0.2 + 0.01 * (rows - 1))
            policy.observe_forward("force3-tree", rows, 0.2 + seconds_per_tree_row * (rows - 1))
            policy.observe_forward("force2", rows, 0.02)
            policy.observe_forward("draft:self", 1, 0.01)
        for _ in range(100):
            policy.observe_three_level(Plan(3, "self", 2, 6), 2, 1, 3, 6)  # chains: Force 3 rate 3/4
            policy.observe_three_level(Plan(3, "self", 2, 6, force2_tree=True), 2, 1, 9, 6)  # trees: 9/10
        return policy

    cheap = policy_with(0.01).choose()
    assert cheap.levels == 3 and cheap.force2_tree, cheap
    dear = policy_with(0.1).choose()
    assert dear.levels == 3 and not dear.force2_tree, dear


def test_tree_plans_exist_only_where_configured():
    chains = AdaptivePolicy({"self": "model", "ngram": "lookup"}, ("self",), 2, 6, explore_every=16)
    assert not any(p.force1_tree or p.force2_tree for p in chains.candidates())
    trees = AdaptivePolicy({"self": "model", "ngram": "lookup"}, ("self",), 2, 6, explore_every=16,
                           tree_drafters=("self",), tree_nodes=5, force2_tree_nodes=10)
    plans = trees.candidates()
    assert {p.drafter for p in plans if p.force1_tree} == {"self"}  # ngram was not given trees here
    assert all(p.gamma1 < 5 if p.levels == 3 else p.gamma2 < 5 for p in plans if p.force1_tree)
    assert any(p.force2_tree and p.force1_tree for p in plans) and all(p.levels == 3 for p in plans if p.force2_tree)
    assert len({p.name for p in plans}) == len(plans)
    with pytest.raises(ValueError, match="force2_tree_nodes"):
        AdaptivePolicy({"self": "model"}, ("self",), 2, 6, explore_every=16, force2_tree_nodes=6)
    with pytest.raises(ValueError, match="tree_nodes"):
        AdaptivePolicy({"self": "model"}, (), 2, 6, explore_every=16, tree_drafters=("self",))


def test_a_tree_plan_s_unmeasured_rate_follows_its_chain_s():
    """Until a tree plan has run, its rate is its chain's current rate plus the bonus: a lookup whose free
    counterfactual says it rarely matches does not keep a hopeful tree prior (0.9) it never measured."""
    policy = AdaptivePolicy({"ngram": "lookup"}, ("ngram",), 2, 6, explore_every=16, tree_drafters=("ngram",),
                            tree_nodes=8)
    for _ in range(200):
        policy.observe_lookup("ngram", True, 0.1)
    chain = policy.force1_rate("ngram")
    assert chain == pytest.approx(0.1, abs=0.02)
    assert policy.force1_rate("ngram", tree=True) == pytest.approx(chain + 0.1)
    assert policy.tree_rate("direct:ngram", policy.direct["ngram"].rate) == pytest.approx(chain + 0.1)
    policy.observe_three_level(Plan(3, "ngram", 2, 6, force1_tree=True), 0, 0, 3, 6)  # no match: nothing measured
    assert "force2:ngram" not in policy.tree_rates
    for _ in range(100):
        policy.observe_three_level(Plan(3, "ngram", 2, 6, force1_tree=True), 2, 0, 3, 6)  # trees: all accepted
    assert policy.force1_rate("ngram", tree=True) > 0.9 and policy.force1_rate("ngram") == chain


def test_tree_plans_are_priced_at_the_rows_their_tree_can_have():
    policy = AdaptivePolicy({"self": "model", "ngram": "lookup"}, (), 2, 6, explore_every=16,
                            tree_drafters=("self", "ngram"), tree_nodes=16, tree_branch=2)
    assert policy.tree_rows(16, 1, lookup=False) == 3  # the chain's node and one alternative, + the root's row
    assert policy.tree_rows(16, 3, lookup=False) == 7
    assert policy.tree_rows(16, 3, lookup=True) == 15  # 2 + 4 + 8 distinct continuations
    assert policy.tree_rows(16, 6, lookup=True) == 17  # the node budget binds
    for rows in range(1, 18):
        policy.observe_forward("force3", rows, 0.1 * rows)
    shallow = policy.predict(Plan(2, "self", gamma2=1, force1_tree=True))[1]
    assert shallow == pytest.approx(policy.predict(Plan(2, "self", gamma2=1))[1] + 0.1, rel=1e-6)


TREE_CYCLE = [Plan(3, "self", 2, 5, force1_tree=True, force2_tree=True), Plan(1), Plan(2, "ngram", gamma2=4),
              Plan(2, "self", gamma2=3, force1_tree=True), Plan(3, "ngram", 2, 4, force2_tree=True),
              Plan(2, "ngram", gamma2=4, force1_tree=True), Plan(3, "self", 1, 3), Plan(3, "ngram", 1, 3, True, False)]


@pytest.mark.parametrize("period", [1, 3])
def test_switches_between_tree_and_chain_plans_keep_greedy_identity(monkeypatch, period):
    out = run_cycle(monkeypatch, TREE_CYCLE, period, auto("self", tree_nodes=6, tree_branch=3, force2_tree_nodes=9))
    stats = out.triforce_stats
    assert {name for name in stats.detail.plans if "tree" in name.split()[-1]}, stats.detail.plans
    assert stats.detail.tree_nodes > stats.detail.force1_proposed and stats.detail.tree_side_accepts > 0


@pytest.mark.parametrize("draft", ["self", "ngram"])
def test_auto_policy_with_trees_is_greedy_identical(draft):
    model = make_model("llama-gqa")
    prompt = random_prompt(160, period=37)
    expected = model.generate(prompt, max_new_tokens=50, do_sample=False)
    config = auto(draft, tree_nodes=8, tree_branch=3, force2_tree_nodes=10, explore_every=2)
    out = model.generate(prompt, max_new_tokens=50, do_sample=False, triforce_config=config,
                         return_dict_in_generate=True)
    assert torch.equal(out.sequences, expected)
    assert sum(p["steps"] for p in out.triforce_stats.detail.plans.values()) == out.triforce_stats.force3_steps


TREE_ROTATION = [Plan(3, "self", 1, 2, force2_tree=True), Plan(2, "ngram", gamma2=2, force1_tree=True), Plan(1),
                 Plan(3, "ngram", 1, 2, True, True), Plan(2, "self", gamma2=2, force1_tree=True), Plan(3, "self", 1, 2)]
TREES = dict(tree_nodes=3, tree_branch=2, force2_tree_nodes=3)


def test_tree_and_chain_plans_chosen_from_the_past_keep_the_law_exact(monkeypatch):
    """`rotation_law` with trees at either level in the rotation (3 new tokens: 1 s, side accepts on 9 paths)."""
    gap, switches, stats = rotation_law(monkeypatch, TREE_ROTATION, 3, 3, **TREES)
    assert gap < 1e-5
    chosen = {plan for _, plan in switches}
    assert any(plan.force1_tree for plan in chosen) and any(plan.force2_tree for plan in chosen)
    assert any(s.detail.tree_side_accepts for s in stats), "no path accepted a tree's alternative"


def test_the_tree_rotation_catches_a_stale_residual(monkeypatch):
    """The same enumeration with Force 3's tree rule not updating the residual after a rejected child."""
    def stale_residual(decoder):
        decoder.force3_tree_verifier.resample = lambda residual, proposal: residual

    gap, _, _ = rotation_law(monkeypatch, TREE_ROTATION, 3, 3, stale_residual, **TREES)
    assert gap > 1e-3, gap


# -- robustness and short calls ----------------------------------------------------------------------------------

def test_one_disturbed_timing_does_not_set_a_tier_s_cost():
    """Another job's burst makes one forward slow: the cost stays what the other recent timings say; only when
    most recent timings are slow does the cost follow them."""
    costs = TierCosts()
    for _ in range(4):
        costs.observe("force3", 1, 0.1)
    costs.observe("force3", 1, 1.0)
    assert costs.estimate("force3", 1, 9.0) == pytest.approx(0.1)
    for _ in range(3):
        costs.observe("force3", 1, 0.5)
    assert costs.estimate("force3", 1, 9.0) == pytest.approx(0.5)


def test_one_slow_first_timing_does_not_price_out_a_row_count():
    """A row count's first timing, slower than the tier's other row counts imply (disturbed), prices it at what they
    imply until its own timings settle it; then its own cost stands, slow or not."""
    costs = TierCosts()
    for _ in range(CPU.settled_timings):
        costs.observe("force3", 1, 0.11)
        costs.observe("force3", 4, 0.16)
    costs.observe("force3", 5, 0.216)
    assert costs.estimate("force3", 5, 9.0) == pytest.approx(0.16 + (0.16 - 0.11) / 3)
    costs.observe("force3", 6, 0.17)  # a first timing cheaper than the others imply is believed at once
    assert costs.estimate("force3", 6, 9.0) == pytest.approx(0.17)
    for _ in range(CPU.settled_timings - 1):
        costs.observe("force3", 5, 0.216)
    assert costs.estimate("force3", 5, 9.0) == pytest.approx(0.216)


def _three_level_policy(setups: tuple[str, ...] = ("retrieval",)) -> AdaptivePolicy:
    """Force 2 at 0.3 of Force 3's cost (SmolLM2 at 16k: 0.22), Force 1 accepted by Force 2, Force 2 by Force 3
    for 2 tokens in 6: three levels are best in a long call."""
    policy = AdaptivePolicy({"self": "model"}, ("self",), 2, 6, explore_every=1000,
                            setup_seconds={"self": 0.0, **dict.fromkeys(setups)})
    for rows in range(1, 8):
        policy.observe_forward("force3", rows, 0.1 * (1 + 0.1 * (rows - 1)))
        policy.observe_forward("force2", rows, 0.03 * (1 + 0.1 * (rows - 1)))
    policy.observe_forward("draft:self", 1, 0.02)
    for _ in range(30):
        policy.observe_three_level(Plan(3, "self", 2, 6), 2, 0, 2, 6)
        policy.observe_direct("self", 0, 6)
    return policy


def test_the_first_selection_is_a_set_up_a_short_call_does_not_pay():
    """A few tokens left: the first selection (priced at a one-row Force-3 forward until measured) is not repaid
    and plain decoding runs; many tokens left: the three-level plan, its set-up counted, then no set-up."""
    assert _three_level_policy().choose(remaining_tokens=3) == Plan(1)
    assert _three_level_policy(setups=()).choose(remaining_tokens=3).levels == 3  # what the set-up changes
    policy = _three_level_policy()
    plan = policy.choose(remaining_tokens=1000)
    assert plan.levels == 3
    policy.started(plan)
    assert "retrieval" not in policy.setup_seconds and policy.setups(plan) == []


def test_exploration_is_bounded_by_what_the_rest_of_the_call_can_lose():
    """Every step is due for exploration (explore_every=1): near the end of a call no plan predicted slower is
    tried (its loss would exceed ``explore_budget`` of the few seconds left); with many tokens left one is."""
    def explored(remaining: int) -> bool:
        policy = AdaptivePolicy({"self": "model"}, (), 2, 6, explore_every=1, setup_seconds={})
        for rows in range(1, 8):
            policy.observe_forward("force3", rows, 0.1 * (1 + 0.1 * (rows - 1)))
        policy.observe_forward("draft:self", 1, 0.03)
        for _ in range(30):
            policy.observe_direct("self", 2, 6)
        policy.observe_step(policy.choose(remaining_tokens=remaining), 1, 0.1, 0.1)  # not yet due
        policy.choose(remaining_tokens=remaining)
        return policy.exploring

    assert not explored(4)
    assert explored(1000)


def test_a_three_level_step_pays_its_share_of_a_reselection():
    """With the retrieval cache re-selected every ``refresh_every`` Force-3 steps, a three-level step is priced one
    such share of a re-selection's measured seconds, and a plan drafting from Force 2 alone gains what it saves."""
    def predicted(refresh_every: int) -> float:
        policy = AdaptivePolicy({"ngram": "lookup"}, ("ngram",), 2, 6, explore_every=16, setup_seconds={},
                                refresh_every=refresh_every)
        policy.observe_forward("force3", 1, 0.1)
        policy.observe_forward("force2", 1, 0.02)
        policy.observe_forward("select", 1, 0.04)
        return policy.predict(Plan(3, "", 0, 3))[1]

    assert predicted(1) - predicted(4) == pytest.approx(0.04 * (1 - 1 / 4))
