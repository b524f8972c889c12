"""The adaptive hierarchy (``TriForceConfig(policy="auto")``): a plan per Force-3 step from an online cost model
(docs/config.md, "The adaptive policy").

A `Plan` is how one Force-3 step gets its candidates: ``plain`` (none: one-token decoding on the full cache),
``two-level`` (a drafter's chain verified by Force 3) or ``three-level`` (TriForce: Force 1 verified by Force 2,
Force 2's chain verified by Force 3; without a drafter, ``force2``: Force 2 drafts alone), with its gammas and,
where the config allows candidate trees, whether Force 1 proposes a tree and whether Force 2 hands Force 3 one.
Every plan is exact on its own, and the choice depends only on the past (timings and acceptances already
observed), so the output law is the target's whatever is chosen; greedy output stays identical to plain
``generate``.

The cost model, measured online in the same call: seconds per forward of each tier by rows (`TierCosts`; an
unmeasured row count priced at a per-row slope, `PolicyPriors.row_cost_slope`, until the tier's own timings span
``slope_span`` rows) and the per-step overhead; acceptance per level as a geometric rate (`AcceptanceRate`,
`expected_tokens`); a tree priced from its own rate and its own cost tier (``force3-tree``, ``force2-tree``) at the
most rows it can have (`tree_rows`); lookup drafters scored for free on every step against Force 3's distribution
(counterfactual); and per plan kind a calibration of measured / predicted seconds (`AdaptivePolicy.calibration`,
``calibration_bounds``).

The best predicted tokens/s runs (the first step runs plain decoding: it measures Force 3). Every
``explore_every`` steps the best plan of another kind runs once, a kind not yet run first (the interval doubles
while exploring does not pay, up to 16x); a plan with a set-up still to pay (a draft cache's fill; the retrieval
cache's first selection) is only chosen when predicted best with its set-up counted over the tokens left, and a try
is made only while its predicted loss is a small part of the rest of the call (``explore_budget``). Each step's
plan, predicted and measured tokens/s are in `TriForceDetail.plans`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from statistics import median_low

RETRIEVAL = "retrieval"  # `AdaptivePolicy.setup_seconds` key of the retrieval cache's first selection


@dataclass(frozen=True)
class PolicyPriors:
    """What the policy assumes until a call's own timings and acceptances replace it, and how fast it follows them.
    A field marked *measured* stands on the figure in docs/experiments.md, "The adaptive policy's priors"."""

    # an extra row of a forward, as a fraction of a one-row forward, until a tier's rows are timed over ``slope_span``
    # rows: a CPU forward is compute-bound, a GPU forward of a few rows bound by its reads (`DEVICE_PRIORS`; *measured*)
    row_cost_slope: float = 0.125
    # rows a tier's timings span before its own slope prices longer chains (over fewer, one disturbed timing would)
    slope_span: int = 3
    ema: float = 0.3  # weight of the newest step in the moving averages of calibration and overhead
    # a tier's cost: the lower median of its last this many timings (a timing disturbed by another job moves it only
    # once most recent timings are slow)
    recent_timings: int = 5
    # timings of a row count before they alone set its cost; before, a timing dearer than the tier's other row counts
    # imply is not believed (one disturbed first timing would price that row count out of a call; *measured*)
    settled_timings: int = 3
    # the retrieval cache's first selection (three-level plans' set-up) unmeasured, in one-row Force-3 forwards
    # (*measured*, rounded up: a set-up repaid only in a long call is not started in a short one)
    selection_setup_fraction: float = 1.0
    # an exploring step's predicted loss, at most this fraction of the rest of the call's predicted seconds
    explore_budget: float = 0.05
    # a row of a draft model's cache fill where the prefill did not time its chunks, in one-row forwards of that model
    # (*measured*, the largest kept: a fill repaid only in a long call is not started in a short one)
    fill_row_fraction: float = 0.05
    # a one-row forward of a tier not timed yet, in Force 3's, where the decoder gives no fraction of the bytes it
    # reads (`Hierarchy.tier_fractions`; a draft model; *measured*)
    unmeasured_fraction: float = 0.5
    # each step's measured / predicted seconds is clipped to this range in its kind's calibration (a stall moves it by
    # at most ``ema`` x the bound; *measured*: what the tier costs leave out)
    calibration_bounds: tuple[float, float] = (0.5, 2.0)
    # an unmeasured tree's acceptance over its chain's: its first path is the chain, and hope gets it tried once
    tree_prior_bonus: float = 0.1
    model_acceptance: float = 0.6  # a model drafter's per-token acceptance by Force 3, before any is measured
    lookup_acceptance: float = 0.3  # a lookup drafter's, before its counterfactual scores replace it
    force1_acceptance: float = 0.8  # a model drafter's by Force 2 (three levels; a lookup's: its `direct` rate)
    force3_acceptance: float = 0.8  # Force 2's by Force 3
    lookup_coverage: float = 0.5  # how often a lookup proposes a token


# by a target's device type; `PolicyPriors()` (a CPU's) for any other
DEVICE_PRIORS = {"cpu": PolicyPriors(), "cuda": PolicyPriors(row_cost_slope=0.015)}


def device_priors(device_type: str) -> PolicyPriors:
    """The priors of a ``device_type`` (``torch.device.type``) target: `DEVICE_PRIORS`, a CPU's for any other."""
    return DEVICE_PRIORS.get(device_type, DEVICE_PRIORS["cpu"])


@dataclass(frozen=True)
class Choice:
    """What `AdaptivePolicy.choose` decided for one step (`AdaptivePolicy.choice`): the plan, its predicted tokens/s
    and seconds per step (0: no prediction), and whether it explores, displacing a plan predicted at
    ``best_other`` tokens/s. A step is judged against its own choice when it is observed after the next was made
    (a device clock's timings, read a step late)."""

    plan: Plan | None
    prediction: float
    predicted_seconds: float
    exploring: bool
    best_other: float


@dataclass(frozen=True)
class Plan:
    levels: int  # 1: plain decoding, 2: drafter -> Force 3, 3: Force 1 -> Force 2 -> Force 3
    drafter: str = ""  # three levels: "" (with gamma1 0) is Force 2 drafting alone, no Force 1
    gamma1: int = 0
    gamma2: int = 0
    force1_tree: bool = False  # Force 1 proposes a tree (TriForceConfig.tree_nodes) instead of a chain
    force2_tree: bool = False  # Force 2 hands Force 3 a tree (TriForceConfig.force2_tree_nodes); three levels

    @property
    def name(self) -> str:
        trees = " tree" * self.force1_tree + " F2-tree" * self.force2_tree
        if self.levels == 1:
            return "plain"
        if self.levels == 2:
            return f"{self.drafter} g{self.gamma2}{trees}"
        if not self.drafter:
            return f"force2 g{self.gamma2}{trees}"
        return f"triforce {self.drafter} g{self.gamma1}/{self.gamma2}{trees}"

    @property
    def kind(self) -> tuple:
        """What exploration tells apart: levels, drafter and tree shape (not the gammas)."""
        return self.levels, self.drafter, self.force1_tree, self.force2_tree


def expected_tokens(rate: float, gamma: int) -> float:
    """Tokens one verification of a ``gamma``-long chain yields at per-token acceptance ``rate``."""
    if rate >= 1.0:
        return gamma + 1.0
    return (1.0 - rate ** (gamma + 1)) / (1.0 - rate)


class TierCosts:
    """Seconds per forward of each tier by rows: the lower median of its last ``recent_timings`` timings
    (`PolicyPriors`). A row count not measured is priced from the nearest measured one, each extra row at
    ``row_cost_slope`` of a one-row forward until the tier's timings span ``slope_span`` rows, then at the slope those
    timings show (never negative); a row count timed fewer than ``settled_timings`` times at the cheaper of its own
    cost and that price."""

    def __init__(self, priors: PolicyPriors = DEVICE_PRIORS["cpu"]) -> None:
        self.priors = priors
        self.slope = priors.row_cost_slope
        self.seconds: dict[str, dict[int, float]] = {}  # tier -> rows -> seconds (the estimate)
        self._recent: dict[tuple[str, int], deque[float]] = {}

    def observe(self, tier: str, rows: int, seconds: float) -> None:
        recent = self._recent.setdefault((tier, rows), deque(maxlen=self.priors.recent_timings))
        recent.append(seconds)
        self.seconds.setdefault(tier, {})[rows] = median_low(recent)

    def estimate(self, tier: str, rows: int, fallback: float) -> float:
        """Measured, else scaled from the nearest measured row count, else ``fallback`` (a one-row cost)."""
        measured = self.seconds.get(tier)
        if not measured:
            return fallback * (1 + self.slope * (rows - 1))
        if rows not in measured:
            return self._scaled(measured, rows)
        own = measured[rows]
        if len(self._recent[(tier, rows)]) >= self.priors.settled_timings or len(measured) == 1:
            return own
        return min(own, self._scaled({r: s for r, s in measured.items() if r != rows}, rows))

    def _scaled(self, measured: dict[int, float], rows: int) -> float:
        """``rows`` priced from the row counts ``measured`` (none of them ``rows``)."""
        nearest = min(measured, key=lambda r: abs(r - rows))
        fewest, most = min(measured), max(measured)
        if most - fewest >= self.priors.slope_span:  # seconds per extra row, from the tier's own timings
            per_row = max(measured[most] - measured[fewest], 0.0) / (most - fewest)
            return measured[nearest] + per_row * (rows - nearest)
        return measured[nearest] * (1 + self.slope * (rows - 1)) / (1 + self.slope * (nearest - 1))


class AcceptanceRate:
    """Geometric per-token acceptance from chains: accepted / (accepted + rejections), decayed."""

    def __init__(self, prior: float, weight: float = 2.0, decay: float = 0.97) -> None:
        self.accepted, self.trials, self.decay = prior * weight, weight, decay

    def observe(self, accepted: float, rejected: float) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.trials = self.decay * self.trials + accepted + rejected

    @property
    def rate(self) -> float:
        return min(self.accepted / self.trials, 0.999) if self.trials > 0 else 0.0


@dataclass
class PlanRecord:
    """What one plan did over the call: steps, predicted and measured tokens per second."""

    steps: int = 0
    tokens: int = 0
    seconds: float = 0.0
    predicted: float = 0.0  # sum of the predicted tokens/s of its steps

    def to_dict(self) -> dict:
        return {
            "steps": self.steps,
            "tokens": self.tokens,
            "measured_tokens_per_second": self.tokens / self.seconds if self.seconds else 0.0,
            "predicted_tokens_per_second": self.predicted / self.steps if self.steps else 0.0,
        }


class AdaptivePolicy:
    """Chooses the plan of each Force-3 step (see the module docstring).

    ``drafters``: ``{name: kind}`` of the drafters it may use (kind "model" or "lookup"); ``three_level``:
    the drafters TriForce's three-level plan may use as Force 1 (empty: no three-level plan);
    ``max_gamma1/2``: bounds (``max_lookup_gamma2``: of a lookup drafter's two-level chains, default ``max_gamma2``).
    ``prior_fractions``: ``{tier: fraction}``, a one-row forward of a tier not yet
    timed as a fraction of Force 3's; ``priors``: what it assumes until measured (`PolicyPriors`; default a CPU's,
    `device_priors` gives a device's).
    ``refresh_every``: Force-3 steps per re-selection of the retrieval cache (`TriForceConfig.refresh_interval`): a
    three-level step pays that share of one.
    ``tree_drafters``: the drafters that may propose trees of ``tree_nodes`` nodes
    (plans with ``force1_tree``: gammas below ``tree_nodes``); ``force2_tree_nodes > 0``: three-level plans may
    have Force 2 hand Force 3 a tree of that many nodes (``force2_tree``); ``tree_branch``: children per node.
    """

    def __init__(self, drafters: dict[str, str], three_level: tuple[str, ...], max_gamma1: int, max_gamma2: int,
                 explore_every: int, setup_seconds: dict[str, float | None] | None = None,
                 tree_drafters: tuple[str, ...] = (), tree_nodes: int = 0, force2_tree_nodes: int = 0,
                 tree_branch: int = 2, prior_fractions: dict[str, float] | None = None,
                 max_lookup_gamma2: int | None = None, priors: PolicyPriors = DEVICE_PRIORS["cpu"],
                 refresh_every: int = 1) -> None:
        unknown = [name for name in (*three_level, *tree_drafters) if name not in drafters]
        if unknown:
            raise ValueError(f"three_level / tree drafters {unknown} are not among the drafters {tuple(drafters)}")
        if bool(tree_drafters) != bool(tree_nodes):
            raise ValueError(f"tree_drafters {tree_drafters} and tree_nodes {tree_nodes}: both or neither")
        if force2_tree_nodes and force2_tree_nodes <= max_gamma2:
            raise ValueError(f"force2_tree_nodes ({force2_tree_nodes}) must exceed max_gamma2 ({max_gamma2})")
        self.drafters, self.three_level = drafters, tuple(three_level)
        self.tree_drafters, self.tree_nodes, self.tree_branch = tuple(tree_drafters), tree_nodes, tree_branch
        self.force2_tree_nodes = force2_tree_nodes if three_level else 0
        # one-time cost of a drafter's first use (a model drafter fills its cache), spread over the steps left; None:
        # unmeasured, priced by `setup_rows` (its fill's rows in the target's rows: rows x the draft's bytes as a
        # fraction of the target's; given for every unmeasured set-up) at ``fill_row_fraction`` of a one-row Force-3
        # forward each
        self.setup_seconds: dict[str, float | None] = dict(setup_seconds or {})
        self.setup_rows: dict[str, float] = {}
        self.remaining_tokens = 1 << 30
        self.max_gamma1, self.max_gamma2 = max_gamma1, max_gamma2
        self.refresh_every = refresh_every
        # a lookup drafter's two-level chains may be longer (they cost nothing to draft)
        self.max_lookup_gamma2 = max(max_gamma2, max_lookup_gamma2 or 0)
        self.priors = priors
        self.costs = TierCosts(priors)
        # a one-row forward of a tier not timed yet ("draft:<name>", "force2"), as a fraction of Force 3's one-row
        # forward (``priors.unmeasured_fraction`` where not given; the bytes each reads: `Hierarchy.tier_fractions`)
        self.prior_fractions: dict[str, float] = dict(prior_fractions or {})
        self.overhead: dict[int, float] = {}  # seconds per step outside the forwards, by plan levels
        # acceptance priors: hopeful enough that each plan is tried once, then measured
        self.direct = {name: AcceptanceRate(priors.model_acceptance if kind == "model" else priors.lookup_acceptance)
                       for name, kind in drafters.items()}
        # Force 1 verified by Force 2, per drafter (a lookup's prior: its counterfactual rate against Force 3,
        # `direct`, until its own three-level steps are measured; Force 2 approximates Force 3)
        self.force2_rate = {name: AcceptanceRate(priors.force1_acceptance) for name in self.three_level
                            if drafters[name] == "model"}
        self.force3_rate = AcceptanceRate(priors.force3_acceptance)  # Force 2 verified by Force 3
        # the same for trees ("direct:<drafter>", "force2:<drafter>", "force3"), from a tree plan's first measured
        # step on (`tree_rate`)
        self.tree_rates: dict[str, AcceptanceRate] = {}
        self.lookup_coverage = {name: AcceptanceRate(priors.lookup_coverage) for name, kind in drafters.items()
                                if kind == "lookup"}
        self.base_interval = explore_every
        self.interval = explore_every
        self.since_explore = 0
        self.current: Plan | None = None
        self.exploring = False
        self.prediction = 0.0  # predicted tokens/s of the chosen plan
        self.predicted_seconds = 0.0  # its predicted seconds per step, set-up excluded (0: no prediction)
        # per plan kind: moving average of measured / predicted step seconds (``priors.calibration_bounds``)
        self.calibration: dict[tuple, float] = {}
        self.best_other = 0.0  # when exploring: the prediction of the plan it displaced
        self.tried: set[tuple] = set()  # plan kinds run in this call (`Plan.kind`)
        self.records: dict[str, PlanRecord] = {}
        self.log: list[tuple[str, float, float]] = []

    # -- predictions ------------------------------------------------------------------------------------
    def _force3(self, rows: int) -> float:
        return self.costs.estimate("force3", rows, self.costs.estimate("force3", 1, 1.0))

    def _tree_tier(self, tier: str, rows: int, chain_cost: float) -> float:
        """Seconds of a tree forward of ``rows`` rows on ``tier``: measured on tree forwards, else the chain's
        ``chain_cost`` at those rows."""
        if self.costs.seconds.get(f"{tier}-tree"):
            return self.costs.estimate(f"{tier}-tree", rows, chain_cost)
        return chain_cost

    def tree_rows(self, nodes: int, depth: int, lookup: bool) -> int:
        """Most rows the forward of a tree of at most ``nodes`` nodes and depth ``depth`` takes (+1: the root's
        row). A chain plus leaf alternatives (a model drafter's tree, Force 2's) holds at most ``tree_branch``
        nodes per depth; a lookup's tree of distinct continuations at most ``tree_branch ** d`` at depth ``d``."""
        most, width = 0, 1
        for _ in range(depth):
            width = width * self.tree_branch if lookup else self.tree_branch
            most += width
            if most >= nodes:
                return nodes + 1
        return most + 1

    def tree_rate(self, key: str, chain_rate: float) -> float:
        """A tree plan's acceptance rate (``key``: `tree_rates`): measured, else ``chain_rate`` + the bonus."""
        rate = self.tree_rates.get(key)
        return rate.rate if rate is not None else min(chain_rate + self.priors.tree_prior_bonus, 0.999)

    def _observe_tree(self, key: str, chain_rate: float, accepted: float, rejected: float) -> None:
        if accepted + rejected <= 0:  # nothing proposed (a lookup without a match): nothing measured
            return
        if key not in self.tree_rates:
            self.tree_rates[key] = AcceptanceRate(self.tree_rate(key, chain_rate))
        self.tree_rates[key].observe(accepted, rejected)

    def _verify3(self, plan: Plan) -> tuple[float, float]:
        """``(expected tokens, seconds)`` of Force 3 verifying ``plan``'s ``gamma2`` proposals (a chain or a tree)."""
        if plan.force2_tree:
            rows = self.tree_rows(self.force2_tree_nodes, plan.gamma2, lookup=False)
            return (expected_tokens(self.tree_rate("force3", self.force3_rate.rate), plan.gamma2),
                    self._tree_tier("force3", rows, self._force3(rows)))
        return expected_tokens(self.force3_rate.rate, plan.gamma2), self._force3(plan.gamma2 + 1)

    def _prior(self, tier: str) -> float:
        """Seconds of a one-row forward of ``tier`` before it is timed (`prior_fractions` of Force 3's)."""
        return self.prior_fractions.get(tier, self.priors.unmeasured_fraction) * self._force3(1)

    def _drafter_seconds(self, name: str, tokens: int) -> float:
        if self.drafters[name] == "lookup":
            return self.costs.estimate(f"draft:{name}", 1, 0.0) if tokens else 0.0
        return tokens * self.costs.estimate(f"draft:{name}", 1, self._prior(f"draft:{name}"))

    def setups(self, plan: Plan) -> list[str]:
        """The set-ups ``plan`` would pay if run now (`setup_seconds` keys): its drafter's, the retrieval's."""
        needs = [plan.drafter] if plan.levels > 1 else []
        needs += [RETRIEVAL] if plan.levels == 3 else []
        return [name for name in needs if name in self.setup_seconds]

    def _setup_price(self, name: str) -> float:
        setup = self.setup_seconds[name]
        if setup is not None:
            return setup
        if name == RETRIEVAL:
            return self.priors.selection_setup_fraction * self._force3(1)
        # a drafter's fill, unmeasured: its rows at ``fill_row_fraction`` of a one-row Force-3 forward each
        return self.priors.fill_row_fraction * self.setup_rows[name] * self._force3(1)

    def predict(self, plan: Plan) -> tuple[float, float]:
        """``(expected tokens, predicted seconds)`` of one step of ``plan``, the set-ups it still has to pay
        (`setups`) spread over the steps the rest of the call would take with it."""
        tokens, seconds = self._calibrated(plan)
        setup = sum(self._setup_price(name) for name in self.setups(plan))
        return tokens, seconds + setup * tokens / max(self.remaining_tokens, tokens)

    def _calibrated(self, plan: Plan) -> tuple[float, float]:
        """`_predict` with its seconds scaled by the kind's `calibration` (set-up excluded)."""
        tokens, seconds = self._predict(plan)
        return tokens, seconds * self.calibration.get(plan.kind, 1.0)

    def set_up(self, fill_rows: dict[str, float], seconds_per_row: float | None,
               prior_fractions: dict[str, float]) -> None:
        """The call's set-ups and priors, known once its prompt is prefilled. ``fill_rows``: per model drafter that
        fills its cache by a forward, its fill's rows in the target's rows (rows x the draft's bytes over the
        target's), priced at the prefill's ``seconds_per_row`` (None: unmeasured, ``priors.fill_row_fraction`` of a
        one-row Force-3 forward per row); where three-level plans may run, the retrieval cache's first selection
        (priced by ``priors.selection_setup_fraction``); ``prior_fractions``: one-row forwards of tiers not yet
        timed, as fractions of Force 3's."""
        self.setup_seconds = {name: None if seconds_per_row is None else rows * seconds_per_row
                              for name, rows in fill_rows.items()}
        if self.three_level:
            self.setup_seconds[RETRIEVAL] = None
        self.setup_rows = dict(fill_rows)
        self.prior_fractions.update(prior_fractions)

    def started(self, plan: Plan) -> None:
        """``plan`` is about to run: its set-ups (`setups`) are paid, and its kind counts as tried."""
        for name in self.setups(plan):
            self.setup_seconds.pop(name)
        self.tried.add(plan.kind)

    def choice(self) -> Choice:
        """The last `choose`'s decision."""
        return Choice(self.current, self.prediction, self.predicted_seconds, self.exploring, self.best_other)

    def _predict(self, plan: Plan) -> tuple[float, float]:
        overhead = self.overhead.get(plan.levels, 0.0)
        if plan.levels == 1:
            return 1.0, self._force3(1) + overhead
        if plan.levels == 2:
            rate = self.direct[plan.drafter].rate
            coverage = self.lookup_coverage[plan.drafter].rate if plan.drafter in self.lookup_coverage else 1.0
            verify = self._force3(plan.gamma2 + 1)
            if plan.force1_tree:
                rate = self.tree_rate(f"direct:{plan.drafter}", rate)
                rows = self.tree_rows(self.tree_nodes, plan.gamma2, plan.drafter in self.lookup_coverage)
                verify = self._tree_tier("force3", rows, self._force3(rows))
            tokens = 1.0 + coverage * (expected_tokens(rate, plan.gamma2) - 1.0)
            seconds = (self._drafter_seconds(plan.drafter, plan.gamma2) + coverage * verify
                       + (1 - coverage) * self._force3(1))
            return tokens, seconds + overhead
        # Force-2 rounds until Force 2 has gamma2 tokens: Force 1's chain (a lookup proposes one only with
        # probability `coverage`) verified in one Force-2 forward
        fallback = self._prior("force2")
        select = self.costs.estimate("select", 1, 0.0) / self.refresh_every
        tokens, verify3 = self._verify3(plan)
        if not plan.drafter:  # Force 2 alone: one one-row forward per token
            return tokens, plan.gamma2 * self.costs.estimate("force2", 1, fallback) + verify3 + select + overhead
        coverage = self.lookup_coverage[plan.drafter].rate if plan.drafter in self.lookup_coverage else 1.0
        rate = self.force1_rate(plan.drafter, plan.force1_tree)
        if not plan.force1_tree:
            return tokens, self._chain_rounds(plan, rate, coverage, fallback) + verify3 + select + overhead
        per_round = 1.0 + coverage * (expected_tokens(rate, plan.gamma1) - 1.0)
        rows = self.tree_rows(self.tree_nodes, plan.gamma1, plan.drafter in self.lookup_coverage)
        verify2 = self._tree_tier("force2", rows, self.costs.estimate("force2", rows, fallback))
        force2 = coverage * verify2 + (1 - coverage) * self.costs.estimate("force2", 1, fallback)
        seconds = plan.gamma2 / per_round * (self._drafter_seconds(plan.drafter, plan.gamma1) + force2) + verify3
        return tokens, seconds + select + overhead

    def _chain_rounds(self, plan: Plan, rate: float, coverage: float, fallback: float) -> float:
        """Expected seconds of Force 1 and Force 2 until Force 2 holds ``plan.gamma2`` tokens, the rounds run as
        `levels.Force2Level.candidate_steps` runs them: with ``s`` tokens still wanted Force 1 drafts
        ``min(gamma1, s - 1)`` (a lookup proposes with probability ``coverage``, else nothing), Force 2 verifies
        them in one forward of that many rows + 1 and keeps the accepted ones (per-token ``rate``, geometric) and its
        own next token. A round's chain is shorter than ``gamma1`` near the end, so pricing ``gamma1`` every round
        over-prices three-level steps (docs/experiments.md, "The adaptive policy's priors")."""
        seconds = [0.0] * (plan.gamma2 + 1)  # seconds[s]: expected seconds with s tokens still wanted
        for s in range(1, plan.gamma2 + 1):
            alone = self.costs.estimate("force2", 1, fallback) + seconds[s - 1]  # nothing drafted: Force 2's token
            drafted = min(plan.gamma1, s - 1)
            if not drafted:
                seconds[s] = alone
                continue
            chain = self._drafter_seconds(plan.drafter, drafted) + self.costs.estimate("force2", drafted + 1, fallback)
            for accepted in range(drafted + 1):  # then Force 2's own token: accepted + 1 tokens gained
                chance = rate ** accepted * (1 - rate) if accepted < drafted else rate ** drafted
                chain += chance * seconds[max(s - accepted - 1, 0)]
            seconds[s] = coverage * chain + (1 - coverage) * alone
        return seconds[plan.gamma2]

    def force1_rate(self, drafter: str, tree: bool = False) -> float:
        """Per-token acceptance of ``drafter``'s chains (``tree``: trees) by Force 2."""
        chain = self.force2_rate[drafter].rate if drafter in self.force2_rate else self.direct[drafter].rate
        return self.tree_rate(f"force2:{drafter}", chain) if tree else chain

    def candidates(self) -> list[Plan]:
        plans = [Plan(1)]
        for name in self.drafters:
            trees = (False, True) if name in self.tree_drafters else (False,)
            longest = self.max_lookup_gamma2 if self.drafters[name] == "lookup" else self.max_gamma2
            plans += [Plan(2, name, gamma2=g, force1_tree=tree) for g in range(1, longest + 1)
                      for tree in trees if not tree or g < self.tree_nodes]
        force2_trees = (False, True) if self.force2_tree_nodes else (False,)
        if self.three_level:  # Force 2 drafting alone (its chain verified by Force 3)
            plans += [Plan(3, "", 0, g2, False, tree2) for g2 in range(1, self.max_gamma2 + 1)
                      for tree2 in force2_trees]
        for name in self.three_level:
            trees = (False, True) if name in self.tree_drafters else (False,)
            plans += [Plan(3, name, g1, g2, tree1, tree2) for g1 in range(1, self.max_gamma1 + 1)
                      for g2 in range(2, self.max_gamma2 + 1) if g2 > g1
                      for tree1 in trees if not tree1 or g1 < self.tree_nodes for tree2 in force2_trees]
        return plans

    def tokens_per_second(self, plan: Plan) -> float:
        tokens, seconds = self.predict(plan)
        return tokens / seconds if seconds > 0 else 0.0

    # -- choice -----------------------------------------------------------------------------------------
    def choose(self, remaining_tokens: int | None = None) -> Plan:
        """The plan of the next step (the best predicted, or, when it is time, the best other one)."""
        if remaining_tokens is not None:
            self.remaining_tokens = max(1, remaining_tokens)
        if not self.costs.seconds.get("force3"):  # nothing to predict from yet: the first step measures Force 3
            self.exploring, self.prediction, self.predicted_seconds, self.current = False, 0.0, 0.0, Plan(1)
            self.since_explore += 1
            return self.current
        scored = sorted(((self.tokens_per_second(p), p) for p in self.candidates()), key=lambda x: -x[0])
        best = scored[0][1]
        self.exploring, self.prediction = False, scored[0][0]
        if self.since_explore >= self.interval:
            self.since_explore = 0
            # a plan whose set-up (a draft cache's first fill, the first selection) is still to pay runs only when
            # predicted best: a one-step try would pay the whole set-up for one step's worth of measurement; and a
            # try must not cost more than ``explore_budget`` of what the rest of the call is predicted to take
            left = self.remaining_tokens / scored[0][0] if scored[0][0] > 0 else 0.0
            others = [(tps, p) for tps, p in scored if p.kind != best.kind and not self.setups(p)
                      and self._exploration_loss(p, scored[0][0]) <= self.priors.explore_budget * left]
            # a kind never run is predicted from priors (and rates shared with other kinds) alone: tried first (a
            # 64-token call explores once or twice; docs/experiments.md, "The adaptive policy's priors")
            untried = [(tps, p) for tps, p in others if p.kind not in self.tried]
            if others:
                self.exploring, self.best_other = True, scored[0][0]
                self.prediction, best = (untried or others)[0]
        self.since_explore += 1
        self.current = best
        self.predicted_seconds = self._calibrated(best)[1]
        return best

    def _exploration_loss(self, plan: Plan, best_speed: float) -> float:
        """Predicted seconds one step of ``plan`` takes beyond what the best plan takes for the same tokens."""
        tokens, seconds = self.predict(plan)
        return seconds - tokens / best_speed if best_speed > 0 else 0.0

    # -- observations -----------------------------------------------------------------------------------
    def observe(self, step) -> None:
        """One finished step (a `report.StepRecord`, read): what each forward cost (a forward shared by rows: its
        wall, once per row that took part), how each row's levels did, what the free lookups would have proposed, and
        the step's seconds."""
        plan = step.plan
        self.observe_forward("force3-tree" if step.force3_tree else "force3", step.force3_rows, step.force3_seconds)
        drafted, force1_seconds = 0, 0.0
        for row in step.rows:
            for name, acceptance in row.lookups.items():
                self.observe_lookup(name, acceptance is not None, acceptance or 0.0)
            if row.report is None:
                continue
            for timing in row.report.timings:
                self.observe_forward(*timing)
            if plan.levels == 2 and row.proposed:
                self.observe_direct(plan.drafter, row.accepted, row.proposed, plan.force1_tree)
            elif plan.levels == 3:
                self.observe_three_level(plan, row.report.force2_accepted, row.report.force2_rejections,
                                         row.accepted, row.proposed)
            drafted += row.report.drafted
            force1_seconds += row.report.force1_seconds
        lookup = plan.levels > 1 and self.drafters.get(plan.drafter) == "lookup"
        if drafted and (plan.levels == 2 or not lookup):
            # a model drafter: seconds per drafted token; a lookup (two levels: one call per row): per step
            self.observe_forward(f"draft:{plan.drafter}", 1, force1_seconds if lookup else force1_seconds / drafted)
        tokens = sum(row.committed for row in step.rows) / max(len(step.rows), 1)
        self.observe_step(plan, tokens, step.seconds, step.forward_seconds, step.choice)

    def observe_forward(self, tier: str, rows: int, seconds: float) -> None:
        self.costs.observe(tier, rows, seconds)

    def observe_step(self, plan: Plan, tokens: int, seconds: float, forward_seconds: float,
                     choice: Choice | None = None) -> None:
        """One finished step: its tokens, wall seconds and the part spent in timed forwards; ``choice``: what was
        decided for it (default: the last `choose`'s)."""
        choice = choice if choice is not None else self.choice()
        predicted = choice.prediction
        if choice.predicted_seconds > 0 and seconds > 0 and plan == choice.plan:
            low, high = self.priors.calibration_bounds
            ratio = min(max(seconds / choice.predicted_seconds, low), high)
            old = self.calibration.get(plan.kind, 1.0)
            self.calibration[plan.kind] = (1 - self.priors.ema) * old + self.priors.ema * old * ratio
        old = self.overhead.get(plan.levels)
        spare = max(seconds - forward_seconds, 0.0)
        self.overhead[plan.levels] = spare if old is None else (1 - self.priors.ema) * old + self.priors.ema * spare
        self.tried.add(plan.kind)
        record = self.records.setdefault(plan.name, PlanRecord())
        record.steps += 1
        record.tokens += tokens
        record.seconds += seconds
        record.predicted += predicted
        self.log.append((plan.name, predicted, tokens / seconds if seconds else 0.0))
        if choice.exploring:
            won = tokens / seconds >= choice.best_other if seconds else False
            self.interval = self.base_interval if won else min(2 * self.interval, 16 * self.base_interval)

    def observe_direct(self, drafter: str, accepted: int, proposed: int, tree: bool = False) -> None:
        """A two-level step: Force 3 accepted ``accepted`` of ``drafter``'s ``proposed`` (``tree``: a tree's depth)."""
        rejected = 1.0 if accepted < proposed else 0.0
        if tree:
            self._observe_tree(f"direct:{drafter}", self.direct[drafter].rate, accepted, rejected)
        else:
            self.direct[drafter].observe(accepted, rejected)

    def observe_three_level(self, plan: Plan, force2_accepted: int, force2_rejections: int,
                            force3_accepted: int, proposed: int) -> None:
        """A three-level step of ``plan``: Force 2's acceptances of Force 1 and Force 3's of Force 2."""
        drafter = plan.drafter
        if plan.force1_tree:
            self._observe_tree(f"force2:{drafter}", self.force1_rate(drafter), force2_accepted, force2_rejections)
        elif drafter:  # (none: Force 2 drafted alone, nothing of Force 1's to observe)
            (self.force2_rate.get(drafter) or self.direct[drafter]).observe(force2_accepted, force2_rejections)
        force3_rejected = 1.0 if force3_accepted < proposed else 0.0
        if plan.force2_tree:
            self._observe_tree("force3", self.force3_rate.rate, force3_accepted, force3_rejected)
        else:
            self.force3_rate.observe(force3_accepted, force3_rejected)

    def observe_lookup(self, drafter: str, proposed: bool, acceptance: float) -> None:
        """Counterfactual: would the lookup have proposed a token, and with what acceptance probability."""
        self.lookup_coverage[drafter].observe(1.0 if proposed else 0.0, 0.0 if proposed else 1.0)
        if proposed:
            self.direct[drafter].observe(acceptance, 1.0 - acceptance)

    def summary(self) -> dict:
        return {name: record.to_dict() for name, record in self.records.items()}
