"""GPU check: plain, static-cache and TriForce decoding of random-weight models of real shapes on CUDA.

No weights can reach the lent GPU machine (no network), so the models are built from configs with random
weights: a Llama with SmolLM2-135M's shape and a Qwen2 with Qwen2.5-1.5B's shape, in bf16 and fp32, with
``max_position_embeddings`` 131072. Random weights make acceptance meaningless as a quality figure (real
text and trained weights decide it); what this measures is the *cost* of each tier on the GPU, the decode
speed of each method at long contexts, and whether greedy TriForce output is identical to plain
``generate`` (it must be in fp32; bf16 reports how many leading tokens agree).

Per (shape, dtype, context), one prefill of every prompt token but the last is shared: plain ``generate``
gets a deep copy (``cache=``), the static-cache run a `StaticCache` copy of it, TriForce the prefix itself
(read-only by contract; checked). Decode tok/s = new tokens / seconds of the whole ``generate`` call
(which then prefills only the last prompt token). Configurations run in priority order against a
deadline; the table and JSON are rewritten after each one, so a timeout keeps what finished.

    python benchmarks/gpu_check.py --out gpu-out                # the CUDA run (see docs/gpu_check.md)
    python benchmarks/gpu_check.py --tiny --out /tmp/gpu-tiny    # seconds on a CPU: checks the script runs
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch
import transformers
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

import hf_triforce
from hf_triforce import TriForceConfig
from hf_triforce.tools.bench import static_copy

MAX_POSITIONS = 131072
NO_SPECIAL = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
SHAPES = {
    "smollm2-135m": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536,
        vocab_size=49152, rope_theta=100000.0, tie_word_embeddings=True, max_position_embeddings=MAX_POSITIONS)),
    "qwen2.5-1.5b": (Qwen2Config, Qwen2ForCausalLM, dict(
        hidden_size=1536, num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
        intermediate_size=8960, vocab_size=151936, rope_theta=1000000.0, tie_word_embeddings=True,
        max_position_embeddings=MAX_POSITIONS)),
    "tiny": (LlamaConfig, LlamaForCausalLM, dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        vocab_size=512, max_position_embeddings=4096)),
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# triforce-self / -ngram: a fixed three-level plan (each tier's cost on the GPU); triforce-auto: the adaptive
# policy (the library default), which falls back to plain decoding where speculation does not pay.
METHODS = ("plain", "static", "triforce-self", "triforce-ngram", "triforce-auto")
LONGEST = MAX_POSITIONS - 256  # "128k": leaves room for the new tokens inside max_position_embeddings

# Priority order: what must come back first. (shape, dtype, context)
GPU_PLAN = [
    ("smollm2-135m", "bf16", 32768),
    ("smollm2-135m", "fp32", 32768),
    ("qwen2.5-1.5b", "bf16", 32768),
    ("qwen2.5-1.5b", "fp32", 32768),
    ("smollm2-135m", "bf16", LONGEST),
    ("qwen2.5-1.5b", "bf16", LONGEST),
    ("smollm2-135m", "fp32", LONGEST),
    ("smollm2-135m", "bf16", 65536),
    ("qwen2.5-1.5b", "bf16", 65536),
    ("qwen2.5-1.5b", "fp32", 65536),
]
TINY_PLAN = [("tiny", "fp32", 512), ("tiny", "bf16", 512)]


def log(*args) -> None:
    print(*args, flush=True)


def triforce_config(name: str, tiny: bool) -> TriForceConfig:
    draft, policy = ("self", "auto") if name == "auto" else (name, "fixed")
    if tiny:  # budget below the 512-token context, so retrieval really selects chunks
        return TriForceConfig(draft=draft, retrieval_budget=128, chunk_size=8, sink_tokens=16, window=64, gamma1=2,
                              gamma2=6, policy=policy)
    return TriForceConfig(draft=draft, retrieval_budget=4096, chunk_size=8, sink_tokens=16, window=256, gamma1=2,
                          gamma2=6, policy=policy)


def build_model(shape: str, dtype: torch.dtype, device: torch.device):
    config_cls, model_cls, kwargs = SHAPES[shape]
    config = config_cls(**kwargs, **NO_SPECIAL)
    torch.manual_seed(0)
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype).eval()


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def prompt_ids(vocab: int, length: int, device: torch.device) -> torch.Tensor:
    """Random tokens whose second half repeats the first (so n-gram lookup has something to find)."""
    generator = torch.Generator().manual_seed(1)
    half = torch.randint(0, vocab, (1, (length + 1) // 2), generator=generator)
    return torch.cat((half, half), dim=1)[:, :length].to(device)


@torch.no_grad()
def prefill(model, ids: torch.Tensor, chunk: int) -> DynamicCache:
    cache = DynamicCache(config=model.config)
    for begin in range(0, ids.shape[1], chunk):
        piece = ids[:, begin : begin + chunk]
        positions = torch.arange(begin, begin + piece.shape[1], device=ids.device)[None]
        model(input_ids=piece, cache=cache, position_ids=positions, use_cache=True, logits_to_keep=1)
    return cache


def kv_bytes(model, tokens: int) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * tokens * elem


def run_method(model, method: str, ids: torch.Tensor, prefix: DynamicCache, new_tokens: int, tiny: bool,
               compile_static: bool = False):
    """One timed ``generate``; returns (sequences, seconds, stats dict or None)."""
    kwargs = dict(max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                  return_dict_in_generate=True)
    if method == "plain":
        kwargs["cache"] = copy.deepcopy(prefix)
    elif method in ("static", "static-compiled"):
        kwargs["cache"] = static_copy(model, prefix, ids.shape[1] + new_tokens + 16)
        kwargs["disable_compile"] = not compile_static
    elif method.startswith("triforce-"):
        kwargs["cache"] = prefix
        kwargs["triforce_config"] = triforce_config(method.removeprefix("triforce-"), tiny)
    else:
        raise ValueError(method)
    sync(ids.device)
    start = time.perf_counter()
    out = model.generate(ids, **kwargs)
    sync(ids.device)
    seconds = time.perf_counter() - start
    stats = getattr(out, "triforce_stats", None)
    return out.sequences, seconds, (stats.to_dict() if stats is not None else None)


def leading_identical(a: torch.Tensor, b: torch.Tensor, start: int) -> int:
    x, y = a[0, start:].tolist(), b[0, start:].tolist()
    n = 0
    for u, v in zip(x, y):
        if u != v:
            break
        n += 1
    return n


def measure(model, shape: str, dtype_name: str, context: int, args, device: torch.device,
            methods=METHODS) -> list[dict]:
    """Every method on one shared prefill; one row per method."""
    vocab = model.config.vocab_size
    ids = prompt_ids(vocab, context, device)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    sync(device)
    start = time.perf_counter()
    prefix = prefill(model, ids[:, :-1], args.prefill_chunk)
    sync(device)
    prefill_s = time.perf_counter() - start
    cached = int(prefix.get_seq_length())
    log(f"  prefill {context} tokens: {prefill_s:.2f} s")
    rows, reference = [], None
    for method in methods:
        row = dict(model=shape, dtype=dtype_name, context=context, method=method, prefill_s=prefill_s,
                   new_tokens=args.new_tokens)
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
            times, sequences, stats = [], None, None
            for _ in range(args.repeats):
                sequences, seconds, stats = run_method(model, method, ids, prefix, args.new_tokens, args.tiny)
                times.append(seconds)
            generated = sequences.shape[1] - ids.shape[1]
            row.update(seconds=statistics.median(times), all_seconds=times, generated=generated,
                       tok_s=generated / statistics.median(times))
            if device.type == "cuda":
                row["peak_gib"] = torch.cuda.max_memory_allocated(device) / 2**30
            if stats is not None:
                row["stats"] = stats
            if int(prefix.get_seq_length()) != cached:
                row["error"] = f"cache= was modified: {cached} -> {int(prefix.get_seq_length())} tokens"
            if method == "plain":
                reference = sequences
            if reference is not None:
                same = leading_identical(sequences, reference, ids.shape[1])
                row["identical_leading"] = same
                row["identical"] = same == generated == reference.shape[1] - ids.shape[1]
            tiers = ""
            if stats:
                tiers = (f" F2 acc {stats.get('force2_acceptance', float('nan')):.2f}"
                         f" F3 acc {stats.get('force3_acceptance', float('nan')):.2f}"
                         f" tok/F3 {stats.get('tokens_per_force3_step', float('nan')):.2f}"
                         f" s F1/F2/F3 {stats.get('force1_seconds', 0):.2f}/{stats.get('force2_seconds', 0):.2f}"
                         f"/{stats.get('force3_seconds', 0):.2f}")
            log(f"  {method:15s} {row['tok_s']:8.2f} tok/s  identical {row.get('identical_leading')}/{generated}"
                f"{tiers}")
        except torch.OutOfMemoryError as error:
            row["error"] = f"OOM: {str(error).splitlines()[0][:160]}"
            log(f"  {method}: {row['error']}")
        except Exception as error:  # noqa: BLE001 - one failing method must not hide the others
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
            log(f"  {method}: {row['error']}")
            traceback.print_exc()
        rows.append(row)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    del prefix
    add_ratios(rows)
    return rows


def add_ratios(rows: list[dict]) -> None:
    base = {r["method"]: r.get("tok_s") for r in rows}
    for row in rows:
        if row.get("tok_s"):
            if base.get("plain"):
                row["vs_plain"] = row["tok_s"] / base["plain"]
            if base.get("static"):
                row["vs_static"] = row["tok_s"] / base["static"]


def fmt(value, spec=".2f", missing="-") -> str:
    if value is None:
        return missing
    try:
        if value != value:  # NaN
            return missing
    except TypeError:
        pass
    return format(value, spec)


def context_label(context: int) -> str:
    return f"{context // 1024}k" if context >= 1024 else str(context)


def table(rows: list[dict]) -> str:
    lines = [
        "| model | method | dtype | context | prefill s | decode tok/s | vs plain | vs static | F2 acc | F3 acc"
        " | tokens/F3 step | identical | F1/F2/F3 s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        stats = r.get("stats") or {}
        if "error" in r and "tok_s" not in r:
            lines.append(f"| {r['model']} | {r['method']} | {r['dtype']} | {context_label(r['context'])} | "
                         f"{fmt(r.get('prefill_s'))} | {r['error'][:80]} | | | | | | | |")
            continue
        if r["method"] == "plain":
            same = "(reference)"
        elif r.get("identical"):
            same = "yes"
        else:
            same = f"{r.get('identical_leading', '?')}/{r.get('generated', '?')}"
        if r.get("error"):
            same += f" ({r['error'][:60]})"
        tiers = "/".join(fmt(stats.get(f"force{i}_seconds")) for i in (1, 2, 3)) if stats else "-"
        lines.append(
            f"| {r['model']} | {r['method']} | {r['dtype']} | {context_label(r['context'])} | {fmt(r.get('prefill_s'))}"
            f" | {fmt(r.get('tok_s'))} | {fmt(r.get('vs_plain'))}x | {fmt(r.get('vs_static'))}x"
            f" | {fmt(stats.get('force2_acceptance'))} | {fmt(stats.get('force3_acceptance'))}"
            f" | {fmt(stats.get('tokens_per_force3_step'))} | {same} | {tiers} |"
        )
    return "\n".join(lines) + "\n"


def environment(device: torch.device) -> dict:
    env = dict(python=platform.python_version(), torch=torch.__version__, transformers=transformers.__version__,
               hf_triforce=getattr(hf_triforce, "__version__", "?"), device=str(device),
               float32_matmul_precision=torch.get_float32_matmul_precision())
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_memory_gib=round(props.total_memory / 2**30, 1), cuda=torch.version.cuda,
                   capability=".".join(map(str, torch.cuda.get_device_capability(device))))
    return env


def write(out: Path | None, env: dict, rows: list[dict], skipped: list[str], extras: list[dict],
          trees: list[dict] | None = None, routes: list[dict] | None = None) -> None:
    text = table(rows + extras)
    if trees:
        text += "\nTree verification cost (issue 12: 32 rows for at most 1.3x a decode):\n\n" + tree_cost_table(trees)
    if routes:
        text += "\nAttention routes, one layer (issue 24: GPU attention without flash-attn):\n\n" + routes_table(routes)
    if skipped:
        text += "\nSkipped (deadline or memory): " + "; ".join(skipped) + "\n"
    text += ("\nRandom weights: acceptance and tokens/F3 step measure nothing about real text; decode tok/s and"
             " the identity column are what this table is for. Environment: "
             + ", ".join(f"{k} {v}" for k, v in env.items()) + "\n")
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "gpu_table.md").write_text(text)
        (out / "gpu_check.json").write_text(json.dumps(
            dict(environment=env, rows=rows, extras=extras, skipped=skipped, tree_costs=trees or [],
                 attention_routes=routes or []), indent=1,
            default=str))


def warm_up(model, device: torch.device, args) -> None:
    """Every method once on a short prompt: kernel selection, cuBLAS handles, allocator growth."""
    length = 256 if args.tiny else 8192  # above the 4096 budget: retrieval runs
    ids = prompt_ids(model.config.vocab_size, length, device)
    prefix = prefill(model, ids[:, :-1], args.prefill_chunk)
    for method in METHODS:
        try:
            run_method(model, method, ids, prefix, 8, args.tiny)
        except Exception as error:  # noqa: BLE001 - reported again by the measured run
            log(f"  warm-up {method}: {type(error).__name__}: {error}")


def fits(model, context: int, device: torch.device, new_tokens: int) -> tuple[bool, str]:
    if device.type != "cuda":
        return True, ""
    free, _ = torch.cuda.mem_get_info(device)
    # prefix + one method's copy (plain/static/TriForce's full cache) + TriForce's smaller caches, plus the
    # prefill chunk's activations and mask: a generous 4 KV copies and 8 GiB.
    need = 4 * kv_bytes(model, context + new_tokens + 16) + 8 * 2**30
    return need < free, f"needs ~{need / 2**30:.1f} GiB, {free / 2**30:.1f} GiB free"


def bnb_extra(args, device: torch.device) -> list[dict]:
    """bitsandbytes 4-bit target (smollm2 shape, 4k context): does TriForce run on quantized linears?"""
    try:
        import bitsandbytes  # noqa: F401
        from transformers import BitsAndBytesConfig
    except Exception as error:  # noqa: BLE001
        log(f"bitsandbytes: not importable ({type(error).__name__}: {error}); skipped")
        return []
    log(f"bitsandbytes {bitsandbytes.__version__}: 4-bit target, smollm2 shape")
    with tempfile.TemporaryDirectory() as folder:
        build_model("smollm2-135m", torch.float32, torch.device("cpu")).save_pretrained(folder)
        model = LlamaForCausalLM.from_pretrained(
            folder, device_map={"": device.index or 0},
            quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=torch.bfloat16))
    model.eval()
    warm_up(model, device, args)
    rows = measure(model, "smollm2-135m", "bnb-4bit", 4096, args, device)
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def tree_costs(args, device: torch.device) -> list[dict]:
    """Issue 12's premise on this device: seconds of a one-token decode, a 6-proposal chain and a 31-node tree
    (32 rows) through TriForce's attention on a full cache of random entries (`tree_verify_cost.py`), per dtype."""
    from tree_verify_cost import branches_tree, fill, timed  # this folder (run as benchmarks/gpu_check.py)

    from hf_triforce.caches import BufferCache
    from hf_triforce.integration import recording_attention

    shape, context = ("tiny", 512) if args.tiny else ("smollm2-135m", 32768)
    rows = []
    for dtype_name in ("bf16", "fp32"):
        model = build_model(shape, DTYPES[dtype_name], device)
        cache = BufferCache(model.config.num_hidden_layers, context + 40)
        fill(model, cache, context)
        with recording_attention(model):
            decode = timed(model, cache, context, None, 1, 3)
            chain = timed(model, cache, context, None, 7, 3)
            tree = timed(model, cache, context, branches_tree(31, 4), 0, 3)
        rows.append(dict(model=shape, dtype=dtype_name, context=context, decode_ms=1e3 * decode, chain6_ms=1e3 * chain,
                         tree31_ms=1e3 * tree, chain_vs_decode=chain / decode, tree_vs_decode=tree / decode))
        log(f"  tree cost {shape} {dtype_name} {context_label(context)}: decode {1e3 * decode:.1f} ms, chain of 6 "
            f"{chain / decode:.2f}x, tree of 31 nodes {tree / decode:.2f}x")
        del model, cache
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return rows


def tree_cost_table(rows: list[dict]) -> str:
    lines = ["| model | dtype | context | decode ms | chain of 6 ms | vs decode | tree of 31 nodes ms | vs decode |",
             "|---|---|---|---|---|---|---|---|"]
    lines += [f"| {r['model']} | {r['dtype']} | {context_label(r['context'])} | {r['decode_ms']:.1f} | "
              f"{r['chain6_ms']:.1f} | {r['chain_vs_decode']:.2f}x | {r['tree31_ms']:.1f} | "
              f"{r['tree_vs_decode']:.2f}x |" for r in rows]
    return "\n".join(lines) + "\n"


def attention_routes(args, device: torch.device) -> list[dict]:
    """Each fused attention route against today's masked path, on one layer's shapes (SmolLM2: 9 heads, 3 KV heads,
    head dim 64) over a 32k cache of random entries: Force 3's verification (7 rows, bottom-right causal) and a
    31-node tree (32 rows: prefix and fp32 block merged by log-sum-exp, or one FlexAttention call). Per route:
    the first call (a FlexAttention compile included), the mean of the timed calls (FlexAttention's block mask
    cached, as the layers of one forward share it; its build is timed apart), and the largest error against the
    fp32 masked reference. Entries run in priority order until ``args.routes_budget_s`` is spent."""
    from tree_verify_cost import branches_tree  # this folder (run as benchmarks/gpu_check.py)

    from hf_triforce.kernels import attention, native_attention
    from hf_triforce.kernels.tree_attention import block_visibility, tree_sdpa

    context, heads, kv_heads, dim, q_len = (512, 4, 2, 16, 7) if args.tiny else (32768, 9, 3, 64, 7)
    module = torch.nn.Module().eval()
    visible = block_visibility(1, branches_tree(31, 4), device)
    m = visible.shape[0]
    generator = torch.Generator(device=device).manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device=device, generator=generator) * 0.5

    keys32, values32 = randn(1, kv_heads, context + m, dim), randn(1, kv_heads, context + m, dim)
    query32, tree_query32 = randn(1, heads, q_len, dim), randn(1, heads, m, dim)
    kv_len = context + q_len
    mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=device).tril(kv_len - q_len)[None, None]
    with torch.no_grad(), native_attention.force_route("sdpa"):
        reference = attention.gqa_sdpa(module, query32, keys32[:, :, :kv_len], values32[:, :, :kv_len], mask,
                                       scaling=dim**-0.5)[0]
        tree_reference = tree_sdpa(module, tree_query32, keys32, values32, visible, scaling=dim**-0.5)[0]
    has_varlen = native_attention.varlen_function() is not None and device.type == "cuda"
    has_flash = attention._flash_attn_varlen_func() is not None and device.type == "cuda"
    plan = []
    for dtype_name in ("bf16", "fp32"):
        low = dtype_name == "bf16"
        for kind in ("verify", "tree"):
            routes = ["sdpa"] + ["flash_attn"] * (low and has_flash) + ["varlen"] * (low and has_varlen) + ["flex"]
            plan += [(dtype_name, kind, route) for route in routes + ["flex_tree"] * (kind == "tree")]
    start, rows = time.perf_counter(), []
    for dtype_name, kind, route in plan:
        row = dict(dtype=dtype_name, kind=kind, route=route, context=context, rows=q_len if kind == "verify" else m)
        if time.perf_counter() - start > args.routes_budget_s:
            row["error"] = "skipped: routes budget spent"
            rows.append(row)
            continue
        dtype = DTYPES[dtype_name]
        keys, values = keys32.to(dtype), values32.to(dtype)
        if kind == "verify":
            query, expected = query32.to(dtype), reference
            k, v = keys[:, :, :kv_len], values[:, :, :kv_len]
            functions = dict(sdpa=attention.gqa_sdpa, flash_attn=attention.flash_verify,
                             varlen=native_attention.varlen_verify, flex=native_attention.flex_verify)

            def call(query=query, k=k, v=v, fn=functions[route]):
                return fn(module, query, k, v, mask, scaling=dim**-0.5)[0]
        else:
            query, expected = tree_query32.to(dtype), tree_reference

            def call(query=query, keys=keys, values=values):
                return tree_sdpa(module, query, keys, values, visible, scaling=dim**-0.5)[0]
        try:
            with torch.no_grad(), native_attention.force_route(route):
                sync(device)
                first = time.perf_counter()
                out = call()
                sync(device)
                row["first_call_s"] = time.perf_counter() - first
                repeats = 3 if args.tiny else 20
                begin = time.perf_counter()
                for _ in range(repeats):
                    out = call()
                sync(device)
            row["ms"] = 1e3 * (time.perf_counter() - begin) / repeats
            row["max_error"] = (out.float() - expected).abs().max().item()
            if route in ("flex", "flex_tree") and (kind, route) != ("tree", "flex"):  # the prefix has no mask
                sync(device)
                begin = time.perf_counter()
                if kind == "verify":  # built once per forward, shared by its layers: not in the per-call time
                    native_attention._causal_block_mask.__wrapped__(q_len, heads // kv_heads, kv_len, device)
                else:
                    native_attention._build_tree_block_mask(visible, heads // kv_heads, context, device)
                sync(device)
                row["mask_ms"] = 1e3 * (time.perf_counter() - begin)
        except Exception as error:  # noqa: BLE001 - one failing route must not hide the others
            row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        base = next((r for r in rows if r["dtype"] == dtype_name and r["kind"] == kind and r["route"] == "sdpa"), None)
        if base and base.get("ms") and row.get("ms"):
            row["vs_sdpa"] = base["ms"] / row["ms"]
        elif route == "sdpa" and row.get("ms"):
            row["vs_sdpa"] = 1.0
        rows.append(row)
        log(f"  attention {dtype_name} {kind} {route}: " + (row.get("error") or
            f"{row['ms']:.3f} ms (first call {row['first_call_s']:.2f} s), {row.get('vs_sdpa', 1.0):.2f}x masked, "
            f"max error {row['max_error']:.2e}"))
    del keys32, values32
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rows


def routes_table(rows: list[dict]) -> str:
    lines = ["| dtype | call | rows | context | route | ms | vs masked SDPA | first call s"
             " | block mask ms (per forward) | max error vs fp32 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "ms" not in r:
            lines.append(f"| {r['dtype']} | {r['kind']} | {r['rows']} | {context_label(r['context'])} | {r['route']} |"
                         f" {r.get('error', '')[:80]} | | | | |")
            continue
        lines.append(f"| {r['dtype']} | {r['kind']} | {r['rows']} | {context_label(r['context'])} | {r['route']} | "
                     f"{r['ms']:.3f} | {fmt(r.get('vs_sdpa'))}x | {r['first_call_s']:.2f} | {fmt(r.get('mask_ms'))} | "
                     f"{r['max_error']:.1e} |")
    return "\n".join(lines) + "\n"


def compiled_static_extra(args, device: torch.device) -> list[dict]:
    """transformers' own best plain decoding: StaticCache + its auto-compile (smollm2 bf16, 32k)."""
    model = build_model("smollm2-135m", torch.bfloat16, device)
    context = 32768
    ids = prompt_ids(model.config.vocab_size, context, device)
    prefix = prefill(model, ids[:, :-1], args.prefill_chunk)
    row = dict(model="smollm2-135m", dtype="bf16", context=context, method="static-compiled",
               new_tokens=args.new_tokens)
    try:
        _, compile_s, _ = run_method(model, "static", ids, prefix, args.new_tokens, args.tiny, compile_static=True)
        sequences, seconds, _ = run_method(model, "static", ids, prefix, args.new_tokens, args.tiny,
                                           compile_static=True)
        plain, _, _ = run_method(model, "plain", ids, prefix, args.new_tokens, args.tiny)
        generated = sequences.shape[1] - ids.shape[1]
        same = leading_identical(sequences, plain, ids.shape[1])
        row.update(first_call_s=compile_s, seconds=seconds, generated=generated, tok_s=generated / seconds,
                   identical_leading=same, identical=same == generated)
        log(f"  static-compiled: first call {compile_s:.1f} s, then {row['tok_s']:.2f} tok/s")
    except Exception as error:  # noqa: BLE001
        row["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:200] if str(error) else ''}"
        log(f"  static-compiled: {row['error']}")
    del model, prefix
    gc.collect()
    torch.cuda.empty_cache()
    return [row]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tiny", action="store_true", help="2-layer 64-hidden model, 512 context, on the CPU")
    parser.add_argument("--out", type=Path, default=Path(os.environ["OUT"]) if os.environ.get("OUT") else None,
                        help="folder for gpu_table.md and gpu_check.json (default: $OUT if set)")
    parser.add_argument("--new-tokens", type=int, default=None,
                        help="new tokens per run (64: random-weight TriForce runs many forwards per token; tiny: 16)")
    parser.add_argument("--repeats", type=int, default=1, help="timed runs per method (median)")
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    parser.add_argument("--deadline-s", type=float, default=300.0,
                        help="start no configuration that would likely end after this many seconds")
    parser.add_argument("--only", default=None, help="comma-separated shapes to run (default: all in the plan)")
    parser.add_argument("--no-extras", action="store_true", help="skip the bitsandbytes and compiled-static rows")
    parser.add_argument("--routes-budget-s", type=float, default=20.0,
                        help="seconds for the attention-route timings (compiles included); later entries are skipped")
    args = parser.parse_args(argv)
    args.new_tokens = args.new_tokens or (16 if args.tiny else 64)
    t0 = time.perf_counter()

    if args.tiny:
        device, plan = torch.device("cpu"), TINY_PLAN
    else:
        if not torch.cuda.is_available():
            log("no CUDA device (use --tiny for the CPU smoke run)")
            return 2
        device, plan = torch.device("cuda", 0), GPU_PLAN
        torch.set_float32_matmul_precision("highest")  # fp32 rows are true fp32 (no TF32)
    if args.only:
        keep = set(args.only.split(","))
        plan = [p for p in plan if p[0] in keep]
    env = environment(device)
    log("environment: " + json.dumps(env))

    rows: list[dict] = []
    extras: list[dict] = []
    skipped: list[str] = []
    trees: list[dict] = []
    try:  # first: seconds, no prefill, and it answers whether tree verification is almost free on this device
        trees = tree_costs(args, device)
    except Exception as error:  # noqa: BLE001 - reported, and the run goes on
        skipped.append(f"tree cost ({type(error).__name__}: {error})")
        log(f"tree cost: {type(error).__name__}: {error}")
        traceback.print_exc()
    routes: list[dict] = []
    try:  # second: seconds (compiles included), no model: each attention route against the masked path at 32k
        routes = attention_routes(args, device)
    except Exception as error:  # noqa: BLE001 - reported, and the run goes on
        skipped.append(f"attention routes ({type(error).__name__}: {error})")
        log(f"attention routes: {type(error).__name__}: {error}")
        traceback.print_exc()
    write(args.out, env, rows, skipped, extras, trees, routes)
    durations: dict[tuple[str, str], tuple[int, float]] = {}
    longest = 0.0
    models: dict[tuple[str, str], torch.nn.Module] = {}
    for shape, dtype_name, context in plan:
        label = f"{shape} {dtype_name} {context_label(context)}"
        remaining = args.deadline_s - (time.perf_counter() - t0)
        seen = durations.get((shape, dtype_name))
        # decode is mostly launch-bound on a GPU: half the time scales with the context (prefill, attention)
        estimate = seen[1] * (0.5 + 0.5 * max(1.0, context / seen[0])) if seen else max(20.0, 2.0 * longest)
        if estimate > remaining:
            log(f"skip {label}: ~{estimate:.0f} s estimated, {remaining:.0f} s left")
            skipped.append(f"{label} (time)")
            continue
        start = time.perf_counter()
        key = (shape, dtype_name)
        try:
            if key not in models:  # kept for later contexts: both shapes in both dtypes take ~10 GiB
                log(f"build {shape} {dtype_name}")
                models[key] = build_model(shape, DTYPES[dtype_name], device)
                warm_up(models[key], device, args)
                log(f"  built and warmed up in {time.perf_counter() - start:.1f} s")
                start = time.perf_counter()  # estimates for longer contexts exclude the build
            model = models[key]
            ok, why = fits(model, context, device, args.new_tokens)
            if not ok:
                log(f"skip {label}: {why}")
                skipped.append(f"{label} (memory: {why})")
                continue
            log(f"run {label}")
            rows.extend(measure(model, shape, dtype_name, context, args, device))
        except torch.OutOfMemoryError as error:
            skipped.append(f"{label} (OOM)")
            log(f"{label}: OOM {str(error).splitlines()[0][:160]}")
        except Exception as error:  # noqa: BLE001
            skipped.append(f"{label} ({type(error).__name__}: {error})")
            log(f"{label}: {type(error).__name__}: {error}")
            traceback.print_exc()
        took = time.perf_counter() - start
        durations[key] = (context, took)
        longest = max(longest, took)
        log(f"  ({took:.1f} s, {time.perf_counter() - t0:.0f} s total)")
        write(args.out, env, rows, skipped, extras, trees, routes)
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    models.clear()
    gc.collect()

    if device.type == "cuda" and not args.no_extras:
        for name, extra, needs in (("bitsandbytes 4-bit", bnb_extra, 40.0),
                                   ("static-compiled", compiled_static_extra, 150.0)):
            remaining = args.deadline_s - (time.perf_counter() - t0)
            if remaining < needs:
                skipped.append(f"{name} (time)")
                log(f"skip {name}: {remaining:.0f} s left")
                continue
            try:
                extras.extend(extra(args, device))
            except Exception as error:  # noqa: BLE001
                skipped.append(f"{name} ({type(error).__name__}: {error})")
                log(f"{name}: {type(error).__name__}: {error}")
                traceback.print_exc()
            write(args.out, env, rows, skipped, extras, trees, routes)

    write(args.out, env, rows, skipped, extras, trees, routes)
    log("")
    log(table(rows + extras))
    if trees:
        log(tree_cost_table(trees))
    if routes:
        log(routes_table(routes))
    if skipped:
        log("skipped: " + "; ".join(skipped))
    fp32_bad = [r for r in rows if r["dtype"] == "fp32" and r["method"].startswith("triforce-")
                and not r.get("identical")]
    log(f"fp32 TriForce rows not identical to plain generate: {len(fp32_bad)}"
        + "".join(f"\n  {r['model']} {context_label(r['context'])} {r['method']}: "
                  f"{r.get('identical_leading')}/{r.get('generated')} {r.get('error', '')}" for r in fp32_bad))
    log(f"done in {time.perf_counter() - t0:.0f} s")
    return 1 if fp32_bad else 0


if __name__ == "__main__":
    sys.exit(main())
