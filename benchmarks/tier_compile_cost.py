"""Force-1 and Force-2 forward costs of the lean tiers by ``TriForceConfig.tier_compile``.

SmolLM2-135M, a question-free slice of Paul Graham's essays: Force 1 = one token on a 272-entry sink+window cache
(sink 16 + window 256, filled to 264), Force 2 = gamma1 + 1 = 3 tokens on a retrieval-sized buffer (budget 4096 +
tail, filled to 4096). Each forward timed ``--reps`` times after warm-up (min and median, ms); ``compile`` also
reports the seconds its first calls spent compiling (paid once per model and process).

    python benchmarks/tier_compile_cost.py --precision lean-int4 --threads 2 --json out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from hf_triforce.assets import load_smollm2
from hf_triforce.caches.buffer import BufferCache
from hf_triforce.caches.sink_window import SinkWindowCache, make_layer_rerotations
from hf_triforce.decoding.tiers import lean_model
from hf_triforce_bench.texts import essays


def timed(model, cache, tokens: torch.Tensor, start: int, reps: int) -> tuple[float, float]:
    n = tokens.shape[1]
    positions = torch.arange(start, start + n)[None]

    def once():
        model(input_ids=tokens, cache=cache, position_ids=positions, logits_to_keep=n)
        cache.rollback(start)

    for _ in range(3):
        once()
    seconds = []
    for _ in range(reps):
        began = time.perf_counter()
        once()
        seconds.append(time.perf_counter() - began)
    return min(seconds) * 1e3, statistics.median(seconds) * 1e3


@torch.no_grad()
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="lean-int4")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    parser.add_argument("--json")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    ids = tokenizer(essays()[:60000], return_tensors="pt").input_ids[:, :4100]
    lean = lean_model(model, args.precision)
    force1 = SinkWindowCache(model.config.num_hidden_layers, 16, 256, make_layer_rerotations(model))
    lean(input_ids=ids[:, :264], cache=force1, position_ids=torch.arange(264)[None])
    force2 = BufferCache(model.config.num_hidden_layers, 4096 + 64)
    for begin in range(0, 4096, 1024):
        lean(input_ids=ids[:, begin : begin + 1024], cache=force2, position_ids=torch.arange(begin, begin + 1024)[None])
    rows = []
    for mode in ("off", "fixed", "compile"):
        view = lean if mode == "off" else lean.compiled(mode)
        began = time.perf_counter()
        f1 = timed(view, force1, ids[:, 264:265], 264, args.reps)
        f2 = timed(view, force2, ids[:, 4096:4099], 4096, args.reps)
        fixed = view.fixed_shape
        rows.append(dict(mode=mode, force1_ms=f1, force2_ms=f2, wall_s=time.perf_counter() - began,
                         compiles=fixed.compiles if fixed else 0,
                         compile_seconds=fixed.compile_seconds if fixed else 0.0))
        print(json.dumps(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(precision=args.precision, threads=args.threads, reps=args.reps, rows=rows,
                           cpu=open("/proc/cpuinfo").read().split("model name")[1].split("\n")[0].strip(": ")),
                      f, indent=1)


if __name__ == "__main__":
    main()
