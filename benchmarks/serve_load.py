"""`hf-triforce serve` (one replica) under concurrent clients: aggregate decode throughput, time to first token and
requests lost, for four settings side by side, each its own server process on the same machine:

- ``plain-alone``: plain static-cache decoding (``--triforce-config off``), one request at a time
  (``--max-batch-size 1``);
- ``plain-batched``: plain decoding, concurrent requests as one batch (plain batched ``generate``);
- ``triforce-alone``: ``TriForceConfig()``, one request at a time;
- ``triforce-batched``: ``TriForceConfig()``, concurrent requests as one ragged TriForce batch.

Each setting runs two phases of ``--clients`` concurrent clients, each with a held-out document of its own
(``--text``, ``--context`` tokens): ``first``, a first question on each document (its prefill included), then
``second``, another question on each (the documents' prefixes in the prefix store). Per phase: the aggregate decode
tokens/s (every completion token after each request's first, over the seconds from the phase's first first token to
its last token), the clients' time to first token p50/p95 (queueing included), the requests lost (an error or no
answer). Greedy (temperature 0) by default, or ``--temperature 0.6 --top-p 0.9``; greedy answers are compared
between the settings, request by request.

    python benchmarks/serve_load.py                                              # 8 clients, 8k Wikipedia documents
    python benchmarks/serve_load.py --context 512 --new-tokens 8 --clients 2     # a quick check that it runs
"""

from __future__ import annotations

import argparse
import json
import socket
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from hf_triforce_bench.server_process import start_server, stop_server

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = {  # name: (--triforce-config, batched)
    "plain-alone": ("off", False), "plain-batched": ("off", True),
    "triforce-alone": ("{}", False), "triforce-batched": ("{}", True),
}
QUESTIONS = [
    "Summarize the text above in three sentences.",
    "Which people, places or organizations does the text above name, and what does it say about each?",
]


def documents(text: str, tokenizer, count: int, tokens: int) -> list[str]:
    """``count`` consecutive stretches of ``text`` of about ``tokens`` tokens each."""
    ids = tokenizer(text, add_special_tokens=False).input_ids
    if len(ids) < count * tokens:
        raise SystemExit(f"serve_load: the text has {len(ids)} tokens, fewer than {count} x {tokens}")
    return [tokenizer.decode(ids[k * tokens : (k + 1) * tokens]) for k in range(count)]


def ask(client, args, document: str, question: str) -> dict:
    """One streamed chat request: the client's clock (send, first and last token) and the server's figures; an error
    is kept, not raised (a lost request)."""
    sent = time.perf_counter()
    first = last = None
    text, usage = "", None
    try:
        stream = client.chat.completions.create(
            model=args.model, messages=[{"role": "user", "content": f"{document}\n\n{question}"}],
            max_tokens=args.new_tokens, temperature=args.temperature, top_p=args.top_p, stream=True,
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            elif chunk.choices and chunk.choices[0].delta.content:
                text += chunk.choices[0].delta.content
                last = time.perf_counter()
                first = first or last
    except Exception as error:  # the bench counts it as lost and goes on
        return {"error": f"{type(error).__name__}: {error}", "sent": sent}
    if usage is None:
        return {"error": "no usage chunk", "sent": sent}
    figures = usage.model_extra["triforce"]
    return {"sent": sent, "first": first, "last": last, "text": text, "completion_tokens": usage.completion_tokens,
            "cached_tokens": usage.prompt_tokens_details.cached_tokens, "batch_rows": (figures.get("batch") or {}).get(
                "rows", 1), "queue_s": figures.get("queue_seconds"), "server_prefill_s": figures.get(
                "server_prefill_seconds")}


def phase(client, args, requests: list[tuple[str, str]], label: str) -> list[dict]:
    from tqdm import tqdm

    with ThreadPoolExecutor(len(requests)) as pool, tqdm(total=len(requests), desc=label) as bar:
        futures = [pool.submit(ask, client, args, document, question) for document, question in requests]
        results = []
        for future in futures:
            results.append(future.result())
            bar.update()
    return results


def run_setting(args, name: str, docs: list[str]) -> dict:
    import openai

    triforce, batched = SETTINGS[name]
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    command = [args.model, "--replicas", "1", "--triforce-config", triforce, "--max-batch-size",
               str(args.max_batch_size if batched else 1), "--prefix-store-bytes", str(args.store_bytes)]
    if args.threads:
        command += ["--threads", str(args.threads)]
    log = args.out.with_suffix(f".{name}.log")
    try:
        process = start_server(command, port, log, args.start_timeout, cwd=ROOT)
    except RuntimeError as error:
        raise SystemExit(f"serve_load: {error}") from error
    try:
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                               timeout=args.request_timeout)
        ask(client, args, "Hello.", "Say hello.")  # the first call's set-up (kernels, routes)
        return {label: phase(client, args, [(doc, question) for doc in docs], f"{name} {label}")
                for label, question in zip(("first", "second"), QUESTIONS)}
    finally:
        stop_server(process, timeout=120)


def summary(rows: list[dict]) -> dict:
    answered = [row for row in rows if "error" not in row and row["first"] is not None]
    if not answered:
        return {"requests": len(rows), "lost": len(rows)}
    ttft = sorted(row["first"] - row["sent"] for row in answered)
    decoded = sum(row["completion_tokens"] - 1 for row in answered)
    span = max(row["last"] for row in answered) - min(row["first"] for row in answered)
    return {"requests": len(rows), "lost": len(rows) - len(answered),
            "decode_tok_s": decoded / span if span > 0 else None,
            "ttft_p50_s": statistics.median(ttft), "ttft_p95_s": ttft[round(0.95 * (len(ttft) - 1))],
            "max_batch_rows": max(row["batch_rows"] for row in answered),
            "median_cached_tokens": statistics.median(row["cached_tokens"] for row in answered)}


def table(results: dict) -> str:
    lines = ["| phase | setting | requests | lost | aggregate decode tok/s | TTFT p50 s | TTFT p95 s | largest batch | "
             "median cached tokens |", "|---|---|---|---|---|---|---|---|---|"]
    for label in ("first", "second"):
        for name, runs in results.items():
            s = summary(runs[label])
            if "decode_tok_s" not in s:
                lines.append(f"| {label} | {name} | {s['requests']} | {s['lost']} | - | - | - | - | - |")
                continue
            lines.append(f"| {label} | {name} | {s['requests']} | {s['lost']} | {s['decode_tok_s'] or 0:.1f} | "
                         f"{s['ttft_p50_s']:.2f} | {s['ttft_p95_s']:.2f} | {s['max_batch_rows']} | "
                         f"{s['median_cached_tokens']:.0f} |")
    names = list(results)
    for other in names[1:]:
        same = [a.get("text") == b.get("text") for label in ("first", "second")
                for a, b in zip(results[names[0]][label], results[other][label])]
        lines.append(f"answers of {other} identical to {names[0]}'s: {sum(same)} of {len(same)}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m", help="a bundled model name or a model folder")
    parser.add_argument("--text", default="wikipedia", help="the documents' text (hf_triforce.texts.TEXTS)")
    parser.add_argument("--context", type=int, default=8000, help="document tokens (default 8000)")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--max-batch-size", type=int, default=8, help="the batched settings' --max-batch-size")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=list(SETTINGS))
    parser.add_argument("--store-bytes", type=int, default=8 << 30, help="the prefix store's budget")
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the replica (default all cores)")
    parser.add_argument("--start-timeout", type=float, default=600)
    parser.add_argument("--request-timeout", type=float, default=7200)
    parser.add_argument("--out", type=Path, default=Path("serve-load.json"))
    args = parser.parse_args(argv)
    from hf_triforce.assets import load_model
    from hf_triforce_bench.texts import TEXTS

    args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.text not in TEXTS:
        raise SystemExit(f"serve_load: --text must be one of {sorted(TEXTS)}, got {args.text!r}")
    _, tokenizer = load_model(args.model)  # also puts a bundled model's checkpoint on disk before the servers start
    docs = documents(TEXTS[args.text](), tokenizer, args.clients, args.context)
    results = {}
    for name in args.settings:
        results[name] = run_setting(args, name, docs)
        args.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results,
                                        "summary": {n: {label: summary(r[label]) for label in r}
                                                    for n, r in results.items()}}, indent=1))
    print(table(results))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
