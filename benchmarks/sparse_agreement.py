"""How well does Force 2 (the target on a retrieval cache) agree with Force 3 (the full cache)? Teacher-forced.

One prefill of a question prompt about a natural text (Paul Graham's essays, the chat template, SmolLM2 or another
bundled model (``--model``), YaRN where the context needs it), then the model's own greedy answer (``--new-tokens``,
decoded on the prefilled full cache) is scored position by position: ``p`` from the full cache, ``q`` from each
sparse cache selected the way Force 2 selects it — with the query of the last cached token, refreshed at every
position, every 4 or 12 positions (``--selections every4 every12``: ``refresh_every`` Force-3 steps of a few tokens
each) or only once at the end of the prompt. Reported per configuration: expected acceptance ``sum(min(p, q))`` at
temperature 1 and at 0.6 (what a sampled verification accepts), and greedy agreement (``argmax q == argmax p``). A
StreamingLLM cache (sink chunk + recent tokens, same budget) is the baseline the retrieval has to beat.

One prefill serves every variant: budgets x chunk sizes x recent-token counts (``--recents``, default the
library's: a quarter of the budget in whole chunks) x chunk scorings (``--scorings``: ``sum``, the library's: each
chunk's mean key against the sum of its KV head's query heads; ``mass``: the attention mass each query head is
estimated to put on the chunk, a softmax of its scaled scores over the chunks, summed over the group).

Force 1 too (``--force1-window``, one or more windows): the target drafting on its sink+window cache
(`ModelDrafter`, filled and placed as ``--force1-variants`` says, at ``--force1-precision``), fed the same answer: its
agreement with Force 3 (what two levels accept) and with each refreshed Force-2 configuration (what Force 2 accepts
of Force 1's drafts). And how flat the target's own law is there (mean entropy, mean top probability): a flat ``p``
caps every tier's acceptance. A draft model (``--draft-model``, sharing the target's vocabulary) is scored as Force 1
too: on the same sink+window cache at ``--force1-precision``, filled by a forward of its own weights, at the positions
`TriForceConfig(draft=...)` gives it (`draft_positions`). ``--json`` writes every row.

    python benchmarks/sparse_agreement.py --context 16000 --rope-factor 2 --budgets 512 1024 2048 4096
    python benchmarks/sparse_agreement.py --text wikipedia --context 32000 --rope-factor 4 --budgets 1024 4096 \
        --chunks 8
    python benchmarks/sparse_agreement.py --text shakespeare --context 16000 --rope-factor 2 --budgets 4096 \
        --chunks 8 16 32 --recents 1024 2048 3072 --scorings sum mass --selections every --json out.json
    python benchmarks/sparse_agreement.py --context 64000 --rope-factor 8 --budgets 4096 8192 --chunks 8 \
        --selections every every4 once --prefill-dir prefills
    python benchmarks/sparse_agreement.py --model qwen2.5-coder-1.5b --draft-model qwen2.5-coder-0.5b \
        --context 32000 --budgets 4096 8192 --chunks 8 --selections every4 --force1-window 1024 \
        --force1-variants copy-absolute --force1-precision lean-int4 --prefill-dir prefills
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import LogitsProcessorList

from hf_triforce import assets
from hf_triforce.caches import BufferCache, RetrievalCache
from hf_triforce.config import TriForceConfig
from hf_triforce.decoding.tiers import tier_model
from hf_triforce.drafters.model import ModelDrafter, draft_positions
from hf_triforce.forwards.forward import forward_logits, prefill, run_inline
from hf_triforce.integration import recording_attention
from hf_triforce.kernels.attention import QueryRecorder
from hf_triforce.tools.prompts import document_prompt
from hf_triforce_bench import texts
from hf_triforce_bench.compare import saved_prefix

FORCE1_VARIANTS = {"forward-slots": (False, "slots"), "copy-slots": (True, "slots"),
                   "forward-absolute": (False, "absolute"), "copy-absolute": (True, "absolute")}
# positions between re-selections: at every position, every 4 or 12 (`refresh_every` Force-3 steps of ~3 tokens
# each), or once at the end of the prompt (0)
SELECTIONS = {"every": 1, "every4": 4, "every12": 12, "once": 0}


class MassScoredCache(RetrievalCache):
    """A retrieval cache whose chunks are ranked by the attention mass each query head is estimated to put on them
    (softmax over the chunks of its scaled scores against their mean keys), summed over the KV head's query heads:
    every head weighs the same, whatever the scale of its query."""

    def _top_chunks(self, layer_idx: int, source, n_mid: int, k: int, queries: dict[int, torch.Tensor]):
        query = queries[layer_idx].float()  # [b, heads, d]
        summaries = self._chunk_summaries(layer_idx, source.keys, n_mid, query.device)  # [b, kv, n_mid, d]
        batch, heads, dim = query.shape
        kv_heads = source.keys.shape[1]
        grouped = query.reshape(batch, kv_heads, heads // kv_heads, dim)
        scores = torch.einsum("bhnd,bhgd->bhgn", summaries, grouped) * dim ** -0.5
        mass = torch.softmax(scores, dim=-1).sum(2)
        return mass.topk(k, dim=-1).indices.sort(dim=-1).values


SCORINGS = {"sum": RetrievalCache, "mass": MassScoredCache}


def agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict[str, float]:
    out = {}
    for temperature in (1.0, 0.6):
        p = torch.softmax(p_logits.float() / temperature, -1)
        q = torch.softmax(q_logits.float() / temperature, -1)
        out[f"accept T={temperature}"] = float(torch.minimum(p, q).sum(-1).mean())
    out["greedy"] = float((p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean())
    return out


def greedy_reference(model, ids: torch.Tensor, k: int, full: BufferCache, prefill_dir: str | None = None):
    """Prefill ``ids`` but its last token into ``full``, then decode ``k`` greedy tokens on it. Returns the tokens
    fed at positions ``n-1 .. n+k-2`` ``[1, k]``, ``p`` ``[k, vocab]`` and, per position, the query of the last
    cached token when it is predicted (what a Force-2 selection there is made with). ``prefill_dir``: the prefill is
    read from (or computed and saved to) a folder of saved prefills (`hf_triforce_bench.compare.saved_prefix`), all but
    its last entry copied into ``full`` and the last recomputed to record its query."""
    n = ids.shape[1]
    at_prompt_end = QueryRecorder()
    if prefill_dir is None:
        prefill(model, ids[:, :-1], full, chunk_size=2048, show_progress=True, recorder=at_prompt_end)
    else:
        saved, _, source = saved_prefix(model, ids, Path(prefill_dir))
        print(f"prefill: {source}", flush=True)
        for layer, entries in zip(full.layers, saved.layers):
            layer.write(entries.keys[:, :, : n - 2], entries.values[:, :, : n - 2])
        del saved
        forward_logits(model, ids[:, n - 2 : n - 1], full, n - 2, 1, at_prompt_end)
    fed, rows, queries = [ids[:, -1:]], [], [at_prompt_end.at(-1)]
    for i in range(k):
        recorder = QueryRecorder()
        rows.append(forward_logits(model, fed[-1], full, n - 1 + i, 1, recorder)[0])
        queries.append(recorder.at(0))
        fed.append(rows[-1].argmax().view(1, 1))
    return torch.cat(fed[:k], dim=1), torch.stack(rows), queries[:k]


def variants(args) -> list[dict]:
    """The sparse caches to score: per budget and chunk size, a retrieval cache per recent-token count, scoring and
    selection, and (with the first chunk size) the sink + recent baseline."""
    out = []
    for budget in args.budgets:
        for chunk in args.chunks:
            if budget % chunk:
                continue
            recents = args.recents or [(budget // 4) // chunk * chunk]
            for recent in recents:
                if recent % chunk or recent > budget - 2 * chunk:
                    continue
                for scoring in args.scorings:
                    for selection in args.selections:
                        out.append(dict(cache="retrieval", budget=budget, chunk=chunk, recent=recent,
                                        scoring=scoring, selection=selection))
            if chunk == args.chunks[0]:
                out.append(dict(cache="streaming (sink + recent)", budget=budget, chunk=chunk, recent=budget - chunk,
                                scoring="-", selection="every"))
    return out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", choices=sorted(assets.MODELS))
    parser.add_argument("--draft-model", default=None, choices=sorted(assets.MODELS),
                        help="a draft model scored as Force 1 beside the target's own drafting")
    parser.add_argument("--context", type=int, default=16000)
    parser.add_argument("--rope-factor", type=float, default=None)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--recents", type=int, nargs="+", default=None,
                        help="recent tokens of the retrieval cache (multiples of the chunk; default: a quarter of the "
                             "budget in whole chunks, the library's)")
    parser.add_argument("--scorings", nargs="+", default=["sum"], choices=list(SCORINGS))
    parser.add_argument("--selections", nargs="+", default=list(SELECTIONS), choices=list(SELECTIONS))
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", choices=sorted(texts.TEXTS), default="essays")
    parser.add_argument("--force1-sink", type=int, default=16)
    parser.add_argument("--force1-window", type=int, nargs="+", default=[256],
                        help="Force 1's recent window(s), each scored from the same prefill; 0: no Force-1 rows")
    parser.add_argument("--force1-precision", default="model", help="a TriForceConfig.draft_precision but 'auto'")
    parser.add_argument("--force1-variants", nargs="*", default=list(FORCE1_VARIANTS), choices=list(FORCE1_VARIANTS),
                        help="how Force 1's cache is filled (a forward over the sinks and window, or a copy of the "
                             "full cache's entries) and which positions it uses (in-cache slots or absolute)")
    parser.add_argument("--prefill-dir", default=None,
                        help="folder of saved prefills (hf-triforce-bench decode --prefill-dir): read back where saved")
    parser.add_argument("--json", default=None, help="write the run's settings and every row here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    def load(name: str):
        asset = assets.MODELS[name]
        return assets.load_model(name, **(texts.yarn_rope(args.rope_factor, asset) if args.rope_factor else {}))

    model, tokenizer = load(args.model)
    draft = load(args.draft_model)[0] if args.draft_model else None
    ids = document_prompt(tokenizer, texts.TEXTS[args.text](), args.context)
    n, k = ids.shape[1], args.new_tokens
    layers = model.config.num_hidden_layers
    full = BufferCache(layers, n + k)
    start = time.perf_counter()
    results = []
    with recording_attention(model):
        # the full cache holds n + k - 1
        forced, p, selection_queries = greedy_reference(model, ids, k, full, args.prefill_dir)
        print(f"prefill + reference {time.perf_counter() - start:.0f} s; text {args.text}, context {n}, {k} "
              f"teacher-forced positions of the greedy answer; rope factor {args.rope_factor}", flush=True)
        law = torch.softmax(p.float(), -1)
        entropy = float(-(law * torch.log(law.clamp(min=1e-30))).sum(-1).mean())
        top = float(law.max(-1).values.mean())
        print(f"the target's law there (T=1): mean entropy {entropy:.2f} nats, mean top probability {top:.3f}",
              flush=True)
        force2 = {}  # variant label -> Force 2's logits, selection refreshed at every position
        print("| cache | budget | chunk | recent | scoring | selection | accept T=1 | accept T=0.6 | greedy |")
        print("|---|---|---|---|---|---|---|---|---|")
        for variant in variants(args):
            cls = RetrievalCache if variant["cache"] != "retrieval" else SCORINGS[variant["scoring"]]
            cache = cls(layers, variant["budget"], variant["chunk"], variant["recent"], k + 2)
            rows, interval = [], SELECTIONS[variant["selection"]]
            for i in range(k):
                upto = n - 1 + i  # tokens before the one fed at position n-1+i
                if i == 0 or (interval and i % interval == 0):
                    cache.select(full, upto, selection_queries[i])
                else:
                    cache.sync(full, upto)
                rows.append(forward_logits(model, forced[:, i : i + 1], cache, upto, 1)[0])
            label = (f"{variant['cache']}, budget {variant['budget']}, chunk {variant['chunk']}, recent "
                     f"{variant['recent']}, {variant['scoring']}")
            if variant["selection"] == "every":
                force2[label] = torch.stack(rows)
            scores = agreement(p, torch.stack(rows))
            results.append(dict(variant, tier="Force 2 vs Force 3", **scores))
            print(f"| {variant['cache']} | {variant['budget']} | {variant['chunk']} | {variant['recent']} | "
                  f"{variant['scoring']} | {variant['selection']} | {scores['accept T=1.0']:.3f} | "
                  f"{scores['accept T=0.6']:.3f} | {scores['greedy']:.3f} |", flush=True)
        force1_runs = [(window, name) for window in args.force1_window if window
                       for name in args.force1_variants + ([f"draft {args.draft_model}"] if draft else [])]
        for force1_window, name in force1_runs:
            if name in FORCE1_VARIANTS:
                copy, positions = FORCE1_VARIANTS[name]
                drafter = ModelDrafter(tier_model(model, args.force1_precision, 1), args.force1_sink, force1_window,
                                       LogitsProcessorList(), False, None, source=full if copy else None,
                                       positions=positions)
            else:  # the draft model: its cache filled by its own weights' forward (it cannot copy the target's)
                drafter = ModelDrafter(tier_model(draft, args.force1_precision, 1), args.force1_sink, force1_window,
                                       LogitsProcessorList(), False, None, fill_model=draft,
                                       positions=draft_positions(TriForceConfig(), model, draft))
            sequence = ids[:, :-1]
            drafter.prefill(torch.cat((sequence, ids[:, -1:]), dim=1))
            force1 = []
            for i in range(k):
                sequence = torch.cat((sequence, forced[:, i : i + 1]), dim=1)  # n - 1 + i + 1 tokens
                _, rows, _ = run_inline(drafter._draft_steps(sequence, 1))
                force1.append(rows[0])
            force1 = torch.stack(force1)
            window = f"sink {args.force1_sink} + window {force1_window}, {args.force1_precision}, {name}"
            scores = agreement(p, force1)
            results.append(dict(tier="Force 1 vs Force 3", force1=window, **scores))
            print(f"| Force 1 vs Force 3 | {window} | - | - | - | - | {scores['accept T=1.0']:.3f} | "
                  f"{scores['accept T=0.6']:.3f} | {scores['greedy']:.3f} |")
            for label, rows in force2.items():
                scores = agreement(rows, force1)
                results.append(dict(tier="Force 1 vs Force 2", force1=window, force2=label, **scores))
                print(f"| Force 1 vs Force 2 ({label}) | {window} | - | - | - | every | {scores['accept T=1.0']:.3f} | "
                      f"{scores['accept T=0.6']:.3f} | {scores['greedy']:.3f} |", flush=True)
    if args.json:
        settings = {key: value for key, value in vars(args).items() if key != "json"}
        with open(args.json, "w") as handle:
            json.dump({"settings": settings, "context_tokens": n, "entropy": entropy, "top_probability": top,
                       "answer": forced[0, 1:].tolist() + [int(p[-1].argmax())], "rows": results}, handle, indent=1)


if __name__ == "__main__":
    main()
