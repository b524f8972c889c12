"""Whether a CPU call of few query rows over a long cache takes the library's kernel or ATen's route: timed on the CPU.

`cpu_attention`'s kernel reads each KV head's cache once for all the head's query rows; ATen's route
(`attention.aten_attention`) runs many small matrix products. Which is cheaper depends on the CPU and on the code the
kernel was built into (`native_build.build_target`; docs/experiments.md, "Attention over a long cache on the CPU: the
library's kernel"). So `AttentionRoutes` times both routes per shape class (dtype, head dim, KV heads, query heads per
KV head, threads), row count (`CALIBRATED_ROWS`: a call of ``n`` new rows takes the route of the largest not above
``n``) and cache length (powers of two from `cpu_attention.MIN_CACHED`, likewise), at a call's set-up for every
length the call can reach (`installed`), and keeps the choices for the model's later calls. The kernel takes a class
only where it is cheaper by more than `MARGIN`. A class met first inside a forward (another model's shapes) is timed
there, once; outside `installed` every call takes ATen's route.

Exactness: both routes compute the same attention, summed in fp32 in other orders; the route of a call depends on its
row count, its cache length and timings fixed before the call's tokens are drawn, not on the values
(docs/exactness.md).
"""

from __future__ import annotations

import contextlib
import contextvars
import time
import weakref
from collections.abc import Iterator

import torch
from torch import nn

from . import attention, cpu_attention

ROUTES = ("kernel", "aten")
CALIBRATED_ROWS = (1, 2, 4, 8)  # new rows timed; n rows take the route of the largest of these <= n
ROUNDS = 3  # per route and class: the fastest of these (the machine may be shared; the minimum is the stable figure)
MARGIN = 0.02  # the kernel takes a class where it is cheaper than ATen's route by more than this fraction

# the routes of the TriForce call running in this context (`AttentionRoutes.installed`)
_ACTIVE: contextvars.ContextVar[AttentionRoutes | None] = contextvars.ContextVar("triforce_attention_routes",
                                                                                default=None)
# model -> its AttentionRoutes: timings kept for the model's later calls (dropped with the model)
_ROUTES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

Shape = tuple[torch.dtype, int, int, int, int]  # dtype, head dim, KV heads, query heads per KV head, threads


def length_class(cached: int) -> int:
    """The timed cache length a call with ``cached`` entries (at least `cpu_attention.MIN_CACHED`) takes the route
    of: the largest power-of-two multiple of `cpu_attention.MIN_CACHED` not above it."""
    length = cpu_attention.MIN_CACHED
    while length * 2 <= cached:
        length *= 2
    return length


def row_class(rows: int) -> int:
    return max(count for count in CALIBRATED_ROWS if count <= rows)


def shape_of(query: torch.Tensor, key: torch.Tensor) -> Shape:
    heads, dim, kv_heads = query.shape[1], query.shape[3], key.shape[1]
    return query.dtype, dim, kv_heads, heads // kv_heads, torch.get_num_threads()


def cpu_dtype(model: nn.Module) -> torch.dtype | None:
    """``model``'s dtype where it runs on the CPU in a dtype the kernel takes (`cpu_attention.DTYPES`); else None."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu" or parameter.dtype not in cpu_attention.DTYPES:
        return None
    return parameter.dtype


def model_shapes(model: nn.Module) -> set[tuple[int, int, int]]:
    """The attention shapes (head dim, KV heads, query heads per KV head) of ``model``'s attention modules that expose
    them as transformers' do (``head_dim``, ``num_key_value_groups``, a ``k_proj`` linear layer), read from the
    modules: a config's global values may not hold for every layer. Empty where no module exposes them (its calls'
    classes are then timed at their first call)."""
    shapes = set()
    for module in model.modules():
        dim, groups = getattr(module, "head_dim", None), getattr(module, "num_key_value_groups", None)
        keys = getattr(module, "k_proj", None)
        if isinstance(dim, int) and dim > 0 and isinstance(groups, int) and isinstance(keys, nn.Linear):
            shapes.add((dim, keys.out_features // dim, groups))
    return shapes


def label(shape: Shape) -> str:
    """A shape class in words: ``"3 KV heads x 3, head dim 64, torch.float32, 2 threads"``."""
    dtype, dim, kv_heads, groups, threads = shape
    return f"{kv_heads} KV heads x {groups}, head dim {dim}, {dtype}, {threads} threads"


class AttentionRoutes:
    """The route (``"kernel"`` or ``"aten"``) of each shape class, row count and cache length for one model's calls,
    timed at set-up (`installed`) and kept."""

    def __init__(self) -> None:
        self.routes: dict[tuple[Shape, int, int], str] = {}
        self.calibration_seconds = 0.0

    def route(self, query: torch.Tensor, key: torch.Tensor) -> str:
        """The route of a call of ``query`` ``[1, heads, new, dim]`` over ``key`` ``[1, kv_heads, kv_len, dim]``
        (one `cpu_attention.supports` takes), timed now if its class was not."""
        new = query.shape[2]
        return self.route_of(shape_of(query, key), row_class(new), length_class(key.shape[2] - new))

    def route_of(self, shape: Shape, rows: int, length: int) -> str:
        key = (shape, rows, length)
        if key not in self.routes:
            began = time.perf_counter()
            self.routes[key] = self.calibrate(shape, rows, length)
            self.calibration_seconds += time.perf_counter() - began
        return self.routes[key]

    @torch.no_grad()
    def calibrate(self, shape: Shape, rows: int, length: int) -> str:
        """Times the kernel against ATen's route (`attention.aten_attention`) on random query rows over a view of a
        longer cache buffer, as a cache's is, `ROUNDS` rounds alternating the routes; ``"kernel"`` where its fastest
        round beats ATen's by more than `MARGIN`, else ``"aten"``."""
        dtype, dim, kv_heads, groups, _ = shape
        # from a private generator: the caller's global RNG (a seeded sampled call) is left untouched
        generator = torch.Generator().manual_seed(0)
        buffers = torch.randn(2, 1, kv_heads, length + rows + 16, dim, generator=generator, dtype=dtype)
        keys, values = buffers[0, :, :, : length + rows], buffers[1, :, :, : length + rows]
        query = torch.randn(1, kv_heads * groups, rows, dim, generator=generator, dtype=dtype)
        runs = {"kernel": lambda: cpu_attention.attend(query, keys, values, None),
                "aten": lambda: attention.aten_attention(query, keys, values, None)}
        best = dict.fromkeys(runs, float("inf"))
        for _ in range(ROUNDS):
            for route, run in runs.items():
                began = time.perf_counter()
                run()
                best[route] = min(best[route], time.perf_counter() - began)
        return "kernel" if best["kernel"] < best["aten"] * (1 - MARGIN) else "aten"

    def calibrate_model(self, model: nn.Module, max_length: int) -> None:
        """Time ``model``'s shape class at every `CALIBRATED_ROWS` count and every cache length a call of up to
        ``max_length`` positions reaches (nothing where it is not a CPU model in a dtype and head dim the kernel
        takes, where the kernel is not built, or below `cpu_attention.MIN_CACHED`)."""
        dtype = cpu_dtype(model)
        if dtype is None or not cpu_attention.available():
            return
        threads = torch.get_num_threads()
        for dim, kv_heads, groups in model_shapes(model):
            if dim not in cpu_attention.HEAD_DIMS:
                continue
            for rows in CALIBRATED_ROWS:
                length = cpu_attention.MIN_CACHED
                while length + rows <= max_length:
                    self.route_of((dtype, dim, kv_heads, groups, threads), rows, length)
                    length *= 2

    def used(self) -> dict[str, dict[int, dict[int, str]]]:
        """``{shape class (`label`): {rows: {cache length: route}}}`` of every class timed so far."""
        out: dict[str, dict[int, dict[int, str]]] = {}
        for (shape, rows, length), route in sorted(self.routes.items(), key=lambda item: (label(item[0][0]),
                                                                                          *item[0][1:])):
            out.setdefault(label(shape), {}).setdefault(rows, {})[length] = route
        return out

    @contextlib.contextmanager
    def installed(self, model: nn.Module, max_length: int) -> Iterator[AttentionRoutes]:
        """For the block, this context's calls take the timed routes (``model``'s classes up to ``max_length``
        positions timed first: `calibrate_model`)."""
        self.calibrate_model(model, max_length)
        token = _ACTIVE.set(self)
        try:
            yield self
        finally:
            _ACTIVE.reset(token)


def attention_routes(model: nn.Module) -> AttentionRoutes:
    """``model``'s `AttentionRoutes`, made on first use and kept (its timings serve the model's later calls)."""
    if model not in _ROUTES:
        _ROUTES[model] = AttentionRoutes()
    return _ROUTES[model]


NOT_SET_UP = "sdpa (no routes timed: the cpu kernel runs in calls hf_triforce's own loops set up)"


def active() -> AttentionRoutes | None:
    """The routes installed in this context (`AttentionRoutes.installed`), or None."""
    return _ACTIVE.get()


def takes_kernel(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> bool:
    """Whether this call (bottom-right causal, its mask not read) runs `cpu_attention.attend`: the kernel takes it
    (`cpu_attention.supports`) and the routes installed in this context timed it cheaper for its class."""
    routes = _ACTIVE.get()
    return routes is not None and cpu_attention.supports(query, key, value) and routes.route(query, key) == "kernel"


def describe(model: nn.Module) -> str:
    """`TriForceDetail.attention_kernel` for ``model``'s calls: ``"cpu kernel"`` where the kernel took every class
    timed for the model's shape; ``"cpu kernel where faster (k of n timed classes, sdpa elsewhere)"``; ``"sdpa
    (<why>)"`` where it took none: slower at every timed class, not built (`cpu_attention.status`), a head dim it has
    no code for, or a cache too short for it; ``""`` for other devices and dtypes."""
    dtype = cpu_dtype(model)
    if dtype is None:
        return ""
    if not cpu_attention.available():
        return f"sdpa (cpu kernel {cpu_attention.status()})"
    shapes = {(dtype, *shape) for shape in model_shapes(model)}
    dims = sorted({shape[1] for shape in shapes})
    if dims and not set(dims) & set(cpu_attention.HEAD_DIMS):
        return (f"sdpa (head dim {', '.join(map(str, dims))}: the cpu kernel takes "
                f"{', '.join(map(str, cpu_attention.HEAD_DIMS))})")
    routes = _ROUTES.get(model)
    own = [route for (full, _, _), route in (routes.routes.items() if routes else ())
           if not shapes or full[:4] in shapes]
    if not own:
        return f"sdpa (no call over {cpu_attention.MIN_CACHED} cached entries or more timed: the cpu kernel's)"
    taken = own.count("kernel")
    if taken == len(own):
        return "cpu kernel"
    if taken == 0:
        return f"sdpa (cpu kernel slower at all {len(own)} timed classes)"
    return f"cpu kernel where faster ({taken} of {len(own)} timed classes, sdpa elsewhere)"
