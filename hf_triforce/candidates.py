"""`TriForceCandidateGenerator`: Force 1 and Force 2 as a transformers `CandidateGenerator` (docs/assisted.md).

transformers' assisted-generation loop (``_assisted_decoding``) is Force 3: ``get_candidates`` has the library's level
(`levels.Force2Level` over a Force-1 drafter, or `levels.Force1Level` with ``levels=2``) propose up to gamma2 tokens
with ``log q``, the processed law each was drawn from; transformers verifies them (greedy: the longest prefix equal
to its argmax; sampling: `_speculative_sampling`, exact for tokens distributed as q); ``update_candidate_strategy``
commits what it accepted (caches roll back by length, the retrieval cache syncs and re-selects). Deterministic
proposals (an n-gram drafter with ``levels=2``) come without logits: the loop accepts a candidate when its own draw
from p equals it, the same rule for a point mass.

The generator reads the full model's cache and the query of the last accepted token: `TriForceConfig(loop="assisted")`
prefills a `BufferCache` and records queries through the attention wrapper; with the upstream patch,
``generate(candidate_generator=TriForceCandidateGenerator)`` reads ``generate``'s own cache and gets the
verification forward's queries as ``verifier_queries``. No `LogitsProcessor` comes with it: the call's own
processors are applied to Force 2's logits here and to the model's in the loop.
"""

from __future__ import annotations

import time

import torch
from transformers import LogitsProcessorList, StoppingCriteriaList

from . import compat
from .config import TriForceConfig
from .decoding.hierarchy import Hierarchy
from .decoding.policy import Plan
from .decoding.preflight import check_model
from .decoding.resolved import ResolvedConfig, resolve
from .forwards.forward import device_clock, run_inline
from .kernels import attention_routes
from .kernels.attention import QueryRecorder
from .request import check_request, recording_attention
from .stats import TriForceStats
from .verification.sampling import ChainVerifier, Sampler, TorchSampler
from .verification.scoring import row_processors


class CacheView:
    """A transformers cache (``generate``'s `DynamicCache`) read as the tiers read Force 3's `BufferCache`: ``length``
    tokens, every layer's ``keys``/``values`` holding each token at its position. Sliding-window layers keep only
    their window there: refused."""

    def __init__(self, cache) -> None:
        kept = [index for index, layer in enumerate(cache.layers)
                if getattr(layer, "is_sliding", False) or not hasattr(layer, "keys")]
        if kept:
            raise ValueError(f"TriForceCandidateGenerator: the cache's layers {kept} do not keep every token (sliding "
                             "window or another layout); use TriForceConfig(loop='assisted') with this model")
        self.cache = cache

    @property
    def layers(self) -> list:
        return self.cache.layers

    @property
    def length(self) -> int:
        return int(self.cache.get_seq_length())


def requested_config(generation_config, triforce_config, assistant_model) -> TriForceConfig | ResolvedConfig:
    """The `TriForceConfig` a generator is asked for: the one given (resolved already by `assisted.run_assisted`),
    else ``generation_config.triforce_config`` (a dict on a patched transformers; ``assistant_model``, if any, as its
    draft model), else the default; chains only."""
    config = triforce_config
    if config is None:
        raw = getattr(generation_config, "triforce_config", None)
        if isinstance(raw, TriForceConfig):
            config = raw
        elif isinstance(raw, dict):
            config = TriForceConfig.from_dict(raw, draft_model=assistant_model)
        elif raw is None:
            config = TriForceConfig() if assistant_model is None else TriForceConfig(draft=assistant_model)
        else:
            raise TypeError(f"generation_config.triforce_config must be a dict or a TriForceConfig, got "
                            f"{type(raw).__name__}")
    if not isinstance(config, (TriForceConfig, ResolvedConfig)):
        raise TypeError(f"triforce_config must be a TriForceConfig, got {type(config).__name__}")
    if config.trees:
        raise ValueError("TriForceCandidateGenerator: transformers' assisted loop verifies chains only: set "
                         f"tree_nodes=0 and force2_tree_nodes=0 (got {config.tree_nodes} and "
                         f"{config.force2_tree_nodes})")
    return config


class TriForceCandidateGenerator(compat.CandidateGenerator):
    """Force 1 drafting and Force 2 verifying as transformers' `CandidateGenerator` (module docstring).

    Built by ``TriForceConfig(loop="assisted")``, or by transformers with the upstream patch as a factory:
    ``model.generate(ids, candidate_generator=TriForceCandidateGenerator, triforce_config={...})`` (the keyword
    arguments below are what it passes; ``assistant_model=``, if given, is the draft model).

    model: the target (Force 3 runs it in transformers' loop; Force 1 and Force 2 run it, or copies of its weights
        for ``draft_precision``, on their own caches).
    generation_config: the call's: ``max_length``, ``do_sample``, and ``triforce_config`` where ``triforce_config=``
        is not given.
    logits_processor: the call's processors (``generate`` builds them, warpers included when sampling): applied to
        Force 1's and Force 2's logits as the loop applies them to the model's.
    model_kwargs: the call's; its ``"cache"`` is the full cache where ``full_cache`` is not given.
    triforce_config: a `TriForceConfig` (trees are refused: the loop verifies chains).
    stopping_criteria: the call's criteria, if known: candidates stop at the first token at which they would stop
        generation (greedy: before it, so that the loop's bonus token is never past a stop; sampling: after it, since
        dropping a candidate because of its own value would bias the law). Criteria must be functions of the
        sequence, as transformers' are; they are called with ``scores=None``, as the loop calls them without
        ``output_scores``.
    full_cache: Force 3's cache holding the sequence (a `BufferCache`; default: ``model_kwargs["cache"]``, full
        attention layers only).
    sampler: the tiers' random draws (default: torch's global RNG, which transformers' loop uses too).

    ``stats`` (`TriForceStats`) counts what the tiers did; ``recorder`` receives the verification forwards' queries
    where no ``verifier_queries`` come with ``update_candidate_strategy`` (a forward run under
    `kernels.attention.recording` with the model on the recording attention).
    """

    # a transformers with the upstream patch hands update_candidate_strategy the verification forward's queries
    requires_verifier_queries = True

    def __init__(self, model, generation_config=None, logits_processor: LogitsProcessorList | None = None,
                 model_kwargs: dict | None = None, *, triforce_config: TriForceConfig | ResolvedConfig | None = None,
                 stopping_criteria: StoppingCriteriaList | None = None, full_cache=None, sampler: Sampler | None = None,
                 input_ids: torch.LongTensor | None = None, inputs_tensor: torch.Tensor | None = None,
                 assistant_model=None) -> None:
        generation_config = generation_config if generation_config is not None else model.generation_config
        requested = requested_config(generation_config, triforce_config, assistant_model)
        config = resolve(requested, model, driver="assisted")  # once; a config resolved by the caller as it is
        model_kwargs = model_kwargs or {}
        if full_cache is None:
            self._check_foreign_call(model, config, input_ids, generation_config, model_kwargs, logits_processor)
            full_cache = CacheView(model_kwargs["cache"])
        self.model, self.config, self.full = model, config, full_cache
        self.do_sample = bool(generation_config.do_sample)
        self.max_length = int(generation_config.max_length)
        self.criteria = stopping_criteria
        self.sampler = sampler if sampler is not None else TorchSampler()
        processors = row_processors(logits_processor or LogitsProcessorList(), 0, 1)
        self.stats = TriForceStats()
        self.recorder = QueryRecorder()
        clock = device_clock(model)  # times the tiers' forwards (read with the stats, after the verification)
        self.hierarchy = Hierarchy(model, config, [processors], self.do_sample, self.sampler, clock,
                                   max_lengths=[self.max_length], full_cache=full_cache)
        plan = Plan(config.levels, config.draft_name, config.gamma1, config.gamma2)
        self.drafter = self.hierarchy.drafter(0, config.draft_name)
        self.level = self.hierarchy.level(0, plan)
        # where hf_triforce's own loop set the call up, its timed routes; where transformers built this generator, none
        # are installed and every call takes ATen's route (`attention_routes.takes_kernel`)
        routes = attention_routes.active()
        self.stats.detail.attention_kernel = attention_routes.describe(model) if routes is not None else \
            attention_routes.NOT_SET_UP if attention_routes.cpu_dtype(model) is not None else ""
        self.queries: dict[int, torch.Tensor] | None = None  # per layer, the query of the last cached token
        self.proposed, self.ran, self.length, self.handed_to_loop_at = 0, False, 0, 0.0

    @staticmethod
    def _check_foreign_call(model, config, input_ids, generation_config, model_kwargs, logits_processor) -> None:
        """Built by transformers (the upstream patch's factory): what `TriForceConfig(loop="assisted")` checks before
        its prefill, and what the tiers cannot read from ``generate``'s own cache."""
        if "cache" not in model_kwargs:
            raise ValueError("TriForceCandidateGenerator needs the full model's cache: model_kwargs['cache'] or "
                             "full_cache=")
        mask = model_kwargs.get("attention_mask")
        if mask is not None and not bool(mask.all()):
            raise ValueError("TriForceCandidateGenerator on generate()'s cache: a padded prompt (attention_mask with "
                             "zeros) is not supported there; use TriForceConfig(loop='assisted'), which removes the "
                             "padding, or an unpadded prompt")
        if any(window is not None for window in compat.layer_windows(model.config)):
            raise ValueError("TriForceCandidateGenerator on generate()'s cache: the model has sliding-window layers, "
                             "whose cache keeps only the window; use TriForceConfig(loop='assisted')")
        ids = input_ids if input_ids is not None else torch.zeros(1, 1, dtype=torch.long, device=model.device)
        checked = {k: v for k, v in model_kwargs.items() if k not in ("cache", "position_ids")}
        check_request(model, ids, config, generation_config, checked, logits_processor)
        with recording_attention(model):
            check_model(model, config, ids[:, :1])

    @property
    def force2_verifier(self) -> ChainVerifier:
        """The exact rule of the Force-2 level (a test may alter it)."""
        return self.hierarchy.force2_verifier

    @property
    def num_drafting_tokens(self) -> int:
        """The most tokens `get_candidates` proposes (transformers 5.25 keeps that many recurrent states)."""
        return self.config.gamma2

    def candidate_logits(self, probs: torch.Tensor) -> torch.Tensor:
        """Logits whose softmax is ``probs`` ``[n, vocab]`` (the laws the candidates were drawn from): ``log probs``,
        ``-inf`` where a processor removed a token."""
        return torch.log(probs)

    def get_candidates(self, input_ids: torch.LongTensor, **kwargs) -> tuple[torch.LongTensor, torch.Tensor | None]:
        """``input_ids`` ``[1, n]`` (the committed sequence) followed by up to ``gamma2`` candidates, and
        ``[1, k, vocab]`` logits of the laws they were drawn from (None: greedy, point masses, or no candidate).
        No candidate where the full cache is not yet ``n - 1`` tokens with a recorded query (transformers' first
        iteration then prefills) or the call has no room for one."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"TriForceCandidateGenerator: transformers' assisted loop decodes one prompt per call; "
                             f"got a batch of {input_ids.shape[0]}")
        self.proposed, self.ran, self.length = 0, False, input_ids.shape[1]
        limit = self.max_length - input_ids.shape[1] - 1
        if limit <= 0 or self.queries is None or self.full.length != input_ids.shape[1] - 1:
            self.handed_to_loop_at = time.perf_counter()
            return input_ids, None
        with recording_attention(self.model), torch.no_grad():
            self.level.start(input_ids, self.queries)
            proposal = run_inline(self.level.candidate_steps(input_ids, limit))
        self.level.take_report().add_to(self.stats)
        self.ran = True
        # a drafter may keep its tokens on the device (`levels.proposal_steps`); transformers' loop takes them as ids
        drafted = proposal.tokens.tolist() if isinstance(proposal.tokens, torch.Tensor) else proposal.tokens
        tokens = self._before_stop(input_ids, drafted)
        self.proposed = len(tokens)
        self.handed_to_loop_at = time.perf_counter()
        if not tokens:
            return input_ids, None
        candidates = torch.cat((input_ids, input_ids.new_tensor([tokens])), dim=1)
        if proposal.probs is None:
            return candidates, None
        return candidates, self.candidate_logits(proposal.probs[: len(tokens)])[None]

    def _before_stop(self, sequence: torch.Tensor, tokens: list[int]) -> list[int]:
        """``tokens`` up to the first at which the stopping criteria stop generation: greedy, without it (the loop's
        own next token then stops it, or does not); sampling, with it (a candidate dropped for its own value would
        bias the law; the loop may then add one token past the stop)."""
        if not self.criteria:
            return tokens
        for index in range(len(tokens)):
            prefix = torch.cat((sequence, sequence.new_tensor([tokens[: index + 1]])), dim=1)
            if bool(self.criteria(prefix, None).any()):
                return tokens[: index + 1 if self.do_sample else index]
        return tokens

    def update_candidate_strategy(self, input_ids: torch.LongTensor, scores: torch.Tensor, num_matches: int,
                                  **verifier_outputs) -> None:
        """The model accepted ``num_matches`` candidates and appended its own token (``input_ids``, its cache holds
        all but that token): count the step, keep the query of the last cached token, and let the level keep its
        caches to the committed sequence."""
        stats, num_matches = self.stats, int(num_matches)
        stats.force3_seconds += time.perf_counter() - self.handed_to_loop_at
        stats.force3_steps += 1
        stats.force3_accepted += num_matches
        stats.force3_rejections += num_matches < self.proposed
        stats.force3_tokens += input_ids.shape[1] - self.length
        plan = self.config.levels if self.proposed else 1
        stats.plan_steps[plan] = stats.plan_steps.get(plan, 0) + 1
        if "verifier_queries" in verifier_outputs:  # rows: the candidates' forward, row num_matches the last accepted
            self.queries = {layer: q[:, :, num_matches] for layer, q in verifier_outputs["verifier_queries"].items()}
        elif self.recorder.queries:  # the verification forward's last proposed + 1 rows
            self.queries = self.recorder.at(num_matches - self.proposed - 1)
        if self.ran and input_ids.shape[1] < self.max_length:
            with torch.no_grad():
                # the tokens this step committed, on the host (transformers' loop has read them back already)
                self.level.commit(input_ids, num_matches, self.proposed, self.queries,
                                  input_ids[0, self.length:].tolist())
            self.level.take_report().add_to(self.stats)

    def prefilled(self) -> None:
        """The full cache was just prefilled with the queries going to ``recorder``: its last row's query seeds the
        first retrieval selection."""
        if self.recorder.queries:
            self.queries = self.recorder.at(-1)

    def finish(self, new_tokens: int) -> TriForceStats:
        """The call's `TriForceStats` (`Hierarchy.finish_row`); its tiers' forwards as `Decoder.tier_forwards` reports
        them, Force 3's transformers' forward of the model."""
        config, stats = self.config, self.stats
        tiers = {f"force1 {config.draft_name}"} | ({"force2"} if config.levels == 3 else set())
        self.hierarchy.finish_row(stats, 0, new_tokens, self.hierarchy.tier_forwards(tiers, "eager"))
        self.hierarchy.count_cache_bytes(stats)
        return stats
