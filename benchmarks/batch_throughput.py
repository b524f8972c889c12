"""Batched decoding, side by side: TriForce batches vs plain and static-cache batched ``generate``.

SmolLM2-135M-Instruct fp32. Row ``i`` of a batch is a different passage of Paul Graham's essays (text offset
``i * 40000`` characters) in the chat template followed by the benchmark question (`tools.prompts`), of
context ``context - 96 * i`` tokens, left-padded: rows of different lengths. Every method decodes exactly
``new_tokens`` per row (``min_new_tokens`` too). For each batch size, mode and round the methods run one after
the other on the same batch. Reported per method: decode tokens/s of the batch (``batch * new_tokens`` over
the call's seconds minus its prefill: TriForce's own ``prefill_seconds``; for the baselines the seconds of
plain's call with ``max_new_tokens=1`` on the same batch — an approximation), end-to-end tokens/s,
decode tokens per CPU-second of this process (the machine is shared: CPU time is what contention disturbs
least; TriForce's prefill CPU time is measured around its prefill calls), and for greedy whether each
row equals plain batched ``generate``'s row and, at the largest batch, the row decoded alone by plain
``generate``.

    python benchmarks/batch_throughput.py --contexts 4096 --batches 1 2 4 --modes greedy sampled \
        --new-tokens 64 --repeats 1 --out docs/bench/batch-4k
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hf_triforce import TriForceConfig
from hf_triforce.tools import assets
from hf_triforce.tools.prompts import document_prompt

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
    """The output and the call's wall seconds (``cpu=True``: this process's CPU seconds, all threads)."""
    torch.manual_seed(seed)
    start, cpu_start = time.perf_counter(), time.process_time()
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, **gen, **kw)
    CPU_SECONDS.append(time.process_time() - cpu_start)
    return out, time.perf_counter() - start


CPU_SECONDS: list[float] = []  # of the last calls (contention shows in wall time, much less in CPU time)
PREFILL_CPU_SECONDS: list[float] = []  # TriForce's prefills inside a call (`cpu_timed_prefill`)


def cpu_timed_prefill() -> None:
    """Wrap the prefill TriForce's decoders call so that its CPU seconds are measured, not estimated."""
    from hf_triforce import batch as batch_module
    from hf_triforce import decoder as decoder_module

    for module in (batch_module, decoder_module):
        original = module.prefill

        def timed(*args, _original=original, **kwargs):
            start = time.process_time()
            try:
                return _original(*args, **kwargs)
            finally:
                PREFILL_CPU_SECONDS.append(time.process_time() - start)

        module.prefill = timed
PREFILLS: dict = {}  # (context, batch) -> (wall, cpu) seconds of plain's 1-token call, reused across modes


def run(model, tokenizer, text, context, batch, mode, args, rounds: list) -> dict:
    ids, mask, rows = batch_of(tokenizer, text, context, batch)
    gen = dict(do_sample=False, pad_token_id=tokenizer.pad_token_id)
    if mode == "sampled":
        gen = dict(do_sample=True, temperature=0.6, top_p=0.9, top_k=0, pad_token_id=tokenizer.pad_token_id)
    results: dict[str, dict] = {}
    for r in range(args.repeats):
        seed = 1000 + r
        for name in ["plain", "static", *args.methods]:
            if name in ("plain", "static"):
                kw = {"cache_implementation": "static"} if name == "static" else {}
                out, seconds = call(model, ids, mask, args.new_tokens, gen, seed, **kw)
                cpu = CPU_SECONDS[-1]
                key = (context, batch)  # plain's prefill stands for static's too (the same forward)
                if key not in PREFILLS:
                    PREFILLS[key] = (call(model, ids, mask, 1, gen, seed)[1], CPU_SECONDS[-1])
                prefill, cpu_prefill = PREFILLS[key]
                sequences, stats = out, None
            else:
                config = TriForceConfig(**METHODS[name])
                PREFILL_CPU_SECONDS.clear()
                out, seconds = call(model, ids, mask, args.new_tokens, gen, seed, triforce_config=config,
                                    return_dict_in_generate=True)
                sequences, prefill = out.sequences, out.triforce_stats.prefill_seconds
                cpu, cpu_prefill = CPU_SECONDS[-1], sum(PREFILL_CPU_SECONDS)
                stats = out.triforce_stats
            entry = results.setdefault(name, {"decode_seconds": [], "total_seconds": [], "decode_cpu_seconds": []})
            entry["decode_seconds"].append(seconds - prefill)
            entry["decode_cpu_seconds"].append(cpu - cpu_prefill)
            entry["total_seconds"].append(seconds)
            entry["sequences"] = sequences[:, ids.shape[1]:]
            if stats is not None:
                entry["stats"] = {k: v for k, v in stats.to_dict().items() if not isinstance(v, dict)}
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
               "end_to_end_tok_s": tokens / statistics.median(entry["total_seconds"]),
               "decode_tok_per_cpu_s": tokens / statistics.median(entry["decode_cpu_seconds"]),
               "decode_seconds": entry["decode_seconds"]}
        if mode == "greedy":
            same = [bool(torch.equal(entry["sequences"][i], plain[i])) for i in range(batch)]
            row["identical_to_plain_batched"] = same
            if "plain_batched_equals_alone" in summary:
                row["identical_to_alone"] = [bool(torch.equal(entry["sequences"][i], alone[i])) for i in range(batch)]
        row["sequences"] = entry["sequences"].tolist()
        for key in ("stats", "row_acceptance", "tokens_per_force3_step"):
            if key in entry:
                row[key] = entry[key]
        summary[name] = row
    rounds.append(summary)
    line = " | ".join(f"{n} {summary[n]['decode_tok_s']:.2f} ({summary[n]['decode_tok_per_cpu_s']:.2f}/cpu-s)"
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
    cpu_timed_prefill()
    overrides = assets.yarn_rope(args.rope_factor) if args.rope_factor else {}
    model, tokenizer = assets.load_smollm2(**overrides)
    if tokenizer.pad_token_id is None:
        raise ValueError("the tokenizer has no pad token")
    text = assets.essays()
    rounds: list = []
    for context in args.contexts:
        for batch in args.batches:
            for mode in args.modes:
                run(model, tokenizer, text, context, batch, mode, args, rounds)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "results.json").write_text(json.dumps({"args": vars(args) | {"out": str(args.out)},
                                                           "methods": METHODS, "runs": rounds}, indent=1))


if __name__ == "__main__":
    main()
