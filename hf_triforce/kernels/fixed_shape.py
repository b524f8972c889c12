"""Tier forwards at fixed shapes: the lean forward on whole cache buffers, compiled once per model.

Force 1's sink+window cache and Force 2's retrieval cache have constant capacities, so their forwards have fixed
shapes once they read the whole buffer (`LeanModel.fixed_shape_layers`: new entries written at a position tensor
with ``index_copy_``, entries past a row's own masked out; the cache's length stays a Python integer, so a rejection
is still a length). Such a forward is made once and replayed at every step, length and call:

* ``"fixed"``: the fixed-shape forward run eagerly (what the compiled form computes);
* ``"compile"``: ``torch.compile`` (inductor, ``fullgraph=True``: a graph break raises), on CUDA with CUDA graphs
  (``reduce-overhead``; cache buffers and weights static). One graph for one-token forwards and one for several
  tokens per cache capacity, all made in a model's first call (`compiles` counts them; tests assert no growth);
* ``"graph"`` (CUDA): the forward captured as a ``torch.cuda.CUDAGraph`` per row count and cache buffer, without
  compiling; inputs are copied into its static tensors, weights and cache buffers read in place. What breaks a
  capture breaks ``"compile"``'s ``fullgraph=True`` on the CPU first, where the tests run it.

Force 3's verification runs the same way (`LeanModel.fixed_shape_verify`, entry ``"fixed_shape_verify"``) over the
full cache, whose capacity is fixed per call only: that dimension is compiled dynamic and a graph captured per row
count for each call's cache; its logits and stacked queries are copied out of the graph's memory. Exactness is
unchanged (docs/exactness.md): every row sees only its own and earlier entries (masked entries get probability
exactly 0).
"""

from __future__ import annotations

import time
import types

import torch

from ..caches.buffer import BufferLayer

TIER_COMPILE_MODES = ("fixed", "compile", "graph")  # TriForceConfig.tier_compile, but "off" and "auto"


def _counting_inductor(forward: FixedShapeForward, cuda_graphs: bool):
    """The inductor backend of ``torch.compile``, counting each graph it compiles into ``forward.compiles``."""
    from torch._inductor import list_mode_options
    from torch._inductor.compile_fx import compile_fx

    patches = list_mode_options("reduce-overhead") if cuda_graphs else {}

    def backend(graph, example_inputs):
        forward.compiles += 1
        return compile_fx(graph, example_inputs, config_patches=patches)

    return backend


def _own_code(method):
    """``method`` bound to a copy of its function's code object. Dynamo keeps its graphs, and counts its
    recompilations against ``recompile_limit`` (8), per code object: every lean copy compiled in a process (a
    target's Force 1 and Force 2, a draft model, other models) would share one limit and, under fullgraph=True,
    fail past it. With its own code, each `FixedShapeForward` has its own graphs and limit."""
    function = method.__func__
    own = types.FunctionType(function.__code__.replace(), function.__globals__, function.__name__,
                             function.__defaults__, function.__closure__)
    return types.MethodType(own, method.__self__)


ENTRIES = ("fixed_shape_layers", "fixed_shape_verify")  # the `LeanModel` methods a FixedShapeForward runs


class FixedShapeForward:
    """Runs a `LeanModel`'s forward on a cache of plain `BufferLayer`s through its method ``entry`` (`ENTRIES`:
    `LeanModel.fixed_shape_layers`, the tiers' hidden state; `LeanModel.fixed_shape_verify`, Force 3's logits and
    queries), eagerly or compiled (`TIER_COMPILE_MODES`); ``dynamic``: the cache capacity (a cache whose capacity
    changes between calls) and a row count above one are compiled as dynamic dimensions from the first call.
    Counters (read by `TriForceDetail.tier_compile`): ``calls`` (forwards it ran), ``compiles`` (graphs compiled),
    ``compile_seconds`` (wall of the calls that compiled)."""

    def __init__(self, mode: str, entry: str = "fixed_shape_layers", dynamic: bool = False) -> None:
        if mode not in TIER_COMPILE_MODES:
            raise ValueError(f"TriForceConfig.tier_compile must be one of {TIER_COMPILE_MODES}, got {mode!r}")
        if entry not in ENTRIES:
            raise ValueError(f"FixedShapeForward entry must be one of {ENTRIES}, got {entry!r}")
        self.mode, self.entry, self.dynamic = mode, entry, dynamic
        self.calls = 0
        self.compiles = 0
        self.compile_seconds = 0.0
        self._function = None
        self._static: set[int] = set()  # data pointers already marked static (CUDA graphs)
        # "graph": (rows, cache capacity) -> the forward captured over the buffers of the last cache of that shape (a
        # call's caches are new: a graph over freed buffers is replaced, so graphs and their pools never accumulate)
        self._graphs: dict[tuple[int, int], _Captured] = {}

    @staticmethod
    def covers(cache) -> bool:
        """Whether every layer of ``cache`` is a plain, allocated `BufferLayer` holding the same length."""
        layers = getattr(cache, "layers", None)
        if not layers or any(type(layer) is not BufferLayer or not layer.is_initialized for layer in layers):
            return False
        return len({layer.length for layer in layers}) == 1

    def _replay(self, lean, input_ids, position_ids, write_index, keys, values):
        """The ``"graph"`` forward: captured on its first call per row count and cache buffer, replayed after."""
        if input_ids.device.type != "cuda":
            raise RuntimeError(f"TriForceConfig.tier_compile='graph' captures CUDA graphs; this model is on "
                               f"{input_ids.device} (use 'fixed' or 'compile' there)")
        key = (input_ids.shape[1], keys[0].shape[2])
        captured = self._graphs.get(key)
        if captured is None or captured.buffers != _pointers(keys, values):
            self._graphs.pop(key, None)  # its pool is freed before the next capture allocates one
            began = time.perf_counter()
            self._graphs[key] = captured = _Captured(getattr(lean, self.entry), input_ids, position_ids, write_index,
                                                     keys, values)
            self.compiles += 1
            self.compile_seconds += time.perf_counter() - began
        return captured(input_ids, position_ids, write_index)

    def _compiled(self, lean):
        if self._function is None:
            cuda_graphs = next(iter(lean.layers)).qkv.weight.is_cuda
            if self.mode == "fixed":
                self._function = getattr(lean, self.entry)
            else:
                self._function = torch.compile(_own_code(getattr(lean, self.entry)), fullgraph=True,
                                               backend=_counting_inductor(self, cuda_graphs))
            self._cuda_graphs = self.mode == "compile" and cuda_graphs
        return self._function

    def _mark_static(self, tensors) -> None:
        """CUDA graphs replay fixed addresses: buffers and weights marked static are read in place."""
        for tensor in tensors:
            if tensor.data_ptr() not in self._static:
                torch._dynamo.mark_static_address(tensor)
                self._static.add(tensor.data_ptr())

    def __call__(self, lean, input_ids: torch.Tensor, position_ids: torch.Tensor, cache):
        """``input_ids`` ``[1, n]`` at ``position_ids`` after the cache's entries -> what ``entry`` returns (hidden
        ``[n, hidden]``; Force 3's logits and queries); the cache's layers grow by ``n`` entries as their own
        ``update`` would have grown them."""
        layers = cache.layers
        n, start, capacity = input_ids.shape[1], layers[0].length, layers[0].capacity
        if start + n > capacity:
            raise RuntimeError(f"BufferLayer overflow: {start} + {n} entries exceed its capacity {capacity}")
        keys, values = [layer.keys for layer in layers], [layer.values for layer in layers]
        write_index = torch.arange(start, start + n, device=input_ids.device)
        if self.mode == "graph":
            out = self._replay(lean, input_ids, position_ids, write_index, keys, values)
        else:
            out = self._run_compiled(lean, input_ids, position_ids, write_index, keys, values)
        for layer in layers:
            layer.length += n
        self.calls += 1
        return out

    def _run_compiled(self, lean, input_ids, position_ids, write_index, keys, values):
        """The ``"fixed"`` / ``"compile"`` forward (its first call per shape compiles)."""
        function = self._compiled(lean)
        if self._cuda_graphs:
            self._mark_static(keys + values)
        if self.dynamic and self.mode == "compile":  # one graph for every call's capacity and every row count > 1
            for buffer in keys + values:
                torch._dynamo.mark_dynamic(buffer, 2)
            if input_ids.shape[1] > 1:
                for tensor, dim in ((input_ids, 1), (position_ids, 1), (write_index, 0)):
                    torch._dynamo.maybe_mark_dynamic(tensor, dim)
        compiles, began = self.compiles, time.perf_counter()
        out = function(input_ids, position_ids, write_index, keys, values)
        if self.compiles != compiles:
            self.compile_seconds += time.perf_counter() - began
        return _cloned(out) if self._cuda_graphs else out  # a graph's outputs are overwritten by its next replay


def _pointers(keys, values) -> tuple[int, ...]:
    return tuple(t.data_ptr() for t in (*keys, *values))


def _cloned(out):
    """A copy of a forward's output (a tensor or a tuple of tensors)."""
    return tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()


class _Captured:
    """One fixed-shape forward (``function``: a `LeanModel`'s entry) captured as a CUDA graph: its static inputs
    and its outputs."""

    def __init__(self, function, input_ids, position_ids, write_index, keys, values) -> None:
        self.input_ids, self.position_ids, self.write_index = input_ids.clone(), position_ids.clone(), write_index
        self.buffers = _pointers(keys, values)
        device = input_ids.device
        side = torch.cuda.Stream(device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):  # warm-up (cuBLAS workspaces): it writes the entries the replay writes again
            function(self.input_ids, self.position_ids, self.write_index, keys, values)
        torch.cuda.current_stream(device).wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.out = function(self.input_ids, self.position_ids, self.write_index, keys, values)

    def __call__(self, input_ids, position_ids, write_index):
        self.input_ids.copy_(input_ids)
        self.position_ids.copy_(position_ids)
        self.write_index.copy_(write_index)
        self.graph.replay()
        return _cloned(self.out)  # the next replay overwrites it
