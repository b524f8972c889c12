"""Batched decoding, side by side: TriForce batches vs plain and static-cache batched ``generate``.

SmolLM2-135M-Instruct fp32. Row ``i`` of a batch is a different passage of Paul Graham's essays (text offset
``i * 40000`` characters) in the chat template followed by the benchmark question (`tools.prompts`), of
context ``context - 96 * i`` tokens, left-padded: rows of different lengths. Every method decodes exactly
``new_tokens`` per row (``min_new_tokens`` too). The batch is prefilled once (all columns but the last, in
chunks, into a DynamicCache, its entries copied into a StaticCache); every method continues from a copy of
it (``cache=``; TriForce copies each row's entries into its own cache), so each call is decoding: its seconds
include one token's forward per row and, for TriForce, that copy. For each batch size, mode and round the
methods run one after the other on the same batch. Reported per method: decode tokens/s of the batch (``batch *
new_tokens`` over the call's seconds), decode tokens per CPU-second of this process, TriForce's stats and
plans, and for greedy whether each row equals plain batched ``generate``'s row and, at the largest batch (unless
``--no-alone``), the row decoded alone by plain ``generate``.

    python benchmarks/batch_throughput.py --contexts 4096 --batches 1 2 4 --modes greedy sampled \
        --new-tokens 64 --repeats 1 --out docs/bench/batch-4k
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache, StaticCache

from hf_triforce import TriForceConfig, assets
from hf_triforce.tools.prompts import document_prompt
from hf_triforce_bench import texts

ROW_SHIFT, TEXT_SHIFT = 96, 40000
METHODS = {
    # TriForce proper: self drafts on a sink+window cache, Force 2 on a 512-entry retrieval cache (fixed plan)
    "triforce-self": dict(draft="self", levels=3, retrieval_budget=512, chunk_size=8, sink_tokens=16, window=256,
                          gamma1=2, gamma2=6, policy="fixed"),
    # n-gram lookup drafts verified by Force 3 directly (two levels): no drafting forwards
    "ngram-2-levels": dict(draft="ngram", levels=2, gamma1=3, gamma2=8, policy="fixed"),
    # what a user gets from TriForceConfig(): policy="auto", retrieval budget 4096
    "default": dict(),
}


def batch_of(tokenizer, text: str, context: int, batch: int) -> tuple[torch.Tensor, torch.Tensor, list]:
    rows = [document_prompt(tokenizer, text[i * TEXT_SHIFT:], context - ROW_SHIFT * i)[0] for i in range(batch)]
    width = max(len(r) for r in rows)
    ids = torch.full((batch, width), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros(batch, width, dtype=torch.long)
    for i, r in enumerate(rows):
        ids[i, width - len(r):], mask[i, width - len(r):] = r, 1
    return ids, mask, rows


def call(model, ids, mask, new: int, gen: dict, seed: int, **kw):
    """The output and the call's wall seconds (this process's CPU seconds go to `CPU_SECONDS`)."""
    torch.manual_seed(seed)
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **gen, **kw)
    CPU_SECONDS.append(time.process_time() - cpu_start)
    return out, time.perf_counter() - start


CPU_SECONDS: list[float] = []  # of the last calls (contention shows in wall time, much less in CPU time)


def as_static(model, dynamic: DynamicCache, capacity: int) -> StaticCache:
    """A StaticCache holding the DynamicCache's entries (its layers append them, as a forward would)."""
    static = StaticCache(config=model.config, max_cache_len=capacity)
    for index, layer in enumerate(dynamic.layers):
        static.update(layer.keys, layer.values, index)
    return static


def prefilled(model, ids, mask):
    """The cache of every column of the left-padded batch but the last, as one forward of the batch would leave
    it for the real tokens (positions from the mask, as ``generate`` computes them): every method continues from
    it (``cache=``), so the prompt is prefilled once per batch instead of once per method, and each call's time is
    decoding (plus one token's forward per row). Each row is prefilled alone, in chunks (rows never attend to
    each other; alone, without padding, the causal kernel runs instead of a dense batch mask, and activations
    stay one row's), and its entries are placed after its padding; the padding columns hold zeros, masked out."""
    width = ids.shape[1] - 1
    layers = None
    with torch.no_grad():
        for row in tqdm(range(ids.shape[0]), desc="prefill rows"):
            pad = int((mask[row] == 0).sum())
            cache = DynamicCache(config=model.config)
            for begin in range(pad, width, PREFILL_CHUNK):
                end = min(begin + PREFILL_CHUNK, width)
                model(ids[row : row + 1, begin:end], cache=cache, logits_to_keep=1,
                      position_ids=torch.arange(begin - pad, end - pad)[None])
            if layers is None:  # [batch, kv heads, width, head dim] per layer, zeros in the padding columns
                layers = [tuple(entries.new_zeros((ids.shape[0], entries.shape[1], width, entries.shape[3]))
                                for entries in (layer.keys, layer.values)) for layer in cache.layers]
            for (keys, values), layer in zip(layers, cache.layers):
                keys[row, :, pad:], values[row, :, pad:] = layer.keys[0], layer.values[0]
            del cache
    batch_cache = DynamicCache(config=model.config)
    for index, (keys, values) in enumerate(layers):
        batch_cache.update(keys, values, index)
    return batch_cache


def fingerprint(cache: DynamicCache) -> tuple:
    """The length and a checksum of the first and last layers' entries (to see that nobody wrote the prefix)."""
    first, last = cache.layers[0], cache.layers[-1]
    return cache.get_seq_length(), float(first.keys.double().sum()), float(last.values.double().sum())


PREFILL_CHUNK = 2048  # columns per prefill forward (bounded activations)


def run(model, tokenizer, text, context, batch, mode, args, rounds: list, caches: dict) -> dict:
    ids, mask, rows = batch_of(tokenizer, text, context, batch)
    if (context, batch) not in caches:
        caches.clear()  # one batch's caches in memory at a time
        dynamic = prefilled(model, ids, mask)
        caches[(context, batch)] = dynamic
    dynamic = caches[(context, batch)]  # the one prefix in memory: copied for plain and static, read by TriForce
    capacity = ids.shape[1] + args.new_tokens + 8
    prefix_fingerprint = fingerprint(dynamic)
    gen = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if mode == "sampled":
        gen = dict(do_sample=True, temperature=0.6, top_p=0.9, top_k=0, pad_token_id=tokenizer.pad_token_id)
    results: dict[str, dict] = {}
    for r in range(args.repeats):
        seed = 1000 + r
        for name in ["plain", "static", *args.methods]:
            if name == "static":
                prefix = as_static(model, dynamic, capacity)
            elif name == "plain":
                prefix = copy.deepcopy(dynamic)
            else:
                prefix = dynamic  # TriForce copies each row's entries into its own cache and never writes this one
            if name in ("plain", "static"):
                out, seconds = call(model, ids, mask, args.new_tokens, gen, seed, cache=prefix)
                sequences, stats = out, None
            else:
                config = TriForceConfig(**METHODS[name])
                out, seconds = call(model, ids, mask, args.new_tokens, gen, seed, triforce_config=config,
                                    return_dict_in_generate=True, cache=prefix)
                sequences, stats = out.sequences, out.triforce_stats
            del prefix
            if fingerprint(dynamic) != prefix_fingerprint:
                raise RuntimeError(f"{name} changed the shared prefix cache")
            entry = results.setdefault(name, {"decode_seconds": [], "decode_cpu_seconds": []})
            entry["decode_seconds"].append(seconds)
            entry["decode_cpu_seconds"].append(CPU_SECONDS[-1])
            entry["sequences"] = sequences[:, ids.shape[1]:]
            if stats is not None:
                figures = stats.to_dict()
                entry["stats"] = {k: v for k, v in figures.items() if not isinstance(v, dict)}
                entry["stats"]["detail"] = {k: v for k, v in figures["detail"].items() if not isinstance(v, dict)}
                entry["plans"] = stats.detail.plans
                entry["row_acceptance"] = [round(s.force3_acceptance, 3) for s in out.triforce_row_stats]
                entry["tokens_per_force3_step"] = [round(s.tokens_per_force3_step, 2) for s in out.triforce_row_stats]
    tokens = batch * args.new_tokens
    summary = {"context": context, "batch": batch, "mode": mode, "row_lengths": [len(r) for r in rows]}
    plain = results["plain"]["sequences"]
    if mode == "greedy" and batch == max(args.batches) and batch > 1 and args.alone:
        alone = [call(model, r[None], None, args.new_tokens, gen, 0)[0][0, len(r):] for r in rows]
        summary["plain_batched_equals_alone"] = [bool(torch.equal(plain[i], alone[i])) for i in range(batch)]
    for name, entry in results.items():
        row = {"decode_tok_s": tokens / statistics.median(entry["decode_seconds"]),
               "decode_tok_per_cpu_s": tokens / statistics.median(entry["decode_cpu_seconds"]),
               "decode_seconds": entry["decode_seconds"]}
        if mode == "greedy":
            same = [bool(torch.equal(entry["sequences"][i], plain[i])) for i in range(batch)]
            row["identical_to_plain_batched"] = same
            if "plain_batched_equals_alone" in summary:
                row["identical_to_alone"] = [bool(torch.equal(entry["sequences"][i], alone[i])) for i in range(batch)]
        row["sequences"] = entry["sequences"].tolist()
        for key in ("stats", "plans", "row_acceptance", "tokens_per_force3_step"):
            if key in entry:
                row[key] = entry[key]
        summary[name] = row
    rounds.append(summary)
    base = summary["plain"]["decode_tok_s"]
    line = " | ".join(f"{n} {summary[n]['decode_tok_s']:.2f} ({summary[n]['decode_tok_s'] / base:.2f}x)"
                      for n in results)
    print(f"{context} batch {batch} {mode}: decode tok/s {line}", flush=True)
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[4096])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--modes", nargs="+", default=["greedy", "sampled"], choices=["greedy", "sampled"])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rope-factor", type=float, default=None, help="YaRN factor (16k: 2)")
    parser.add_argument("--no-alone", dest="alone", action="store_false",
                        help="skip decoding each row alone (the plain-batched-vs-unbatched check)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=list(METHODS))
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = texts.yarn_rope(args.rope_factor) if args.rope_factor else {}
    model, tokenizer = assets.load_smollm2(**overrides)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token")
    text = texts.essays()
    rounds: list = []
    caches: dict = {}
    for context in args.contexts:
        for batch in args.batches:
            for mode in args.modes:
                run(model, tokenizer, text, context, batch, mode, args, rounds, caches)
                if args.out is not None:  # after every round: an interrupted run keeps what it measured
                    write(args, rounds)


def write(args, rounds: list) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                       "methods": METHODS, "runs": rounds}, indent=1))


if __name__ == "__main__":
    main()
