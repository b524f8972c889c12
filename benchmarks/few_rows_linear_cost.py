"""What a few rows through a model's linear layers cost by route (`kernels.linear_routes`): ATen's two and the kernel's.

For each model's decoder-layer shapes (SmolLM2-135M: hidden 576, MLP 1536; Qwen2.5-Coder-1.5B: hidden 1536, 2 KV heads
of 128, MLP 8960; ``--dtype``, random weights: the cost does not depend on the values) and number of rows, times the
layers of ``--layers`` decoder layers (more weight bytes than a last-level cache, as a forward streams them) under each
route of `linear_routes.multiply`: ``linear`` (``x @ W.T``), ``left`` (``W @ x.T``), ``stream`` (the few-rows kernel);
the routes alternate within each setting; the least of ``--repeats`` (the machine is shared; the minimum is the stable
figure). Each row also gives the weight bytes read per second by the kernel and its largest error against float64 as
a fraction of its error bound (`few_rows_linear.error_bound`).

    python benchmarks/few_rows_linear_cost.py --threads 2 --dtype bfloat16 --json out.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from hf_triforce.kernels import few_rows_linear, linear_routes

DENSE_ROUTES = ("linear", "left", "stream")  # linear_routes.ROUTES less "gguf", which takes a GGUF file's blocks
# one decoder layer's projections, [out, in]: q, k, v, o, gate, up, down
SHAPES = {
    "smollm2-135m": [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)],
    "qwen2.5-coder-1.5b": [(1536, 1536), (256, 1536), (256, 1536), (1536, 1536), (8960, 1536), (8960, 1536),
                           (1536, 8960)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 2, 3, 4, 6, 8, 11])
    parser.add_argument("--layers", type=int, nargs="+", default=[24, 4], help="decoder layers per model, in order")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                        help="the rows' and weights' dtype (default float32)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    if not few_rows_linear.available():
        raise SystemExit(f"the few-rows kernel does not run here: {few_rows_linear.status()}")
    results = []
    print("| shapes | weight MB | rows | linear ms | left ms | stream ms | stream GB/s | stream error / bound |")
    print("|---|---|---|---|---|---|---|---|")
    for (name, shapes), layers in zip(SHAPES.items(), args.layers):
        weights = [torch.randn(out, width, dtype=dtype) for _ in range(layers) for out, width in shapes]
        nbytes = sum(weight.nbytes for weight in weights)
        for rows in args.rows:
            inputs = {width: torch.randn(rows, width, dtype=dtype) for _, width in shapes}
            best = dict.fromkeys(DENSE_ROUTES, float("inf"))
            for _ in range(args.repeats):
                for route in DENSE_ROUTES:
                    began = time.perf_counter()
                    for weight in weights:
                        linear_routes.multiply(route, inputs[weight.shape[1]], weight)
                    best[route] = min(best[route], time.perf_counter() - began)
            weight = weights[-1]
            x = inputs[weight.shape[1]]
            error = (few_rows_linear.multiply(x, weight).double() - x.double() @ weight.double().T).abs()
            ratio = (error / few_rows_linear.error_bound(x, weight)).max().item()
            row = {"shapes": name, "layers": layers, "weight_bytes": nbytes, "rows": rows,
                   **{f"{route}_seconds": seconds for route, seconds in best.items()}, "error_over_bound": ratio}
            results.append(row)
            print(f"| {name} ({layers} layers) | {nbytes / 1e6:.0f} | {rows} | {best['linear'] * 1e3:.1f} | "
                  f"{best['left'] * 1e3:.1f} | {best['stream'] * 1e3:.1f} | {nbytes / best['stream'] / 1e9:.1f} | "
                  f"{ratio:.1e} |", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"threads": args.threads, "dtype": args.dtype, "results": results}, handle, indent=1)


if __name__ == "__main__":
    main()
