"""What the CPU attention kernel (`kernels.cpu_attention`) costs against ATen's route, by cache length and rows, and the
route the library takes (`kernels.attention_routes`), for a chosen build target.

For each attention shape (SmolLM2-135M: 3 KV heads of 64; Qwen2.5-Coder-1.5B: 2 KV heads of 128; ``--dtype``), cache
length and number of new tokens, times `cpu_attention.attend` against the route the attention wrapper takes without
it (`attention.aten_attention`: `one_row_sdpa` for one new token, else `split_kv_sdpa` where it pays, else
`gqa_sdpa`), and gives the route `AttentionRoutes` chooses for that call's class (timed as at a call's set-up) with
its cost: the "routed / ATen" column is the figure that must not exceed 1 (beyond timing noise). K/V are random
views of longer buffers, as a cache's are (the cost does not depend on the values); the routes alternate within each
setting; medians of ``--repeats``. Each row also gives the kernel's largest error against float64, beside ATen's, and
the kernel with every row count taken in pairs (``pairs ms``: `cpu_attention.attend`'s ``narrow_rows`` above any row
count, the path a decoding step takes; a verification's rows, more than `cpu_attention.NARROW_ROWS` a KV head, go in
fours against the keys transposed in AVX-512 builds).

``--march`` builds the kernel for ``native`` (default), ``x86-64-v4`` (AVX-512) or ``x86-64-v3`` (AVX2: the code an
AVX2-only CPU runs, measured on any newer one); it sets ``HF_TRIFORCE_CPU_MARCH`` for this process. Run it once per
target on a quiet machine, e.g.:

    python benchmarks/cpu_attention_cost.py --threads 2 --march x86-64-v3 --json v3.json
    python benchmarks/cpu_attention_cost.py --threads 2 --march native --json native.json
    python benchmarks/cpu_attention_cost.py --threads 2 --march native --dtype bfloat16 --json native-bf16.json

Against ATen's AVX2 kernels as an AVX2-only CPU runs them: ``ATEN_CPU_CAPABILITY=avx2`` (and
``ONEDNN_MAX_CPU_ISA=AVX2``) in the environment of the x86-64-v3 run.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
from tqdm.auto import tqdm

from hf_triforce.kernels import attention, attention_routes, cpu_attention, native_build

SHAPES = {"smollm2-135m": (3, 3, 64), "qwen2.5-coder-1.5b": (2, 6, 128)}


PAIRS = 1 << 20  # `cpu_attention.attend`'s narrow_rows for the pairs column: above any call's rows


def aten_name(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> str:
    """Which function `attention.aten_attention` runs for this call."""
    if query.shape[2] == 1:
        return "one_row_sdpa"
    if attention._wants_split_kv(query, keys, values, 0.0, attention._INFERENCE):
        return "split_kv_sdpa"
    return "gqa_sdpa"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=25)
    parser.add_argument("--march", choices=tuple(native_build.MARCHES), default=None,
                        help="the kernel's build target (HF_TRIFORCE_CPU_MARCH; default: the environment's, else "
                             "native)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--new", type=int, nargs="+", default=[1, 2, 5, 8, 11])
    parser.add_argument("--shapes", nargs="+", choices=tuple(SHAPES), default=list(SHAPES))
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="the query's, keys' and values' dtype (default float32)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    too_few = [n for n in args.new if not 1 <= n <= cpu_attention.MAX_NEW_TOKENS]
    if too_few or min(args.lengths) < cpu_attention.MIN_CACHED:
        raise SystemExit(f"--new must be 1 to {cpu_attention.MAX_NEW_TOKENS} and --lengths at least "
                         f"{cpu_attention.MIN_CACHED} (the calls the kernel takes)")
    if args.march is not None:
        os.environ[native_build.MARCH_ENV] = args.march
    torch.set_num_threads(args.threads)
    if not cpu_attention.available():
        raise SystemExit(f"the CPU attention kernel does not run here: {cpu_attention.status()}")
    target, flags = native_build.build_target(), " ".join(native_build.compile_flags())
    print(f"build target {target} ({flags}); {platform.processor() or platform.machine()}, torch {torch.__version__}, "
          f"{args.threads} threads, ATen's CPU capability {torch.backends.cpu.get_cpu_capability()}\n")
    routes = attention_routes.AttentionRoutes()
    dtype = getattr(torch, args.dtype)
    rows = []
    print("| shape | cached | new tokens | ATen route | ATen ms | kernel ms | kernel speed-up | pairs ms | "
          "route taken | routed / ATen | kernel / ATen max error |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    settings = [(name, length, new) for name in args.shapes for length in args.lengths for new in args.new]
    for name, length, new in tqdm(settings, desc="settings", unit="setting", leave=False):
        kv_heads, groups, dim = SHAPES[name]
        buffers = (torch.randn(2, 1, kv_heads, length + 64, dim) * 0.5).to(dtype)
        keys, values = buffers[0, :, :, : length + new], buffers[1, :, :, : length + new]
        query = torch.randn(1, kv_heads * groups, new, dim).to(dtype)
        runs = {"aten": lambda q=query, k=keys, v=values: attention.aten_attention(q, k, v, None),
                "kernel": lambda q=query, k=keys, v=values: cpu_attention.attend(q, k, v, None),
                "pairs": lambda q=query, k=keys, v=values: cpu_attention.attend(q, k, v, None, narrow_rows=PAIRS)}
        times: dict[str, list[float]] = {route: [] for route in runs}
        order = list(runs)
        for index in range(args.repeats):  # the order rotates: a call right after ATen's shares the cores with its
            for route in order[index % len(order):] + order[:index % len(order)]:  # OpenMP threads' spin-wait
                run = runs[route]
                start = time.perf_counter()
                run()
                times[route].append(time.perf_counter() - start)
        ms = {route: statistics.median(t[2:] or t) * 1e3 for route, t in times.items()}
        taken = routes.route(query, keys)  # as a call's set-up times it: its class, once
        exact = cpu_attention.reference(query, keys, values, None)
        error = {route: (run().reshape(exact.shape).double() - exact).abs().max().item() for route, run in runs.items()}
        row = dict(shape=name, cached=length, new=new, aten_route=aten_name(query, keys, values), aten_ms=ms["aten"],
                   kernel_ms=ms["kernel"], speedup=ms["aten"] / ms["kernel"], pairs_ms=ms["pairs"], route=taken,
                   routed_over_aten=ms[taken] / ms["aten"], kernel_error=error["kernel"], aten_error=error["aten"])
        rows.append(row)
        tqdm.write(f"| {name} | {length} | {new} | {row['aten_route']} | {ms['aten']:.3f} | {ms['kernel']:.3f} | "
                   f"{row['speedup']:.2f}x | {ms['pairs']:.3f} | {taken} | {row['routed_over_aten']:.2f} | "
                   f"{error['kernel']:.1e} / {error['aten']:.1e} |")
    worst = max(rows, key=lambda row: row["routed_over_aten"])
    print(f"\nworst routed / ATen: {worst['routed_over_aten']:.2f} ({worst['shape']}, {worst['cached']} cached, "
          f"{worst['new']} new, route {worst['route']}); route timings {routes.calibration_seconds:.1f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(threads=args.threads, repeats=args.repeats, dtype=args.dtype, torch=torch.__version__,
                           build_target=target,
                           flags=flags, cpu=platform.processor(), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
