"""The CPU kernels a TriForce call may run, built at the call's set-up and described for its stats.

A kernel is compiled on its first use in a process (`native_build`: seconds). `prepare` builds the kernels before
the call's prefill for any model on the CPU (the GGUF one where a model has GGUF blocks attached: `gguf_weights`), so
that no compile lands inside a timed forward (the adaptive policy's timings, a linear route's calibration);
`describe` says which build target they were built for and whether each runs (`TriForceDetail.cpu_kernels`).
"""

from __future__ import annotations

import time

from torch import nn

from . import cpu_attention, few_rows_linear, gguf_linear, gguf_weights, native_build


def on_cpu(model: nn.Module) -> bool:
    """A model with floating-point weights on the CPU (one whose forwards the kernels may serve)."""
    parameter = next(model.parameters(), None)
    return parameter is not None and parameter.device.type == "cpu" and parameter.is_floating_point()


def prepare(models: list[nn.Module]) -> float:
    """Build, load and check the kernels where any of ``models`` is `on_cpu`; the seconds it took (about 0 once
    done in this process). ValueError where ``HF_TRIFORCE_CPU_MARCH`` names no build target."""
    began = time.perf_counter()
    if any(on_cpu(model) for model in models):
        cpu_attention.status()
        few_rows_linear.status()
    if any(gguf_weights.describe(model) for model in models):
        gguf_linear.status()
    return time.perf_counter() - began


def describe(model: nn.Module) -> dict:
    """`TriForceDetail.cpu_kernels` for ``model``: ``{}`` where it is not `on_cpu`; else ``{"target": the build
    target (`native_build.build_target`), "attention": `cpu_attention.status`, "linear": `few_rows_linear.status`}``,
    a status ``"on"`` or why the kernel does not run (its calls then take ATen's routes); where GGUF blocks are
    attached to its layers, ``"gguf"``: ``{"kernel": `gguf_linear.status`, "layers": {type: layers attached}}`` (the
    layers' ``"gguf"`` route, where `TriForceDetail.linear_routes` names it, read them at their stored width)."""
    if not on_cpu(model):
        return {}
    described = {"target": native_build.build_target(), "attention": cpu_attention.status(),
                 "linear": few_rows_linear.status()}
    attached = gguf_weights.describe(model)
    if attached:
        described["gguf"] = {"kernel": gguf_linear.status(), "layers": attached}
    return described
