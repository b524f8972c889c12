"""How well does Force 2 (the target on a retrieval cache) agree with Force 3 (the full cache)? Teacher-forced.

One prefill of a question prompt about a natural text (Paul Graham's essays, the chat template, SmolLM2,
YaRN where the context needs it), then the model's own greedy answer (``--new-tokens``) is scored position
by position: ``p`` from the full cache, ``q`` from each sparse cache selected the way Force 2 selects it —
with the query of the last cached token, refreshed at every position (``refresh_every=1``) or only once at
the end of the prompt. Reported per configuration: expected acceptance ``sum(min(p, q))`` at temperature 1 and
at 0.6 (what a sampled verification accepts), and greedy agreement (``argmax q == argmax p``). A StreamingLLM
cache (sink chunk + recent tokens, same budget) is the baseline the retrieval has to beat.

Force 1 too (``--force1-window``): the target drafting on its sink+window cache (`ModelDrafter`, in-cache positions,
at ``--force1-precision``), fed the same answer: its agreement with Force 3 (what two levels accept) and with each
refreshed Force-2 configuration (what Force 2 accepts of Force 1's drafts). And how flat the target's own law is
there (mean entropy, mean top probability): a flat ``p`` caps every tier's acceptance.

    python benchmarks/sparse_agreement.py --context 16000 --rope-factor 2 --budgets 512 1024 2048 4096
    python benchmarks/sparse_agreement.py --text wikipedia --context 32000 --rope-factor 4 --budgets 1024 4096 \
        --chunks 8
"""

from __future__ import annotations

import argparse
import time

import torch
from transformers import LogitsProcessorList

from hf_triforce.caches import BufferCache, RetrievalCache
from hf_triforce.decoding.forward import forward_logits, prefill
from hf_triforce.decoding.steps import run_inline
from hf_triforce.decoding.tiers import tier_model
from hf_triforce.drafters.model import ModelDrafter
from hf_triforce.integration import recording_attention
from hf_triforce.kernels.attention import QueryRecorder
from hf_triforce.tools import assets
from hf_triforce.tools.prompts import document_prompt

FORCE1_VARIANTS = {"forward-slots": (False, "slots"), "copy-slots": (True, "slots"),
                   "forward-absolute": (False, "absolute"), "copy-absolute": (True, "absolute")}


def agreement(p_logits: torch.Tensor, q_logits: torch.Tensor) -> dict[str, float]:
    out = {}
    for temperature in (1.0, 0.6):
        p = torch.softmax(p_logits.float() / temperature, -1)
        q = torch.softmax(q_logits.float() / temperature, -1)
        out[f"accept T={temperature}"] = float(torch.minimum(p, q).sum(-1).mean())
    out["greedy"] = float((p_logits.argmax(-1) == q_logits.argmax(-1)).float().mean())
    return out


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=16000)
    parser.add_argument("--rope-factor", type=float, default=None)
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--budgets", type=int, nargs="+", default=[512, 1024, 2048, 4096])
    parser.add_argument("--chunks", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--text", choices=sorted(assets.TEXTS), default="essays")
    parser.add_argument("--force1-sink", type=int, default=16)
    parser.add_argument("--force1-window", type=int, default=256, help="0: no Force-1 rows")
    parser.add_argument("--force1-precision", default="model", help="a TriForceConfig.draft_precision but 'auto'")
    parser.add_argument("--force1-variants", nargs="+", default=list(FORCE1_VARIANTS), choices=list(FORCE1_VARIANTS),
                        help="how Force 1's cache is filled (a forward over the sinks and window, or a copy of the "
                             "full cache's entries) and which positions it uses (in-cache slots or absolute)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    overrides = assets.yarn_rope(args.rope_factor) if args.rope_factor else {}
    model, tokenizer = assets.load_smollm2(**overrides)
    ids = document_prompt(tokenizer, assets.TEXTS[args.text](), args.context)
    n, k = ids.shape[1], args.new_tokens
    answer = model.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False)[:, n:]
    forced = torch.cat((ids[:, -1:], answer[:, :-1]), dim=1)  # token fed at positions n-1 .. n+k-2
    layers = model.config.num_hidden_layers
    full = BufferCache(layers, n + k)
    start = time.perf_counter()
    with recording_attention(model):
        at_prompt_end, forced_rows = QueryRecorder(), QueryRecorder()
        prefill(model, ids[:, :-1], full, chunk_size=2048, show_progress=True, recorder=at_prompt_end)
        p = forward_logits(model, forced, full, n - 1, k, forced_rows)  # the full cache now holds n + k - 1
        # the query of the last cached token when position i is predicted: token n-2+i
        selection_queries = [at_prompt_end.at(-1)] + [forced_rows.at(i) for i in range(k - 1)]
        print(f"prefill + reference {time.perf_counter() - start:.0f} s; text {args.text}, context {n}, {k} "
              f"teacher-forced positions of the greedy answer; rope factor {args.rope_factor}", flush=True)
        law = torch.softmax(p.float(), -1)
        entropy = float(-(law * torch.log(law.clamp(min=1e-30))).sum(-1).mean())
        print(f"the target's law there (T=1): mean entropy {entropy:.2f} nats, mean top probability "
              f"{float(law.max(-1).values.mean()):.3f}", flush=True)
        force2 = {}  # (budget, chunk) -> Force 2's logits, selection refreshed at every position
        print("| cache | budget | chunk | selection | accept T=1 | accept T=0.6 | greedy |")
        print("|---|---|---|---|---|---|---|")
        for budget in args.budgets:
            for chunk in args.chunks:
                if budget % chunk:
                    continue
                variants = [("retrieval", (budget // 4) // chunk * chunk, True),
                            ("retrieval", (budget // 4) // chunk * chunk, False)]
                if chunk == args.chunks[0]:
                    variants.append(("streaming (sink + recent)", budget - chunk, True))
                for name, recent, refreshed in variants:
                    cache = RetrievalCache(layers, budget, chunk, recent, k + 2)
                    rows = []
                    for i in range(k):
                        upto = n - 1 + i  # tokens before the one fed at position n-1+i
                        if refreshed or i == 0:
                            cache.select(full, upto, selection_queries[i])
                        else:
                            cache.sync(full, upto)
                        rows.append(forward_logits(model, forced[:, i : i + 1], cache, upto, 1)[0])
                    if refreshed and name == "retrieval":
                        force2[budget, chunk] = torch.stack(rows)
                    scores = agreement(p, torch.stack(rows))
                    print(f"| {name} | {budget} | {chunk} | {'every position' if refreshed else 'end of prompt'} | "
                          f"{scores['accept T=1.0']:.3f} | {scores['accept T=0.6']:.3f} | {scores['greedy']:.2f} |",
                          flush=True)
        for variant in args.force1_variants if args.force1_window else ():
            copy, positions = FORCE1_VARIANTS[variant]
            drafter = ModelDrafter(tier_model(model, args.force1_precision, 1), args.force1_sink, args.force1_window,
                                   LogitsProcessorList(), False, None, source=full if copy else None,
                                   positions=positions)
            sequence = ids[:, :-1]
            drafter.prefill(torch.cat((sequence, ids[:, -1:]), dim=1))
            force1 = []
            for i in range(k):
                sequence = torch.cat((sequence, forced[:, i : i + 1]), dim=1)  # n - 1 + i + 1 tokens
                _, rows, _ = run_inline(drafter._draft_steps(sequence, 1))
                force1.append(rows[0])
            force1 = torch.stack(force1)
            window = f"sink {args.force1_sink} + window {args.force1_window}, {args.force1_precision}, {variant}"
            scores = agreement(p, force1)
            print(f"| Force 1 vs Force 3 | {window} | - | - | {scores['accept T=1.0']:.3f} | "
                  f"{scores['accept T=0.6']:.3f} | {scores['greedy']:.2f} |")
            for (budget, chunk), rows in force2.items():
                scores = agreement(rows, force1)
                print(f"| Force 1 vs Force 2 ({budget}, chunk {chunk}) | {window} | - | every position | "
                      f"{scores['accept T=1.0']:.3f} | {scores['accept T=0.6']:.3f} | {scores['greedy']:.2f} |",
                      flush=True)

if __name__ == "__main__":
    main()
