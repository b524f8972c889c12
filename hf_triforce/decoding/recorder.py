"""What a step's timings and counts become: each row's statistics and the policy's observations."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..forwards.clock import Seconds
from .policy import StepRecord
from .report import LevelReport


@dataclass
class UnreadStep:
    """A step's timings until they are read (`loop.Decoder`): per row its level's catch-up report (a draft cache's fill,
    a selection before the step), Force 3's seconds, per active row its level's report (None: a plain step), and the
    policy's record (None: no policy)."""

    catch_ups: list[tuple[int, LevelReport]] = field(default_factory=list)
    force3_seconds: float | Seconds = 0.0
    rows: list[tuple[int, LevelReport | None]] = field(default_factory=list)
    record: StepRecord | None = None
