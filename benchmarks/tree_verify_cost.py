"""Cost of verifying a candidate tree on a full cache of L tokens vs a one-token decode (SmolLM2-135M shapes).

The aim: a tree of up to 32 nodes verified at 32k for at most 1.3x a one-token decode on the CPU path.
As in `verify_cost.py` the KV buffer is filled with random values (attention cost does not depend on them), so
32k is measured without a prefill. Timed, each as the median of ``--repeats`` forwards after a warm-up, through
TriForce's attention (recording wrapper): a one-token decode and a chain of ``--chain`` proposals (root + chain
rows) through the chain path (`forward_logits`), and a tree of ``--nodes`` nodes (``--branches`` chains of
equal depth under the root: the shape with the most rows per depth).

    python benchmarks/tree_verify_cost.py --contexts 8192 16384 32768 --nodes 31 --branches 4 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from hf_triforce import assets
from hf_triforce.caches import BufferCache
from hf_triforce.decoding.tree_forward import tree_logits
from hf_triforce.forwards.forward import forward_logits
from hf_triforce.integration import recording_attention
from hf_triforce.verification.draft_tree import DraftTree
from hf_triforce_bench import texts


def fill(model, cache: BufferCache, length: int) -> None:
    cfg = model.config
    shape = (1, cfg.num_key_value_heads, length, getattr(cfg, "head_dim", None) or cfg.hidden_size //
             cfg.num_attention_heads)
    for layer in cache.layers:
        layer.write(*((torch.randn(shape) * 0.5).to(model.device, model.dtype) for _ in range(2)))


def branches_tree(nodes: int, branches: int) -> DraftTree:
    """``branches`` chains under the root, ``nodes`` in all (the first chains one node longer where uneven)."""
    tokens, parents = [], []
    for branch in range(branches):
        depth = nodes // branches + (branch < nodes % branches)
        for level in range(depth):
            parents.append(-1 if level == 0 else len(tokens) - 1)
            tokens.append(1 + len(tokens))
    return DraftTree(tokens, parents)


def timed(model, cache: BufferCache, length: int, tree: DraftTree | None, rows: int, repeats: int) -> float:
    """Seconds of one forward: ``tree`` after the root (the last token, uncached) through the tree path, or, with
    ``tree=None``, ``rows`` tokens through the chain path (``rows=1``: a decoding step)."""
    sequence = torch.randint(0, min(1000, model.config.vocab_size), (1, length + max(rows, 1)), device=model.device)
    times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with torch.no_grad():
            if tree is None:
                logits = forward_logits(model, sequence[:, length:], cache, length, rows)
            else:
                logits = tree_logits(model, cache, length, sequence[:, : length + 1], tree)
        if logits.is_cuda:  # wait for the forward, not its launch
            torch.cuda.synchronize(logits.device)
        times.append(time.perf_counter() - start)
        cache.rollback(length)
    return statistics.median(times[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--nodes", type=int, default=31, help="tree nodes besides the root (31: 32 rows)")
    parser.add_argument("--branches", type=int, default=4)
    parser.add_argument("--chain", type=int, default=6, help="chain length compared (gamma2)")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                        help="the model's and cache's dtype (bfloat16: ATen's CPU kernels use AMX where present)")
    args = parser.parse_args()
    model, _ = assets.load_smollm2(**texts.yarn_rope(4.0))
    model = model.to(getattr(torch, args.dtype))
    tree = branches_tree(args.nodes, args.branches)
    print(f"| context | decode 1 tok ms | chain of {args.chain} ms | ratio | tree of {args.nodes} nodes ms | ratio |")
    print("|---|---|---|---|---|---|")
    for length in args.contexts:
        cache = BufferCache(model.config.num_hidden_layers, length + args.nodes + 2)
        fill(model, cache, length)
        with recording_attention(model):
            one = timed(model, cache, length, None, 1, args.repeats)
            chained = timed(model, cache, length, None, args.chain + 1, args.repeats)
            treed = timed(model, cache, length, tree, 0, args.repeats)
        print(f"| {length} | {one * 1e3:.0f} | {chained * 1e3:.0f} | {chained / one:.2f}x | {treed * 1e3:.0f} | "
              f"{treed / one:.2f}x |", flush=True)
        del cache


if __name__ == "__main__":
    main()
