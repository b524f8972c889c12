"""`CallKernels`: the kernels one TriForce call runs, set up in one order and read out into its statistics.

Both drivers (the library's loop and transformers' assisted loop) set a call up the same way:

    built       the CPU kernels compiled and loaded before anything is timed (`cpu_kernels.prepare`): no compile
                lands inside a timed forward
    attention   the target's attention routes timed for every cache length the call can reach, and installed for the
                block (`attention_routes.AttentionRoutes.installed`)
    (the driver builds what runs under them: the tiers' lean or int8 copies, the candidate generator; copies are made
    before any linear layer is switched, so that none copies a switched layer)
    linear      `switch_linear`: the given models' linear layers take the few-row route timed fastest on this CPU
                (`linear_routes`), and the target's row-mixing layers run row by row
                (`row_mixing.RowByRowMixingLayers`, which the driver enables after its prefill)
    read out    `fill`: what was built, timed and installed, in a `TriForceDetail`

Everything installed is removed when the block ends; the routes' timings are kept for the models' later calls.
"""

from __future__ import annotations

from contextlib import ExitStack

from torch import nn

from ..stats import TriForceDetail
from . import cpu_kernels
from .attention_routes import attention_routes, describe
from .linear_routes import LinearRoutes, linear_routes
from .row_mixing import RowByRowMixingLayers


class CallKernels:
    """A context for one call on ``target`` of up to ``max_length`` positions; ``models``: every model the call runs
    (the target and a draft model), whose CPU kernels are built on construction."""

    def __init__(self, target: nn.Module, models: list[nn.Module], max_length: int) -> None:
        self.target, self.max_length = target, max_length
        self.build_seconds = cpu_kernels.prepare(models)
        self.attention = attention_routes(target)
        self._attention_calibrated = self.attention.calibration_seconds
        self.linear: list[LinearRoutes] = []
        self._linear_calibrated: list[float] = []
        self._bypassed: dict[str, int] = {}
        self._stack = ExitStack()

    def __enter__(self) -> CallKernels:
        self._stack.enter_context(self.attention.installed(self.target, self.max_length))
        return self

    def __exit__(self, *exc) -> bool:
        return self._stack.__exit__(*exc)

    def switch_linear(self, models: list[nn.Module]) -> RowByRowMixingLayers:
        """For the rest of the block: ``models``' linear layers on their timed routes (timed now where not yet), the
        target's row-mixing layers wrapped. Returns the `RowByRowMixingLayers`, for the driver to enable after its
        prefill."""
        self.linear = [linear_routes(model) for model in models]
        self._linear_calibrated = [routes.calibration_seconds for routes in self.linear]
        self._bypassed = dict(self.linear[0].bypassed) if self.linear else {}
        for routes in self.linear:
            self._stack.enter_context(routes.installed())
        return self._stack.enter_context(RowByRowMixingLayers(self.target))

    def fill(self, stats: TriForceDetail) -> None:
        """``stats``' kernel fields: the CPU kernels and their build seconds, the attention routes and this call's
        seconds timing them, the first switched model's linear routes and the calls that bypassed them, and this
        call's seconds timing every model's."""
        stats.cpu_kernels = cpu_kernels.describe(self.target)
        stats.kernel_build_seconds = self.build_seconds
        stats.attention_routes = self.attention.used()
        stats.attention_calibration_seconds = self.attention.calibration_seconds - self._attention_calibrated
        stats.attention_kernel = describe(self.target)
        stats.linear_calibration_seconds = sum(routes.calibration_seconds - before
                                               for routes, before in zip(self.linear, self._linear_calibrated))
        if self.linear:
            first = self.linear[0]
            stats.linear_routes = first.used()
            stats.linear_bypassed = {why: calls - self._bypassed.get(why, 0) for why, calls in first.bypassed.items()
                                     if calls > self._bypassed.get(why, 0)}
