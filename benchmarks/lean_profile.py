"""Per-op profile of one Force-1 forward (SmolLM2, one token on a 272-entry sink+window cache): the eager
transformers forward and the lean ``lean-int4`` one (`hf_triforce.kernels.lean`), each timed unprofiled (median of
30) and then profiled over 20 forwards (torch.profiler adds a few microseconds to every op: small ops read high).

    python benchmarks/lean_profile.py --threads 2 > docs/bench/lean-drafting/profile-2-threads.txt
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
from torch.profiler import ProfilerActivity, profile

from hf_triforce.caches.sink_window import SinkWindowCache, make_layer_rerotations
from hf_triforce.decoding.forward import forward_logits
from hf_triforce.integration import recording_attention
from hf_triforce.kernels.lean import lean_model
from hf_triforce.tools.assets import essays, load_smollm2


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load_smollm2()
    ids = torch.tensor([tokenizer(essays()[:20000]).input_ids[:600]])
    rerotations = make_layer_rerotations(model)
    for name, drafting in (("eager", model), ("lean-int4", lean_model(model, "lean-int4"))):
        cache = SinkWindowCache(model.config.num_hidden_layers, 16, 256, rerotations)
        with torch.no_grad(), recording_attention(model):
            forward_logits(drafting, ids[:, :271], cache, 0, 1)

            def step(drafting=drafting, cache=cache):
                forward_logits(drafting, ids[:, 300:301], cache, 271, 1)
                cache.rollback(271)

            for _ in range(5):
                step()
            seconds = []
            for _ in range(30):
                start = time.perf_counter()
                step()
                seconds.append(time.perf_counter() - start)
            with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
                for _ in range(20):
                    step()
        print(f"== {name}: forward median {1e3 * statistics.median(seconds):.2f} ms (unprofiled), "
              f"{args.threads} threads, load {os.getloadavg()[0]:.2f}")
        print(prof.key_averages(group_by_input_shape=True).table(
            sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40, max_shapes_column_width=60))
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))


if __name__ == "__main__":
    main()
