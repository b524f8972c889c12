"""A causal LM drafting on a constant-size `SinkWindowCache`: the target itself (``"self"``) or a draft model."""

from __future__ import annotations

import torch

from ..caches.buffer import BufferCache
from ..caches.sink_window import SinkWindowCache, copy_refusal, make_layer_rerotations
from ..compat import layer_devices, num_layers
from ..forwards.forward import Clock, ForwardRequest, HostClock, Seconds, TierGenerator, run_inline
from ..kernels.lean import LeanModel
from ..tokens import agreement, append_tokens
from ..verification.draft_tree import DraftTree
from ..verification.sampling import Sampler, scores_to_probs
from ..verification.scoring import process_positions
from .branching import branched_chain
from .registry import MODEL_DRAFTER, DraftContext, Drafter, register_drafter

# a drafter filling by copy refills once it is more than this many tokens behind the sequence (steps ran without
# it); catching up costs a forward of that many rows, a copy a few milliseconds. One filling by forwards refills
# only when half its window behind (a fill is a 272-row forward: docs/experiments.md, "Force 1: a window of 1024...").
COPY_REFILL_BEHIND = 8
# A drafter that fills its cache by a forward (a draft model: it cannot copy the target's entries) runs that fill,
# sink + window = 1040 rows by default, by the draft model's own weights, and drafts by its lean copy: the int4
# kernels are built for a few rows, the model's own BLAS products for many. Exact either way: the drafter's law is
# still a deterministic function of the sequence (the self drafter likewise drafts on the target's own entries).
# The fill's cost both ways: docs/experiments.md, "Lean drafting tiers: weight-only int4 in groups of 32".


class ModelDrafter(Drafter):
    """A causal LM on a constant-size sink+window cache (`SinkWindowCache`, in-cache or absolute positions)."""

    def __init__(self, model, sink_tokens: int, window: int, processors, do_sample: bool, sampler: Sampler,
                 sampled_siblings: bool = False, source: BufferCache | None = None, positions: str = "slots",
                 fill_model=None, clock: Clock | None = None, cache_rows: int | None = None):
        """``sampled_siblings``: when sampling, a tree's alternatives are the draft's top-ranked tokens (False, the
        default: they accepted more, docs/experiments.md, "Candidate trees") or drawn without replacement (True); see
        `propose_tree`. ``source``: the target's full cache, when ``model`` drafts for itself (the target or a copy of
        its weights): fills copy their entries from it (`SinkWindowCache.copy_from`) instead of running a forward over
        them, where it can (`copy_refusal`; `fill` says how). ``positions``: the cache's (`SinkWindowCache`):
        ``"slots"`` (in-cache) or ``"absolute"`` (the tokens' own). ``fill_model``: the model whose forward fills the
        cache where it is not copied (default ``model``): a draft model's own weights when ``model`` is its lean copy,
        whose int4 CPU kernels are built for a few rows (the note above the class). ``clock``: the call's, timing its
        forwards (`forwards.forward`; default the host's). ``cache_rows``: the entries its cache is allocated for
        (default ``sink_tokens + window``; `SinkWindowCache`'s ``capacity``)."""
        self.model = model
        self.fill_model = model if fill_model is None else fill_model
        layers = num_layers(model.config)
        # at absolute positions no key is ever moved: the probe forward of `make_layer_rerotations` is not paid
        rerotations = make_layer_rerotations(model) if positions == "slots" else [None] * layers
        self.cache = SinkWindowCache(layers, sink_tokens, window, rerotations, positions, cache_rows)
        self.cache.expect_devices(layer_devices(model))
        refusal = copy_refusal(source) if source is not None else "drafting with another model than the target"
        self.source = source if refusal is None else None
        self.fill = "a copy of the full cache's entries" if refusal is None else f"a forward ({refusal})"
        self.processors = processors
        self.do_sample = do_sample
        self.sampler = sampler
        self.sampled_siblings = sampled_siblings
        self.fed = 0  # tokens of the sequence fed to it: their entries are in the cache (or evicted)
        self.drafted: tuple[int, list[int]] | None = None  # (position, chain) of the last tree's cached chain
        self.clock = clock if clock is not None else HostClock()
        self.seconds: float | Seconds = 0.0  # its forwards' (`clock.Seconds` on a CUDA device: read after the fact)
        # of `seconds`, the first fill's: a draft model's pass over the prompt, prompt processing rather than decoding
        self.prefill_seconds: float | Seconds = 0.0
        self.forwards = 0

    def _forward_steps(self, tokens: torch.Tensor, model=None) -> TierGenerator[torch.Tensor]:
        """The last row's logits ``[1, vocab]`` of ``tokens`` fed at the next in-cache positions (by ``model``,
        default the drafting model)."""
        self.cache.make_room(tokens.shape[1])
        start = self.fed if self.cache.positions == "absolute" else self.cache.length
        request = ForwardRequest(self.model if model is None else model, self.cache, tokens, start, 1, self.clock)
        logits = yield request
        self.seconds += request.seconds
        self.forwards += 1
        self.fed += tokens.shape[1]
        return logits

    def prefill(self, prompt: torch.Tensor) -> None:
        """Ready to propose after ``prompt``: on the first call, the cache filled with the prompt's first
        ``sink_tokens`` and last ``window`` tokens but the last; later (the levels of a call share one drafter, and
        each starts it) nothing: drafting catches up with the sequence (`_draft_steps`); a second fill would cost a
        272-row forward (docs/experiments.md, "Force 1: a window of 1024...")."""
        if not self.fed:
            before = self.seconds
            self._fill(prompt)
            self.prefill_seconds = self.seconds - before

    def _fill(self, prompt: torch.Tensor) -> None:
        """(Re)fill the cache with the prompt's first ``sink_tokens`` and last ``window`` tokens, except the last:
        copied from ``source`` as far as it holds them (drafting feeds the rest), else by a forward."""
        if self.source is not None and self.source.length:
            self.fed = min(self.source.length, prompt.shape[1] - 1)
            self.cache.copy_from(self.source, self.fed)
            return
        self.cache.rollback(0)
        n = prompt.shape[1] - 1
        sink, window = self.cache.sink_tokens, self.cache.window - self.cache.evict_block
        spans = [(0, n)] if n <= sink + window else [(0, sink), (n - window, n)]
        if self.cache.positions == "absolute":  # each span at its own positions
            for begin, end in spans:
                self.fed = begin
                if end > begin:
                    run_inline(self._forward_steps(prompt[:, begin:end], self.fill_model))
        else:  # one forward: the slots are the positions
            body = torch.cat([prompt[:, begin:end] for begin, end in spans], dim=1)
            if body.shape[1]:
                run_inline(self._forward_steps(body, self.fill_model))
        self.fed = n

    def propose(self, sequence: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor | None]:
        tokens, probs = run_inline(self.propose_steps(sequence, n))
        return (tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens), probs

    def propose_steps(self, sequence: torch.Tensor, n: int) -> TierGenerator[tuple[list[int] | torch.Tensor,
                                                                                  torch.Tensor | None]]:
        """`Drafter.propose_steps`: the tokens stay on the device (a ``[n]`` tensor) until verification reads them
        with its own readback."""
        tokens, _, probs = yield from self._draft_steps(sequence, n)
        return tokens, (torch.stack(probs) if probs else None)

    def _draft_steps(self, sequence: torch.Tensor, n: int
                     ) -> TierGenerator[tuple[list[int] | torch.Tensor, list[torch.Tensor], list[torch.Tensor]]]:
        """``n`` drafted tokens (a ``[n]`` tensor on the device), each row's processed scores, and (sampling) the law
        each token was drawn from."""
        if self.drafted is not None:  # a tree's side node may have been accepted: keep only what still agrees
            start, drafted = self.drafted
            self.rollback(start + agreement(sequence[0, start : start + len(drafted)].tolist(), drafted))
            self.drafted = None
        behind = COPY_REFILL_BEHIND if self.source is not None else self.cache.window // 2
        if sequence.shape[1] - self.fed > behind:  # far behind (steps ran without it)
            self._fill(sequence)
        tokens: list[torch.Tensor] = []
        drafted_scores, probs = [], []  # per drafted token, its processed scores and (sampling) its law
        pending = sequence[:, self.fed :]
        while len(tokens) < n:
            logits = yield from self._forward_steps(pending)
            current = sequence if not tokens or not self.processors else append_tokens(sequence, tokens)
            scores = process_positions(self.processors, current, logits, sequence.shape[1] + len(tokens))
            drafted_scores.append(scores[0])
            # the token stays on the device: verification reads it with its own readback (no read per drafted token)
            if self.do_sample:
                law = scores_to_probs(scores)[0]
                token = self.sampler.device_categorical(law)
                probs.append(law)
            else:
                token = scores[0].argmax()
            pending = token.view(1, 1)
            tokens.append(token)
        return (torch.stack(tokens) if tokens else tokens), drafted_scores, probs

    def propose_tree(self, sequence: torch.Tensor, depth: int, nodes: int, branch: int) -> DraftTree:
        """The drafted chain (as `propose`), plus alternatives where the chain is least certain: the remaining
        ``nodes`` go to the positions with the highest estimated chance that an alternative there is accepted
        (`branching.sibling_counts`), at most ``branch - 1`` alternatives per position, as leaves.

        Greedy (or ``sampled_siblings=False``): the alternatives are the draft's next most likely tokens there,
        point masses. Sampling with ``sampled_siblings``: they are drawn from the draft's law after the chain's
        token without replacement (`tree.draw_siblings`), each carrying the law it was drawn with. Exact for
        sampled verification either way: an alternative is a function of (or a fresh draw given) the path and
        the siblings before it; how many there are depends on the chain only."""
        tokens, drafted_scores, probs = run_inline(self._draft_steps(sequence, min(depth, nodes)))
        tokens = tokens.tolist() if isinstance(tokens, torch.Tensor) else tokens
        # the cache holds the chain's entries; the committed path may leave it at a side node (checked next time)
        self.drafted = (sequence.shape[1], tokens)
        laws = probs if self.do_sample else [scores_to_probs(scores) for scores in drafted_scores]
        chain_laws = probs if self.do_sample else [None] * len(tokens)
        sampler = self.sampler if self.do_sample and self.sampled_siblings else None
        return branched_chain(tokens, laws, chain_laws, nodes, branch, sampler)

    def rollback(self, length: int) -> None:
        if self.fed > length:
            self.cache.rollback(self.cache.length - (self.fed - length))
            self.fed = length

    def nbytes(self) -> int:
        return self.cache.nbytes()


def draft_positions(config, target, model) -> str:
    """`TriForceConfig.draft_positions` made concrete for drafting ``model`` for ``target`` (``"auto"``: absolute
    unless ``model`` takes fewer positions than the target)."""
    if config.draft_positions != "auto":
        return config.draft_positions
    if model is target:
        return "absolute"
    fewer = getattr(model.config, "max_position_embeddings", 0) < getattr(target.config, "max_position_embeddings", 0)
    return "slots" if fewer else "absolute"


def _build(context: DraftContext, model) -> ModelDrafter:
    config = context.config
    source = context.full_cache if model is context.target else None  # its own entries: copied, not recomputed
    drafting = context.force1_model(model)
    fill = model if isinstance(drafting, LeanModel) else None
    return ModelDrafter(drafting, config.sink_tokens, config.window, context.processors, context.do_sample,
                        context.sampler, source=source, positions=draft_positions(config, context.target, model),
                        fill_model=fill, clock=context.clock, cache_rows=context.cache_rows)


register_drafter("self", lambda context: _build(context, context.target), "model",
                 "the target itself on a sink+window cache (TriForce's Force 1)", trees=True)
register_drafter(MODEL_DRAFTER, lambda context: _build(context, context.config.draft), "model",
                 "a small draft model sharing the target's vocabulary, on a sink+window cache", trees=True)
