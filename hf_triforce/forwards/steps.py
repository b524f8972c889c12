"""Tiers written as generators of forward requests, so that a batch can run its rows' forwards together.

A tier's ``*_steps`` method is a generator: each time it needs the model it yields a `ForwardRequest` and
receives that forward's logits; its result is the generator's return value. Batch size 1 drives it with
`run_inline` (each request runs when it is yielded: exactly a direct call). `hf_triforce.decoding.lockstep` drives
every row of a batch together and runs the requests of rows whose caches share storage in one batched
forward (each row's logits are its own, up to summation order).
"""

from __future__ import annotations

from collections.abc import Generator
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch

from .clock import Clock, HostClock, Seconds
from .forward import forward_logits

T = TypeVar("T")
Steps = Generator["ForwardRequest", torch.Tensor, T]


@dataclass
class ForwardRequest:
    """``tokens`` ``[1, n]`` fed after what ``cache`` holds, at positions ``start, start + 1, ...``; the logits
    of the last ``keep`` rows are wanted (``[keep, vocab]``). ``clock``: the call's (`clock.device_clock`), which
    times the forward; ``seconds``: set by whoever ran it, the forward's seconds on that clock (`clock.Seconds`
    read later on a device's)."""

    model: Any
    cache: Any
    tokens: torch.Tensor
    start: int
    keep: int
    clock: Clock = field(default_factory=HostClock)
    seconds: float | Seconds = 0.0

    def run(self) -> torch.Tensor:
        """This request alone, as a batch-1 forward."""
        began = self.clock.start()
        logits = forward_logits(self.model, self.tokens, self.cache, self.start, self.keep)
        self.seconds = self.clock.stop(began)
        return logits


def run_inline(steps: Steps[T]) -> T:
    """Drive a tier's generator alone: every request runs as a batch-1 forward when it is yielded."""
    try:
        request = next(steps)
        while True:
            request = steps.send(request.run())
    except StopIteration as done:
        return done.value
