import sys, time, statistics, torch
from hf_triforce import assets
from hf_triforce.bench import prefill_prefix, measure, Run
torch.set_num_threads(2)
ctx = int(sys.argv[1]); configs = [tuple(map(int, c.split(","))) for c in sys.argv[2:]]
model, tok = assets.load_smollm2(**(assets.yarn_rope(4) if ctx > 8000 else {}))
import os; off = int(os.environ.get("OFF", 0)); ids = tok(assets.TEXTS["shakespeare"](), return_tensors="pt").input_ids[:, off:off + ctx]
t = time.perf_counter(); prefix = prefill_prefix(model, ids); pre = time.perf_counter() - t
print("prefill", pre, flush=True)
runs = {"plain": Run("plain"), **{c: Run("triforce-ngram-int8") for c in configs}}
for r in range(3):
    for key, run in runs.items():
        measure(model, ids, prefix, run.method, 128, 512, run, pre, gammas=(2, 6) if key == "plain" else key)
    print("round", r, {k: round(v.tokens_per_second, 2) for k, v in runs.items()}, flush=True)
base = runs["plain"]
for k, v in runs.items():
    s = v.stats
    print(k, round(v.tokens_per_second, 2), round(v.tokens_per_second / base.tokens_per_second, 2),
          "same" if torch.equal(v.sequences, base.sequences) else "DIFF",
          s and (round(s.force2_acceptance, 2), round(s.force3_acceptance, 2), round(s.tokens_per_force3_step, 2),
                 round(s.force2_seconds, 1), round(s.force3_seconds, 1)))
