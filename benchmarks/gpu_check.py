"""GPU check: what each TriForce tier costs on a GPU against graphed static decoding, the speedup that follows,
and whether the library is exact there.

Three stages, in this order; each rewrites ``gpu_check.json`` and ``gpu_table.md`` when it ends, so a timeout
keeps what finished:

1. **tiers** — a Llama-3.1-8B-shaped target and a Llama-3.2-1B-shaped draft in bf16 (random weights: a forward's
   cost does not depend on them), each forward run on the model's own weights over preallocated KV buffers (new
   entries written at their positions, attention over a fixed length), timed as a captured CUDA graph and eagerly:
   - ``static``: one row over the full context — static-cache decoding graph-captured, the baseline;
   - ``force3``: 1..gamma2+1 rows over the full context (Force 3's verification);
   - ``force2``: 1..gamma1+1 rows over the retrieval budget (Force 2);
   - ``select``: the retrieval re-selection of all layers (chunk means scored against the query, top-k chunks,
     their entries gathered into the budget);
   - ``draft:self``: the target on its sink + window cache (Force 1 = the target);
     ``draft:draft`` / ``draft:vanilla``: the draft on its sink + window cache / on the full context.
   Attention over a long cache takes the fastest route of a one-layer timing per (rows, length): one unmasked SDPA
   call (flash), one masked call (the library's unsplit route) or the library's split-KV attention
   (`hf_triforce.kernels.split_kv`: the cache in spans laid along the batch dimension, merged by log-sum-exp) with
   its own choice of spans (``split``) or 4-64 spans (``split<p>``). The r new rows attend to the whole buffer
   without the causal mask among themselves (r*r of r*length scores: the cost is the masked forward's); the
   library's exactness is checked in stage 3, not here.
2. **projection** — the measured tier costs fed to the adaptive policy's own cost model
   (`hf_triforce_bench.roofline.planning_policy`) with acceptance rates given on the command line (measured with
   real weights on the CPU, where the models can run): tokens/s of the best plan of each kind over graphed static
   decoding. Labelled a projection: the costs are measured, the acceptance is not measured here.
3. **library** — ``TriForceConfig()`` end to end on CUDA on a small Llama shape with a scaled output layer
   (peaked logits: greedy identity means something in bf16 and fp32): identical to plain ``generate``, tokens/s
   of both, the tier forwards that ran (``TriForceStats``), and the host synchronisations of one call
   (``torch.cuda.set_sync_debug_mode``).

    python benchmarks/gpu_check.py --out gpu-out                 # on the GPU (scripts/gpu_check.sh)
    python benchmarks/gpu_check.py --dry-run --out /tmp/gpu-dry  # tiny shapes on the CPU: every stage runs
"""

from __future__ import annotations

import argparse
import copy
import json
import platform
import sys
import time
import traceback
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

import hf_triforce
from hf_triforce import TriForceConfig
from hf_triforce.kernels import split_kv
from hf_triforce.tools.timing import prefill_prefix, static_copy
from hf_triforce_bench.roofline import planning_policy, rank_plans

MAX_POSITIONS = 131072
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
SHAPES = {  # transcribed from the models' published config.json (random weights here)
    "llama-3.1-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                         num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0, tie_word_embeddings=False),
    "llama-3.2-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0,
                         tie_word_embeddings=True),
    # TriForce's own setting (Sun et al., 2024): an MHA 7B with a 128k window, a 68M draft
    "llama-2-7b-128k": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
                            num_key_value_heads=32, vocab_size=32000, rope_theta=10000.0, tie_word_embeddings=False),
    "llama-68m": dict(hidden_size=768, intermediate_size=3072, num_hidden_layers=2, num_attention_heads=12,
                      num_key_value_heads=12, vocab_size=32000, tie_word_embeddings=False),
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True),
    "tiny-target": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
                        num_key_value_heads=2, vocab_size=512, tie_word_embeddings=False),
    "tiny-draft": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True),
}


@dataclass(frozen=True)
class Plan:
    """What a run measures: shapes, contexts and the TriForce sizes whose tiers are timed."""

    target: str
    draft: str
    library_model: str
    contexts: tuple[int, ...]
    library_context: int
    dtype: torch.dtype
    budget: int = 4096
    chunk_size: int = 8
    sink: int = 16
    window: int = 256
    gamma1: int = 2
    gamma2: int = 6
    replays: int = 40
    new_tokens: int = 64


GPU_PLAN = Plan("llama-3.1-8b", "llama-3.2-1b", "smollm2-135m", (32768, MAX_POSITIONS - 256, 65536), 16384,
                torch.bfloat16)
DRY_PLAN = Plan("tiny-target", "tiny-draft", "tiny-target", (512, 1024), 512, torch.float32, budget=128, window=64,
                replays=2, new_tokens=12)


def log(*args) -> None:
    print(*args, flush=True)


def build(shape: str, dtype: torch.dtype, device: torch.device) -> LlamaForCausalLM:
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=MAX_POSITIONS, **NO_SPECIAL)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM._from_config(config, dtype=dtype)
    return model.eval()


# -- attention: the new rows' queries over a KV buffer, GQA folded into the query rows ------------------------------
def _fold(q: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """q: [1, heads, rows, d] -> [1, kv_heads, group * rows, d] (the heads that share a KV head become rows)."""
    _, heads, rows, dim = q.shape
    return q.reshape(1, kv_heads, heads // kv_heads * rows, dim)


def split_attention(parts: int | None = None) -> Callable:
    """The library's split-KV attention (`hf_triforce.kernels.split_kv.split_kv_attention`, what
    `LeanModel.fixed_shape_layers` runs over a long buffer): the buffer in ``parts`` spans (None: the library's own
    choice, `split_kv.split_parts`) and the entries past them, each a batch entry of one call of torch's fused
    kernel with a bias, merged by log-sum-exp. The rows see the whole buffer, as `sdpa_attention`'s do (the bias
    costs the same whatever it masks); the bias is made once per shape, as the library makes it once per forward."""
    masks: dict[tuple, split_kv.SplitKVMask] = {}

    def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        # q: [1, kv_heads, rows, d]; k, v: [1, kv_heads, length, d]
        _, kv_heads, rows, _ = q.shape
        length = k.shape[2]
        pieces = parts or split_kv.split_parts(kv_heads, rows, length, q.device, head_dim=v.shape[-1])
        key = (rows, length, pieces, q.dtype, q.device)
        if key not in masks:
            masks[key] = split_kv.split_kv_mask(torch.ones(rows, length, dtype=torch.bool, device=q.device), pieces,
                                                q.dtype)
        return split_kv.split_kv_attention(q, k, v, masks[key], k.shape[-1] ** -0.5, pieces)

    return attend


def sdpa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    return F.scaled_dot_product_attention(q, k, v)


def masked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """One SDPA call under a boolean mask (here all true): what `LeanModel.fixed_shape_layers` runs where the library
    does not split (on CUDA the mask takes the memory-efficient kernel, not flash)."""
    visible = torch.ones(q.shape[2], k.shape[2], dtype=torch.bool, device=q.device)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=visible)


def attention_routes(length: int, kv_heads: int = 8, rows: int = 1, device: torch.device | str = "cpu",
                     head_dim: int = 128) -> dict[str, Callable]:
    """``sdpa`` (unmasked: the static baseline's route), ``masked`` (the library's unsplit route), ``split``
    (the library's split with `split_kv.split_parts`'s choice, where it splits) and ``split<p>`` (4-64 spans of at
    least 256 entries: how the choice compares)."""
    routes = {"sdpa": sdpa_attention, "masked": masked_attention}
    if split_kv.split_parts(kv_heads, rows, length, device, head_dim=head_dim) > 1:
        routes["split"] = split_attention()
    for parts in (4, 8, 16, 32, 64):
        if (length - 1) // parts >= 256:
            routes[f"split{parts}"] = split_attention(parts)
    return routes


# -- one tier forward on the model's own weights ----------------------------------------------------------------------
class TierForward:
    """``rows`` new tokens through ``model`` over KV buffers of ``length`` entries (the rows written at the end).

    Buffers, per layer: ``keys[i]``, ``values[i]``: [1, kv_heads, length, head_dim] views of one allocation that
    the caller owns (the tiers of one context share it). Inputs are static tensors, so a CUDA graph replays the
    forward as captured."""

    def __init__(self, model, keys: list[torch.Tensor], values: list[torch.Tensor], rows: int, attend: Callable):
        self.model, self.keys, self.values, self.rows, self.attend = model, keys, values, rows, attend
        length = keys[0].shape[2]
        device = keys[0].device
        self.ids = torch.randint(0, model.config.vocab_size, (1, rows), device=device,
                                 generator=torch.Generator(device).manual_seed(rows))
        self.positions = torch.arange(length - rows, length, device=device)[None]

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        inner, rows = self.model.model, self.rows
        hidden = inner.embed_tokens(self.ids)
        cos, sin = inner.rotary_emb(hidden, self.positions)
        for layer, k_buffer, v_buffer in zip(inner.layers, self.keys, self.values):
            attn = layer.self_attn
            x = layer.input_layernorm(hidden)
            q, k, v = (proj(x).view(1, rows, -1, attn.head_dim).transpose(1, 2)
                       for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            k_buffer[:, :, -rows:].copy_(k)
            v_buffer[:, :, -rows:].copy_(v)
            kv_heads = k_buffer.shape[1]
            out = self.attend(_fold(q, kv_heads), k_buffer, v_buffer)
            out = out.reshape(1, q.shape[1], rows, -1).transpose(1, 2).reshape(1, rows, -1)
            hidden = hidden + attn.o_proj(out)
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.model.lm_head(inner.norm(hidden))


class Selection:
    """The retrieval re-selection of every layer: chunk means [1, kv_heads, chunks, d] scored against the query's
    heads summed per group, the top ``budget / chunk`` chunks, their entries gathered into the budget buffers."""

    def __init__(self, model, keys, values, budget: int, chunk: int, device: torch.device):
        config = model.config
        self.keys, self.values, self.chunk = keys, values, chunk
        self.picks = budget // chunk
        dim = keys[0].shape[-1]
        group = config.num_attention_heads // config.num_key_value_heads
        self.summaries = [k.unflatten(2, (-1, chunk)).float().mean(3) for k in keys]
        self.query = torch.randn(1, config.num_key_value_heads, group, dim, device=device,
                                 generator=torch.Generator(device).manual_seed(7)).to(keys[0].dtype)
        shape = (1, config.num_key_value_heads, budget, dim)
        self.out_k = [torch.empty(shape, dtype=keys[0].dtype, device=device) for _ in keys]
        self.out_v = [torch.empty_like(t) for t in self.out_k]
        self.offsets = torch.arange(chunk, device=device)

    @torch.no_grad()
    def __call__(self) -> torch.Tensor:
        for summaries, k, v, out_k, out_v in zip(self.summaries, self.keys, self.values, self.out_k, self.out_v):
            scores = (self.query.float() @ summaries.transpose(-1, -2)).sum(2)  # [1, kv_heads, chunks]
            chunks = scores.topk(self.picks, dim=-1).indices  # [1, kv_heads, picks]
            index = (chunks[..., None] * self.chunk + self.offsets).flatten(2)[..., None]
            index = index.expand(-1, -1, -1, k.shape[-1])  # [1, kv_heads, budget, d]
            torch.gather(k, 2, index, out=out_k)
            torch.gather(v, 2, index, out=out_v)
        return self.out_k[-1]


# -- timing ----------------------------------------------------------------------------------------------------------
def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(fn: Callable, device: torch.device, replays: int) -> float:
    fn()
    _sync(device)
    start = time.perf_counter()
    for _ in range(replays):
        fn()
    _sync(device)
    return (time.perf_counter() - start) / replays


def time_graphed(fn: Callable, device: torch.device, replays: int, pool) -> tuple[float, float]:
    """(seconds per replay of ``fn`` captured as a CUDA graph, largest |graph - eager| of its output)."""
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        for _ in range(2):
            eager = fn()
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool):
        captured = fn()
    graph.replay()
    torch.cuda.synchronize(device)
    error = (captured.float() - eager.float()).abs().max().item()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize(device)
    seconds = start.elapsed_time(end) / 1e3 / replays
    del graph
    return seconds, error


@dataclass
class Timing:
    tier: str
    context: int
    rows: int
    length: int
    route: str
    graphed_ms: float | None
    eager_ms: float
    graph_error: float | None


class Stage:
    """The run's results, rewritten to ``out`` after every stage (and the table beside them)."""

    def __init__(self, out: Path, meta: dict):
        self.out, self.data = out, {"meta": meta, "tiers": [], "routes": [], "projection": [], "library": [],
                                    "errors": []}

    def save(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1))
        (self.out / "gpu_table.md").write_text(render(self.data))


def _routes(keys, values, rows: int, device) -> dict[str, Callable]:
    """`attention_routes` for ``rows`` query rows per KV head over these buffers."""
    return attention_routes(keys[0].shape[2], keys[0].shape[1], rows, device, values[0].shape[-1])


def route_choice(model, keys, values, rows: int, device, replays: int, graphed: bool) -> tuple[str, list[dict]]:
    """The fastest attention route for ``rows`` over these buffers, timed on one layer's shapes."""
    config = model.config
    q = torch.randn(1, config.num_key_value_heads, config.num_attention_heads // config.num_key_value_heads * rows,
                    keys[0].shape[-1], device=device, dtype=keys[0].dtype)
    results, best = [], None
    reference = sdpa_attention(q, keys[0], values[0]).float()
    for name, attend in _routes(keys, values, q.shape[2], device).items():
        def call(attend=attend):
            return attend(q, keys[0], values[0])
        try:
            seconds = time_graphed(call, device, replays * 5, None)[0] if graphed else time_eager(call, device, replays)
        except RuntimeError as error:  # a route this torch build lacks (e.g. no flash kernel for this dtype)
            results.append({"route": name, "rows": rows, "length": keys[0].shape[2], "error": str(error)[:200]})
            continue
        error = (call().float() - reference).abs().max().item()
        results.append({"route": name, "rows": rows, "length": keys[0].shape[2], "ms": seconds * 1e3,
                        "max_error": error})
        if error < 5e-2 and (best is None or seconds < best[1]):
            best = (name, seconds)
    return best[0], results


def measure_tiers(plan: Plan, device: torch.device, stage: Stage, deadline: float) -> None:
    graphed = device.type == "cuda"
    pool = None  # each graph its own pool, freed with it (a shared pool outlives its graphs only while one holds it)
    target = build(plan.target, plan.dtype, device)
    draft = build(plan.draft, plan.dtype, device)
    longest = max(plan.contexts) + plan.gamma2 + 1

    def buffers(model, length):
        config = model.config
        dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        shape = (config.num_hidden_layers, 1, config.num_key_value_heads, length, dim)
        generator = torch.Generator(device).manual_seed(3)
        return (torch.randn(shape, dtype=plan.dtype, device=device, generator=generator),
                torch.randn(shape, dtype=plan.dtype, device=device, generator=generator))

    # bytes one static decode step must read: every matrix but the embedding, and the KV cache
    stage.data["meta"]["target_weight_bytes"] = sum(
        p.numel() * p.element_size() for n, p in target.named_parameters() if "embed_tokens" not in n)
    stage.data["meta"]["target_kv_bytes_per_token"] = 2 * target.config.num_hidden_layers * \
        target.config.num_key_value_heads * target.config.head_dim * torch.finfo(plan.dtype).bits // 8
    full = {"target": buffers(target, longest), "draft": buffers(draft, longest)}
    small = {"target": buffers(target, plan.budget + plan.gamma1 + 1), "draft": buffers(draft, plan.sink + plan.window)}
    models = {"target": target, "draft": draft}

    def views(storage, length):
        return [storage[0][i, :, :, :length] for i in range(storage[0].shape[0])], \
               [storage[1][i, :, :, :length] for i in range(storage[1].shape[0])]

    def run(tier, context, who, rows, length, storage):
        if time.monotonic() > deadline:
            raise TimeoutError(f"deadline reached before {tier} rows={rows} at {context}")
        keys, values = views(storage, length)
        route, routes = route_choice(models[who], keys, values, rows, device, plan.replays, graphed)
        stage.data["routes"].extend(routes)
        group = models[who].config.num_attention_heads // models[who].config.num_key_value_heads
        forward = TierForward(models[who], keys, values, rows, _routes(keys, values, group * rows, device)[route])
        eager = time_eager(forward, device, max(2, plan.replays // 4))
        graph_s, error = time_graphed(forward, device, plan.replays, pool) if graphed else (None, None)
        timing = Timing(tier, context, rows, length, route, graph_s and graph_s * 1e3, eager * 1e3, error)
        stage.data["tiers"].append(asdict(timing))
        log(f"  {tier:13s} ctx={context:6d} rows={rows} len={length:6d} {route:8s} "
            f"graphed={'-' if graph_s is None else f'{graph_s * 1e3:.3f}'} ms eager={eager * 1e3:.3f} ms")

    # the context-free tiers once (their cost does not depend on the full context)
    for rows in range(1, plan.gamma1 + 2):
        run("force2", 0, "target", rows, plan.budget + rows, small["target"])
    run("draft:self", 0, "target", 1, plan.sink + plan.window, small["target"])
    run("draft:draft", 0, "draft", 1, plan.sink + plan.window, small["draft"])
    stage.save()
    for context in plan.contexts:
        run("static", context, "target", 1, context + 1, full["target"])
        for rows in (plan.gamma2 + 1, *range(2, plan.gamma2 + 1)):
            run("force3", context, "target", rows, context + rows, full["target"])
        run("draft:vanilla", context, "draft", 1, context + 1, full["draft"])
        keys, values = views(full["target"], context)
        select = Selection(target, keys, values, plan.budget, plan.chunk_size, device)
        eager = time_eager(select, device, max(2, plan.replays // 4))
        graph_s = time_graphed(select, device, plan.replays, pool)[0] if graphed else None
        stage.data["tiers"].append(asdict(Timing("select", context, 1, context, "-", graph_s and graph_s * 1e3,
                                                 eager * 1e3, None)))
        del select
        stage.save()
    del target, draft, full, small


def project(plan: Plan, stage: Stage, acceptance: dict[str, float]) -> None:
    """Each context's measured tier costs (graphed where measured) through the policy's cost model."""
    config = TriForceConfig(retrieval_budget=plan.budget, chunk_size=plan.chunk_size, sink_tokens=plan.sink,
                            window=plan.window, gamma1=plan.gamma1, gamma2=plan.gamma2)
    rows = stage.data["tiers"]

    def ms(row):
        return row["graphed_ms"] if row["graphed_ms"] is not None else row["eager_ms"]

    for context in plan.contexts:
        here = [r for r in rows if r["context"] in (0, context)]
        if not any(r["tier"] == "select" and r["context"] == context for r in here):
            continue
        tiers: dict[str, dict[int, float]] = {}
        for r in here:
            tier = "force3" if r["tier"] == "static" else r["tier"]
            tiers.setdefault(tier, {})[r["rows"]] = ms(r) / 1e3
        policy = planning_policy(tiers, context, acceptance["force3"],
                                 {"self": acceptance["streaming"], "draft": acceptance["draft"],
                                  "vanilla": acceptance["draft"]},
                                 {"self": acceptance["force2"], "draft": acceptance["draft"]}, config)
        for p in rank_plans(policy):
            stage.data["projection"].append({"context": context, **asdict(p)})
    stage.save()


# the library's configurations timed end to end: the default, and fixed plans whose every step replays the drafting
# tiers (the default may choose n-gram chains on a repeating random prompt, where no tier forward runs); the three-level
# plan again with Force 3 on transformers' eager forward, beside its default (CUDA graphs of the native forward)
LIBRARY_CONFIGS = {"auto": {}, "fixed, 3 levels": {"policy": "fixed", "levels": 3},
                   "fixed, 3 levels, force3 eager": {"policy": "fixed", "levels": 3, "force3_compile": "off"},
                   "fixed, 2 levels": {"policy": "fixed", "levels": 2}}


def library_check(plan: Plan, device: torch.device, stage: Stage) -> None:
    """TriForceConfig() and fixed plans end to end: identity with plain generate (bf16 and fp32), decode tok/s from
    a shared prefill, ms per tier forward, host syncs of one call."""
    for dtype in (torch.float32, plan.dtype) if plan.dtype != torch.float32 else (torch.float32,):
        for row in _library_rows(plan, dtype, device):
            stage.data["library"].append(row)
            log(f"  library {row['dtype']} {row['config']}: plain {row['plain_tok_s']:.1f} tok/s, static "
                f"{row['static_tok_s']:.1f}, triforce {row['triforce_tok_s']:.1f} (identical: "
                f"{row['triforce_identical']}), ms per forward {row['tier_ms']}, Force 3 {row['force3_forward']}, "
                f"syncs/call {row['host_syncs_per_call']}")
            stage.save()


def _on_device(extra: dict, device: torch.device) -> dict:
    """A library configuration for ``device``: off CUDA (the dry run) the fixed plans verify on Force 3's fixed-shape
    forward run eagerly, what CUDA captures as graphs by default, so that the dry run takes that path too."""
    if device.type == "cuda" or extra.get("policy") != "fixed":
        return extra
    return {"force3_compile": "fixed", **extra}


def _tier_ms(stats) -> dict:
    """Mean ms of one forward of each tier that ran (Force 1 per drafted token, Force 2/3 per verification)."""
    counts = {"force1": stats.detail.force1_proposed, "force2": stats.detail.force2_steps, "force3": stats.force3_steps}
    return {tier: round(getattr(stats, f"{tier}_seconds") / n * 1e3, 3) for tier, n in counts.items() if n}


def _library_rows(plan: Plan, dtype: torch.dtype, device: torch.device) -> list[dict]:
    model = build(plan.library_model, dtype, device)
    with torch.no_grad():  # peaked logits: argmax margins far above either dtype's rounding
        model.lm_head.weight.mul_(8.0)
    model.generation_config.pad_token_id = 0
    # random tokens whose second half repeats the first: lookup and retrieval have something to find
    half = torch.randint(0, model.config.vocab_size, (1, plan.library_context // 2),
                         generator=torch.Generator().manual_seed(5))
    ids = torch.cat((half, half), dim=1).to(device)
    kwargs = dict(max_new_tokens=plan.new_tokens, min_new_tokens=plan.new_tokens, do_sample=False)
    # one prefill of every prompt token but the last, shared: each method decodes from its copy of it (made before
    # the clock; TriForce's own copy, `prefix_copy_seconds`, is subtracted), so tok/s is decoding's
    prefix = prefill_prefix(model, ids)
    configs = {name: TriForceConfig(retrieval_budget=plan.budget, window=plan.window, gamma1=plan.gamma1,
                                    gamma2=plan.gamma2, **_on_device(extra, device))
               for name, extra in LIBRARY_CONFIGS.items()}
    methods = {"plain": lambda: {"cache": copy.deepcopy(prefix)},
               "static": lambda: {"cache": static_copy(model, prefix, ids.shape[1] + plan.new_tokens + 16),
                                  "disable_compile": True}}
    for name, config in configs.items():
        methods[name] = lambda config=config: {"cache": prefix, "triforce_config": config,
                                               "return_dict_in_generate": True}
    results = {}
    for name, arguments in methods.items():
        # warm-up: the same call (kernels, the lean/route probes, graphs of the timed call's shapes)
        model.generate(ids, **kwargs, **arguments())
        given = arguments()
        _sync(device)
        start = time.perf_counter()
        out = model.generate(ids, **kwargs, **given)
        _sync(device)
        stats = getattr(out, "triforce_stats", None)
        seconds = time.perf_counter() - start - (stats.detail.prefix_copy_seconds if stats is not None else 0.0)
        sequences = out.sequences if hasattr(out, "sequences") else out
        results[name] = (seconds, sequences[0, ids.shape[1]:].tolist(), stats)
    plain = results["plain"][1]
    rows = []
    for name, config in configs.items():
        seconds, tokens, stats = results[name]
        syncs = count_syncs(device, model.generate, ids, **kwargs, cache=prefix, triforce_config=config)
        row = {"model": plan.library_model, "dtype": str(dtype).removeprefix("torch."), "context": ids.shape[1],
               "new_tokens": plan.new_tokens, "config": name, "host_syncs_per_call": syncs,
               "tier_ms": _tier_ms(stats), "stats": stats.to_dict(),
               "force3_forward": stats.detail.tier_forwards.get("force3", "-"),
               "triforce_tok_s": plan.new_tokens / seconds, "triforce_identical": tokens == plain,
               "triforce_agree": next((i for i, (a, b) in enumerate(zip(tokens, plain)) if a != b), len(plain))}
        for base in ("plain", "static"):
            row[f"{base}_tok_s"] = plan.new_tokens / results[base][0]
        row["static_identical"] = results["static"][1] == plain
        rows.append(row)
    return rows


def hf_static(plan: Plan, device: torch.device, stage: Stage) -> None:
    """transformers' own best plain decoding on the target shape: static-cache `generate` with its automatic
    compile (CUDA graphs), ms per decoded token from two timed calls that differ only in their token count."""
    model = build(plan.target, plan.dtype, device)
    model.generation_config.pad_token_id = 0
    context = plan.contexts[0]
    ids = torch.randint(0, model.config.vocab_size, (1, context), generator=torch.Generator().manual_seed(9))
    ids = ids.to(device)
    kwargs = dict(do_sample=False, cache_implementation="static")
    start = time.perf_counter()
    model.generate(ids, max_new_tokens=65, min_new_tokens=65, **kwargs)  # compiles
    first = time.perf_counter() - start
    seconds = {}
    for tokens in (1, 65):
        _sync(device)
        start = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, **kwargs)
        _sync(device)
        seconds[tokens] = time.perf_counter() - start
    row = {"model": plan.target, "context": context, "first_call_s": first,
           "ms_per_token": (seconds[65] - seconds[1]) / 64 * 1e3}
    stage.data.setdefault("hf_static", []).append(row)
    log(f"  hf static compiled {plan.target} at {context}: {row['ms_per_token']:.3f} ms/token "
        f"(first call {first:.0f} s)")
    stage.save()


def count_syncs(device: torch.device, call: Callable, *args, **kwargs) -> int | None:
    """Host synchronisations of one call (CUDA's sync debug mode warns at each); None off CUDA."""
    if device.type != "cuda":
        return None
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call(*args, **kwargs)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


# -- the table -------------------------------------------------------------------------------------------------------
def render(data: dict) -> str:
    meta = data["meta"]
    lines = [f"# GPU check — {meta['device']} ({meta['date']})", "",
             f"torch {meta['torch']}, transformers {meta['transformers']}, hf_triforce {meta['hf_triforce']}; "
             f"target {meta['target']}, draft {meta['draft']}, {meta['dtype']}, random weights; budget "
             f"{meta['budget']}, chunk {meta['chunk_size']}, sink+window {meta['sink']}+{meta['window']}, gamma1 "
             f"{meta['gamma1']}, gamma2 {meta['gamma2']}.", ""]
    tiers = data["tiers"]
    statics = {r["context"]: r for r in tiers if r["tier"] == "static"}
    if tiers:
        lines += ["## Tier forwards (ms; graphed = one CUDA graph replay, eager = the same forward launched op by "
                  "op; x static = graphed over graphed static decoding at that context)", "",
                  "| tier | context | rows | KV length | attention | graphed ms | eager ms | x static |",
                  "|---|---|---|---|---|---|---|---|"]
        for r in tiers:
            refs = [statics[c] for c in ([r["context"]] if r["context"] else sorted(statics))]
            ratio = ", ".join(f"{r['graphed_ms'] / s['graphed_ms']:.2f}" for s in refs
                              if r["graphed_ms"] and s["graphed_ms"])
            graphed = "-" if r["graphed_ms"] is None else f"{r['graphed_ms']:.3f}"
            lines.append(f"| {r['tier']} | {r['context'] or 'any'} | {r['rows']} | {r['length']} | {r['route']} | "
                         f"{graphed} | {r['eager_ms']:.3f} | {ratio or '-'} |")
        lines.append("")
        if "target_weight_bytes" in meta:
            for context, r in sorted(statics.items()):
                if r["graphed_ms"]:
                    read = meta["target_weight_bytes"] + meta["target_kv_bytes_per_token"] * r["length"]
                    lines.append(f"Graphed static decoding at {context}: {read / 1e9:.1f} GB read per step, "
                                 f"{read / r['graphed_ms'] / 1e6:.0f} GB/s.")
            lines.append("")
        lines.append("x static of the context-free tiers (force2, draft:self, draft:draft): one ratio per context "
                     "in increasing order.")
        lines.append("")
    if data["projection"]:
        lines += [f"## Projection (measured tier costs, acceptance assumed: {meta['acceptance']})", "",
                  "| context | plan kind | best gammas | tokens/step | ms/step | tokens/s | vs graphed static |",
                  "|---|---|---|---|---|---|---|"]
        for p in data["projection"]:
            lines.append(f"| {p['context']} | {p['label']} | {p['plan']} | {p['tokens_per_step']:.2f} | "
                         f"{p['seconds_per_step'] * 1e3:.2f} | {p['tokens_per_second']:.1f} | {p['speedup']:.2f}x |")
        lines.append("")
    if data["library"]:
        lines += ["## The library end to end (TriForceConfig(), greedy, scaled output layer, decode tok/s from a "
                  "shared prefill)", "",
                  "| model | dtype | context | config | plain tok/s | static tok/s | TriForce tok/s | identical "
                  "(agree) | ms per forward | Force 3 | host syncs per call | forwards |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in data["library"]:
            detail = (r["stats"] or {}).get("detail", {})
            lines.append(f"| {r['model']} | {r['dtype']} | {r['context']} | {r.get('config', 'auto')} | "
                         f"{r['plain_tok_s']:.1f} | {r['static_tok_s']:.1f} | {r['triforce_tok_s']:.1f} | "
                         f"{r['triforce_identical']} ({r['triforce_agree']}/{r['new_tokens']}) | "
                         f"{r.get('tier_ms', '-')} | {r.get('force3_forward', '-')} | {r['host_syncs_per_call']} | "
                         f"{detail.get('draft_precision', '-')}, {detail.get('tier_forwards', '-')}, tier_compile "
                         f"{(detail.get('tier_compile') or {}).get('mode', 'off')} |")
        lines.append("")
    for r in data.get("hf_static", []):
        lines.append(f"transformers' static-cache `generate`, compiled, {r['model']} at {r['context']}: "
                     f"{r['ms_per_token']:.3f} ms per token (first call, compile included: {r['first_call_s']:.0f} s).")
        lines.append("")
    for error in data["errors"]:
        lines.append(f"- **{error['stage']} failed**: {error['error']}")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-check-out"))
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on this machine's device (CPU)")
    parser.add_argument("--deadline-s", type=float, default=300.0, help="stop starting new timings after this")
    parser.add_argument("--stages", default="tiers,projection,library")
    for name, value, meaning in (("force3", 0.9, "Force 2 -> Force 3"), ("force2", 0.6, "Force 1 (self) -> Force 2"),
                                 ("streaming", 0.6, "the target on sink+window -> Force 3"),
                                 ("draft", 0.6, "the draft model -> the target")):
        parser.add_argument(f"--accept-{name}", type=float, default=value, help=f"acceptance {meaning}")
    parser.add_argument("--target", choices=SHAPES, help=f"the target's shape (default {GPU_PLAN.target})")
    parser.add_argument("--draft", choices=SHAPES, help=f"the draft's shape (default {GPU_PLAN.draft})")
    parser.add_argument("--contexts", type=int, nargs="+", help=f"full-cache contexts (default {GPU_PLAN.contexts})")
    parser.add_argument("--from-json", type=Path, help="project a measured run's gpu_check.json again (with "
                        "--stages projection and other --accept-* rates); runs nothing")
    args = parser.parse_args(argv)
    deadline = time.monotonic() + args.deadline_s
    plan = DRY_PLAN if args.dry_run else GPU_PLAN
    chosen = {"target": args.target, "draft": args.draft, "contexts": args.contexts and tuple(args.contexts)}
    plan = replace(plan, **{k: v for k, v in chosen.items() if v})
    device = torch.device("cuda" if torch.cuda.is_available() and not args.dry_run else "cpu")
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        warm = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
        for _ in range(200):  # a few seconds of work: the clocks leave their idle state before anything is timed
            warm @ warm
        torch.cuda.synchronize(device)
        del warm
    args.out.mkdir(parents=True, exist_ok=True)
    acceptance = {k: getattr(args, f"accept_{k}") for k in ("force3", "force2", "streaming", "draft")}
    meta = {"device": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
            "date": time.strftime("%Y-%m-%d"), "torch": torch.__version__, "transformers": transformers.__version__,
            "hf_triforce": hf_triforce.__version__, "python": sys.version.split()[0], "target": plan.target,
            "draft": plan.draft, "dtype": str(plan.dtype).removeprefix("torch."), "acceptance": acceptance,
            **{k: getattr(plan, k) for k in ("budget", "chunk_size", "sink", "window", "gamma1", "gamma2")}}
    stage = Stage(args.out, meta)
    if args.from_json:  # a measured run's tier costs, projected again under other acceptance rates
        measured = json.loads(args.from_json.read_text())
        stage.data["meta"] = {**measured["meta"], "acceptance": acceptance}
        stage.data["tiers"] = measured["tiers"]
        plan = replace(plan, contexts=tuple(sorted({r["context"] for r in measured["tiers"] if r["context"]})),
                       **{k: measured["meta"][k] for k in ("budget", "chunk_size", "sink", "window", "gamma1",
                                                             "gamma2")})
    stages = {"tiers": lambda: measure_tiers(plan, device, stage, deadline),
              "projection": lambda: project(plan, stage, acceptance),
              "library": lambda: library_check(plan, device, stage),
              "hf_static": lambda: hf_static(plan, device, stage)}
    for name in args.stages.split(","):
        log(f"== {name}")
        try:
            stages[name]()
        except Exception as error:  # recorded in the table; the next stage still runs
            traceback.print_exc()
            stage.data["errors"].append({"stage": name, "error": f"{type(error).__name__}: {error}"[:400]})
        if device.type == "cuda":
            torch.cuda.empty_cache()
        stage.save()
    print((args.out / "gpu_table.md").read_text())
    return 1 if stage.data["errors"] else 0


if __name__ == "__main__":
    sys.exit(main())
