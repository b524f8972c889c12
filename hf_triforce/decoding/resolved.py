"""`ResolvedConfig`: a call's `TriForceConfig` resolved once, before anything is built, into a frozen value holding
every resolved choice and derived size. Everything downstream reads it; nothing resolves again.

    resolve(config, target, driver)
        draft_precision, tier_compile   concrete (`tiers.resolve_draft_precision`: "auto" by the models and device)
        retrieval_dtype                 concrete (`tiers.resolve_retrieval_dtype`: "auto" by Force 2's forward)
        lean_unavailable_reason         why ``draft_precision="auto"`` kept the models' eager forwards (None: not)
        draft_name                      the configured drafter's name (``"model"`` for a draft model)
        lookup_gamma2, proposal_rows,   the sizes of `sizing`, for the loop that drives the hierarchy: ``"triforce"``
        recent_tokens, round_rows,      (the library's loop, whose adaptive policy may verify longer lookup chains) or
        force3_rows, force3_room        ``"assisted"`` (transformers' loop: at most ``gamma2`` candidates a step)

Every field of the `TriForceConfig` (and its ``refresh_interval``, ``trees``) is an attribute of the resolved value
too (``resolved.gamma2``), so that a resolved config goes wherever a config goes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from ..config import TriForceConfig
from ..drafters.registry import MODEL_DRAFTER
from .sizing import force3_rows, lookup_gamma2, proposal_rows, recent_tokens, round_rows
from .tiers import resolve_draft_precision, resolve_retrieval_dtype

LOOPS = ("triforce", "assisted")


@dataclass(frozen=True)
class ResolvedConfig:
    """A `TriForceConfig` with its choices made concrete for one target and its sizes derived (module docstring)."""

    config: TriForceConfig  # draft_precision, tier_compile and retrieval_dtype concrete
    driver: str  # the loop that drives the hierarchy (`LOOPS`)
    lean_unavailable_reason: str | None
    draft_name: str
    lookup_gamma2: int  # most tokens a lookup drafter proposes straight to Force 3
    proposal_rows: int  # most rows Force 1 proposes for one Force-2 verification
    recent_tokens: int  # recent tokens the retrieval cache always keeps
    round_rows: int  # tail room a step's Force-2 rounds need in the retrieval cache
    force3_rows: int  # most candidates one Force-3 verification scores
    force3_room: int  # rows Force 3's cache keeps past the request: the candidates, the bonus token, one more

    def __post_init__(self) -> None:
        # every field of the config, and its derived properties, read as attributes of this value
        for name in [f.name for f in fields(self.config)] + ["refresh_interval", "trees"]:
            object.__setattr__(self, name, getattr(self.config, name))

    def with_draft(self, name: str) -> ResolvedConfig:
        """This resolution with ``draft=name`` (another drafter of the policy's; the sizes do not depend on it)."""
        return replace(self, config=replace(self.config, draft=name), draft_name=name)


def resolve(config: TriForceConfig | ResolvedConfig, target, driver: str = "triforce") -> ResolvedConfig:
    """``config`` resolved for ``target`` driven by ``driver`` (`LOOPS`); a `ResolvedConfig` is returned as it is."""
    if isinstance(config, ResolvedConfig):
        return config
    if driver not in LOOPS:
        raise ValueError(f"driver must be one of {LOOPS}, got {driver!r}")
    config.validate()  # a field set after construction is checked here, before anything reads it
    concrete, lean_unavailable_reason = resolve_draft_precision(config, target)
    concrete = resolve_retrieval_dtype(concrete, target)
    # transformers' loop asks for at most gamma2 candidates a step (no adaptive policy lengthens a lookup's chain)
    lookup = lookup_gamma2(concrete) if driver == "triforce" else concrete.gamma2
    rows = force3_rows(concrete) if driver == "triforce" else concrete.gamma2
    return ResolvedConfig(
        config=concrete, driver=driver, lean_unavailable_reason=lean_unavailable_reason,
        draft_name=concrete.draft if isinstance(concrete.draft, str) else MODEL_DRAFTER,
        lookup_gamma2=lookup, proposal_rows=proposal_rows(concrete), recent_tokens=recent_tokens(concrete),
        round_rows=round_rows(concrete), force3_rows=rows, force3_room=rows + 2,
    )
