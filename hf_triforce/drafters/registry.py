"""The `Drafter` base class and the registry of Force-1 drafters (each drafter subclasses `Drafter`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from transformers import LogitsProcessorList

from ..forwards.forward import Clock, HostClock, Seconds, TierGenerator
from ..verification.draft_tree import DraftTree
from ..verification.sampling import Sampler


class Drafter:
    """What Force 1 asks of a drafter: the four required methods below raise NotImplementedError; the optional
    members have defaults a drafter overrides where it can do better.

    A ``"lookup"`` drafter's ``propose`` must have no side effects and draw no random numbers: the adaptive policy
    asks it every step what it would propose (counterfactual scoring), whether or not the step uses it.
    """

    seconds: float | Seconds = 0.0  # time spent proposing, accumulated (`clock.Seconds` on a CUDA device)
    # proposes from the sequence's host copy, an int64 NumPy array ``[1, n]``, where the decoder has one
    # (`decoding.levels.drafting_sequence`): a drafter that reads token values (the lookups); on an accelerator each
    # read of a device ``sequence`` would wait for the device
    host_sequence: bool = False

    def prefill(self, prompt: torch.Tensor) -> None:
        """Ready to propose after ``prompt`` ``[1, n]``; called before the first proposal (and again when a level
        starts using it)."""
        raise NotImplementedError(f"{type(self).__name__} must implement Drafter.prefill")

    def propose(self, sequence: torch.Tensor | np.ndarray, n: int) -> tuple[list[int], torch.Tensor | None]:
        """Up to ``n`` proposed tokens after ``sequence`` ``[1, length]`` and, row by row, the exact distribution
        ``[n, vocab]`` each was drawn from (``None`` for a deterministic proposer: point masses)."""
        raise NotImplementedError(f"{type(self).__name__} must implement Drafter.propose")

    def rollback(self, length: int) -> None:
        """Forget everything past the sequence's first ``length`` tokens (a committed prefix)."""
        raise NotImplementedError(f"{type(self).__name__} must implement Drafter.rollback")

    def nbytes(self) -> int:
        """Bytes of the state it holds (its cache)."""
        raise NotImplementedError(f"{type(self).__name__} must implement Drafter.nbytes")

    def propose_steps(self, sequence: torch.Tensor | np.ndarray,
                      n: int) -> TierGenerator[tuple[list[int] | torch.Tensor, torch.Tensor | None]]:
        """`propose` as a generator of its forwards (`hf_triforce.forwards.forward`), so that a batch drafts all
        its rows in one forward per token (`decoding.levels.proposal_steps`); the tokens may be a ``[n]`` tensor
        left on the device. Default: no forward to share; it yields nothing and returns `propose`'s answer."""
        yield from ()
        return self.propose(sequence, n)

    def propose_tree(self, sequence: torch.Tensor | np.ndarray, depth: int, nodes: int, branch: int) -> DraftTree:
        """A `DraftTree` of at most ``nodes`` nodes, ``depth`` deep, ``branch`` children per node, whose first path
        is the chain `propose` would give; asked only of a drafter registered with ``trees=True`` (`DrafterSpec`).
        Default: it proposes chains only."""
        raise NotImplementedError(f"{type(self).__name__} proposes chains only (registered with trees=False)")


def host_row(sequence: torch.Tensor | np.ndarray) -> np.ndarray:
    """Row 0 of a ``[1, n]`` sequence as host int64 token ids (a tensor is copied to the host: a read)."""
    if isinstance(sequence, torch.Tensor):
        return sequence[0].cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(sequence[0], dtype=np.int64)


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may use: the target, the config, the call's processors, sampling mode and sampler, and the
    target's full cache (its row of it, in a batch; None where there is none): a drafter running the target's own
    weights may copy entries from it; the call's clock, which times a drafter's forwards (`forwards.forward`); and
    ``force1_model``, the model Force 1 runs for a drafting model (its lean or int8 copy for the configured
    ``draft_precision``: the hierarchy hands `decoding.tiers.tier_model`'s; default: the model as given); and
    ``cache_rows``, the entries a model drafter's cache is allocated for (what the call can reach)."""

    target: Any
    config: Any  # TriForceConfig
    processors: LogitsProcessorList
    do_sample: bool
    sampler: Sampler
    full_cache: Any = None  # BufferCache
    clock: Clock = field(default_factory=HostClock)
    force1_model: Callable[[Any], Any] = field(default=lambda model: model)
    # entries a model drafter's sink+window cache is allocated for (`decoding.sizing.sink_window_rows`; None:
    # sink_tokens + window)
    cache_rows: int | None = None


@dataclass(frozen=True)
class DrafterSpec:
    """A registered drafter: ``build(context)`` makes one per `generate` call.

    ``kind``: ``"model"`` (runs a network; each proposal costs a forward) or ``"lookup"`` (costs almost
    nothing; the bench drafts more per step with it). ``description`` is shown by the CLI. ``trees``: its
    drafters also offer ``propose_tree(sequence, depth, nodes, branch)`` (a `tree.DraftTree` whose first path
    is the chain ``propose`` would give; ``TriForceConfig.tree_nodes``).
    """

    name: str
    build: Callable[[DraftContext], Drafter]
    kind: str
    description: str
    trees: bool = False


DRAFTERS: dict[str, DrafterSpec] = {}
MODEL_DRAFTER = "model"  # the spec used when TriForceConfig.draft is a model object


def register_drafter(name: str, build: Callable[[DraftContext], Drafter], kind: str, description: str,
                     trees: bool = False) -> None:
    """Add a drafter under ``name`` (refuses a name in use and an unknown ``kind``)."""
    if name in DRAFTERS:
        raise ValueError(f"a drafter named {name!r} is already registered")
    if kind not in ("model", "lookup"):
        raise ValueError(f"drafter kind must be 'model' or 'lookup', got {kind!r}")
    DRAFTERS[name] = DrafterSpec(name, build, kind, description, trees)


def drafter_names() -> tuple[str, ...]:
    """Names a `TriForceConfig.draft` string may take."""
    return tuple(name for name in DRAFTERS if name != MODEL_DRAFTER)


def spec_of(draft: Any) -> DrafterSpec:
    """The registered drafter ``draft`` names (a model object: the ``model`` drafter); ValueError naming ``draft``
    and the names it may take for any other string."""
    name = draft if isinstance(draft, str) else MODEL_DRAFTER
    if name not in DRAFTERS:
        raise ValueError(f"TriForceConfig.draft must be one of {drafter_names()} or a PreTrainedModel, got {draft!r}")
    return DRAFTERS[name]


def build_drafter(context: DraftContext) -> Drafter:
    """The drafter ``context.config.draft`` names (a model object: the ``model`` drafter); TypeError naming the
    drafter where its ``build`` returns something that is not a `Drafter`."""
    spec = spec_of(context.config.draft)
    drafter = spec.build(context)
    if not isinstance(drafter, Drafter):
        raise TypeError(f"the {spec.name!r} drafter's build returned a {type(drafter).__name__}, which does not "
                        "subclass hf_triforce.drafters.Drafter")
    return drafter
