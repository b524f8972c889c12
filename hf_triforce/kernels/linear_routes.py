"""How the model's CPU `nn.Linear` layers multiply the few rows of a decoding forward, chosen by timing on this CPU.

The routes compute the same dot products in other summation orders (fp32 rounding, and for bf16 / fp16 weights one
rounding of each output to their dtype, like any change of GEMM kernel):

- ``"linear"``: ``F.linear(x, W)``, i.e. ``x @ W.T`` (what the model does);
- ``"left"``: ``(W @ x.T).T``; one row goes in as two identical columns and the first is kept (MKL's one-column
  product takes a slower kernel than its two-column one on some CPUs);
- ``"stream"``: the library's kernel (`few_rows_linear`), fp32, bf16 or fp16 weights, where it is built;
- ``"gguf"``: the weights' GGUF blocks read at their stored width (`gguf_linear`), where a GGUF file's blocks were
  attached to every layer of the group (`gguf_weights.attach_gguf`): exactly the fp32 weight's values.

Which is faster depends on the CPU, the shapes and the row count (docs/experiments.md, "Linear layers of a few rows on
the CPU"). `LinearRoutes` times the routes per layer group (``"head"``: the output layer; ``"decoder"``: every other
eligible layer) at `CALIBRATED_ROWS` (a call of ``n`` rows takes the route of the largest not above ``n``), on a
working set larger than a last-level cache, before the call decodes, and keeps them for the model's later calls
under what each group was timed on (`timed_on`), timed again at a call that finds the group otherwise. Calls of
more than `MAX_ROUTED_ROWS` rows (the prefill's chunks), under CPU autocast or of rows in another dtype than the
weight keep ``F.linear`` (`bypass`, counted in `TriForceDetail.linear_bypassed`). The timings take ~1 s once per
model and process (`TriForceDetail.linear_calibration_seconds`).

Exactness: each row's outputs are its own dot products under every route, so a row does not depend on the call's
other rows; the route depends on the row count and on timings, both fixed before the call's tokens are drawn
(docs/exactness.md).
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch import nn
from torch.nn import functional as F

from . import few_rows_linear, gguf_linear, gguf_weights

ROUTES = ("linear", "left", "stream", "gguf")
MAX_ROUTED_ROWS = 16  # more rows (a prefill chunk): F.linear, a compute-bound product either way
CALIBRATED_ROWS = (1, 2, 4, 8)  # the row counts timed; n rows take the route of the largest of these <= n
# the weights one timing streams: more than a last-level cache (32 MB per AMD CCX), else the timing measures
# cache-resident products a decoding forward never sees (docs/experiments.md, "Linear layers of a few rows on the CPU")
CALIBRATION_BYTES = 48 << 20
CALIBRATION_ROUNDS = 2  # per route: the fastest of these (the machine is shared; the minimum is the stable figure)

# model -> its LinearRoutes: calibrations are kept for the model's later calls (dropped with the model)
_ROUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def eligible(layer: nn.Module) -> bool:
    """A plain CPU `nn.Linear` with a plain floating-point weight and no forward of its own (not an accelerate hook, a
    quantized layer, a tensor-subclass weight, or a layer another context already switched)."""
    return (type(layer) is nn.Linear and type(layer.weight.data) is torch.Tensor and layer.weight.device.type == "cpu"
            and layer.weight.is_floating_point() and "forward" not in vars(layer))


def multiply(route: str, rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``rows`` ``[n, in]`` times ``weight.T`` (``weight`` ``[out, in]``) by ``route`` -> ``[n, out]``."""
    if route == "linear":
        return F.linear(rows, weight)
    if route == "stream":
        return few_rows_linear.multiply(rows, weight)
    if route == "gguf":
        return gguf_linear.multiply(rows, gguf_weights.matrix_of(weight))
    # a contiguous copy: MKL takes a slow path for a stride-0 column (docs/experiments.md, "Linear layers ...")
    columns = rows if rows.shape[0] > 1 else rows.expand(2, -1).contiguous()
    return (weight @ columns.T).T[: rows.shape[0]]


def bypass(hidden: torch.Tensor, weight: torch.Tensor) -> str | None:
    """Why a call of ``hidden`` rows through ``weight`` takes ``F.linear`` whatever its route, or None: under CPU
    autocast (``F.linear`` casts as the model's own forward does; a route would not), or rows of another dtype than
    the weight (``F.linear`` raises or casts as the model's forward would)."""
    if torch.is_autocast_enabled(hidden.device.type):
        return f"autocast ({torch.get_autocast_dtype(hidden.device.type)})"
    if hidden.dtype != weight.dtype:
        return f"{hidden.dtype} rows, {weight.dtype} weight"
    return None


def timed_on(layers: list[nn.Linear]) -> tuple:
    """What the routes of ``layers`` were chosen for: each layer's weight storage, dtype and shape, and whether GGUF
    blocks are attached to it (the routes `routes_for` offers, and the products timed, follow from these)."""
    return tuple((id(layer), layer.weight.data_ptr(), layer.weight.dtype, tuple(layer.weight.shape),
                  gguf_weights.matrix_of(layer.weight) is not None) for layer in layers)


def routes_for(layers: list[nn.Linear]) -> tuple[str, ...]:
    """The routes ``layers`` can take: ``"stream"`` only where the kernel takes every one of their weights, ``"gguf"``
    only where every one has GGUF blocks attached (`gguf_weights.matrix_of`) and that kernel is built."""
    offered = {
        "stream": bool(layers) and all(few_rows_linear.supports(layer.weight) for layer in layers),
        "gguf": bool(layers) and all(gguf_weights.matrix_of(layer.weight) is not None for layer in layers)
        and gguf_linear.available(),
    }
    return tuple(route for route in ROUTES if offered.get(route, True))


class LinearRoutes:
    """The route of each layer group (``"head"``, ``"decoder"``) and row count for one model, timed when first
    installed (`calibrate_all`)."""

    def __init__(self, model: nn.Module) -> None:
        self.model = weakref.ref(model)  # kept in `_ROUTES` under the model: no strong reference back to it
        self.groups: dict[str, list[nn.Linear]] = {}  # the eligible layers by group, found on each `installed`
        self.routes: dict[tuple[str, int], str] = {}
        self.timed_on: dict[str, tuple] = {}  # group -> `timed_on` of the layers its routes in `routes` were timed on
        self.calibration_seconds = 0.0
        # calls a route other than "linear" was chosen for that took F.linear instead, by why (`bypass`)
        self.bypassed: dict[str, int] = {}

    def find_groups(self) -> dict[str, list[nn.Linear]]:
        """The model's eligible layers: ``"head"`` (the output layer) and ``"decoder"`` (every other one)."""
        model = self.model()
        head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
        layers = [module for module in model.modules() if isinstance(module, nn.Linear)]
        return {"head": [head] if head is not None and eligible(head) else [],
                "decoder": [layer for layer in layers if layer is not head and eligible(layer)]}

    def recheck(self) -> None:
        """Drops the routes of every group whose layers differ from those its routes were timed on (`timed_on`), so
        that `calibrate_all` times them again for the layers as they are."""
        for group, layers in self.groups.items():
            now = timed_on(layers)
            if self.timed_on.get(group) != now:
                self.routes = {key: route for key, route in self.routes.items() if key[0] != group}
                self.timed_on[group] = now

    def route(self, group: str, rows: int) -> str:
        """The route for ``rows`` rows through ``group``: that of the largest `CALIBRATED_ROWS` count not above
        ``rows`` (timed now if not yet: `calibrate`)."""
        if not 1 <= rows <= MAX_ROUTED_ROWS:
            return "linear"
        key = (group, max(count for count in CALIBRATED_ROWS if count <= rows))
        if key not in self.routes:
            began = time.perf_counter()
            self.routes[key] = self.calibrate(*key)
            self.calibration_seconds += time.perf_counter() - began
        return self.routes[key]

    def calibrate_all(self) -> None:
        """Time every group at every `CALIBRATED_ROWS` count not timed yet."""
        for group in (group for group, layers in self.groups.items() if layers):
            for rows in CALIBRATED_ROWS:
                self.route(group, rows)

    @torch.no_grad()
    def calibrate(self, group: str, rows: int) -> str:
        """Times each route the group can take (`routes_for`) over its first layers holding `CALIBRATION_BYTES` of
        weights (all of them if fewer; counted at the narrowest width a route reads them, a GGUF matrix's blocks where
        attached, so that no route's timing reads from the cache), `CALIBRATION_ROUNDS` rounds alternating the routes;
        returns the fastest (ties: ``"linear"``)."""
        working, held = [], 0
        for layer in self.groups[group]:
            working.append(layer.weight)
            matrix = gguf_weights.matrix_of(layer.weight)
            held += layer.weight.nbytes if matrix is None else min(layer.weight.nbytes, matrix.nbytes)
            if held >= CALIBRATION_BYTES:
                break
        # timing inputs from a private generator: the caller's global RNG (a seeded sampled call) is left untouched
        generator = torch.Generator().manual_seed(0)
        inputs = {weight.shape[1]: torch.randn(rows, weight.shape[1], dtype=weight.dtype, generator=generator)
                  for weight in working}
        routes = routes_for(self.groups[group])
        best = dict.fromkeys(routes, float("inf"))
        for _ in range(CALIBRATION_ROUNDS):
            for route in routes:
                began = time.perf_counter()
                for weight in working:
                    multiply(route, inputs[weight.shape[1]], weight)
                best[route] = min(best[route], time.perf_counter() - began)
        return min(routes, key=lambda route: (best[route], route != "linear"))

    def used(self) -> dict[str, dict[int, str]]:
        """``{group: {rows: route}}`` of every `CALIBRATED_ROWS` count timed so far."""
        out: dict[str, dict[int, str]] = {}
        for (group, rows), route in sorted(self.routes.items()):
            out.setdefault(group, {})[rows] = route
        return out

    def _forward(self, layer: nn.Linear, group: str):
        def forward(hidden: torch.Tensor) -> torch.Tensor:
            rows = hidden.reshape(-1, hidden.shape[-1])
            route = self.route(group, rows.shape[0])
            why = bypass(hidden, layer.weight) if route != "linear" else None
            if why is not None:
                self.bypassed[why] = self.bypassed.get(why, 0) + 1
                route = "linear"
            if route == "linear":
                return F.linear(hidden, layer.weight, layer.bias)
            out = multiply(route, rows, layer.weight)
            if layer.bias is not None:
                out = out + layer.bias
            return out.reshape(*hidden.shape[:-1], layer.weight.shape[0])

        return forward

    @contextmanager
    def installed(self) -> Iterator[LinearRoutes]:
        """For the duration of the block, every layer of the groups multiplies by its group's route (the blocks
        attached to their weights checked first: `gguf_weights.verify`; the kept routes of a group whose layers
        changed dropped: `recheck`; every route not kept timed then: `calibrate_all`). A
        group whose every calibrated count chose ``"linear"`` is left as it is: its forward is already that route, and
        a wrapper would only add a Python call per layer per forward (8% of a tiny model's decode in the enumeration
        tests)."""
        switched, outer = [], self.groups
        self.groups = self.find_groups()  # layers an enclosing block switched are not eligible: left alone
        try:
            gguf_weights.verify(layer.weight for layers in self.groups.values() for layer in layers)
            self.recheck()
            self.calibrate_all()
            for group, layers in self.groups.items():
                if all(self.routes.get((group, rows)) == "linear" for rows in CALIBRATED_ROWS):
                    continue
                for layer in layers:
                    layer.forward = self._forward(layer, group)
                    switched.append(layer)
            yield self
        finally:
            for layer in switched:
                del layer.forward
            self.groups = outer


def linear_routes(model: nn.Module) -> LinearRoutes:
    """``model``'s `LinearRoutes`, made on first use and kept (its calibrations serve the model's later calls)."""
    if model not in _ROUTES:
        _ROUTES[model] = LinearRoutes(model)
    return _ROUTES[model]
