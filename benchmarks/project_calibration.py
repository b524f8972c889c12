"""Calibrate the projection (`hf_triforce.tools.project`) on every measured point in the repository; no new runs.

Reads the measured decode speeds and per-tier forward timings of ``docs/bench/calibration/runs.csv`` (the fields this
calibration reads of each run, `hf_triforce_bench.calibration_runs`: the runs the docs publish, under their bench
folders' names, those only this calibration reads, under ``calibration/<host>/...``, and the GPU check's library runs)
and the kernel and lean-drafting timings under ``docs/bench/`` (a few tier timings are transcribed below), fits each
machine's device numbers on the per-forward measurements and reports predicted vs measured for every point, fitted on
or predicted.
Writes ``docs/bench/calibration/calibration.{json,md}``, the fitted devices ``devices.json`` (``hf-triforce project
--devices docs/bench/calibration/devices.json --device <name>``) and the published projections
``projections.{json,md}`` (``--out``: to another folder; tests/test_project_calibration.py checks that the published
files are what this writes).

Machines ("hosts", named by CPU and date): the recorded CPU runs come from different machines or loads (the same
static-cache ``generate`` of SmolLM2 at 16k measured 3.3-3.9 tok/s on 2026-11-29, 5.8-6.7 on 2026-11-30, 10.4-10.9 on
2026-12-01), so each host gets its own fit (2 vCPUs, 2 torch threads; fp32 everywhere but the Qwen pair on Zen 4):

- ``epyc-avx2-2026-11-29``: SmolLM2 on the bundled Shakespeare (1k-32k, fixed n-gram and self plans, int8 tiers) and
  the Qwen2.5-Coder 1.5B / 0.5B pair at 2k; bandwidth, multi-row weight bandwidth, matmul and attention FLOP/s and
  per-layer overhead fitted on both models' per-forward points (static decode, tier timings).
- ``epyc-avx2-2026-11-30``: SmolLM2 on the essays (1k-32k), the llama.cpp comparison (``llama-cpp-smollm2/*``) and a
  table of tier costs (`TIER_COSTS`); the same five numbers. Its fit is the ``epyc-avx2-fp32`` device.
- ``epyc-avx512-2026-12-01``: the lean drafting tiers (``lean-16k``, ``lean-drafting/2-threads.json``): nine points
  of one model, so the per-layer overhead stays at that day's profile and the multi-row bandwidth is not fitted.
- ``epyc-avx2-2026-12-02``: the Qwen2.5-Coder pair in fp32 at 8k and 32k, lean-int4 drafting tiers, 32 new tokens, one
  round; ``zen4-2026-12-03-qwen-bf16``: the same pair in bf16 on a Zen 4 EPYC with AVX512-BF16, 2k-32k, 64 new tokens,
  one round (``qwen-coder-pair-vs-assisted-zen4/python-*``). Free: bandwidth, matmul and attention FLOP/s and the int4
  copies' bytes/s and FLOP/s (``quantized_bandwidth``, ``quantized_flops``); the per-layer overhead is fixed at 0 and
  the multi-row weight rate at ``bandwidth`` (`LEAN_HOST`: one target whose verifications all have 5-7 rows cannot
  tell them apart). Its fit, with the kernel host's plain-generate rates, is the ``zen4-bf16`` device.
- ``zen4-2026-12-03-medians``, ``zen4-2026-12-03-kernels``: Zen 4 EPYCs, SmolLM2 fp32 1k-32k and the Qwen pair bf16
  2k-32k, medians of 3; the second with kernel timings of plain ``generate``; ``zen4-2026-12-03-held-out``: the Qwen
  pair's runs of ``docs/results.md``'s current results, not fitted: predicted by the kernel host's fit
  (`PREDICTED_BY`).
- ``h200``: the library runs of ``gpu-h200*`` (`benchmarks/gpu_check.py`), random-weight SmolLM2 and Qwen2.5-1.5B
  shapes, bf16 and fp32: bandwidth and matmul FLOP/s are the datasheet's; the per-layer overhead and the attention
  FLOP/s (bf16, fp32) are fitted on each fixed run's seconds of all tiers per Force-3 step.

Points: ``static`` (static-cache ``generate``: one forward per token), ``plain`` (``generate`` on a DynamicCache: the
forward plus a copy of the cache, `plain_generate_seconds`), ``plain steps in the loop`` (the adaptive policy's
one-token steps, `TriForceDetail.plans`), tier timings (``F1`` / ``F2`` / ``F3``: a fixed run's seconds / forwards,
rows = the average proposed + 1; F1 includes the drafter's first cache fill: unmodelled in the older runs, which do
not record how it was filled, a forward of sink + window rows spread over the drafted tokens where the run records
one; Force 1 / Force 2 at the run's ``draft_precision``, Force 3 the model as given), all tiers per Force-3 step and
fixed TriForce runs' tokens/s (priced by the policy's own cost model via `planning_policy`, at the per-level rates
that reproduce the run's tokens per Force-3 step and per Force-2 round). The fitting subset is the per-forward points
(static, F1 / F2 / F3; on the H200 the per-step sums); tokens/s of plain ``generate``, of the loop's plain steps and
of TriForce runs are predictions. Not modelled (listed, not scored): int8 tiers and lean tiers on hosts without
lean-int4 fixed runs to fit their kernels' rates on (`MODELLED_PRECISIONS`), llama.cpp, HF lookup / assisted
generation (no acceptance recorded), compiled static ``generate``, ``auto`` / ``default`` runs as a whole (a mix of
plans; their plain steps are scored where there are at least 5).

    python benchmarks/project_calibration.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from hf_triforce.config import TriForceConfig
from hf_triforce.decoding.policy import Plan
from hf_triforce.decoding.tiers import FORCE2_PRECISION
from hf_triforce_bench.calibration_runs import RUNS, read
from hf_triforce_bench.roofline import (
    DEVICES,
    GPU_LAYER_OVERHEAD,
    Device,
    ModelShape,
    attention_seconds,
    cache_copy_seconds,
    device,
    fill_seconds,
    forward_seconds,
    model_shape,
    plain_generate_seconds,
    planning_policy,
    rate_for_tokens,
    selection_seconds,
)

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
OUT = BENCH / "calibration"
# sink_tokens + window of the runs that do not record their draft cache's size (those of 2026-11-29 to 2026-12-01:
# window 256); the others hold 16 + 1024, read from their draft_cache_bytes
SINK_WINDOW = 16 + 256
STREAMING_GAMMA = 4  # hf_triforce.tools.methods.STREAMING_GAMMA: streaming-self's Force-1 tokens per Force-3 step
TARGET = 0.25  # the projection's aim: every CPU point within 25%

AVX2_1129, AVX2_1130, AVX512_1201, AVX2_1202 = ("epyc-avx2-2026-11-29", "epyc-avx2-2026-11-30",
                                                "epyc-avx512-2026-12-01", "epyc-avx2-2026-12-02")
ZEN4_QWEN, ZEN4_MEDIANS, ZEN4_KERNELS, ZEN4_HELD_OUT = ("zen4-2026-12-03-qwen-bf16", "zen4-2026-12-03-medians",
                                                        "zen4-2026-12-03-kernels", "zen4-2026-12-03-held-out")
LLAMA_CPP_RUNS = ["final-8k-essays", "final-8k-essays-t1", "final-8k-hamlet", "final-16k-essays", "rerun-8k-essays"]
# The runs of every bench folder below (`hf_triforce_bench.calibration_runs`: the fields this calibration reads of each
# folder's results.json, one CSV row per result and method): folder -> its results
RESULTS = read(RUNS)
CPU_FILES = {  # host -> bench folders (relative to docs/bench) whose runs `RESULTS` holds
    AVX2_1129: [f"calibration/{AVX2_1129}/{name}" for name in (
        "1k-2k-int8", "1k-2k-tuned", "4k-8k", "4k-8k-int8", "4k-8k-tuned", "16k", "16k-int8", "16k-tuned", "32k",
        "32k-split", "qwen-2k", "qwen-2k-int8")],
    AVX2_1130: [f"calibration/{AVX2_1130}/natural-{name}" for name in ("1k-8k", "16k", "32k")]
    + [f"llama-cpp-smollm2/{name}" for name in LLAMA_CPP_RUNS],
    AVX512_1201: [f"calibration/{AVX512_1201}/lean-16k"],
    # AMD EPYC, AVX2 only, fp32, the Qwen2.5-Coder pair, lean-int4 tiers
    AVX2_1202: [f"calibration/{AVX2_1202}/qwen-coder-pair/python-{c}" for c in ("8k", "32k")],
    # AMD EPYC Zen 4 (AVX512-BF16), the same pair in bf16, 64 new tokens, lean-int4 tiers
    ZEN4_QWEN: [f"qwen-coder-pair-vs-assisted-zen4/python-{c}" for c in ("2k", "8k", "16k", "32k")],
    # SmolLM2 fp32 1k-32k and the Qwen pair bf16 2k-32k, `TriForceConfig()` runs (a mix of plans: their Force-3
    # verifications are scored, `F3_FROM_DEFAULT_RUNS`), medians of 3, transformers 5.24
    ZEN4_MEDIANS: [f"calibration/{ZEN4_MEDIANS}/{name}" for name in (
        "1k-8k", "16k", "32k", "qwen-python-2k-16k", "qwen-python-32k")],
    # SmolLM2 fp32 1k-32k (transformers 5.25) and the Qwen pair bf16 2k-32k (5.24), `TriForceConfig()` runs with plain
    # generate beside them, medians of 3, and this host's kernel timings (`KERNEL_FILES`)
    ZEN4_KERNELS: ["smollm2-wikipedia-zen4/1k-8k"] + [f"calibration/{ZEN4_KERNELS}/{name}" for name in (
        "16k", "32k", "qwen-python-2k-16k", "qwen-python-32k")],
    # the Qwen pair bf16 at 2k, 8k, 16k and 32k (transformers 5.25), `TriForceConfig()` and `draft=<the 0.5B>` runs,
    # medians of 3: not fitted, every point predicted by the kernel host's fit (`PREDICTED_BY`)
    ZEN4_HELD_OUT: [f"qwen-coder-pair-python-zen4/{c}" for c in ("2k-8k", "16k", "32k")],
}
GPU_FILES = ("gpu-h200", "gpu-h200-smollm2-shape")  # bench folders of `benchmarks/gpu_check.py` runs in `RESULTS`
# Hosts not fitted: every point of theirs is predicted with another host's fitted device (the same CPU model measured
# on another run): what the projection gets right on runs it was not fitted on
PREDICTED_BY = {ZEN4_HELD_OUT: ZEN4_KERNELS}
# Kernel timings of one decoded token (benchmarks/plain_generate_gqa.py: a static decode's packed attention, plain
# generate's enable_gqa attention and DynamicCache's torch.cat, SmolLM2 and Qwen2.5-Coder-1.5B shapes, fp32 and bf16):
# host -> file. Its fit gives the rates plain generate adds (``gqa_attention_flops``, ``copy_bandwidth``) to the Zen 4
# hosts that ran plain generate beside the static decode (`BORROWED_RATES`: the same CPU model; those hosts measured
# no kernel timings of their own)
KERNEL_FILES = {ZEN4_KERNELS: "plain-generate-gqa/zen4.json"}
PLAIN_GENERATE_RATES = ["gqa_attention_flops:float32", "gqa_attention_flops:bfloat16", "copy_bandwidth"]
BORROWED_RATES = {ZEN4_QWEN: ZEN4_KERNELS, ZEN4_MEDIANS: ZEN4_KERNELS}  # the kernel host's own runs: its own fit
# hosts whose `TriForceConfig()` runs (a mix of plans) give Force-3 points: a verification forward of the run's
# average rows (proposals per Force-3 step + 1) whatever drafted them; their Force-1 / Force-2 seconds mix drafters
F3_FROM_DEFAULT_RUNS = (ZEN4_MEDIANS, ZEN4_KERNELS, ZEN4_HELD_OUT)
# the drafting precisions (`TriForceConfig.draft_precision`) whose fixed runs a host's fit prices: hosts with lean-int4
# runs fit the quantized kernels' rates (``quantized_bandwidth``, ``quantized_flops``) on them; the other precisions
# of the older hosts (int8 copies, lean without a fitted rate) stay listed as not modelled
MODELLED_PRECISIONS = {AVX2_1202: ("model", "lean-int4"), ZEN4_QWEN: ("model", "lean-int4")}
# Runs whose draft model filled its cache by its own weights (the model's dtype, BLAS) rather than by its lean drafting
# copy: the runs do not record which way they filled; the 16k / 32k process ran with the library that fills by the
# draft's own weights, and the 0.5B's Force 1 cost 57-71 ms a drafted token there (fill included) against 106-119 ms
# in the 2k / 8k runs, as in the python-draft-fill run (56 ms)
FILLS_BY_OWN_WEIGHTS = tuple(f"qwen-coder-pair-vs-assisted-zen4/python-{c}" for c in ("16k", "32k"))
# What is known of a run's machine beyond its records (source prefix -> note), for points it measured slower than the
# model predicts
RUN_NOTES = {"qwen-coder-pair-vs-assisted-zen4/python-16k (greedy)": "this run's decoding shared the two cores with "
             "other jobs (2026-12-03 06:52-07:10): its static step took 430 ms, 208 ms in the sampled run of the same "
             "process"}
# Tier costs of SmolLM2 fp32 on the 2026-11-30 host (2 threads, caches of random content, median of 7, ranges as
# their middle; recorded only here): (what, cached entries, rows, milliseconds)
TIER_COSTS = [("F3 16k full cache", 16000, 1, 137.0), ("F3 16k full cache", 16000, 7, 225.0),
              ("F3 32k full cache", 32000, 1, 203.0), ("F3 32k full cache", 32000, 7, 321.0),
              ("F2 budget 1024", 1024, 1, 60.0), ("F2 budget 1024", 1024, 4, 91.0),
              ("F2 budget 4096", 4096, 1, 85.5), ("F2 budget 4096", 4096, 4, 124.5),
              ("F1 sink+window", SINK_WINDOW, 1, 57.0)]
# Starting values (the fit is exact least squares; they only name the parameters and hold the fixed ones):
# layer_overhead 4.7 ms / 30 layers is a profile of one eager SmolLM2 forward ("everything else: norms, rotary, views,
# casts, cache writes", docs/results.md, "Lean drafting tiers"), kept fixed where a host's points cannot tell it from
# the weights' bytes (epyc-avx512-2026-12-01: nine points of one model).
CPU_START = dict(bandwidth=20e9, gemm_bandwidth=10e9, flops=30e9, attention_flops=200e9, layer_overhead=4.7e-3 / 30,
                 quantized_bandwidth=5e9, quantized_flops=50e9, gqa_attention_flops=20e9, copy_bandwidth=20e9)
PLAIN = ["bandwidth", "gemm_bandwidth", "flops", "attention_flops", "layer_overhead"]
# The Qwen-pair hosts (one target, every Force-3 verification 5-7 rows, two drafting models) cannot tell the multi-row
# weight rate from the matmul FLOP/s, nor a per-layer overhead from the bytes (fitted free, the flops and the int4
# bytes go unlimited and the overhead to 4.8 ms a layer): the weights are read at ``bandwidth`` whatever the rows and
# the overhead is 0, as the 2026-11-30 fit of this stack finds; free are the memory's bytes/s, the matmul and
# attention FLOP/s, and the int4 copies' bytes/s and FLOP/s
LEAN_HOST = ["bandwidth", "flops", "attention_flops", "quantized_bandwidth", "quantized_flops"]
# hosts of two models in two dtypes (SmolLM2 fp32, the Qwen pair bf16): matmul and attention FLOP/s by dtype; their
# points are static decodes and Force-3 verifications (the target's own weights), so no int4 rates
BY_DTYPE_HOST = ["bandwidth", "flops:float32", "flops:bfloat16", "attention_flops:float32",
                 "attention_flops:bfloat16", "layer_overhead"]
KERNEL_HOST = [*BY_DTYPE_HOST, *PLAIN_GENERATE_RATES]  # its runs (both models) and its kernel timings
CPU_FREE = {AVX2_1129: PLAIN, AVX2_1130: PLAIN, AVX512_1201: ["bandwidth", "flops", "attention_flops"],
            AVX2_1202: LEAN_HOST, ZEN4_QWEN: LEAN_HOST, ZEN4_MEDIANS: BY_DTYPE_HOST, ZEN4_KERNELS: KERNEL_HOST}
CPU_FIXED = {AVX2_1202: {"layer_overhead": 0.0}, ZEN4_QWEN: {"layer_overhead": 0.0}}


@dataclass
class Point:
    host: str
    source: str
    what: str
    unit: str  # "ms" (per forward) or "tok/s"
    measured: float
    seconds: Callable[[dict], float]  # predicted seconds per forward / per token, from the host's parameters
    fit: bool
    model: str = "smollm2-135m"
    note: str = ""  # why the model may miss it, where the run's own records tell ...
    note_if: str = "slower"  # ... if it predicts the point "slower" (more seconds) or "faster" than measured

    def measured_seconds(self) -> float:
        return self.measured / 1e3 if self.unit == "ms" else 1.0 / self.measured

    def predicted(self, params: dict) -> float:
        seconds = self.seconds(params)
        return seconds * 1e3 if self.unit == "ms" else 1.0 / seconds


def device_of(params: dict, dtype: str = "float32") -> Device:
    """A device from fitted parameters (``attention_flops:<dtype>`` / ``flops:<dtype>`` where they differ by dtype)."""
    def rate(name):
        return params.get(f"{name}:{dtype}", params.get(name))

    return Device(name="fit", bandwidth=rate("bandwidth"), flops=rate("flops"),
                  attention_flops=rate("attention_flops"), layer_overhead=params["layer_overhead"],
                  gemm_bandwidth=rate("gemm_bandwidth"), quantized_bandwidth=rate("quantized_bandwidth"),
                  quantized_flops=rate("quantized_flops"), gqa_attention_flops=rate("gqa_attention_flops"),
                  copy_bandwidth=rate("copy_bandwidth"), cpu=True)


def smollm2(dtype="float32") -> ModelShape:
    return model_shape("smollm2-135m", dtype)


# -- CPU points from the bench JSONs ---------------------------------------------------------------------------
def _gammas(entry: dict, drafter: str) -> tuple[int, int]:
    gammas = entry.get("gammas") or {}
    kind = "model" if drafter in ("self", "draft") else "ngram"
    found = gammas.get(kind) or (gammas.get("lookup") if kind == "ngram" else None)
    return tuple(found) if found else (2, 6)


def _budget(entry: dict, method: str) -> int:
    if "(budget " in method:
        return int(method.split("(budget ")[1].rstrip(")"))
    return (entry.get("budgets") or [512])[0]


def _sink_window(stats: dict, model: ModelShape) -> int:
    """The drafter's sink + window entries: its cache's recorded bytes / the model's bytes per token, where the run
    records them (a whole number), else `SINK_WINDOW` (the older runs)."""
    entries, remainder = divmod(stats["detail"].get("draft_cache_bytes") or 0, model.kv_bytes_per_token)
    return entries if entries and not remainder else SINK_WINDOW


def _fills_by_forward(stats: dict, drafter: str) -> bool:
    """Whether the run's Force-1 seconds include a forward filling the drafter's cache: recorded by the later runs
    (``draft_caches``: "filled by a forward" for a draft model, "a copy of the full cache's entries" for self); the
    older runs do not say, and their fill stays unmodelled (their F1 points read it as drafting)."""
    recorded = stats["detail"].get("draft_caches") or {}
    return drafter != "ngram" and any("filled by a forward" in how for how in recorded.values())


def _fixed_run_points(host: str, tag: str, method: str, context: int, new: int, stats: dict, tokens_per_second: float,
                      gammas: tuple[int, int], budget: int, target: ModelShape, draft: ModelShape | None,
                      fit_tiers: bool, dtype: str = "float32", fill_precision: str | None = None,
                      fit_steps: bool = False) -> list[Point]:
    """One fixed-plan TriForce run: its tier timings (seconds / forwards), its forward seconds per Force-3 step
    (every tier's seconds / steps) and its tokens/s, both priced by the policy's own cost model at the per-level
    rates that reproduce the run's tokens per Force-3 step and per Force-2 round. Force 1 / Force 2 at the run's
    drafting precision (``stats["detail"]["draft_precision"]``; Force 2 at `FORCE2_PRECISION`'s), on the drafter's
    recorded sink + window cache; a draft model's cache fill (one forward of sink + window rows, recorded runs only;
    by its drafting copy, or at ``fill_precision``) is spread over the run's drafted tokens, as in the measured
    seconds."""
    cached, detail = context + new // 2, stats["detail"]
    drafter = "self" if "self" in method else "draft" if "draft" in method else "ngram"
    levels = 2 if method.startswith("streaming") else 3
    g1, g2 = gammas if levels == 3 else (1, STREAMING_GAMMA)
    precision = detail.get("draft_precision") or "model"
    force2_precision = FORCE2_PRECISION.get(precision, precision)
    config_budget, budget = budget, min(budget, cached)  # Force 2's cache holds at most the context
    f1_model = draft if drafter == "draft" else target
    window = _sink_window(stats, f1_model) if drafter != "ngram" else SINK_WINDOW
    fills = _fills_by_forward(stats, drafter) and detail["force1_proposed"] > 0
    fill_precision = fill_precision or precision
    points = []

    def dev(p):
        return device_of(p, dtype)

    def add(what, unit, measured, seconds, fit, model=target):
        points.append(Point(host, tag, what, unit, measured, seconds, fit, model.name))

    def force1(d: Device) -> float:
        """Seconds per drafted token: one forward on the sink + window cache, plus the fill spread over the run's."""
        one = forward_seconds(f1_model, d, window, precision=precision)
        return one + (fill_seconds(f1_model, d, window, fill_precision) / detail["force1_proposed"] if fills else 0.0)

    if stats["force3_steps"]:
        proposed = stats["force3_proposed"] if levels == 3 else detail["force1_proposed"]
        rows = round(proposed / stats["force3_steps"]) + 1
        add(f"F3 {rows} rows, {cached} cached", "ms", 1e3 * stats["force3_seconds"] / stats["force3_steps"],
            lambda p, r=rows: forward_seconds(target, dev(p), cached, r), fit_tiers)
    if levels == 3 and detail["force2_steps"]:
        rows = round(detail["force1_proposed"] / detail["force2_steps"]) + 1
        label = "" if force2_precision == "model" else f" {force2_precision}"
        add(f"F2{label} {rows} rows, budget {budget}", "ms", 1e3 * stats["force2_seconds"] / detail["force2_steps"],
            lambda p, r=rows: forward_seconds(target, dev(p), budget, r, precision=force2_precision), fit_tiers)
    if drafter != "ngram" and detail["force1_proposed"]:
        label = "" if precision == "model" else f" {precision}"
        by = "" if fill_precision == precision else f" by its {fill_precision} weights"
        fill = (f" + its cache's fill by a forward of {window} rows{by} over {detail['force1_proposed']} drafted tokens"
                if fills else " (incl. its cache's first fill)" if window == SINK_WINDOW else "")
        add(f"F1 {f1_model.name}{label} on {window}{fill}", "ms",
            1e3 * stats["force1_seconds"] / detail["force1_proposed"], lambda p: force1(dev(p)), fit_tiers, f1_model)
        if not fills and window == SINK_WINDOW:
            points[-1].note_if = "faster"
            points[-1].note = (f"the measured seconds include the cache's first fill (a forward of {window} rows in "
                               "these runs, not recorded apart), which this point does not price")
    per_step = min(max(stats.get("force3_tokens", new - 1) / stats["force3_steps"], 1.0), g2 + 1)
    rate3 = rate_for_tokens(per_step, g2)
    rate1 = rate_for_tokens(min(max(stats["force3_proposed"] / detail["force2_steps"], 1.0), g1 + 1), g1) \
        if levels == 3 else 0.0
    # the policy prices three levels only where the context exceeds the budget: a fixed three-level run at a context
    # within the budget (2k, budget 4096) is priced at the budget its Force 2 saw (the whole context), under it
    config = TriForceConfig(retrieval_budget=min(config_budget, (cached - 1) // 8 * 8), gamma1=g1, gamma2=g2)

    def step(p) -> tuple[float, float]:
        d = dev(p)
        one = force1(d) if drafter != "ngram" else 0.0
        tiers = {"force3": {r: forward_seconds(target, d, cached, r) for r in (1, g2 + 1)},
                 "force2": {r: forward_seconds(target, d, budget, r, precision=force2_precision) for r in (1, g1 + 1)},
                 f"draft:{drafter}": {1: one}, "select": {1: selection_seconds(target, d, cached, budget, 8)}}
        if levels == 2:  # StreamingLLM self-speculation: the drafter verified by Force 3
            policy = planning_policy(tiers, cached, 0.0, {drafter: rate3}, {}, config)
            return policy.predict(Plan(2, drafter, gamma2=g2))
        policy = planning_policy(tiers, cached, rate3, {drafter: rate3}, {drafter: rate1}, config)
        return policy.predict(Plan(3, drafter, g1, g2))

    spent = sum(stats[k] for k in ("force1_seconds", "force2_seconds", "force3_seconds")) + detail["retrieval_seconds"]
    note = ""
    if levels == 3 and drafter != "ngram" and detail["force2_steps"]:
        drafted = detail["force1_proposed"] / detail["force2_steps"]
        note = (f"the policy's plan arithmetic prices {g1} drafted tokens and a {g1 + 1}-row Force-2 forward in every "
                f"Force-2 round; this run drafted {drafted:.2f} a round (a step's last round drafts only what gamma2 "
                "still wants)")
    add(f"all tiers per Force-3 step ({stats['force3_steps']} steps)", "ms", 1e3 * spent / stats["force3_steps"],
        lambda p: step(p)[1], fit_steps)
    points[-1].note = note
    share = spent / (new / tokens_per_second)
    add(f"{method} tok/s (rates F3 {rate3:.2f}, F2 {rate1:.2f})", "tok/s", tokens_per_second,
        lambda p: step(p)[1] / step(p)[0], False)
    points[-1].note = "; ".join(filter(None, [note, f"the tiers took {share:.0%} of the call's decode time"]))
    return points


def cpu_points(host: str) -> tuple[list[Point], list[str], list[str]]:
    """A host's points from its bench folders, the runs not modelled, and the folders not there (yet): skipped."""
    points, skipped, missing = [], [], []
    for folder in CPU_FILES[host]:
        if folder not in RESULTS:
            print(f"note: {host}: {RUNS.relative_to(ROOT)} holds no run of {folder} (yet): skipped")
            missing.append(folder)
            continue
        qwen = "qwen" in folder
        for entry in RESULTS[folder]:
            context = entry["context"]
            dtype = entry.get("dtype") or "float32"
            target = model_shape(entry.get("model") or ("qwen2.5-coder-1.5b" if qwen else "smollm2-135m"), dtype)
            draft_name = entry.get("draft_model") or ("qwen2.5-coder-0.5b" if qwen else None)
            draft = model_shape(draft_name, dtype) if draft_name else None
            mode = "sampled" if entry.get("sampling") else "greedy"
            source = f"{folder} ({mode})"

            def dev(p, d=dtype):
                return device_of(p, d)

            for method, run in entry["methods"].items():
                cached = context + run["new_tokens"] // 2
                stats = run.get("stats") or {}
                if method == "static":
                    points.append(Point(host, f"{source} static {context}", f"static generate, {cached} cached",
                                        "tok/s", run["decode_tokens_per_second"],
                                        lambda p, c=cached, t=target, dv=dev: forward_seconds(t, dv(p), c),
                                        True, target.name))
                elif method == "plain":
                    note = ""
                    if "static" in entry["methods"]:
                        extra = 1 / run["decode_tokens_per_second"] - 1 / entry["methods"]["static"][
                            "decode_tokens_per_second"]
                        lender = host if host in KERNEL_FILES else (BORROWED_RATES.get(host)
                                                                    or PREDICTED_BY.get(host))
                        priced = (f"at {lender}'s kernel rates (benchmarks/plain_generate_gqa.py)" if lender else
                                  "at this host's plain rates (no kernel timings: the enable_gqa path is not priced "
                                  "apart)")
                        note = (f"plain generate (transformers' DynamicCache) took {1e3 * extra:.0f} ms a token more "
                                f"than static-cache generate beside it ({1e6 * extra / cached:.0f} ms per 1k cached "
                                "tokens); the model adds its cache's torch.cat and its maskless attention (SDPA "
                                f"enable_gqa) {priced}")
                    points.append(Point(host, f"{source} plain {context}", f"plain generate, {cached} cached",
                                        "tok/s", run["decode_tokens_per_second"],
                                        lambda p, c=cached, t=target, dv=dev: plain_generate_seconds(t, dv(p), c),
                                        False, target.name, note, "faster"))
                elif method in ("default", "default-draft", "triforce-auto"):
                    if host in F3_FROM_DEFAULT_RUNS and stats.get("force3_steps"):
                        rows = round(stats["force3_proposed"] / stats["force3_steps"]) + 1
                        points.append(Point(
                            host, f"{source} {method} {context}", f"F3 {rows} rows, {cached} cached", "ms",
                            1e3 * stats["force3_seconds"] / stats["force3_steps"],
                            lambda p, c=cached, r=rows, t=target, dv=dev: forward_seconds(t, dv(p), c, r), True,
                            target.name))
                    plain = stats["detail"].get("plans", {}).get("plain", {"steps": 0})
                    if plain["steps"] >= 5:
                        points.append(Point(host, f"{source} {method} {context}",
                                            f"plain steps in the loop ({plain['steps']}), {cached} cached", "tok/s",
                                            plain["measured_tokens_per_second"],
                                            lambda p, c=cached, t=target, dv=dev: forward_seconds(t, dv(p), c),
                                            False, target.name))
                    elif host not in F3_FROM_DEFAULT_RUNS and "plain" in stats["detail"].get("plans", {}):
                        skipped.append(f"{source} {method} {context} (a mix of plans; {plain['steps']} plain steps)")
                    elif host not in F3_FROM_DEFAULT_RUNS:
                        skipped.append(f"{source} {method} {context}")
                elif (method.startswith(("triforce-self", "triforce-ngram", "triforce-draft", "streaming-self"))
                      and (stats["detail"].get("draft_precision") or "model")
                      in MODELLED_PRECISIONS.get(host, ("model",))
                      and "-int8" not in method):
                    drafter = "self" if "self" in method else "draft" if "draft" in method else "ngram"
                    points += _fixed_run_points(host, f"{source} {method} {context}", method, context,
                                                run["new_tokens"], stats, run["decode_tokens_per_second"],
                                                _gammas(entry, drafter), _budget(entry, method), target, draft, True,
                                                dtype, "model" if folder in FILLS_BY_OWN_WEIGHTS else None)
                else:
                    skipped.append(f"{source} {method} {context}")
    return points, skipped, missing


def kernel_points(host: str) -> list[Point]:
    """A host's kernel timings of one decoded token (`KERNEL_FILES`): the packed attention a static decode runs
    (`attention_seconds`), plain generate's maskless enable_gqa attention (its ``maskless_gqa`` rate) and DynamicCache's
    copies (`cache_copy_seconds`); all fitted on."""
    path = BENCH / KERNEL_FILES[host]
    if not path.exists():
        print(f"note: {host}: {path.relative_to(ROOT)} is not there (yet): skipped")
        return []
    points = []
    for row in json.loads(path.read_text())["rows"]:
        model, cached, source = model_shape(row["model"], row["dtype"]), row["context"], path.parent.name

        def dev(p, d=row["dtype"]):
            return device_of(p, d)

        for kind, seconds in (
                ("packed", lambda p, m=model, c=cached, dv=dev: attention_seconds(m, dv(p), c)),
                ("enable_gqa", lambda p, m=model, c=cached, dv=dev: attention_seconds(m, dv(p), c, maskless_gqa=True)),
                ("cat", lambda p, m=model, c=cached, dv=dev: cache_copy_seconds(m, dv(p), c))):
            what = {"packed": "static decode's attention", "enable_gqa": "plain generate's attention (SDPA enable_gqa)",
                    "cat": "DynamicCache's torch.cat"}[kind]
            points.append(Point(host, f"{source} {row['dtype']}", f"{what}, {cached} cached, a token", "ms",
                                row[f"{kind}_ms_per_token"], seconds, True, model.name))
    return points


def cpu_listed_points() -> dict[str, list[Point]]:
    """Tier timings recorded only in `TIER_COSTS` (2026-11-30) and the lean-drafting timings (2026-12-01)."""
    model = smollm2()
    tiers = [Point(AVX2_1130, "tier costs", f"{what}, {rows} rows", "ms", ms,
                   lambda p, c=cached, r=rows: forward_seconds(model, device_of(p), c, r), True)
             for what, cached, rows, ms in TIER_COSTS]
    lean = json.loads((BENCH / "lean-drafting" / "2-threads.json").read_text())["timings_ms"]
    source = "lean-drafting/2-threads.json"
    drafting = [
        Point(AVX512_1201, source, "static decode step, 8000 cached", "ms", lean["static decode step"],
              lambda p: forward_seconds(model, device_of(p), 8000), True),
        Point(AVX512_1201, source, f"F1 eager, {SINK_WINDOW} cached", "ms", lean["force1 model greedy (per token)"],
              lambda p: forward_seconds(model, device_of(p), SINK_WINDOW), True),
        Point(AVX512_1201, source, "F2 eager, 3 rows, 1024 cached", "ms",
              lean["force2 verify model (3 rows, 1024 entries)"],
              lambda p: forward_seconds(model, device_of(p), 1024, 3), True)]
    return {AVX2_1130: tiers, AVX512_1201: drafting}


# -- H200 points -------------------------------------------------------------------------------------------------
def gpu_points() -> tuple[list[Point], list[str]]:
    points, skipped = [], []
    shapes = {"smollm2-135m": "smollm2-135m", "qwen2.5-1.5b": "qwen2.5-coder-1.5b"}  # same shape (random weights)
    for folder in GPU_FILES:
        for entry in RESULTS[folder]:  # a row of its gpu_check.json: one method
            ((method, run),) = entry["methods"].items()
            row = {"model": entry["model"], "dtype": entry["dtype"], "context": entry["context"], "method": method,
                   "new_tokens": run["new_tokens"], "tok_s": run["decode_tokens_per_second"], "stats": run["stats"]}
            dtype = {"bf16": "bfloat16", "fp32": "float32"}[row["dtype"]]
            target = model_shape(shapes[row["model"]], dtype)
            cached = row["context"] + row["new_tokens"] // 2
            tag = f"{folder} {row['model']} {row['dtype']} {row['method']} {row['context']}"
            stats = row.get("stats") or {}

            def dev(p, d=dtype):
                return device_of(p, d)

            if row["method"] in ("plain", "static"):
                seconds = (plain_generate_seconds if row["method"] == "plain" else forward_seconds)
                points.append(Point("h200", tag, f"{row['method']} generate, {cached} cached", "tok/s", row["tok_s"],
                                    lambda p, t=target, c=cached, s=seconds, dv=dev: s(t, dv(p), c), False,
                                    target.name))
            elif row["method"] in ("triforce-self", "triforce-ngram"):
                # benchmarks/gpu_check.py: budget 4096, gammas 2/6. The split between tiers is not reliable there
                # (the same Force-3 forward: 33 ms in the n-gram run, 90 ms in the self run, SmolLM2 bf16 32k), so
                # the fit uses each run's seconds of all tiers per Force-3 step
                points += _fixed_run_points("h200", tag, row["method"], row["context"], row["new_tokens"], stats,
                                            row["tok_s"], (2, 6), 4096, target, None, False, dtype, fit_steps=True)
            else:
                skipped.append(tag)
    return points, skipped


# -- fitting -----------------------------------------------------------------------------------------------------
def _transform(name: str, value: float) -> float:
    return value if name == "layer_overhead" else 1.0 / value


def _untransform(name: str, z: float) -> float:
    return z if name == "layer_overhead" else 1.0 / max(z, 1e-30)


def fit(points: list[Point], params: dict, free: list[str]) -> dict:
    """Least relative squared error over the ``fit`` points, with each free parameter's transform (1 / rate,
    overhead) >= 0. Every prediction is linear in those transforms, so the coefficients are exact differences and
    the non-negative least squares is solved over every subset of active parameters."""
    subset = [p for p in points if p.fit]
    z0 = np.array([_transform(n, params[n]) for n in free])

    def at(z):
        return {**params, **{n: float(_untransform(n, v)) for n, v in zip(free, z)}}

    base = np.array([p.seconds(at(z0)) for p in subset])
    columns = []
    for j in range(len(free)):
        z = z0.copy()
        step = z0[j] or 1.0  # any step gives the coefficient of a linear term; a start at 0 needs one of its own
        z[j] += step
        columns.append((np.array([p.seconds(at(z)) for p in subset]) - base) / step)
    a = np.stack(columns, axis=1)
    intercept = base - a @ z0
    target = np.array([p.measured_seconds() for p in subset])
    a_w, b_w = a / target[:, None], (target - intercept) / target
    best, best_z = math.inf, z0
    for active in itertools.chain.from_iterable(itertools.combinations(range(len(free)), k)
                                                for k in range(1, len(free) + 1)):
        cols = list(active)
        scale = np.abs(a_w[:, cols]).max(axis=0)
        solution = np.linalg.lstsq(a_w[:, cols] / scale, b_w, rcond=None)[0] / scale
        if (solution < 0).any():
            continue
        z = np.zeros(len(free))  # an inactive rate: unlimited (its term 0); an inactive overhead: 0
        z[cols] = solution
        error = float(((a_w @ z - b_w) ** 2).sum())
        if error < best:
            best, best_z = error, z
    return at(best_z)


def rows_of(points: list[Point], params: dict) -> list[dict]:
    out = []
    for p in points:
        predicted = p.predicted(params)
        out.append({"host": p.host, "model": p.model, "source": p.source, "point": p.what, "unit": p.unit,
                    "measured": p.measured, "predicted": float(predicted), "error": float(predicted / p.measured - 1.0),
                    "fitted_on": p.fit, "note": p.note, "note_if": p.note_if})
    return out


def _repeat_groups(rows: list[dict]) -> list[list[dict]]:
    """Points the model cannot tell apart: the same model, kind of point and predicted value (one quantity measured in
    several runs)."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        kind = re.sub(r"\(\d+( steps)?\)|\(rates [^)]*\)", "", r["point"])
        groups.setdefault((r["model"], kind, f"{r['predicted']:.9g}"), []).append(r)
    return list(groups.values())


def why(row: dict, rows: list[dict]) -> str:
    """What the records say about a point's miss: its own note where the miss goes its way, or the spread of the same
    quantity over runs where that spread alone is beyond `TARGET`."""
    slower = (row["error"] > 0) == (row["unit"] == "ms")  # predicted more seconds than measured
    if row["note"] and slower == (row["note_if"] == "slower"):
        return row["note"]
    for group in _repeat_groups(rows):
        if row in group and len(group) > 1:
            lo, hi = min(r["measured"] for r in group), max(r["measured"] for r in group)
            if hi / lo - 1 > TARGET:
                return f"the same forward measured {lo:.3g}-{hi:.3g} {row['unit']} over {len(group)} runs"
    return next((note for source, note in RUN_NOTES.items() if row["source"].startswith(source) and not slower), "")


def repeat_floor(rows: list[dict]) -> tuple[float, str]:
    """The smallest worst-case error any model can reach on these points: points the model cannot tell apart (the
    same host, model and predicted value: one quantity measured in several runs) that were measured at ``lo`` and
    ``hi`` leave at best ``(hi - lo) / (hi + lo)`` on one of them. Returns it and the group that sets it."""
    floor, where = 0.0, ""
    for group in _repeat_groups(rows):
        lo, hi = min(r["measured"] for r in group), max(r["measured"] for r in group)
        if len(group) > 1 and (hi - lo) / (hi + lo) > floor:
            floor = (hi - lo) / (hi + lo)
            where = f"{group[0]['point']}: {lo:.3g}-{hi:.3g} {group[0]['unit']} over {len(group)} runs"
    return floor, where


def summary(rows: list[dict]) -> dict:
    errors = [abs(r["error"]) for r in rows]
    held = [abs(r["error"]) for r in rows if not r["fitted_on"]]
    floor, where = repeat_floor(rows)
    return {"points": len(rows), "within_25": int(sum(e <= TARGET for e in errors)), "max": float(max(errors)),
            "median": float(np.median(errors)), "held_out_max": float(max(held)) if held else None,
            "repeat_floor": floor, "repeat_floor_at": where}


# -- published projections (docs/results.md) -----------------------------------------------------------------------
def measured_rates() -> dict:
    """Per-token rates measured in this project's runs (the inverse of `expected_tokens` on tokens per step / round):
    Force 1 = self on sink+window -> Force 2 (the fixed self runs on the essays, 1k-16k, budget 512), self on
    sink+window -> Force 3 (two levels, 16k), and Qwen2.5-Coder-0.5B -> 1.5B (Force 1 -> Force 2, 2k)."""
    force2 = []
    for folder in ("natural-1k-8k", "natural-16k"):
        for entry in RESULTS[f"calibration/{AVX2_1130}/{folder}"]:
            stats = entry["methods"]["triforce-self"]["stats"]
            force2.append(rate_for_tokens(stats["force3_proposed"] / stats["detail"]["force2_steps"], 2))
    first = {name: RESULTS[f"calibration/{AVX2_1129}/{name}"][0]["methods"] for name in ("16k", "qwen-2k")}
    streaming, qwen = first["16k"]["streaming-self"]["stats"], first["qwen-2k"]["triforce-draft"]["stats"]
    return {"force2": float(np.mean(force2)), "force2_runs": [round(r, 3) for r in force2],
            "streaming": rate_for_tokens(streaming["tokens_per_force3_step"], STREAMING_GAMMA),
            "draft": rate_for_tokens(qwen["force3_proposed"] / qwen["detail"]["force2_steps"], 2)}


# Force 2 -> Force 3 at a 4096 budget: teacher-forced per-token agreement at 32k (docs/results.md, "Force 2: re-select
# every step"): 0.882 selected once per prompt, 0.946 re-selected per position (T=1); Force 2 re-selects
# once per Force-3 step, between the two.
FORCE3_RATE = 0.90
PUBLISHED_GAMMAS = (4, 16)  # the plan search's bounds (gamma1, gamma2) for the published projections
SETTINGS = [  # (label, target, draft, device, context, offloaded, paper's figure, also this stack's H200 numbers)
    ("Llama-3.1-8B, 32k, one H200", "llama-3.1-8b", "llama-3.2-1b", "h200", 32768, False, "", True),
    ("Llama-3.1-8B, 128k, one H200", "llama-3.1-8b", "llama-3.2-1b", "h200", 131072 - 256, False, "", True),
    ("LLaMA-2-7B-128K, 120k, one A100", "llama-2-7b-128k", "llama-68m", "a100", 122880, False, "2.31x", False),
    ("LLaMA-2-7B-128K, 120k, RTX 4090, full cache offloaded", "llama-2-7b-128k", "llama-68m", "rtx4090", 122880,
     True, "7.78x (two RTX 4090s)", False),
]
ROOFLINE = "roofline: no per-forward overhead (CUDA graphs), datasheet attention FLOP/s (flash attention)"
THIS_STACK = "this stack as calibrated on the H200: eager overhead, its measured verification attention"


def publish(h200_fit: dict) -> dict:
    from hf_triforce_bench.roofline import Acceptance, project_plans, tier_precision

    rates = measured_rates()
    acceptance = Acceptance(force3=FORCE3_RATE, force2=rates["force2"], streaming=rates["streaming"],
                            draft=rates["draft"])
    stacks = {ROOFLINE: dict(layer_overhead=0.0),
              THIS_STACK: dict(layer_overhead=h200_fit["layer_overhead"],
                               attention_flops=h200_fit["attention_flops:bfloat16"])}
    out = {"acceptance": acceptance.__dict__, "rates_measured": rates, "gammas_up_to": PUBLISHED_GAMMAS,
           "settings": []}
    for label, target_name, draft_name, device_name, context, offloaded, paper, this_stack in SETTINGS:
        target, draft = model_shape(target_name), model_shape(draft_name, "bfloat16")
        config = TriForceConfig(retrieval_budget=4096, gamma1=PUBLISHED_GAMMAS[0], gamma2=PUBLISHED_GAMMAS[1],
                                full_cache_device="cpu" if offloaded else None)
        for stack, overrides in stacks.items():
            if stack == THIS_STACK and not this_stack:
                continue
            dev = device(device_name, target.dtype, **overrides)
            tiers, plans = project_plans(target, dev, context, acceptance, config, draft)
            out["settings"].append({
                "setting": label, "stack": stack, "paper": paper, "target": target_name, "draft": draft_name,
                "device": device_name, "context": context, "offloaded": offloaded,
                "draft_precision": tier_precision(config.draft_precision, dev, [target, draft]),
                "sink_window": config.sink_tokens + config.window,
                "tiers_ms": {k: {r: 1e3 * v for r, v in by.items()} for k, by in tiers.items()},
                "plans": [plan.__dict__ for plan in plans]})
    return out


def publish_markdown(published: dict) -> str:
    a = published["acceptance"]
    lines = ["# PROJECTIONS (not measurements): `hf_triforce.tools.project`, benchmarks/project_calibration.py\n",
             f"Acceptance (per token): Force 2 -> Force 3 {a['force3']:.2f}, self on sink+window -> Force 2 "
             f"{a['force2']:.3f}, self on sink+window -> Force 3 {a['streaming']:.3f}, draft -> target "
             f"{a['draft']:.3f}; gammas searched up to {published['gammas_up_to']}; budget 4096, sink+window "
             f"{published['settings'][0]['sink_window']}; `TriForceConfig()`'s drafting precision (``auto``: lean-int4 "
             "on a CPU, the model's own weights on a GPU, where the library's lean copies do not run).\n"]
    for setting in published["settings"]:
        lines.append(f"## {setting['setting']} ({setting['stack']}; Force 1 / Force 2 weights: "
                     f"{setting['draft_precision']})\n")
        lines.append("| plan | best gammas | tokens/step | ms/step | tokens/s | vs plain |\n|---|---|---|---|---|---|")
        for p in setting["plans"]:
            lines.append(f"| {p['label']} | {p['plan']} | {p['tokens_per_step']:.2f} | "
                         f"{p['seconds_per_step'] * 1e3:.1f} | {p['tokens_per_second']:.1f} | {p['speedup']:.2f}x |")
        lines.append("")
    return "\n".join(lines)


# the dtype a host's rates without a ":<dtype>" suffix hold for (`fitted_devices`)
HOST_DTYPES = {ZEN4_QWEN: "bfloat16"}
DEVICE_RATES = ("flops", "attention_flops", "quantized_bandwidth", "quantized_flops", "gqa_attention_flops")


def fitted_devices(hosts: dict) -> dict:
    """Each fitted CPU host as a device preset of `hf_triforce.tools.project` (``--devices``): its rates per dtype."""
    devices = {}
    for host, result in hosts.items():
        if host == "h200" or host in PREDICTED_BY:
            continue
        params, dtype = result["params"], HOST_DTYPES.get(host, "float32")
        preset = dict(bandwidth=params["bandwidth"], layer_overhead=params["layer_overhead"], offload_bandwidth=0.0,
                      cpu=True, gemm_bandwidth=params.get("gemm_bandwidth"),
                      copy_bandwidth=params.get("copy_bandwidth"),
                      notes=f"2 vCPUs at 2 torch threads, fitted by benchmarks/project_calibration.py (host {host}, "
                      "docs/bench/calibration/calibration.json)")
        for rate in DEVICE_RATES:
            by_dtype = {key.split(":")[1]: value for key, value in params.items() if key.startswith(f"{rate}:")}
            if rate in params:
                by_dtype.setdefault(dtype, params[rate])
            if by_dtype:
                preset[rate] = by_dtype
        devices[host] = preset
    return devices


COMPACT = (",", ":")  # JSON separators: no whitespace
DIGITS = 6  # significant digits of a point's measured, predicted and error in calibration.json


# a scored point's fields in calibration.json, in this order (a row of values per point, under "columns")
ROW_COLUMNS = ("model", "source", "point", "unit", "measured", "predicted", "error", "fitted_on", "note", "note_if")


def compact(out: dict) -> dict:
    """``out`` as calibration.json holds it: each host's points as ``{"columns": ROW_COLUMNS, "rows": [[...]]}`` (no
    host: the key they sit under; an empty note with an empty ``note_if``, which says which way a note applies),
    measured, predicted and error to `DIGITS` significant digits (the parameters and summaries in full)."""
    def row(r: dict) -> list:
        rounded = {k: float(f"{r[k]:.{DIGITS}g}") for k in ("measured", "predicted", "error")}
        values = {**r, **rounded, "note_if": r["note_if"] if r["note"] else ""}
        return [values[k] for k in ROW_COLUMNS]
    return {**out, "hosts": {host: {**result, "rows": {"columns": list(ROW_COLUMNS),
                                                       "rows": [row(r) for r in result["rows"]]}}
                             for host, result in out["hosts"].items()}}


def overhead_check(hosts: dict) -> list[str]:
    """`GPU_LAYER_OVERHEAD` is the h200 fit (rounded): say so."""
    fitted = hosts["h200"]["params"]["layer_overhead"]
    agree = abs(GPU_LAYER_OVERHEAD / fitted - 1) < 0.02
    if not agree:
        print(f"warning: GPU_LAYER_OVERHEAD {GPU_LAYER_OVERHEAD:.3g} differs from the fit {fitted:.3g}")
    return [f"- GPU_LAYER_OVERHEAD: {GPU_LAYER_OVERHEAD:.3g}, fit {fitted:.3g}{'' if agree else ' -- UPDATE IT'}"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=OUT, help=f"folder of the written files (default {OUT})")
    args = parser.parse_args(argv)
    out = {"hosts": {}, "skipped": {}, "missing": {}}
    extra = cpu_listed_points()
    # the kernel hosts first (they lend rates), the predicted hosts last (after the hosts they are predicted by)
    for host in sorted(CPU_FILES, key=lambda h: (h in PREDICTED_BY, h not in KERNEL_FILES)):
        points, skipped, missing = cpu_points(host)
        if missing:
            out["missing"][host] = missing
        if host in PREDICTED_BY:
            lender = PREDICTED_BY[host]
            if lender not in out["hosts"]:
                raise SystemExit(f"{host} is predicted by {lender}, which was not fitted")
            if points:
                rows = rows_of([replace(p, fit=False) for p in points], out["hosts"][lender]["params"])
                out["hosts"][host] = {"params": out["hosts"][lender]["params"], "summary": summary(rows),
                                      "rows": rows, "predicted_by": lender}
                out["skipped"][host] = skipped
            continue
        if host in KERNEL_FILES:
            points += kernel_points(host)
        points += extra.get(host, [])
        if not any(p.fit for p in points):
            print(f"note: {host}: no measured points yet: not fitted")
            continue
        start = {k: CPU_START[k.split(":")[0]] for k in [*CPU_FREE[host], "layer_overhead"]}
        start.update(CPU_FIXED.get(host, {}))
        lender = BORROWED_RATES.get(host)
        if lender is not None and lender not in out["hosts"]:  # its plain-generate notes name the lender's rates
            raise SystemExit(f"{host} borrows plain generate's rates from {lender}, which was not fitted (its kernel "
                             f"timings {KERNEL_FILES.get(lender)} missing?)")
        if lender is not None:
            start.update({k: out["hosts"][lender]["params"][k] for k in PLAIN_GENERATE_RATES})
        params = fit(points, start, CPU_FREE[host])
        rows = rows_of(points, params)
        out["hosts"][host] = {"params": params, "summary": summary(rows), "rows": rows}
        out["skipped"][host] = skipped
    h200 = DEVICES["h200"]
    gpu, skipped = gpu_points()
    params = {"bandwidth": h200["bandwidth"], "flops:bfloat16": h200["flops"]["bfloat16"],
              "flops:float32": h200["flops"]["float32"], "attention_flops:bfloat16": 1e12,
              "attention_flops:float32": 1e12, "layer_overhead": 1e-3}
    params = fit(gpu, params, ["layer_overhead", "attention_flops:bfloat16", "attention_flops:float32"])
    rows = rows_of(gpu, params)
    out["hosts"]["h200"] = {"params": params, "summary": summary(rows), "rows": rows}
    out["skipped"]["h200"] = skipped

    lines = ["# Calibration of `hf-triforce project` against every measured point (benchmarks/project_calibration.py)",
             "", "Error = predicted / measured - 1. 'fitted on': the point is in its host's fitting subset (the rest "
             "are predictions). Floor: the least worst-case error any model could reach, set by the same quantity "
             "measured in several runs (`repeat_floor`).", "",
             "| host | fitted device | points | within 25% | median abs error | max | max held out | floor |",
             "|---|---|---|---|---|---|---|---|"]
    for host, result in out["hosts"].items():
        p, s = result["params"], result["summary"]
        # a rate the fit left unlimited (its term 0: these points cannot tell it apart from the others) is shown so
        described = ", ".join(f"{k} {v:.3g}" if v < 1e29 else f"{k} unlimited (its term 0 in the fit)"
                              for k, v in p.items())
        described = f"{PREDICTED_BY[host]}'s fit (none of its points fitted on)" if host in PREDICTED_BY else described
        lines.append(f"| {host} | {described} | {s['points']} | {s['within_25']} | {s['median']:.1%} | {s['max']:.1%} "
                     f"| {(s['held_out_max'] or 0):.1%} | {s['repeat_floor']:.1%} ({s['repeat_floor_at']}) |")
    lines += ["", "Free in each host's fit (the rest fixed at the values shown; an absent rate: the plain one): "
              + "; ".join(f"{host} {', '.join(CPU_FREE[host])}" for host in CPU_FREE if host in out["hosts"])
              + "; h200 layer_overhead, attention_flops (bf16, fp32)."]
    lines += [f"Not there yet, skipped: {host}: {', '.join(folders)}." for host, folders in out["missing"].items()]
    lines += ["", "## Points beyond 25%", "", "| host | model | source | point | measured | predicted | error | "
              "fitted on | why (where the records tell) |", "|---|---|---|---|---|---|---|---|---|"]
    for host, result in out["hosts"].items():
        lines += [f"| {host} | {r['model']} | {r['source']} | {r['point']} | {r['measured']:.3g} {r['unit']} | "
                  f"{r['predicted']:.3g} | {r['error']:+.1%} | {'yes' if r['fitted_on'] else ''} | "
                  f"{why(r, result['rows'])} |" for r in result["rows"] if abs(r["error"]) > TARGET]
    for host, result in out["hosts"].items():
        lines += ["", f"## {host}", "", "| model | source | point | measured | predicted | error | fitted on |",
                  "|---|---|---|---|---|---|---|"]
        lines += [f"| {r['model']} | {r['source']} | {r['point']} | {r['measured']:.3g} {r['unit']} | "
                  f"{r['predicted']:.3g} | {r['error']:+.1%} | {'yes' if r['fitted_on'] else ''} |"
                  for r in result["rows"]]
        lines += ["", f"Not modelled ({len(out['skipped'][host])}): " + "; ".join(out["skipped"][host])]
    lines += ["", "## The GPU presets' per-layer overhead against this fit", ""] + overhead_check(out["hosts"])
    folder = args.out
    folder.mkdir(parents=True, exist_ok=True)
    devices = {"about": "CPU devices fitted by benchmarks/project_calibration.py on the runs of docs/bench "
               "(calibration.json); hf-triforce project --devices <this file> --device <name>",
               "devices": fitted_devices(out["hosts"])}
    (folder / "devices.json").write_text(json.dumps(devices, separators=COMPACT))
    (folder / "calibration.json").write_text(json.dumps(compact(out), separators=COMPACT))
    (folder / "calibration.md").write_text("\n".join(lines) + "\n")
    published = publish(out["hosts"]["h200"]["params"])
    (folder / "projections.json").write_text(json.dumps(published, separators=COMPACT))
    (folder / "projections.md").write_text(publish_markdown(published))
    for host, result in out["hosts"].items():
        print(host, {k: f"{v:.3g}" for k, v in result["params"].items()}, result["summary"])
    print(publish_markdown(published))


if __name__ == "__main__":
    main()
