"""Cheap drafting tiers (`hf_triforce.kernels.lean`): what Force 1 costs per drafted token and what it is accepted.

One process, one prefill of a question about the essays in SmolLM2's chat template (``--context`` tokens), then:

1. ``--agreement``: teacher-forced agreement of each drafting copy with the fp32 model over ``--agree-tokens``
   tokens of the essays (E[sum min(p, q)] at T=1 and 0.6, greedy argmax agreement): no timings.
2. timings, side by side and interleaved, ``--repeats`` rounds, medians: a static-cache plain decode step at the
   context (transformers' forward on a ``StaticCache``), Force 1 per drafted token (a ``ModelDrafter`` on its
   sink+window cache of 16 + 256 entries, ``propose`` of ``--draft`` tokens then rollback; greedy, and sampled
   with T=0.6 / top-p 0.9 processors), and one Force-2 verification (3 rows after 1024 cached entries), for each
   drafting model: eager fp32 (``model``), dynamic int8 (``int8``), ``lean``, ``lean-int8``, ``lean-int4`` and
   ``lean-int4`` with a restricted output layer (the ``--vocab`` most frequent ids -- the lowest, BPE order --
   plus the prompt's tokens and the special ids).
3. acceptance: ``generate`` of ``--new`` tokens from the shared prefill, three levels, fixed plan, gamma1 2,
   gamma2 6, retrieval budget 1024, greedy and sampled (T=0.6, top-p 0.9, ``--samples`` seeds, counts summed), per
   drafting variant: Force-2 acceptance (Force 1's drafts against Force 2) and Force-3 acceptance (Force 2's tokens
   against the target), and decode seconds beside transformers' static-cache ``generate`` from the same prefill.
   Force-1 seconds per draft include the draft cache's fill (a 271-token forward per run).
4. the library's default config (``policy="auto"``) with ``draft_precision`` ``model``, ``int8`` and ``lean-int4``
   (and budget 1024), beside static-cache ``generate``: decode tokens/s, one greedy and one sampled run.
   ``lean-int4/F2-<x>`` runs Force 2 on the lean copy ``<x>``; ``/vocab``: Force 1 with the restricted output layer.

    python benchmarks/lean_drafting.py --threads 2 --out docs/bench/lean-drafting/2-threads.json

The machine may be shared: ``uptime``'s load is recorded before and after each part. With ``--threads 1`` the
timings are the thread's CPU time (``time.thread_time``: what the work costs, whatever else runs); otherwise wall
time. Two threads on a loaded 2-core machine wait for each other at every parallel region (a 20 us SDPA took 16 ms
wall under load 4): read ``--threads 2`` numbers with the load beside them.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from operator import attrgetter
from pathlib import Path

import torch
from transformers import DynamicCache, LogitsProcessorList, TemperatureLogitsWarper, TopPLogitsWarper

from hf_triforce import TriForceConfig, assets
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.decoding import hierarchy, tiers
from hf_triforce.drafters.model import ModelDrafter
from hf_triforce.forwards.forward import forward_logits
from hf_triforce.integration import recording_attention
from hf_triforce.kernels import lean
from hf_triforce.kernels.quantized import int8_copy
from hf_triforce.tools.prompts import document_prompt
from hf_triforce.tools.timing import prefill_prefix, static_copy
from hf_triforce.verification.sampling import TorchSampler
from hf_triforce_bench import texts
from hf_triforce_bench.restricted_vocabulary import restricted as restrict_vocabulary

SAMPLING = dict(do_sample=True, temperature=0.6, top_p=0.9)


def load() -> str:
    """The 1-minute load average (the machine may be shared)."""
    return f"{os.getloadavg()[0]:.2f}"


def vocabulary(model, prompt: torch.Tensor, frequent: int) -> torch.Tensor:
    """The ``frequent`` lowest ids (BPE order: the earliest merges, the most frequent tokens), the prompt's tokens and
    the special ids of the config and generation config."""
    special = [getattr(model.config, name, None) for name in ("bos_token_id", "eos_token_id", "pad_token_id")]
    special += [getattr(model.generation_config, name, None) for name in ("bos_token_id", "eos_token_id")]
    flat = []
    for value in special:
        flat += value if isinstance(value, list) else [value]
    ids = torch.cat((torch.arange(frequent), prompt.reshape(-1), torch.tensor([v for v in flat if v is not None])))
    return torch.unique(ids)


def drafting_models(model, prompt: torch.Tensor, frequent: int) -> dict:
    models = {"model": model, "int8": int8_copy(model)}
    for precision in lean.LEAN_PRECISIONS:
        models[precision] = tiers.lean_model(model, precision)
    models["lean-int4/vocab"] = restrict_vocabulary(models["lean-int4"], vocabulary(model, prompt, frequent))
    return models


def agreement(model, tokenizer, names: dict, tokens: int) -> dict:
    ids = torch.tensor([tokenizer(texts.essays()[30000:90000]).input_ids[:tokens]])

    def logits(drafting):
        cache = BufferCache(model.config.num_hidden_layers, tokens + 1)
        with torch.no_grad(), recording_attention(model):
            return torch.cat([forward_logits(drafting, ids[:, i : i + 256], cache, i, min(256, tokens - i))
                              for i in range(0, tokens, 256)]).float()

    reference = logits(model)
    out = {}
    for name, drafting in names.items():
        scores = logits(drafting)
        row = {}
        for temperature in (1.0, 0.6):
            p, q = torch.softmax(reference / temperature, -1), torch.softmax(scores / temperature, -1)
            row[f"E[min(p,q)] T={temperature}"] = float(torch.minimum(p, q).sum(-1).mean())
        row["greedy agreement"] = float((reference.argmax(-1) == scores.argmax(-1)).float().mean())
        out[name] = row
        print(f"  {name:22s} " + "  ".join(f"{k} {v:.4f}" for k, v in row.items()), flush=True)
    return out


def timings(model, ids, prefix, models: dict, repeats: int, draft: int, threads: int) -> dict:
    clock = time.thread_time if threads == 1 else time.perf_counter
    length = ids.shape[1] - 1
    static = static_copy(model, prefix, ids.shape[1] + 8)
    sampled = LogitsProcessorList([TemperatureLogitsWarper(0.6), TopPLogitsWarper(0.9)])
    drafters = {}
    with torch.no_grad(), recording_attention(model):
        for name, drafting in models.items():
            for mode, processors in (("greedy", LogitsProcessorList()), ("sampled", sampled)):
                drafter = ModelDrafter(drafting, 16, 256, processors, mode == "sampled", TorchSampler())
                drafter.prefill(ids)
                drafters[name, mode] = drafter
        verify = {}
        for name in models:
            cache = BufferCache(model.config.num_hidden_layers, 1100)
            for layer, source in zip(cache.layers, prefix.layers):
                layer.write(source.keys[:, :, :1024], source.values[:, :, :1024])
            verify[name] = cache
    results: dict[str, list[float]] = {"static decode step": []}
    token, position = ids[:, -1:], torch.tensor([length])
    for _ in range(repeats):
        with torch.no_grad():
            start = clock()
            model(input_ids=token, cache=static, cache_position=position, position_ids=position[None],
                  use_cache=True)
            results["static decode step"].append(clock() - start)
            for layer in static.layers:  # the step again at the same position next round
                layer.cumulative_length.sub_(1)
        with torch.no_grad(), recording_attention(model):
            for (name, mode), drafter in drafters.items():
                start = clock()
                drafter.propose(ids, draft)
                results.setdefault(f"force1 {name} {mode} (per token)", []).append((clock() - start) / draft)
                drafter.rollback(ids.shape[1] - 1)
            for name, cache in verify.items():
                start = clock()
                forward_logits(models[name], ids[:, -3:], cache, 1024, 3)
                results.setdefault(f"force2 verify {name} (3 rows, 1024 entries)", []).append(clock() - start)
                cache.rollback(1024)
    medians = {name: 1e3 * statistics.median(values[1:]) for name, values in results.items()}
    step = medians["static decode step"]
    for name, value in medians.items():
        print(f"  {name:52s} {value:8.2f} ms  ({value / step:.3f} of a static decode step)", flush=True)
    return medians


def acceptance(model, ids, prefix, new: int, frequent: int, samples: int) -> dict:
    # (label, draft_precision, what Force 2 runs instead of FORCE2_PRECISION's choice, restricted Force-1 vocabulary)
    variants = [("model", "model", None, False), ("int8", "int8", None, False), ("lean", "lean", None, False),
                ("lean-int8", "lean-int8", None, False), ("lean-int4/F2-lean-int4", "lean-int4", "lean-int4", False),
                ("lean-int4/F2-lean-int8", "lean-int4", "lean-int8", False),
                ("lean-int4/F2-lean", "lean-int4", "lean", False),
                ("lean-int4/F2-lean-int4/vocab", "lean-int4", "lean-int4", True)]
    out = {}
    for mode, sampling, seeds in (("greedy", {"do_sample": False}, [0]), ("sampled", SAMPLING, range(samples))):
        walls = []
        for seed in seeds:  # the baseline: transformers' static-cache decoding from the same prefill
            torch.manual_seed(seed)
            static = static_copy(model, prefix, ids.shape[1] + new + 8)
            start = time.perf_counter()
            model.generate(ids, cache=static, max_new_tokens=new, min_new_tokens=new, **sampling)
            walls.append(time.perf_counter() - start)
        out[f"static {mode}"] = {"decode_seconds": walls, "load": load()}
        print(f"  {'static (baseline)':28s} {mode:8s} decode {statistics.median(walls):6.1f} s  load {load()}",
              flush=True)
    real_tier_model, real_force2 = hierarchy.tier_model, dict(tiers.FORCE2_PRECISION)
    subset = vocabulary(model, ids, frequent)
    for label, precision, force2, restricted in variants:
        if force2 is not None:
            tiers.FORCE2_PRECISION[precision] = force2
        if restricted:
            hierarchy.tier_model = lambda m, p, tier, *rest: (
                restrict_vocabulary(real_tier_model(m, p, tier, *rest), subset) if tier == 1
                else real_tier_model(m, p, tier, *rest))
        try:
            for mode, sampling, seeds in (("greedy", {"do_sample": False}, [0]), ("sampled", SAMPLING, range(samples))):
                config = TriForceConfig(draft="self", policy="fixed", levels=3, gamma1=2, gamma2=6,
                                        retrieval_budget=1024, chunk_size=8, sink_tokens=16, window=256,
                                        draft_precision=precision)
                runs = []
                for seed in seeds:
                    torch.manual_seed(seed)
                    start = time.perf_counter()
                    result = model.generate(ids, cache=prefix, triforce_config=config, max_new_tokens=new,
                                            min_new_tokens=new, return_dict_in_generate=True, **sampling)
                    runs.append((time.perf_counter() - start, result.triforce_stats))
                total = {path.split(".")[-1]: sum(attrgetter(path)(stats) for _, stats in runs) for path in
                         ("detail.force1_proposed", "force2_verified", "force2_accepted", "force3_proposed",
                          "force3_accepted", "detail.force2_steps", "force1_seconds", "force2_seconds")}
                out[f"{label} {mode}"] = row = {
                    "force2_acceptance": total["force2_accepted"] / max(total["force2_verified"], 1),
                    "force3_acceptance": total["force3_accepted"] / max(total["force3_proposed"], 1),
                    "runs": len(runs), "decode_seconds": [seconds for seconds, _ in runs],
                    "force1_seconds_per_draft": total["force1_seconds"] / max(total["force1_proposed"], 1),
                    "force2_seconds_per_verification": total["force2_seconds"] / max(total["force2_steps"], 1),
                    "tier_forwards": runs[0][1].detail.tier_forwards, "load": load()}
                print(f"  {label:28s} {mode:8s} F2 acc {row['force2_acceptance']:.3f}  F3 acc "
                      f"{row['force3_acceptance']:.3f}  decode {statistics.median(row['decode_seconds']):6.1f} s  F1 "
                      f"{1e3 * row['force1_seconds_per_draft']:6.2f} ms/draft  F2 "
                      f"{1e3 * row['force2_seconds_per_verification']:6.2f} ms/verify  load {load()}", flush=True)
        finally:
            hierarchy.tier_model = real_tier_model
            tiers.FORCE2_PRECISION.update(real_force2)
    return out


def default_policy(model, ids, prefix, new: int) -> dict:
    """The library's default config (``policy="auto"``) with each drafting precision, beside static-cache
    ``generate``: one greedy and one sampled (seed 0) run each."""
    variants = {"static": None, "default": TriForceConfig(), "default int8": TriForceConfig(draft_precision="int8"),
                "default lean-int4": TriForceConfig(draft_precision="lean-int4"),
                "default lean-int4, budget 1024": TriForceConfig(draft_precision="lean-int4", retrieval_budget=1024)}
    out = {}
    for mode, sampling in (("greedy", {"do_sample": False}), ("sampled", SAMPLING)):
        for label, config in variants.items():
            torch.manual_seed(0)
            kwargs = dict(cache=static_copy(model, prefix, ids.shape[1] + new + 8)) if config is None else dict(
                cache=prefix, triforce_config=config, return_dict_in_generate=True)
            start = time.perf_counter()
            result = model.generate(ids, max_new_tokens=new, min_new_tokens=new, **kwargs, **sampling)
            seconds = time.perf_counter() - start
            stats = getattr(result, "triforce_stats", None)
            out[f"{label} {mode}"] = row = {"decode_seconds": seconds, "tokens_per_second": new / seconds,
                                            "load": load()}
            if stats is not None:
                row.update(plan_steps=stats.plan_steps, force2_acceptance=stats.force2_acceptance,
                           force3_acceptance=stats.force3_acceptance, tier_forwards=stats.detail.tier_forwards)
            print(f"  {mode:8s} {label:32s} {new / seconds:6.2f} tok/s "
                  + ("" if stats is None else f"steps by levels {stats.plan_steps} F2 {stats.force2_acceptance:.2f} "
                     f"F3 {stats.force3_acceptance:.2f}") + f" load {load()}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8000)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument("--samples", type=int, default=3, help="sampled runs (seeds 0, 1, ...) per variant")
    parser.add_argument("--draft", type=int, default=4, help="tokens per timed Force-1 proposal")
    parser.add_argument("--vocab", type=int, default=8192, help="frequent ids in the restricted output layer")
    parser.add_argument("--agreement", action="store_true")
    parser.add_argument("--agree-tokens", type=int, default=768)
    parser.add_argument("--skip", nargs="*", default=[], choices=["timings", "acceptance", "default"])
    parser.add_argument("--reuse-prefill", type=Path, default=None,
                        help="folder where the prompt's prefilled cache is saved and read back (skips the prefill)")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if args.repeats < 2:
        parser.error(f"--repeats must be at least 2 (the first round of timings is a warm-up), got {args.repeats}")
    torch.set_num_threads(args.threads)
    model, tokenizer = assets.load_smollm2()
    ids = document_prompt(tokenizer, texts.essays(), args.context, "question")
    results = {"context": args.context, "threads": args.threads, "torch": torch.__version__, "load_start": load()}
    models = drafting_models(model, ids, args.vocab)
    if args.agreement:
        print("agreement with the fp32 model (teacher-forced, essays):", flush=True)
        extra = {"lean-int4 (int4 head)": lean.LeanModel(model, "lean-int4", {"head": "int4"}),
                 "lean-int4 (group 64)": lean.LeanModel(model, "lean-int4", group_size=64)}
        results["agreement"] = agreement(model, tokenizer, {**models, **extra}, args.agree_tokens)
    saved = args.reuse_prefill / f"smollm2-essays-question-{args.context}.pt" if args.reuse_prefill else None
    if saved is not None and saved.exists():
        prefix = DynamicCache(config=model.config)
        for index, (keys, values) in enumerate(torch.load(saved)):
            prefix.update(keys, values, index)
    else:
        began = time.perf_counter()
        prefix = prefill_prefix(model, ids)
        results["prefill_seconds"] = time.perf_counter() - began
        if saved is not None:
            saved.parent.mkdir(parents=True, exist_ok=True)
            torch.save([(layer.keys, layer.values) for layer in prefix.layers], saved)
    if "timings" not in args.skip:
        print(f"timings ({args.threads} thread(s), {'thread CPU' if args.threads == 1 else 'wall'} time, load "
              f"{load()}):", flush=True)
        results["timings_ms"] = timings(model, ids, prefix, models, args.repeats, args.draft, args.threads)
        results["load_after_timings"] = load()
    if "acceptance" not in args.skip:
        print(f"acceptance ({args.new} new tokens, budget 1024, gamma 2/6):", flush=True)
        results["acceptance"] = acceptance(model, ids, prefix, args.new, args.vocab, args.samples)
    if "default" not in args.skip:
        print(f"the default config (policy auto), {args.new} new tokens:", flush=True)
        results["default_policy"] = default_policy(model, ids, prefix, args.new)
    results["load_end"] = load()
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
