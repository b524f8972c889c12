"""`Hierarchy`: one call's tiers, built once from the target, a resolved config and the rows, and driven by the
library's loop (`loop.Decoder`) or transformers' (`candidates.TriForceCandidateGenerator`).

    Force 3    the target on its full cache: `force3.Force3` / `force3.RaggedForce3` (the cache sized by
               `force3.full_cache`), or the cache transformers' loop verifies on (``full_cache=``)
    drafters   per name, one per row (the configured drafter, and the policy's others), built on first use; in a batch
               model drafters' caches share storage (`Lockstep`)
    levels     per plan, one per row: `levels.Force1Level` (two levels) over the plan's drafter, or
               `levels.Force2Level` (three levels: Force 2's retrieval cache over the full cache) with the plan's
               drafter as its Force 1; built on the plan's first use
    policy     the library's loop's plans: the configured one (`Hierarchy.fixed_plan`), or under ``policy="auto"``
               the call's `AdaptivePolicy` over the drafters it weighs (`adaptive_policy`), seeded after the prefill
               with the tiers' prices by the bytes they read (`Hierarchy.seed_policy`)
"""

from __future__ import annotations

import torch

from ..drafters import DRAFTERS, DraftContext, build_drafter
from ..drafters.model import ModelDrafter
from ..drafters.registry import MODEL_DRAFTER, spec_of
from ..forwards.forward import Clock, TierGenerator, run_inline
from ..stats import TriForceStats
from ..verification.sampling import ChainVerifier, Sampler
from ..verification.tree import TreeVerifier
from .force3 import Force3, RaggedForce3
from .levels import RETRIEVAL_STORAGE, Force1Level, Force2Level, NoDrafter
from .lockstep import Lockstep
from .policy import AdaptivePolicy, Plan, PolicyPriors, device_priors
from .resolved import ResolvedConfig
from .sizing import sink_window_rows
from .tiers import kv_bytes_per_token, lean_self_drafting, tier_forwards, tier_model, weight_bytes


def adaptive_policy(config: ResolvedConfig, max_length: int, target=None) -> AdaptivePolicy | None:
    """``policy="auto"``: the configured drafter plus the free n-gram lookup (and, beside a draft model, the target's
    own lean copy where it drafts lean: the ``"self"`` drafter; `lean_self_drafting`), each as Force 1 of three levels
    too if ``levels=3`` and the request (``max_length`` tokens) is longer than the retrieval budget, with
    tree plans beside the chain plans where the config sets ``tree_nodes`` (drafters that propose trees) or
    ``force2_tree_nodes`` (three levels); ``"fixed"``: None (every step runs the configured plan).
    """
    if config.policy == "fixed":
        return None
    kinds = {config.draft_name: spec_of(config.draft).kind}
    if target is not None and lean_self_drafting(config, target):
        kinds["self"] = DRAFTERS["self"].kind
    kinds.setdefault("ngram", DRAFTERS["ngram"].kind)  # the free lookup, scored on every step
    # three levels only where Force 2 can see less than Force 3: a retrieval budget covering the whole
    # request makes Force 2 a copy of Force 3 at the same cost
    sparse = max_length > config.retrieval_budget
    three = tuple(kinds) if config.levels == 3 and sparse else ()
    trees = tuple(name for name in kinds if DRAFTERS[name].trees) if config.tree_nodes else ()
    return AdaptivePolicy(kinds, three, config.gamma1, config.gamma2, config.explore_every,
                          tree_drafters=trees, tree_nodes=config.tree_nodes if trees else 0,
                          force2_tree_nodes=config.force2_tree_nodes, tree_branch=config.tree_branch,
                          max_lookup_gamma2=config.lookup_gamma2, priors=policy_priors(target),
                          refresh_every=config.refresh_interval)


def policy_priors(target) -> PolicyPriors:
    """The policy's priors for ``target``'s device type (`policy.device_priors`; a CPU's without a device)."""
    return device_priors(getattr(getattr(target, "device", None), "type", "cpu"))


class Hierarchy:
    """The tiers of one call over ``len(processors)`` rows (module docstring). Row ``b`` has its own processors,
    drafters, levels and row of the full cache; every random draw goes through ``sampler``, every forward is timed on
    ``clock``.

    ``full_cache``: the cache transformers' loop runs Force 3 on (batch size 1; no `Force3` then); else Force 3 is
    built here for rows of up to ``max_lengths`` tokens (``paddings``: each row's left padding, a batch's).
    ``max_lengths`` also sizes the model drafters' caches (`sizing.sink_window_rows`; None: sink + window)."""

    def __init__(self, model, config: ResolvedConfig, processors: list, do_sample: bool, sampler: Sampler,
                 clock: Clock, max_lengths: list[int] | None = None, paddings: list[torch.Tensor] | None = None,
                 full_cache=None) -> None:
        self.model, self.config, self.processors = model, config, processors
        self.do_sample, self.sampler, self.clock = do_sample, sampler, clock
        self.batch = len(processors)
        if full_cache is not None:
            self.force3, self.loop_cache = None, full_cache  # the cache transformers' loop verifies on
        elif self.batch == 1:
            self.force3, self.loop_cache = Force3(model, config, max_lengths[0], clock), None
        else:
            self.force3, self.loop_cache = RaggedForce3(model, config, max_lengths, paddings, clock), None
        # Force 2's exact rules (the same rule as Force 3's; their own objects, so that a test can alter one level)
        self.force2_verifier = ChainVerifier(do_sample, sampler)
        self.force2_tree_verifier = TreeVerifier(do_sample, sampler)  # TriForceConfig.force2_tree_nodes > 0
        self.lockstep = Lockstep(self.batch)
        self.drafters: dict[str, list] = {}  # name -> per row
        self.levels: dict[tuple[int, str], list] = {}  # (2, drafter) or (3, "") -> per row
        self.max_lengths = max_lengths
        self.fixed_plan = Plan(config.levels, config.draft_name, config.gamma1, config.gamma2,
                               force1_tree=bool(config.tree_nodes), force2_tree=bool(config.force2_tree_nodes))
        # the library's loop chooses each step's plan (policy="auto"); transformers' loop runs the configured one
        self.policy = adaptive_policy(config, max(max_lengths), model) if full_cache is None else None

    def full(self, b: int):
        """Row ``b`` of Force 3's full cache."""
        return self.loop_cache if self.force3 is None else self.force3.row(b)

    def tier_model(self, model, tier: int):
        """The model Force ``tier`` (1 or 2) runs for ``model`` at the drafting precision (`tiers.tier_model`)."""
        return tier_model(model, self.config.draft_precision, tier, self.config.tier_compile)

    def drafter(self, b: int, name: str):
        """Row ``b``'s drafter ``name`` (``"model"``: the config's draft model); every row's built at once, and in a
        batch model drafters' caches share storage."""
        if name not in self.drafters:
            rows = self._new_drafters(name, range(self.batch))
            if self.batch > 1 and all(isinstance(drafter, ModelDrafter) for drafter in rows):
                self.lockstep.share([drafter.cache for drafter in rows], f"draft:{name}")
            self.drafters[name] = rows
        return self.drafters[name][b]

    def _new_drafters(self, name: str, rows) -> list:
        """New drafters ``name`` for the rows ``rows``, every one the size of the longest row's (a batch's drafter
        caches share storage)."""
        config = self.config if name == self.config.draft_name else self.config.with_draft(name)
        force1 = lambda model: self.tier_model(model, 1)  # noqa: E731
        rows_held = sink_window_rows(config, max(self.max_lengths) if self.max_lengths else None)
        return [build_drafter(DraftContext(self.model, config, self.processors[r], self.do_sample, self.sampler,
                                           self.full(r), self.clock, force1, rows_held)) for r in rows]

    def _new_levels(self, key: tuple[int, str], rows) -> list:
        """New levels ``key`` (``(2, drafter)`` or ``(3, "")``) for the rows ``rows``."""
        if key[0] == 2:
            return [Force1Level(self.drafter(r, key[1]), self.config) for r in rows]
        # Force 2's model (a lean copy is made here if not yet: only where a three-level step runs)
        target = self.tier_model(self.model, 2)
        return [Force2Level(target, NoDrafter(), self.config, self.processors[r], self.force2_verifier, self.full(r),
                            self.clock, self.force2_tree_verifier) for r in rows]

    def reset_row(self, b: int, processors) -> None:
        """Row ``b`` made new for another request with ``processors``: new drafters and levels of every kind built
        so far (a model drafter's and Force 2's caches laid into the row of the shared ones they leave), so that
        nothing of the row's last request is left in them."""
        self.processors[b] = processors
        for name, drafters in self.drafters.items():
            (drafter,) = self._new_drafters(name, [b])
            if isinstance(drafter, ModelDrafter) and id(drafters[b].cache) in self.lockstep.rows:
                self.lockstep.replace(drafters[b].cache, drafter.cache)
            drafters[b] = drafter
        for key, levels in self.levels.items():
            (level,) = self._new_levels(key, [b])
            if key[0] == 3 and id(levels[b].cache) in self.lockstep.rows:
                self.lockstep.replace(levels[b].cache, level.cache)
            levels[b] = level

    def level(self, b: int, plan: Plan):
        """Row ``b``'s level for ``plan``: None (plain), `Force1Level` or `Force2Level` (its retrieval cache synced
        from row ``b`` of the full cache; in a batch, a row of a cache shared by every row's)."""
        if plan.levels == 1:
            return None
        key = (plan.levels, plan.drafter if plan.levels == 2 else "")  # one Force 2 whoever drafts for it
        if key not in self.levels:
            rows = self._new_levels(key, range(self.batch))
            if plan.levels == 3 and self.batch > 1:
                self.lockstep.share([level.cache for level in rows], "force2")
            self.levels[key] = rows
        level = self.levels[key][b]
        if plan.levels == 3:  # Force 1: the plan's drafter, or none (Force 2 drafts alone)
            level.use(self.drafter(b, plan.drafter) if plan.drafter else NoDrafter())
        return level

    def drive(self, steps: dict[int, TierGenerator]) -> dict:
        """Run each row's candidate generator (``steps``: row -> a level's ``candidate_steps``) to its end; returns each
        row's result. Batch size 1 runs each forward when it is asked for (`run_inline`); a batch, its rows in
        lockstep (`Lockstep.drive`: rows whose caches share storage in one forward)."""
        if self.batch == 1:
            return {b: run_inline(row_steps) for b, row_steps in steps.items()}
        return self.lockstep.drive(steps)

    def seed_policy(self, seconds_per_token, context: int) -> None:
        """The adaptive policy's priors, from what the prefill measured (``seconds_per_token``: `Force3.prefill`'s)
        and the tiers' bytes at ``context`` tokens (`tier_fractions`); nothing under ``policy="fixed"``."""
        if self.policy is None:
            return
        # a draft cache's fill is a short-context prefill, priced at the prefill's speed
        window = self.config.sink_tokens + self.config.window
        fill_rows = {name: window * weight_bytes(drafter.fill_model) / weight_bytes(self.model)
                     for name, drafter in self.filled_drafters().items()}  # a copy: ~free
        self.policy.set_up(fill_rows, seconds_per_token, self.tier_fractions(context))

    def tier_fractions(self, context: int) -> dict[str, float]:
        """The target's own tiers' one-row forwards as fractions of Force 3's at ``context`` tokens, by bytes read
        (a one-row forward is memory-bound): Force 1 self-drafting (``"draft:self"``: its tier weights and a
        sink+window cache) and Force 2 (``"force2"``: its tier weights and the retrieval budget), against the
        target's weights and the full cache (the policy's priors until each tier is timed)."""
        per_token = self.force3.nbytes() / max(self.max_lengths)  # the full cache's bytes per position
        force3 = weight_bytes(self.model) + context * per_token
        window = self.config.sink_tokens + self.config.window
        fractions = {}  # the tiers the policy may run (pricing one makes its copy)
        if "self" in self.policy.drafters:
            force1 = weight_bytes(tier_model(self.model, self.config.draft_precision, 1)) + window * per_token
            fractions["draft:self"] = force1 / force3
        if self.policy.three_level:
            force2 = weight_bytes(tier_model(self.model, self.config.draft_precision, 2)) + \
                min(self.config.retrieval_budget, context) * per_token * self.retrieval_width()
            fractions["force2"] = force2 / force3
        for name, drafter in self.filled_drafters().items():  # a draft model: its drafting copy and its own cache
            own = weight_bytes(drafter.model) + window * kv_bytes_per_token(drafter.fill_model)
            fractions[f"draft:{name}"] = own / force3
        return fractions

    def retrieval_width(self) -> float:
        """Bytes of a Force-2 cache entry against a full-cache entry (1: the model's dtype; 0.5: bf16 of fp32)."""
        storage = RETRIEVAL_STORAGE[self.config.retrieval_dtype]
        model = next(self.model.parameters()).dtype
        return 1.0 if storage is None else storage.itemsize / model.itemsize

    def filled_drafters(self) -> dict[str, ModelDrafter]:
        """The policy's model drafters that fill their caches by a forward (a draft model; the self drafter copies
        the full cache's entries), row 0's, by name."""
        models = [name for name, kind in self.policy.drafters.items() if kind == "model"] if self.policy else []
        return {name: drafter for name in models if (drafter := self.drafter(0, name)).source is None}

    def drafting_tiers(self) -> tuple[bool, set[str]]:
        """What the plans this call may choose can run: whether Force 2 (a three-level plan), and which drafters
        that run a model (`DrafterSpec.kind` ``"model"``)."""
        if self.policy is None:
            three, drafters = self.fixed_plan.levels == 3, {self.fixed_plan.drafter}
        else:
            three, drafters = bool(self.policy.three_level), set(self.policy.drafters)
        return three, {name for name in drafters if name and DRAFTERS[name].kind == "model"}

    def tier_copies(self) -> list:
        """The models Force 1 and Force 2 run for the config's drafting precision in the plans this call may choose
        (`tiers.tier_model`: the models themselves for ``"model"``): Force 2's where a plan has three levels, the self
        drafter's and a draft model's where they may draft. A lookup drafter verified by Force 3 alone runs none, so
        no copy is made."""
        three, drafters = self.drafting_tiers()
        tiers = [(self.model, 2)] if three else []
        tiers += [(model, 1) for name, model in (("self", self.model), (MODEL_DRAFTER, self.config.draft))
                  if name in drafters]
        return [self.tier_model(model, tier) for model, tier in tiers]

    def draft_caches(self) -> dict[str, str]:
        """`TriForceDetail.draft_caches`: per model drafter built, its cache's positions and how it is filled."""
        return {name: f"{rows[0].cache.positions} positions, filled by {rows[0].fill}"
                for name, rows in self.drafters.items() if isinstance(rows[0], ModelDrafter)}

    def tier_forwards(self, tiers: set[str], force3: str) -> dict[str, str]:
        """Per tier of ``tiers`` (``"force1 <drafter>"``, ``"force2"``) that runs a drafting forward, the forward it
        runs, and Force 3's, ``force3`` (`tiers.tier_forwards`). Lookup drafters run none."""
        models = {}
        for tier in sorted(tiers):
            if tier == "force2":
                models[tier] = self.levels[(3, "")][0].model
            elif isinstance(drafter := self.drafter(0, tier.removeprefix("force1 ")), ModelDrafter):
                models[tier] = drafter.model
        return tier_forwards(models, self.config.draft_precision, self.config.lean_unavailable_reason, force3)

    def shared_force1_seconds(self) -> float:
        """Seconds every row's drafters spent, each shared forward once (lookups: rows one by one)."""
        shared = self.lockstep.seconds
        return float(sum(shared.get(f"draft:{name}", sum(drafter.seconds for drafter in drafters))
                         for name, drafters in self.drafters.items()))

    def finish_row(self, stats: TriForceStats, b: int, new_tokens: int, tier_forwards: dict[str, str]) -> None:
        """Row ``b``'s statistics at the call's end, as both drivers end a row: its ``new_tokens``, its drafters'
        seconds (in a batch, the shared forwards it took part in; of those, a draft model's fill from the prompt), its
        caches' sizes, fills and dtype, what its plans could draft with, the forward each tier ran (``tier_forwards``:
        `tier_forwards`)."""
        drafters, levels = [rows[b] for rows in self.drafters.values()], [rows[b] for rows in self.levels.values()]
        force2 = self.levels[(3, "")][b] if (3, "") in self.levels else None
        layer = force2.cache.layers[force2.cache.reference] if force2 is not None else None
        three, models = self.drafting_tiers()
        stats.new_tokens, stats.force1_seconds = new_tokens, float(sum(drafter.seconds for drafter in drafters))
        detail = stats.detail
        detail.draft_caches.update(self.draft_caches())
        detail.tier_forwards = dict(tier_forwards)
        detail.draft_precision = self.config.draft_precision if three or models else "none"
        detail.draft_prefill_seconds = float(sum(drafter.prefill_seconds for drafter in drafters
                                                 if isinstance(drafter, ModelDrafter)))
        detail.force2_sees_whole_cache = force2 is not None and force2.started and force2.cache.sees_whole_cache
        detail.retrieval_cache_bytes = sum(level.nbytes() for level in levels)
        filled = layer is not None and layer.is_initialized
        detail.retrieval_dtype = str(layer.keys.dtype).removeprefix("torch.") if filled else ""
        detail.draft_cache_bytes = sum(drafter.nbytes() for drafter in drafters)
        detail.retrieval_summary_bytes = sum(level.summary_bytes() for level in levels)

    def count_cache_bytes(self, stats: TriForceStats) -> None:
        """The full cache's bytes and the call's on the compute device, in ``stats`` (its rows `finish_row` ended)."""
        full, detail = self.force3 if self.force3 is not None else self.loop_cache, stats.detail
        if hasattr(full, "nbytes"):  # transformers' own cache (`candidates.CacheView`) does not count its bytes
            detail.full_cache_bytes = full.nbytes()
            detail.device_resident_bytes = (full.resident_bytes() + detail.retrieval_cache_bytes
                                            + detail.draft_cache_bytes + detail.retrieval_summary_bytes)
