"""Per-tier statistics of one TriForce `generate` call: `TriForceStats`, what a user reads, and its `TriForceDetail`:
the lower tiers' counts, the forwards, kernels and routes each tier ran, their set-up seconds, the caches' bytes."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

# the properties `TriForceStats.to_dict` adds to the fields
DERIVED = ("force2_acceptance", "force3_acceptance", "force2_position_acceptance", "force3_position_acceptance",
           "tokens_per_force3_step")


@dataclass(slots=True)
class TriForceDetail:
    """`TriForceStats.detail`, field by field."""

    force1_proposed: int = 0  # Force-1 drafts, whoever verified them (Force 2 in three-level steps, else Force 3)
    force2_steps: int = 0  # Force-2 verifications
    retrieval_selections: int = 0  # re-selections of the retrieval cache's chunks
    retrieval_seconds: float = 0.0  # those re-selections' seconds
    tree_nodes: int = 0  # nodes of candidate trees verified (TriForceConfig.tree_nodes; proposals count depths)
    tree_side_accepts: int = 0  # accepted tree nodes that were not their parent's first child (beyond the chain)
    # batches: Force-1 / Force-2 forwards run for several rows at once (`hf_triforce.decoding.lockstep`), and the rows'
    # forwards they served (lockstep_requests / lockstep_forwards: rows per lower-tier forward)
    lockstep_forwards: int = 0
    lockstep_requests: int = 0
    force2_sees_whole_cache: bool = False  # Force 2's retrieval budget held the whole context
    # the drafting precision of the tiers the call's plans may run (their copies made on a model's first call:
    # draft_copy_seconds): TriForceConfig.draft_precision, "auto" made concrete ("lean-int4" or "model"); "none" where
    # no plan runs a drafting forward (lookup drafts verified by Force 3 alone: nothing copied)
    draft_precision: str = "none"
    # per tier that ran a drafting forward ("force1 <drafter>": "self", "model" for a draft model; "force2"), the
    # forward it ran: "lean" (`kernels.lean` at draft_precision), "eager" (the transformers forward of the model as
    # given, or of its int8 copy), or "eager (<why>)" where a lean precision was asked for a model the lean forward
    # does not cover, or where draft_precision="auto" fell back to "model"; and "force3", what Force 3's verification
    # ran (TriForceConfig.force3_compile): "eager" (transformers' forward of the model as given), "eager (<why>)" where
    # "auto" would have run it at fixed shapes but could not, or "<mode> (native)" ("graph (native)": the target's own
    # weights in a CUDA graph per row count), with "; candidate trees: eager" where trees may run
    tier_forwards: dict = field(default_factory=dict)
    # TriForceConfig.tier_compile other than "off": {"mode", "forwards" (fixed-shape forwards run), "compiles" (graphs
    # compiled in this call: 0 once a model's first call has compiled), "compile_seconds"} (`kernels.fixed_shape`);
    # where Force 3 ran at fixed shapes, "force3": the same four for its verification forward
    tier_compile: dict = field(default_factory=dict)
    # per model drafter that ran ("self", "model"), its sink+window cache: its positions and how it was filled
    # (`ModelDrafter.fill`: copied from the full cache, or a forward and why)
    draft_caches: dict = field(default_factory=dict)
    draft_copy_seconds: float = 0.0  # making the drafting tiers' weight copies (lean, int8): on a model's first call
    # of force1_seconds, a draft model's first fill of its cache from the prompt (a forward over up to sink_tokens +
    # window prompt tokens: prompt processing, which the bench does not time, as for assisted generation's
    # draft prefill); 0 for drafters that copy the target's entries or look tokens up
    draft_prefill_seconds: float = 0.0
    # adopting a cache= prefix (batch 1): allocating the full cache and copying the prefix in; static-cache
    # `generate` pays the same copy where its StaticCache is filled from a prefix (the bench times neither)
    prefix_copy_seconds: float = 0.0
    # the long-cache attention of a CPU fp32 / bf16 / fp16 target's forwards (`kernels.attention_routes.describe`): "cpu
    # kernel" where the library's compiled kernel took every class timed for the target's shape (decoding steps and
    # few-row verifications over 1024 cached entries or more), "cpu kernel where faster (k of n timed classes, sdpa
    # elsewhere)", or "sdpa (<why not>)": slower at every timed class, not built, a head dim it has no code for, no
    # cache long enough; "" elsewhere (other devices and dtypes take ATen's and the fused routes)
    attention_kernel: str = ""
    # the route each class took ("kernel" or "aten"), timed at set-up on this CPU: {shape class: {new rows: {cached
    # entries: route}}} (`kernels.attention_routes`), and this call's seconds timing them (once per model and process)
    attention_routes: dict = field(default_factory=dict)
    attention_calibration_seconds: float = 0.0
    # the CPU kernels of a CPU target (`kernels.cpu_kernels.describe`): {"target": the -march they were built for
    # (HF_TRIFORCE_CPU_MARCH), "attention": "on" or why not, "linear": "on" or why not, and where GGUF blocks are
    # attached to its layers (`kernels.gguf_weights`) "gguf": {"kernel": "on" or why not, "layers": {type: count}}};
    # {} for other devices
    cpu_kernels: dict = field(default_factory=dict)
    kernel_build_seconds: float = 0.0  # compiling and checking the kernels at this call's set-up (first call only)
    # the target's CPU linear layers: per group ("head", "decoder"), per row count multiplied so far, the route timed
    # fastest on this CPU ("linear": x @ W.T, "left": W @ x.T, "stream": the few-rows kernel, "gguf": the GGUF blocks
    # read at their stored width, `cpu_kernels["gguf"]`; `kernels.linear_routes`), and this call's seconds timing
    # routes (once per model, row count and process)
    linear_routes: dict = field(default_factory=dict)
    linear_calibration_seconds: float = 0.0
    # calls of routed layers that took F.linear instead of their route, by why (CPU autocast, rows of another dtype
    # than the weight: `kernels.linear_routes.bypass`)
    linear_bypassed: dict = field(default_factory=dict)
    # the dtype Force 2's retrieval cache kept its entries in (TriForceConfig.retrieval_dtype: "bfloat16", or the
    # model's: "float32", ...); "" where no Force-2 cache was built
    retrieval_dtype: str = ""
    full_cache_bytes: int = 0
    retrieval_cache_bytes: int = 0
    draft_cache_bytes: int = 0
    # bytes kept on the compute device between forwards: the caches' buffers except an offloaded full cache's,
    # plus the retrieval chunk summaries (one mean key per chunk: they grow with context / chunk_size)
    device_resident_bytes: int = 0
    retrieval_summary_bytes: int = 0
    plans: dict = field(default_factory=dict)  # policy="auto": per plan, steps, predicted and measured tokens/s


@dataclass(slots=True)
class TriForceStats:
    """Counts and seconds per tier; each tier's acceptance = what it accepted / what it verified. ``detail`` (always
    filled; in `to_dict`, not in ``repr``): the forwards, kernels, routes, caches and set-up seconds of the call."""

    new_tokens: int = 0
    force3_tokens: int = 0  # tokens committed by Force-3 steps (the first token, from the prefill, not counted)
    force2_verified: int = 0  # Force-1 drafts Force 2 verified (three-level steps only)
    force2_accepted: int = 0  # of those, accepted by Force 2
    force2_rejections: int = 0  # Force-2 verifications that rejected a draft
    force3_proposed: int = 0  # tokens proposed to Force 3 (by Force 2 in three-level steps, by Force 1 in two-level)
    force3_accepted: int = 0  # of those, accepted by Force 3
    force3_steps: int = 0  # Force-3 verifications
    force3_rejections: int = 0  # of those, the ones that rejected a proposed token (a plain step proposes none)
    prefill_seconds: float = 0.0  # the prompt's prefill (a cache= prefix's adoption included)
    force1_seconds: float = 0.0  # the drafters' (a draft model's first fill from the prompt included)
    force2_seconds: float = 0.0
    force3_seconds: float = 0.0
    plan_steps: dict = field(default_factory=dict)  # Force-3 steps by plan levels (1 plain, 2, 3)
    detail: TriForceDetail = field(default_factory=TriForceDetail, repr=False)

    @property
    def force2_acceptance(self) -> float:
        """Force-1 drafts accepted by Force 2 / verified by Force 2."""
        return self.force2_accepted / self.force2_verified if self.force2_verified else 0.0

    @property
    def force3_acceptance(self) -> float:
        """Tokens accepted by Force 3 / proposed to it."""
        return self.force3_accepted / self.force3_proposed if self.force3_proposed else 0.0

    @property
    def force2_position_acceptance(self) -> float:
        """Force 2's acceptance per position: accepted / (accepted + rejections), the chance that a draft is accepted
        where the drafts before it in its chain were (each verification stops at its first rejection). Unlike
        `force2_acceptance`, which the chain length lowers, it compares with a teacher-forced agreement
        (``benchmarks/sparse_agreement.py``)."""
        seen = self.force2_accepted + self.force2_rejections
        return self.force2_accepted / seen if seen else 0.0

    @property
    def force3_position_acceptance(self) -> float:
        """Force 3's acceptance per position: accepted / (accepted + rejections) (`force2_position_acceptance`)."""
        seen = self.force3_accepted + self.force3_rejections
        return self.force3_accepted / seen if seen else 0.0

    @property
    def setup_seconds(self) -> float:
        """Seconds of this call that are not decoding: adopting a cache= prefix, a draft model's first fill from the
        prompt (prompt processing), and what a model's first call in a process pays once (drafting weight copies,
        route timings, kernel builds)."""
        d = self.detail
        return (d.prefix_copy_seconds + d.draft_prefill_seconds + d.draft_copy_seconds
                + d.attention_calibration_seconds + d.linear_calibration_seconds + d.kernel_build_seconds)

    @property
    def tokens_per_force3_step(self) -> float:
        """Tokens committed per Force-3 verification (the first token, from the prefill, not counted)."""
        return self.force3_tokens / self.force3_steps if self.force3_steps else 0.0

    def to_dict(self) -> dict:
        """The fields and the acceptances as plain values (JSON-ready), the detail's under ``"detail"``."""
        out = asdict(self)
        detail = out.pop("detail")
        return {**out, **{name: getattr(self, name) for name in DERIVED}, "detail": detail}
