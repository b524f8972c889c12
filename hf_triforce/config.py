"""`TriForceConfig`: every knob of the three tiers, validated on construction."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any

from .drafters import DRAFTERS, drafter_names
from .kernels.fixed_shape import TIER_COMPILE_MODES
from .kernels.lean import LEAN_PRECISIONS
from .kernels.row_mixing import ROW_INDEPENDENT_MAX_ROWS

DRAFT_PRECISIONS = ("auto", "model", "int8", *LEAN_PRECISIONS)
TIER_COMPILE = ("auto", "off", *TIER_COMPILE_MODES)
FULL_CACHE_DEVICES = (None, "cpu")
POLICIES = ("auto", "fixed")
DRAFT_POSITIONS = ("auto", "absolute", "slots")
LOOPS = ("triforce", "assisted")
# the longest lookup chain the adaptive policy may verify in one Force-3 step (two levels): HF prompt lookup's
# default (`prompt_lookup_num_tokens=10`); with chains of at most gamma2=6 the policy's n-gram plans got 1.1-1.2x the
# best plain decoding where HF prompt lookup got 2.7-4.1x (Qwen2.5-Coder-1.5B bf16, extractive questions at 2k)
LOOKUP_GAMMA2 = 10
# Force 1's recent window by default (see TriForceConfig's docstring): SmolLM2's lean-int4 self drafter at 8k, window
# 1024 vs 256, two levels fixed: Force-3 acceptance 0.85 / 0.57 greedy and 0.81-0.88 / 0.37-0.50 sampled, 7.95-9.35 /
# 6.8-7.05 tok/s greedy and 8.8 / 4.5-5.2 sampled (one process, alternating; an AVX2 EPYC, 2 threads)
DEFAULT_WINDOW = 1024


def _check_int(name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"TriForceConfig.{name} must be an integer >= {minimum}, got {value!r}")


@dataclass
class TriForceConfig:
    """Configuration of TriForce hierarchical speculative decoding.

    draft: Force-1 proposer: a registered drafter name (``hf_triforce.drafters.DRAFTERS``: ``"self"``, the
        target on a sink+window cache; ``"ngram"``, lookup of the most recent occurrence of the suffix over the
        prompt and output; ``"suffix"``, its most frequent continuation) or a ``PreTrainedModel`` sharing the
        target's vocabulary.
    retrieval_budget: tokens of the Force-2 retrieval cache (sink chunk + top-k chunks + recent tokens);
        a multiple of ``chunk_size``.
    chunk_size: tokens per chunk whose keys are summarised (mean key per KV head) for retrieval.
    retrieval_recent: most recent tokens always kept in the retrieval cache; a multiple of ``chunk_size``
        below the budget. ``None`` means a quarter of the budget rounded down to whole chunks.
    refresh_every: re-select the retrieval chunks every this many Force-3 steps.
    refresh_below: also re-select when a Force-3 step accepts less than this fraction (``None``: never).
    sink_tokens, window: the Force-1 cache holds the first ``sink_tokens`` and the last ``window`` tokens. The default
        window, 1024 (`DEFAULT_WINDOW`), is where a self drafter agrees with the full model at little more cost than
        at 256: teacher-forced on SQuAD's Wikipedia at 16k (SmolLM2, lean-int4) 0.92 against 0.76-0.78 at 256; live at
        8k, two levels fixed, Force-3 acceptance 0.81-0.88 against 0.37-0.57, a drafted token 46 ms against 40 ms
        (docs/results.md). A draft model that fills its cache by a forward fills ``sink_tokens + window`` rows.
    draft_positions: where a model drafter's tokens sit (`caches.sink_window.SinkWindowCache`): ``"absolute"`` (each at
        its position in the sequence, as the full model sees it), ``"slots"`` (in-cache positions, TriForce's and
        StreamingLLM's layout: a draft never sees a position past ``sink_tokens + window``), or ``"auto"``
        (default): absolute for ``draft="self"`` and for a draft model that takes at least the target's
        ``max_position_embeddings``, slots for one that takes fewer. Teacher-forced on held-out text (SmolLM2,
        Wikipedia at 16k, sink 16 + window 256, lean-int4) absolute positions agree with Force 3 0.78 against
        0.72 for slots (`benchmarks/sparse_agreement.py`).
    gamma1: tokens Force 1 drafts per Force-2 verification.
    gamma2: tokens Force 2 hands up per Force-3 verification.
    ngram_max, ngram_min: longest and shortest suffix matched by the ``"ngram"`` drafter.
    prefill_chunk_size: prompt tokens per forward during the chunked prefill of the full cache.
    show_progress: show a tqdm bar during prefill.
    draft_precision: ``"auto"`` (default): ``"lean-int4"`` where the lean forward covers the target (and the draft
        model), i.e. fp32 Llama, Mistral and Qwen2 models on the CPU, ``"native"`` (the lean forward on the model's
        own weights, read in place) for those models on a CUDA device, else ``"model"`` (`kernels.lean.AUTO_PRECISION`;
        ``TriForceStats.draft_precision`` says which ran and ``draft_forward``, per tier, what forward ran and why
        not lean); ``"model"`` (Force 1 and Force 2 run the models as given) or ``"int8"`` (they run a cached int8
        copy of each fp32 model's linear layers; CPU only), or ``"lean"`` / ``"lean-int8"`` / ``"lean-int4"`` (a
        lean forward over a cached copy of the weights in fp32, weight-only int8 or weight-only int4 with an int8
        output layer: Llama, Mistral and Qwen2 fp32 models on CPU; other families draft with their eager forward,
        and ``TriForceStats.draft_forward`` says so; `hf_triforce.kernels.lean`). Force 3 always runs the target as
        given, so the output is exact either way; the precision only changes how often drafts are accepted and what
        they cost.
    tier_compile: how the lean tier forwards run (a lean or ``"auto"`` ``draft_precision`` only;
        `hf_triforce.kernels.fixed_shape`): ``"auto"`` (default): ``"graph"`` where the tiers run the native lean
        forward on a CUDA device, else ``"off"``; ``"off"``: the lean forward through the caches' own ``update``;
        ``"fixed"``: the same on whole cache buffers (fixed shapes, eager); ``"compile"``: that fixed-shape forward
        compiled once per model with ``torch.compile`` (on CUDA as CUDA graphs), reused by every later step and call
        (``TriForceStats.tier_compile`` reports graphs compiled and compile seconds). Forwards it does not cover
        (batches, candidate trees) run the lean forward. ``"graph"`` (CUDA): the fixed-shape forward captured as
        a CUDA graph per row count and cache (a capture costs one forward). Measured on a 2-core Xeon (SmolLM2,
        lean-int4): compiling takes ~54 s once per model and process and makes Force 1 28% and Force 2 15% cheaper
        (docs/results.md),
        so it pays only over long or many generations. The output is exact either way.
    levels: 3 (TriForce) or 2 (Force 1 verified directly by Force 3: with ``draft="self"`` the
        StreamingLLM-cache self-speculation baseline; Force-2 knobs are then unused).
    policy: ``"auto"`` (default): each Force-3 step runs the plan an online cost model predicts fastest —
        plain one-token decoding, the drafter (or free n-gram lookup; beside a draft model drafting with a lean
        copy, also the target's own lean copy, ``"self"``) verified by Force 3, or all three levels — with gammas up
        to ``gamma1`` / ``gamma2`` (`hf_triforce.decoding.policy`). ``"fixed"``: every step
        runs ``levels`` with ``gamma1`` / ``gamma2``. Either way the output is exact. Only sampling draws from
        torch's global RNG: under ``"fixed"`` a seed reproduces a sampled call; under ``"auto"`` the plans follow
        timings measured in the call and consume random draws differently, so a seed need not reproduce it.
    full_cache_device: where Force 3's full cache lives: ``None`` (default: each layer's entries on that
        layer's execution device, next to the model) or ``"cpu"`` (TriForce's offloading mode: host memory,
        pinned for a GPU, streamed to the compute device layer by layer during verification with the next
        layer prefetched; the retrieval and draft caches stay on the device). Output is identical either way.
    tree_nodes: 0 (default): every level proposes a chain. ``> 0``: the drafter proposes a candidate tree of at
        most this many nodes (depth at most the level's gamma), verified exactly in one forward with tree
        attention (`hf_triforce.verification.tree`); drafters ``"ngram"`` (several matches of the suffix:
        distinct continuations) and model drafters (``"self"``, a draft model: their chain plus alternatives
        where the chain is least certain, `hf_triforce.drafters.branching`: the draft's next most likely tokens as point
        masses; a registered drafter proposes trees if registered with ``trees=True``). Needs a model without
        sliding-window layers. Under ``policy="fixed"`` every proposal is a
        tree; under ``"auto"`` tree plans stand beside chain plans and run where the cost model predicts they pay
        (their own acceptance and forward costs, measured; `hf_triforce.decoding.policy`).
    tree_branch: at most this many children per tree node (with ``tree_nodes > 0`` or ``force2_tree_nodes > 0``: at
        least 2).
    force2_tree_nodes: 0 (default): Force 2 hands Force 3 a chain. ``> gamma2`` (three levels): Force 2 hands
        Force 3 a tree of at most this many nodes: its chain plus, as leaves, the tokens it scored next most
        likely where its chain is least certain (`hf_triforce.drafters.branching`; point masses), verified exactly in
        one tree forward on the full cache. Free to propose (Force 2 has scored them); Force 3 pays a row each.
        Under ``policy="auto"``: three-level plans with and without it, chosen as with ``tree_nodes``.
    explore_every: under ``policy="auto"``, steps between tries of the best plan other than the current
        one, a kind of plan not yet run in the call first (doubling, up to 16x, while such tries do not pay).
    loop: which loop runs Force 3. ``"triforce"`` (default): the library's own (`hf_triforce.decoding.loop`: batches,
        trees, the adaptive ``policy``). ``"assisted"``: transformers' assisted-generation loop, with Force 1 and
        Force 2 as its candidate generator (`hf_triforce.TriForceCandidateGenerator`) and the full model verifying
        their tokens with transformers' own rule; every step runs the configured plan (``levels``, ``gamma1``,
        ``gamma2``: that loop asks for candidates and has no per-step plan, so ``policy`` does not apply), one prompt
        per call, chains only (docs/assisted.md). Exact either way.
    """

    draft: Any = "self"
    retrieval_budget: int = 4096
    chunk_size: int = 8
    retrieval_recent: int | None = None
    refresh_every: int = 1
    refresh_below: float | None = None
    sink_tokens: int = 16
    window: int = DEFAULT_WINDOW
    draft_positions: str = "auto"
    gamma1: int = 2
    gamma2: int = 6
    ngram_max: int = 3
    ngram_min: int = 1
    prefill_chunk_size: int = 2048
    show_progress: bool = False
    levels: int = 3
    draft_precision: str = "auto"
    tier_compile: str = "auto"
    policy: str = "auto"
    explore_every: int = 16
    tree_nodes: int = 0
    tree_branch: int = 2
    force2_tree_nodes: int = 0
    full_cache_device: str | None = None
    loop: str = "triforce"

    def __post_init__(self) -> None:
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
            ("refresh_every", 1),
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
        if self.draft_precision not in DRAFT_PRECISIONS:
            raise ValueError(
                f"TriForceConfig.draft_precision must be one of {DRAFT_PRECISIONS}, got {self.draft_precision!r}"
            )
        if self.draft_positions not in DRAFT_POSITIONS:
            raise ValueError(
                f"TriForceConfig.draft_positions must be one of {DRAFT_POSITIONS}, got {self.draft_positions!r}"
            )
        if self.tier_compile not in TIER_COMPILE:
            raise ValueError(f"TriForceConfig.tier_compile must be one of {TIER_COMPILE}, got {self.tier_compile!r}")
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
        if self.full_cache_device not in FULL_CACHE_DEVICES:
            raise ValueError(
                f"TriForceConfig.full_cache_device must be one of {FULL_CACHE_DEVICES}, got {self.full_cache_device!r}"
            )
        if self.policy not in POLICIES:
            raise ValueError(f"TriForceConfig.policy must be one of {POLICIES}, got {self.policy!r}")
        if self.loop not in LOOPS:
            raise ValueError(f"TriForceConfig.loop must be one of {LOOPS}, got {self.loop!r}")
        if self.loop == "assisted" and self.trees:
            raise ValueError("TriForceConfig(loop='assisted'): transformers' assisted loop verifies chains only: set "
                             f"tree_nodes=0 and force2_tree_nodes=0 (got {self.tree_nodes} and "
                             f"{self.force2_tree_nodes}), or loop='triforce'")
        if not isinstance(self.show_progress, bool):
            raise ValueError(f"TriForceConfig.show_progress must be a bool, got {self.show_progress!r}")

    @property
    def trees(self) -> bool:
        """Whether any level proposes candidate trees."""
        return bool(self.tree_nodes or self.force2_tree_nodes)

    @property
    def lookup_gamma2(self) -> int:
        """Most tokens a lookup drafter (``"ngram"``, ``"suffix"``) proposes straight to Force 3 under
        ``policy="auto"``: at least `LOOKUP_GAMMA2` (drafting them costs nothing; the policy prices their rows)."""
        return max(self.gamma2, LOOKUP_GAMMA2) if self.policy == "auto" else self.gamma2

    @property
    def force3_rows(self) -> int:
        """At least the most proposals one Force-3 verification scores: a chain of ``gamma2`` (a lookup's
        `lookup_gamma2`), or a tree."""
        return max(self.gamma2, self.lookup_gamma2, self.tree_nodes, self.force2_tree_nodes)

    @property
    def proposal_rows(self) -> int:
        """Most rows Force 1 proposes for one Force-2 verification: ``gamma1``, or a tree's ``tree_nodes``."""
        return max(self.gamma1, self.tree_nodes)

    @property
    def recent_tokens(self) -> int:
        """Recent tokens always kept by the retrieval cache."""
        if self.retrieval_recent is not None:
            return self.retrieval_recent
        return (self.retrieval_budget // 4) // self.chunk_size * self.chunk_size

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
