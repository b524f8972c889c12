"""The clock that times each tier's forwards for the adaptive policy's cost model, without waiting for the device.

A `Clock` marks the start of a timed region (``start``) and gives its seconds at its end (``stop``):

- `HostClock` (a model on the CPU, or split over several CUDA devices): ``time.perf_counter``. On the CPU a forward's
  work is done when the call returns, so the seconds are known at once (a float). Over several CUDA devices the
  clock synchronises them at each ``stop`` (events on one device cannot time the others' work).
- `EventClock` (a model on one CUDA device): a pair of ``torch.cuda.Event(enable_timing=True)`` recorded on the
  device's current stream around the region. ``stop`` returns `Seconds` that are read (``float``) later: after the
  step's acceptance readback has waited for the stream anyway, reading them costs no synchronisation.

`Seconds` add, subtract and scale like floats (a tier's total, a forward's share per row), so the bookkeeping is the
same on either clock; ``float(seconds)`` reads them. A clock is ``immediate`` where its seconds are known at once;
`loop.Decoder` hands a step's timings to the policy when the step ends on an immediate clock, at the end of the next
step otherwise (`loop.Decoder._timed`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from typing import Any, Protocol

import torch


class Interval(Protocol):
    """One timed region on a device. ``value``: its seconds once read (None until then)."""

    value: float | None

    def read(self) -> float:
        """The region's seconds; waits for the device where it has not passed the region's end yet."""


class Seconds:
    """``constant + sum(coefficient * interval)``: seconds of which some are measured on a device and not read yet.
    Adding, subtracting and scaling keep them unread; ``float()`` reads them (`Interval.read`). Intervals already
    read fold into the constant, so a running total holds only what is still unread."""

    __slots__ = ("constant", "terms")

    def __init__(self, constant: float = 0.0, terms: Iterable[tuple[float, Interval]] = ()) -> None:
        pending = []
        for coefficient, interval in terms:
            if interval.value is not None:
                constant += coefficient * interval.value
            else:
                pending.append((coefficient, interval))
        self.constant, self.terms = constant, tuple(pending)

    def __add__(self, other: float | Seconds) -> Seconds:
        if isinstance(other, Seconds):
            return Seconds(self.constant + other.constant, self.terms + other.terms)
        return Seconds(self.constant + other, self.terms)

    __radd__ = __add__

    def __mul__(self, factor: float) -> Seconds:
        return Seconds(self.constant * factor, ((coefficient * factor, i) for coefficient, i in self.terms))

    __rmul__ = __mul__

    def __neg__(self) -> Seconds:
        return self * -1.0

    def __sub__(self, other: float | Seconds) -> Seconds:
        return self + -other

    def __rsub__(self, other: float) -> Seconds:
        return -self + other

    def __truediv__(self, divisor: float) -> Seconds:
        return self * (1.0 / divisor)

    def __float__(self) -> float:
        return self.constant + sum(coefficient * interval.read() for coefficient, interval in self.terms)

    def __repr__(self) -> str:
        return f"Seconds({self.constant!r} + {len(self.terms)} unread)"


class Clock(Protocol):
    immediate: bool  # True: ``stop`` returns a float known at once

    def start(self) -> Any:
        """A mark of now, for ``stop``."""

    def stop(self, started: Any) -> float | Seconds:
        """Seconds since ``started`` (a mark of this clock)."""


class HostClock:
    """``time.perf_counter`` seconds, known at once. ``devices``: CUDA devices synchronised at each ``stop`` (a model
    split over several: their work is waited for, so that the seconds measure it)."""

    immediate = True

    def __init__(self, devices: Iterable[torch.device] = ()) -> None:
        self.devices = tuple(devices)

    def start(self) -> float:
        return time.perf_counter()

    def stop(self, started: float) -> float:
        for device in self.devices:
            torch.cuda.synchronize(device)
        return time.perf_counter() - started


class EventInterval:
    """The region between two recorded ``torch.cuda.Event(enable_timing=True)``; read once the device has passed
    ``end`` (``end.query()``, which does not wait), else after waiting for it (``end.synchronize()``)."""

    def __init__(self, begin: torch.cuda.Event, end: torch.cuda.Event) -> None:
        self.begin, self.end = begin, end
        self.value: float | None = None

    def read(self) -> float:
        if self.value is None:
            if not self.end.query():
                self.end.synchronize()
            self.value = self.begin.elapsed_time(self.end) / 1000.0  # elapsed_time: milliseconds
            self.begin = self.end = None  # the events are released once read
        return self.value


class EventClock:
    """CUDA events on ``device``'s current stream: a region's seconds are the device's, read after the fact."""

    immediate = False

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def _recorded(self) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(self.device))
        return event

    def start(self) -> torch.cuda.Event:
        return self._recorded()

    def stop(self, started: torch.cuda.Event) -> Seconds:
        return Seconds(0.0, [(1.0, EventInterval(started, self._recorded()))])


def device_clock(model: torch.nn.Module) -> Clock:
    """The clock timing ``model``'s forwards: `EventClock` where its weights lie on one CUDA device, `HostClock`
    otherwise (synchronising the CUDA devices among several)."""
    devices = {parameter.device for parameter in model.parameters()}
    cuda = sorted((device for device in devices if device.type == "cuda"), key=str)
    if len(devices) == 1 and cuda:
        return EventClock(cuda[0])
    return HostClock(cuda)
