"""What the CPU attention kernel (`kernels.cpu_attention`) costs against ATen's best route, by cache length and rows.

For each attention shape (SmolLM2-135M: 3 KV heads of 64; Qwen2.5-Coder-1.5B: 2 KV heads of 128; ``--dtype``), cache
length and number of new tokens, times `cpu_attention.attend` against the route the attention wrapper takes without
it: `attention.one_row_sdpa` for one new token, else the cheaper of `attention.gqa_sdpa` (one masked call) and
`attention.split_kv_sdpa` (spans merged by log-sum-exp). K/V are random views of longer buffers, as a cache's are
(the cost does not depend on the values); the routes alternate within each setting; medians of ``--repeats``. Each
row also gives the kernel's largest error against float64, beside ATen's.

    python benchmarks/cpu_attention_cost.py --threads 2 --dtype bfloat16 --json out.json

On an AVX2 CPU's instructions (an AVX-512 machine standing in for one): the kernel built for x86-64-v3
(``HF_TRIFORCE_CPU_MARCH=x86-64-v3``) against ATen's AVX2 kernels (``ATEN_CPU_CAPABILITY=avx2``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from torch import nn

from hf_triforce.kernels import attention, cpu_attention

SHAPES = {"smollm2-135m": (3, 3, 64), "qwen2.5-coder-1.5b": (2, 6, 128)}


def aten_route(module, query, keys, values):
    """The callables the wrapper would choose between without the kernel."""
    new, length = query.shape[2], keys.shape[2]
    if new == 1:
        return {"one_row_sdpa": lambda: attention.one_row_sdpa(module, query, keys, values, None)[0]}
    mask = torch.ones(1, 1, new, length, dtype=torch.bool).tril(length - new)
    return {"gqa_sdpa": lambda: attention.gqa_sdpa(module, query, keys, values, mask)[0],
            "split_kv_sdpa": lambda: attention.split_kv_sdpa(module, query, keys, values, None)[0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 8192, 16384, 32768])
    parser.add_argument("--new", type=int, nargs="+", default=[1, 4, 7])
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="the query's, keys' and values' dtype (default float32)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not cpu_attention.available():
        raise SystemExit(f"the CPU attention kernel does not run here: {cpu_attention.status()}")
    module = nn.Module().eval()
    rows = []
    print("| shape | cached | new tokens | ATen route | ATen ms | kernel ms | speed-up | kernel / ATen max error |")
    print("|---|---|---|---|---|---|---|---|")
    for name, (kv_heads, groups, dim) in SHAPES.items():
        for length in args.lengths:
            buffers = (torch.randn(2, 1, kv_heads, length + 64, dim) * 0.5).to(dtype)
            for new in args.new:
                keys, values = buffers[0, :, :, : length + new], buffers[1, :, :, : length + new]
                query = torch.randn(1, kv_heads * groups, new, dim).to(dtype)
                routes = {**aten_route(module, query, keys, values),
                          "kernel": lambda q=query, k=keys, v=values: cpu_attention.attend(q, k, v, None)}
                times: dict[str, list[float]] = {route: [] for route in routes}
                for _ in range(args.repeats):
                    for route, run in routes.items():
                        start = time.perf_counter()
                        run()
                        times[route].append(time.perf_counter() - start)
                ms = {route: statistics.median(t[2:]) * 1e3 for route, t in times.items()}
                aten = min((r for r in ms if r != "kernel"), key=ms.get)
                exact = cpu_attention.reference(query, keys, values, None)
                error = {route: (routes[route]().reshape(exact.shape).double() - exact).abs().max().item()
                         for route in ("kernel", aten)}
                row = dict(shape=name, cached=length, new=new, aten_route=aten, aten_ms=ms[aten],
                           kernel_ms=ms["kernel"], speedup=ms[aten] / ms["kernel"], kernel_error=error["kernel"],
                           aten_error=error[aten],
                           supported=cpu_attention.supports(query, keys, values))
                rows.append(row)
                print(f"| {name} | {length} | {new} | {aten} | {ms[aten]:.3f} | {ms['kernel']:.3f} | "
                      f"{row['speedup']:.2f}x | {error['kernel']:.1e} / {error[aten]:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, repeats=args.repeats, dtype=args.dtype, torch=torch.__version__,
                           rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
