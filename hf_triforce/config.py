"""`TriForceConfig`: the knobs of the three tiers, grouped (user settings, tuning, experimental), validated on
construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, ClassVar

from .drafters import DRAFTERS, drafter_names
from .kernels.fixed_shape import TIER_COMPILE_MODES
from .kernels.lean import LEAN_PRECISIONS
from .kernels.row_mixing import ROW_INDEPENDENT_MAX_ROWS

DRAFT_PRECISIONS = ("auto", "model", "int8", *LEAN_PRECISIONS)
TIER_COMPILE = ("auto", "off", *TIER_COMPILE_MODES)
FORCE3_COMPILE = TIER_COMPILE
FULL_CACHE_DEVICES = (None, "cpu")
POLICIES = ("auto", "fixed")
RETRIEVAL_DTYPES = ("auto", "model", "bfloat16")
DRAFT_POSITIONS = ("auto", "absolute", "slots")
LOOPS = ("triforce", "assisted")
# Force 1's window: where a self drafter agrees with Force 3 at little more cost than a smaller one
# (docs/experiments.md, "Force 1: a window of 1024")
DEFAULT_WINDOW = 1024
# `TriForceConfig.refresh_every`'s default: a retrieval selection of at least LARGE_BUDGET entries is renewed every
# REFRESH_EVERY_LARGE Force-3 steps, a smaller one at every step
LARGE_BUDGET = 4096
REFRESH_EVERY_LARGE = 4


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TriForceConfig.{name} must be an integer >= {minimum}, got {value!r}")


def _check_choice(name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"TriForceConfig.{name} must be one of {allowed}, got {value!r}")


@dataclass(kw_only=True)
class TriForceConfig:
    """Configuration of TriForce hierarchical speculative decoding: Force 1 drafts, Force 2 (the target on a
    retrieval cache) verifies Force 1 and drafts for Force 3 (the target on its full cache), which verifies exactly.
    Pass it as ``model.generate(ids, triforce_config=TriForceConfig(...))``; every output is exact whatever the
    values (greedy: token-identical to ``generate``; sampled: the target's distribution).

    Keyword arguments only. Each value is checked on construction and again at each use (`validate`: a field set
    after construction is checked by the call that reads it): a bad one raises a ``ValueError`` (a ``TypeError``
    for a ``draft`` of the wrong type) naming the field and what it allows. The fields come in three groups, declared
    in this order and listed in `USER_FIELDS`, `TUNING_FIELDS` and `EXPERIMENTAL_FIELDS` (docs/config.md).

    User settings
    -------------
    The fields that choose the method (what drafts, how many levels, who plans, which loop), its sizes (gammas,
    budget, window) and where it runs (precision, compilation, full-cache device): what a user sets first.

    draft: Force 1's proposer. ``"self"`` (default): the target itself on a sink + window cache. ``"ngram"``: the
        continuation of the most recent earlier occurrence of the current suffix, over the prompt and the output.
        ``"suffix"``: the continuation most earlier occurrences of the suffix share. Or a ``PreTrainedModel``
        sharing the target's vocabulary (a draft model). The names are those of ``hf_triforce.drafters.DRAFTERS``.
    levels: ``3`` (default): TriForce, Force 1 verified by Force 2, Force 2's tokens verified by Force 3. ``2``: Force 1
        verified directly by Force 3 (with ``draft="self"``, the StreamingLLM-cache self-speculation baseline); the
        Force-2 fields are then unused.
    policy: ``"auto"`` (default): each Force-3 step runs the plan an online cost model predicts fastest: plain
        one-token decoding, the drafter (or the free n-gram lookup; beside a draft model drafting with a lean copy,
        also the target's own lean copy) verified by Force 3, or all three levels, with gammas up to ``gamma1`` /
        ``gamma2`` (`hf_triforce.decoding.policy`). ``"fixed"``: every step runs ``levels`` with ``gamma1`` /
        ``gamma2``. Only sampling draws from torch's global RNG: under ``"fixed"`` a seed reproduces a sampled
        call; under ``"auto"`` the plans follow timings measured in the call, so a seed need not reproduce it.
    gamma1: integer >= 1, default 2: tokens Force 1 drafts per Force-2 verification (under ``policy="auto"``, at
        most this many).
    gamma2: integer >= 1, default 6: tokens handed to one Force-3 verification, by Force 2 (three levels) or by
        Force 1 (two levels). Under ``policy="auto"`` a bound on every chain but a lookup drafter's: the two-level
        chains of ``"ngram"`` and ``"suffix"`` (and of the n-gram lookup the policy always weighs) go up to
        ``max(gamma2, LOOKUP_GAMMA2)``, 10 tokens, since they cost nothing to draft
        (`hf_triforce.decoding.sizing.LOOKUP_GAMMA2`); under ``"fixed"`` they stay within ``gamma2``.
    retrieval_budget: integer, default 4096: tokens of Force 2's retrieval cache (the sink chunk, the top-scored
        chunks and the recent tokens); a multiple of ``chunk_size``, at least two chunks. A request no longer than
        the budget leaves Force 2 the whole cache (no three-level plan under ``policy="auto"``).
    window: integer, default 1024 (`DEFAULT_WINDOW`): recent tokens in Force 1's cache, beside ``sink_tokens``;
        must exceed ``gamma1 + gamma2 + 1``. A draft model that fills its cache by a forward fills
        ``sink_tokens + window`` rows.
    draft_precision: how Force 1 and Force 2 run (Force 3 computes the target itself: ``force3_compile``).
        ``"auto"`` (default): ``"lean-int4"`` where the lean forward covers the target (and a draft model): fp32 or
        bf16 Llama, Mistral and Qwen2 models on the CPU; ``"native"`` for those models on a CUDA device; else
        ``"model"`` (``TriForceDetail.draft_precision`` says which ran, ``tier_forwards`` per tier what forward ran
        and why not lean). ``"model"``: the models as given. ``"int8"``: a cached int8 copy of each fp32 model's
        linear layers (CPU only). ``"lean"``, ``"lean-int8"``, ``"lean-int4"``: a lean forward over a cached copy of
        the weights in fp32, weight-only int8, or weight-only int4 with an int8 output layer (CPU). ``"native"``:
        the lean forward on the model's own weights, read in place (`hf_triforce.kernels.lean`). Families the lean
        forward does not cover draft with their eager forward, and ``TriForceDetail.tier_forwards`` says so.
    tier_compile: how the lean tier forwards run (a lean or ``"auto"`` ``draft_precision`` only;
        `hf_triforce.kernels.fixed_shape`). ``"auto"`` (default): ``"graph"`` where the tiers run the native lean
        forward on a CUDA device, else ``"off"``. ``"off"``: through the caches' own ``update``. ``"fixed"``: on
        whole cache buffers (fixed shapes, eager). ``"compile"``: that fixed-shape forward compiled once per model
        with ``torch.compile`` and reused by every later step and call; on the CPU it pays only over long or many
        generations (docs/experiments.md, "Tier forwards compiled"). ``"graph"`` (CUDA): the fixed-shape forward
        captured as a CUDA graph per row count and cache. Batches and candidate trees run the lean forward;
        ``TriForceDetail.tier_compile`` reports what was compiled and its seconds. On a CUDA device Force 3's
        verification follows ``"graph"`` and ``"compile"`` by default (``force3_compile``).
    full_cache_device: where Force 3's full cache lives. ``None`` (default): each layer's entries on that layer's
        execution device, next to the model. ``"cpu"``: host memory (pinned for a GPU), streamed to the compute device
        layer by layer during verification with the next layer prefetched (TriForce's offloading mode; the
        retrieval and draft caches stay on the device).
    loop: which loop runs Force 3. ``"triforce"`` (default): the library's own (`hf_triforce.decoding.loop`:
        batches, trees, the adaptive ``policy``). ``"assisted"``: transformers' assisted-generation loop, with
        Force 1 and Force 2 as its candidate generator (`hf_triforce.TriForceCandidateGenerator`): the configured
        plan every step (``policy`` does not apply), one prompt per call, chains only (docs/assisted.md).
    show_progress: bool, default ``False``: show a tqdm bar during the prefill.

    Tuning
    ------
    Defaults that suit most uses: retrieval details, Force 1's cache layout, the n-gram matcher, the prefill, the
    adaptive policy's exploration.

    chunk_size: integer >= 1, default 8: tokens per retrieval chunk; each chunk is scored by its mean key per KV
        head.
    retrieval_recent: ``None`` (default: a quarter of ``retrieval_budget``, rounded down to whole chunks) or a
        multiple of ``chunk_size`` from 0 to ``retrieval_budget - chunk_size``: the most recent tokens Force 2's
        cache always keeps.
    retrieval_dtype: ``"auto"`` (default), ``"model"`` or ``"bfloat16"``: the dtype Force 2's retrieval cache keeps
        its entries in. ``"model"``: the model's (copies of the full cache's entries). ``"bfloat16"``: rounded to bf16
        as they are copied in or computed, so that a Force-2 forward reads half the cache bytes of an fp32 model's;
        Force 2 only proposes, so every output stays exact. It needs Force 2's lean forward (a lean
        ``draft_precision``, or ``"auto"`` where it resolves to one). ``"auto"``: ``"bfloat16"`` where Force 2 runs
        the lean forward on the CPU over an fp32 model, else ``"model"`` (`TriForceDetail.retrieval_dtype` says which
        ran).
    refresh_every: ``None`` (default) or an integer >= 1: re-select the retrieval chunks every this many Force-3 steps
        (between re-selections the committed tokens' exact entries are copied in after every step). ``None``: every
        `REFRESH_EVERY_LARGE` steps with a ``retrieval_budget`` of at least `LARGE_BUDGET`, else every step: a smaller
        selection misses more of what the answer moves on to (docs/experiments.md, "Force 2: re-select every 4
        Force-3 steps"). `refresh_interval` is the value in force.
    refresh_below: ``None`` (default: never) or a fraction in (0, 1]: also re-select after a Force-3 step that
        accepts less than this fraction of its tokens.
    sink_tokens: integer >= 0, default 16: the first tokens of the sequence Force 1's cache always keeps (attention
        sinks), beside ``window``.
    draft_positions: where a model drafter's cached tokens sit (`hf_triforce.caches.sink_window.SinkWindowCache`).
        ``"absolute"``: each at its position in the sequence, as the full model sees it. ``"slots"``: at its
        in-cache position (TriForce's and StreamingLLM's layout: the draft never sees a position past
        ``sink_tokens + window``). ``"auto"`` (default): absolute for ``draft="self"`` and for a draft model that
        takes at least the target's ``max_position_embeddings``, slots for one that takes fewer.
    ngram_max, ngram_min: integers >= 1, defaults 3 and 1, ``ngram_min <= ngram_max``: the longest and shortest
        suffix the n-gram lookup matches.
    prefill_chunk_size: integer >= 1, default 2048: prompt tokens per forward in the chunked prefill of the full
        cache (bounds the activation memory).
    explore_every: integer >= 1, default 16: under ``policy="auto"``, steps between tries of the best plan other
        than the current one, a kind of plan not yet run in the call first (the interval doubles, up to 16x, while
        such tries do not pay).
    force3_compile: how Force 3's verification forward runs (batch size 1, chains; `hf_triforce.decoding.tiers.
        force3_forward`). ``"auto"`` (default): where the tiers run as CUDA graphs or compiled on a CUDA device
        (``tier_compile`` resolved to ``"graph"`` or ``"compile"``), in that mode on the target's native lean
        forward (its own weights read in place, activations in its dtype, rounded as its forward rounds them) over
        the full cache's whole buffer; else, and on the CPU, transformers' forward of the model as given.
        ``"off"``: transformers' forward. ``"fixed"``, ``"compile"``, ``"graph"`` (CUDA): that forward in that
        mode (`hf_triforce.kernels.fixed_shape`), whatever ``tier_compile`` is; a model or call it cannot serve
        (a family or sliding windows the lean forward does not cover, ``device_map=``, ``full_cache_device="cpu"``,
        a batch, ``"graph"`` off CUDA) raises a ValueError naming why. A candidate tree's verification stays on
        transformers' forward. ``TriForceDetail.tier_forwards["force3"]`` says what ran (``"graph (native)"``,
        ``"eager"``), ``tier_compile["force3"]`` what it compiled.

    Experimental
    ------------
    Candidate trees: exact, off by default, chosen by the adaptive policy only where it predicts they pay; they have
    not paid on the CPU at long contexts (docs/experiments.md, "Candidate trees"). Refused on sliding-window models, in
    batches and with ``loop="assisted"``.

    tree_nodes: integer from 0 to 63, default 0 (chains). ``> 0``: the drafter proposes a candidate tree of at most
        this many nodes (depth at most the level's gamma), verified exactly in one tree-attention forward
        (`hf_triforce.verification.tree`): ``"ngram"`` (distinct continuations of several matches) and model
        drafters (their chain plus the next most likely tokens where the chain is least certain, as point masses:
        `hf_triforce.drafters.branching`); ``"suffix"`` proposes chains only. Under ``policy="fixed"`` every
        proposal is a tree; under ``"auto"`` tree plans stand beside chain plans.
    tree_branch: integer >= 1, default 2: at most this many children per tree node; at least 2 with ``tree_nodes > 0``
        or ``force2_tree_nodes > 0``.
    force2_tree_nodes: 0 (default: Force 2 hands Force 3 a chain) or from ``gamma2 + 1`` to 63 (three levels): Force 2
        hands Force 3 a tree of at most this many nodes, its chain plus, as leaves, the tokens it scored next most
        likely where the chain is least certain (point masses), verified exactly in one tree forward; free to
        propose, one Force-3 row each. Under ``policy="auto"`` three-level plans run with and without it.
    """

    USER_FIELDS: ClassVar[tuple[str, ...]] = (
        "draft", "levels", "policy", "gamma1", "gamma2", "retrieval_budget", "window", "draft_precision",
        "tier_compile", "full_cache_device", "loop", "show_progress")
    TUNING_FIELDS: ClassVar[tuple[str, ...]] = (
        "chunk_size", "retrieval_recent", "retrieval_dtype", "refresh_every", "refresh_below", "sink_tokens",
        "draft_positions", "ngram_max", "ngram_min", "prefill_chunk_size", "explore_every", "force3_compile")
    EXPERIMENTAL_FIELDS: ClassVar[tuple[str, ...]] = ("tree_nodes", "tree_branch", "force2_tree_nodes")

    # user settings
    draft: Any = "self"
    levels: int = 3
    policy: str = "auto"
    gamma1: int = 2
    gamma2: int = 6
    retrieval_budget: int = 4096
    window: int = DEFAULT_WINDOW
    draft_precision: str = "auto"
    tier_compile: str = "auto"
    full_cache_device: str | None = None
    loop: str = "triforce"
    show_progress: bool = False
    # tuning
    chunk_size: int = 8
    retrieval_recent: int | None = None
    retrieval_dtype: str = "auto"
    refresh_every: int | None = None
    refresh_below: float | None = None
    sink_tokens: int = 16
    draft_positions: str = "auto"
    ngram_max: int = 3
    ngram_min: int = 1
    prefill_chunk_size: int = 2048
    explore_every: int = 16
    force3_compile: str = "auto"
    # experimental
    tree_nodes: int = 0
    tree_branch: int = 2
    force2_tree_nodes: int = 0

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise a ``ValueError`` (a ``TypeError`` for a ``draft`` of the wrong type) naming the first field whose
        value is not allowed, and what it allows. Run on construction and again by each call that uses the config
        (`request.check_request`, `decoding.resolved.resolve`): a field set after construction is checked there."""
        if isinstance(self.draft, str):
            if self.draft not in drafter_names():
                raise ValueError(
                    f"TriForceConfig.draft must be one of {drafter_names()} or a PreTrainedModel, got {self.draft!r}"
                )
        elif not hasattr(self.draft, "forward") or not hasattr(self.draft, "config"):
            raise TypeError(
                f"TriForceConfig.draft must be one of {drafter_names()} or a transformers PreTrainedModel, "
                f"got an object of type {type(self.draft).__name__}"
            )
        for name, minimum in (
            ("chunk_size", 1),
            ("retrieval_budget", 1),
            ("sink_tokens", 0),
            ("window", 1),
            ("gamma1", 1),
            ("gamma2", 1),
            ("ngram_max", 1),
            ("ngram_min", 1),
            ("prefill_chunk_size", 1),
            ("explore_every", 1),
            ("tree_nodes", 0),
            ("tree_branch", 1),
            ("force2_tree_nodes", 0),
        ):
            _check_int(name, getattr(self, name), minimum)
        if self.retrieval_budget % self.chunk_size:
            raise ValueError(
                f"TriForceConfig.retrieval_budget ({self.retrieval_budget}) must be a multiple of chunk_size "
                f"({self.chunk_size})"
            )
        if self.retrieval_budget < 2 * self.chunk_size:
            raise ValueError(
                f"TriForceConfig.retrieval_budget must hold at least two chunks (>= {2 * self.chunk_size}), "
                f"got {self.retrieval_budget}"
            )
        if self.retrieval_recent is not None:
            _check_int("retrieval_recent", self.retrieval_recent, 0)
            too_big = self.retrieval_recent > self.retrieval_budget - self.chunk_size
            if self.retrieval_recent % self.chunk_size or too_big:
                raise ValueError(
                    "TriForceConfig.retrieval_recent must be a multiple of chunk_size between 0 and "
                    f"retrieval_budget - chunk_size ({self.retrieval_budget - self.chunk_size}), "
                    f"got {self.retrieval_recent}"
                )
        if self.refresh_every is not None:
            _check_int("refresh_every", self.refresh_every, 1)
        if self.refresh_below is not None and not (
            isinstance(self.refresh_below, (int, float)) and not isinstance(self.refresh_below, bool)
            and 0.0 < self.refresh_below <= 1.0
        ):
            raise ValueError(f"TriForceConfig.refresh_below must be None or in (0, 1], got {self.refresh_below!r}")
        if self.ngram_min > self.ngram_max:
            raise ValueError(
                f"TriForceConfig.ngram_min ({self.ngram_min}) must not exceed ngram_max ({self.ngram_max})"
            )
        if self.window <= self.gamma1 + self.gamma2 + 1:
            raise ValueError(
                f"TriForceConfig.window must exceed gamma1 + gamma2 + 1 ({self.gamma1 + self.gamma2 + 1}), "
                f"got {self.window}"
            )
        if isinstance(self.levels, bool) or not isinstance(self.levels, int) or self.levels not in (2, 3):
            raise ValueError(f"TriForceConfig.levels must be 2 or 3, got {self.levels!r}")
        for name, allowed in (
            ("draft_precision", DRAFT_PRECISIONS),
            ("retrieval_dtype", RETRIEVAL_DTYPES),
            ("draft_positions", DRAFT_POSITIONS),
            ("tier_compile", TIER_COMPILE),
            ("full_cache_device", FULL_CACHE_DEVICES),
            ("policy", POLICIES),
            ("loop", LOOPS),
            ("force3_compile", FORCE3_COMPILE),
        ):
            _check_choice(name, getattr(self, name), allowed)
        if self.retrieval_dtype == "bfloat16" and self.draft_precision in ("model", "int8"):
            raise ValueError(f"TriForceConfig.retrieval_dtype='bfloat16' needs Force 2's lean forward: set "
                             f"draft_precision to one of {('auto', *LEAN_PRECISIONS)} (got {self.draft_precision!r}), "
                             "or retrieval_dtype='model'")
        if self.tier_compile not in ("off", "auto") and self.draft_precision not in ("auto", *LEAN_PRECISIONS):
            raise ValueError(f"TriForceConfig.tier_compile={self.tier_compile!r} runs the lean tier forward: set "
                             f"draft_precision to one of {('auto', *LEAN_PRECISIONS)} (got {self.draft_precision!r}), "
                             "or tier_compile='off'")
        if self.tree_nodes > ROW_INDEPENDENT_MAX_ROWS - 1:
            raise ValueError(f"TriForceConfig.tree_nodes must be at most {ROW_INDEPENDENT_MAX_ROWS - 1} (a tree's rows "
                             f"are verified in one forward), got {self.tree_nodes}")
        if self.force2_tree_nodes:
            if self.levels != 3:
                raise ValueError("TriForceConfig.force2_tree_nodes > 0 needs levels=3 (Force 2 hands Force 3 the "
                                 f"tree), got levels={self.levels}")
            if not self.gamma2 < self.force2_tree_nodes <= ROW_INDEPENDENT_MAX_ROWS - 1:
                raise ValueError("TriForceConfig.force2_tree_nodes must be 0 or between gamma2 + 1 "
                                 f"({self.gamma2 + 1}: the chain and one alternative) and "
                                 f"{ROW_INDEPENDENT_MAX_ROWS - 1}, got {self.force2_tree_nodes}")
            if self.tree_branch < 2:
                raise ValueError("TriForceConfig.force2_tree_nodes > 0 needs tree_branch >= 2 (the alternatives are "
                                 f"extra children), got tree_branch={self.tree_branch}")
        if self.tree_nodes and self.tree_branch < 2:
            raise ValueError("TriForceConfig.tree_nodes > 0 needs tree_branch >= 2 (with one child per node a tree is "
                             f"a chain), got tree_branch={self.tree_branch}")
        if self.tree_nodes and isinstance(self.draft, str) and not DRAFTERS[self.draft].trees:
            with_trees = tuple(name for name in drafter_names() if DRAFTERS[name].trees)
            raise ValueError(f"TriForceConfig.tree_nodes > 0: the {self.draft!r} drafter proposes chains only; use one "
                             f"of {with_trees} or a draft model")
        if self.loop == "assisted" and self.force3_compile not in ("auto", "off"):
            raise ValueError(f"TriForceConfig(loop='assisted', force3_compile={self.force3_compile!r}): transformers' "
                             "assisted loop runs the target's own forward for Force 3; use force3_compile='auto' or "
                             "'off', or loop='triforce'")
        if self.loop == "assisted" and self.trees:
            raise ValueError("TriForceConfig(loop='assisted'): transformers' assisted loop verifies chains only: set "
                             f"tree_nodes=0 and force2_tree_nodes=0 (got {self.tree_nodes} and "
                             f"{self.force2_tree_nodes}), or loop='triforce'")
        if not isinstance(self.show_progress, bool):
            raise ValueError(f"TriForceConfig.show_progress must be a bool, got {self.show_progress!r}")

    @property
    def refresh_interval(self) -> int:
        """Force-3 steps between re-selections of the retrieval chunks: ``refresh_every``, or its default for the
        budget."""
        if self.refresh_every is not None:
            return self.refresh_every
        return REFRESH_EVERY_LARGE if self.retrieval_budget >= LARGE_BUDGET else 1

    @property
    def trees(self) -> bool:
        """Whether any level proposes candidate trees."""
        return bool(self.tree_nodes or self.force2_tree_nodes)

    def to_dict(self) -> dict[str, Any]:
        """A JSON-friendly dict; a draft model is stored by its ``name_or_path``."""
        out = asdict(self) if isinstance(self.draft, str) else {
            f.name: getattr(self, f.name) for f in fields(self) if f.name != "draft"
        }
        if not isinstance(self.draft, str):
            out["draft"] = getattr(self.draft.config, "name_or_path", None) or "<model>"
        return out

    @classmethod
    def from_dict(cls, data: dict[str, Any], draft_model: Any = None) -> TriForceConfig:
        """Inverse of `to_dict`; pass ``draft_model`` when the dict names a draft model."""
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"Unknown TriForceConfig keys {sorted(unknown)}; allowed: {sorted(known)}")
        data = dict(data)
        if draft_model is not None:
            data["draft"] = draft_model
        elif data.get("draft", "self") not in drafter_names():
            raise ValueError(
                f"The dict names draft model {data['draft']!r}: pass it as from_dict(..., draft_model=model)"
            )
        return cls(**data)
