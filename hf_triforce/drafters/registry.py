"""The `Drafter` protocol and the registry of Force-1 drafters.

Contract: ``propose(sequence, n)`` returns up to ``n`` proposed tokens and, row by row, the exact
distribution each was drawn from (``None`` for a deterministic proposer: a point mass). ``rollback(length)``
is called with the length of a committed prefix of the sequence; ``prefill(prompt)`` once, before the first
proposal. ``seconds`` accumulates the time spent proposing. A ``"lookup"`` drafter's ``propose`` must have no
side effects and draw no random numbers: the adaptive policy asks it every step what it would propose
(counterfactual scoring), whether or not the step uses it. A drafter that runs a model may also offer
``propose_steps(sequence, n)``, `propose` as a generator of its forwards (`hf_triforce.decoding.steps`), so that a
batch drafts all its rows in one forward per token. A drafter that reads token values (the lookups) sets
``host_sequence = True`` and is then given the sequence's host copy, an int64 NumPy array ``[1, n]``, where the
decoder has one (`drafting_sequence`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch
from transformers import LogitsProcessorList

from ..decoding.clock import Clock, HostClock
from ..decoding.steps import Steps
from ..verification.sampling import Sampler


class Drafter(Protocol):
    seconds: float

    def prefill(self, prompt: torch.Tensor) -> None: ...

    def propose(self, sequence: torch.Tensor, n: int) -> tuple[list[int], torch.Tensor | None]: ...

    def rollback(self, length: int) -> None: ...

    def nbytes(self) -> int: ...


def proposal_steps(drafter: Drafter, sequence: torch.Tensor, n: int,
                   host: np.ndarray | None = None) -> Steps[tuple[list[int] | torch.Tensor, torch.Tensor | None]]:
    """``drafter.propose(sequence, n)`` as a generator of forward requests (none for a drafter without
    ``propose_steps``: it proposes directly; ``host``: the sequence's host copy, `drafting_sequence`). The tokens
    are ids, or a ``[n]`` tensor on the device where a drafter's ``propose_steps`` keeps them there (verification
    reads them back with its acceptance)."""
    steps = getattr(drafter, "propose_steps", None)
    if steps is None:
        return drafter.propose(drafting_sequence(drafter, sequence, host), n)
    return (yield from steps(sequence, n))


def drafting_sequence(drafter: Drafter, sequence: torch.Tensor, host: np.ndarray | None) -> torch.Tensor | np.ndarray:
    """What ``drafter`` proposes from: ``host``, the sequence's host copy (int64 ``[1, n]``), for a drafter that reads
    token values (``host_sequence``: the lookups; on an accelerator each read of ``sequence`` would wait for the
    device), where the caller has one; else ``sequence``."""
    return host if host is not None and getattr(drafter, "host_sequence", False) else sequence


def host_row(sequence: torch.Tensor | np.ndarray) -> np.ndarray:
    """Row 0 of a ``[1, n]`` sequence as host int64 token ids (a tensor is copied to the host: a read)."""
    if isinstance(sequence, torch.Tensor):
        return sequence[0].cpu().numpy().astype(np.int64, copy=False)
    return np.asarray(sequence[0], dtype=np.int64)


def append_tokens(sequence: torch.Tensor, tokens: list[int] | list[torch.Tensor] | torch.Tensor) -> torch.Tensor:
    """``sequence`` ``[1, n]`` followed by ``tokens``: ids (copied to the device), 0-d tensors or a ``[k]`` tensor
    on the device (no host read either way)."""
    if isinstance(tokens, torch.Tensor):
        row = tokens.to(sequence.device)
    elif tokens and isinstance(tokens[0], torch.Tensor):
        row = torch.stack(tokens).to(sequence.device)
    else:
        row = device_tokens(tokens, sequence.device)
    return torch.cat((sequence, row.view(1, -1)), dim=1)


def device_tokens(tokens: list[int], device: torch.device) -> torch.Tensor:
    """``tokens`` as a ``[k]`` long tensor on ``device``; to an accelerator by an asynchronous copy from pinned
    memory (a blocking copy from the host waits for the device)."""
    host = torch.tensor(tokens, dtype=torch.long)
    if torch.device(device).type != "cuda":
        return host.to(device)
    return host.pin_memory().to(device, non_blocking=True)


@dataclass(frozen=True)
class DraftContext:
    """What a drafter may use: the target, the config, the call's processors, sampling mode and sampler, and the
    target's full cache (its row of it, in a batch; None where there is none): a drafter running the target's own
    weights may copy entries from it; and the call's clock, which times a drafter's forwards (`decoding.clock`)."""

    target: Any
    config: Any  # TriForceConfig
    processors: LogitsProcessorList
    do_sample: bool
    sampler: Sampler
    full_cache: Any = None  # BufferCache
    clock: Clock = field(default_factory=HostClock)


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
    return DRAFTERS[draft if isinstance(draft, str) else MODEL_DRAFTER]


def build_drafter(context: DraftContext) -> Drafter:
    """The drafter ``context.config.draft`` names (a model object: the ``model`` drafter)."""
    return spec_of(context.config.draft).build(context)
