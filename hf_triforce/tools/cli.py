"""`hf-triforce demo | generate | serve` (also `python -m hf_triforce ...`); the measurement bench is
`hf-triforce-bench` (the ``hf_triforce_bench`` package, ``pip install hf-triforce[bench]``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def _positive(value: str) -> int:
    number = int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return number


def _probability(value: str) -> float:
    number = float(value)
    if not 0.0 < number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {value}")
    return number


def _bytes(value: str) -> int:
    units = {"": 1, "b": 1, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "kb": 10**3, "mb": 10**6, "gb": 10**9}
    text = value.strip().lower()
    digits = text.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = text[len(digits):]
    try:
        number = float(digits)
    except ValueError:
        number = -1.0
    if unit not in units or number < 0:
        raise argparse.ArgumentTypeError(f"must be a size in bytes such as 4GiB, 512MiB or 1000000, got {value}")
    return int(number * units[unit])


def _temperature(value: str) -> float:
    number = float(value)
    if not number > 0.0:
        raise argparse.ArgumentTypeError(f"must be above 0, got {value}")
    return number


# `TriForceConfig` fields the demo and generate take from the command line: (option, field, help); unset, each is
# TriForceConfig's default
CONFIG_OPTIONS = (
    ("--budget", "retrieval_budget", "tokens of Force 2's retrieval cache"),
    ("--chunk-size", "chunk_size", "tokens per retrieval chunk"),
    ("--gamma1", "gamma1", "Force-1 tokens per Force-2 step"),
    ("--gamma2", "gamma2", "Force-2 tokens per Force-3 step"),
    ("--sink-tokens", "sink_tokens", "Force-1 cache sink tokens"),
    ("--window", "window", "Force-1 cache window"),
)


def add_config_arguments(parser: argparse.ArgumentParser) -> None:
    """The `TriForceConfig` fields of `CONFIG_OPTIONS` as options (default: TriForceConfig's own)."""
    from ..config import TriForceConfig

    group = parser.add_argument_group("TriForce (default: TriForceConfig's)")
    defaults = TriForceConfig()
    for option, name, text in CONFIG_OPTIONS:
        kind = int if name == "sink_tokens" else _positive
        group.add_argument(option, type=kind, default=None, dest=name, metavar="N",
                           help=f"{text} (default {getattr(defaults, name)})")


def config_fields(args: argparse.Namespace) -> dict:
    """The `CONFIG_OPTIONS` fields given on the command line, as `TriForceConfig` keyword arguments."""
    return {name: getattr(args, name) for _, name, _ in CONFIG_OPTIONS if getattr(args, name) is not None}


def build_parser() -> argparse.ArgumentParser:
    from ..assets import MODELS
    from ..drafters import drafter_names
    from .demo import BASELINES
    from .prompts import PROMPTS

    model_help = f"one of {', '.join(MODELS)} or a local model folder"

    parser = argparse.ArgumentParser(prog="hf-triforce", description="Exact TriForce speculative decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    demo = commands.add_parser("demo", help="plain generate vs TriForce on SmolLM2-135M and a question about a "
                               "Shakespeare play, greedy and sampled")
    demo.add_argument("--context", type=_positive, default=8000, help="prompt tokens (default 8000)")
    demo.add_argument("--new-tokens", type=_positive, default=96, help="tokens to generate (default 96)")
    demo.add_argument("--draft", choices=drafter_names(), default=None,
                      help="TriForce's Force-1 drafter (default: TriForceConfig's)")
    demo.add_argument("--baselines", nargs="*", choices=BASELINES, default=list(BASELINES),
                      help="transformers' best plain decoding beside plain generate: a StaticCache eager and with "
                      "generate's compile (default both; the faster counts)")
    demo.add_argument("--prompt", choices=PROMPTS, default="question",
                      help="'question' (default): the play in the chat template and a question about it; "
                      "'continue': the raw play, continued")
    demo.add_argument("--play", default="hamlet", help="Shakespeare tragedy used as the prompt (default hamlet)")
    demo.add_argument("--threads", type=_positive, default=None, help="torch threads (default: torch's choice)")
    add_config_arguments(demo)

    gen = commands.add_parser("generate", help="stream a TriForce continuation of a prompt file")
    gen.add_argument("--model", default=None, help=f"{model_help} (default smollm2-135m)")
    gen.add_argument("--prompt-file", type=Path, required=True)
    gen.add_argument("--max-new-tokens", type=_positive, default=128)
    gen.add_argument("--sample", action="store_true", help="sample instead of greedy decoding")
    gen.add_argument("--temperature", type=_temperature, default=1.0)
    gen.add_argument("--top-p", type=_probability, default=1.0)
    gen.add_argument("--draft", default="self",
                     help=f"a registered drafter ({', '.join(drafter_names())}) or a draft model: {model_help}")
    gen.add_argument("--int8", action="store_true", help="run Force 1 and Force 2 on int8 copies (CPU, fp32 model)")
    gen.add_argument("--stats", action="store_true", help="print the per-tier statistics at the end")
    add_config_arguments(gen)

    serve = commands.add_parser("serve", help="an OpenAI-compatible server (chat and text completions, streamed or "
                                "not) answering with TriForce, with a store of prefilled prompt prefixes; Ray Serve "
                                "replicas on this machine or a Ray cluster (docs/serving.md)")
    serve.add_argument("model", help=f"{model_help} (present on every node of a cluster)")
    serve.add_argument("--host", default="127.0.0.1", help="HTTP address (default 127.0.0.1; 0.0.0.0 for all)")
    serve.add_argument("--port", type=_positive, default=8000, help="HTTP port (default 8000)")
    serve.add_argument("--triforce-config", default="{}",
                       help="TriForceConfig fields as a JSON object (default '{}': TriForceConfig()), or 'off' for "
                       "plain decoding; a request's 'triforce' field overrides fields")
    serve.add_argument("--served-model-name", default=None, help="the name requests give as 'model' (default MODEL)")
    serve.add_argument("--replicas", type=_positive, default=1, help="replicas, each the model and its prefix store "
                       "(default 1)")
    serve.add_argument("--autoscaling", default=None, help="Ray Serve autoscaling_config as JSON, e.g. "
                       "'{\"min_replicas\": 1, \"max_replicas\": 4}' (replaces --replicas)")
    serve.add_argument("--threads", type=_positive, default=None,
                       help="torch threads (and Ray CPUs reserved) per replica (default: this machine's cores "
                       "divided by --replicas)")
    serve.add_argument("--prefix-store-bytes", type=_bytes, default=4 << 30,
                       help="per replica, the bytes of prefilled caches kept (default 4GiB; 0 turns the store off)")
    serve.add_argument("--prefix-min-tokens", type=_positive, default=256,
                       help="the shortest prompt prefix stored and reused (default 256)")
    serve.add_argument("--address", default=None, help="join a running Ray cluster ('auto' or HEAD_IP:6379) "
                       "instead of starting one on this machine")
    serve.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    serve.add_argument("--max-replicas-per-node", type=_positive, default=None,
                       help="replicas one node of the cluster holds at most (default: as many as its CPUs take)")
    serve.add_argument("--proxy-location", choices=["EveryNode", "HeadOnly"], default="EveryNode",
                       help="Ray Serve's HTTP proxies: one on every node (default) or on the head node only (nodes "
                            "that share one host)")
    serve.add_argument("--max-batch-size", type=_positive, default=8,
                       help="concurrent requests a replica decodes together as one batch at most (default 8; 1: one "
                            "at a time)")

    return parser


def _generate(args) -> int:
    from transformers import TextStreamer

    from ..config import TriForceConfig
    from ..drafters import drafter_names

    if not args.prompt_file.is_file():
        raise SystemExit(f"hf-triforce generate: --prompt-file {args.prompt_file} does not exist")
    model, tokenizer = _load("hf-triforce generate", "--model", args.model)
    draft = args.draft if args.draft in drafter_names() else _load("hf-triforce generate", "--draft", args.draft)[0]
    precision = {"draft_precision": "int8"} if args.int8 else {}
    try:
        config = TriForceConfig(draft=draft, show_progress=True, **precision, **config_fields(args))
    except ValueError as error:
        raise SystemExit(f"hf-triforce generate: {error}") from error
    ids = tokenizer(args.prompt_file.read_text(), return_tensors="pt").input_ids
    sampling = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p} if args.sample else {
        "do_sample": False}
    out = model.generate(ids, max_new_tokens=args.max_new_tokens, triforce_config=config, return_dict_in_generate=True,
                         streamer=TextStreamer(tokenizer, skip_prompt=True), **sampling)
    if args.stats:
        print(out.triforce_stats.to_dict())
    return 0


def _load(command: str, option: str, name_or_path: str | None, dtype: str = "float32", **config_overrides):
    """`assets.load_model`; a missing model exits naming ``command`` (``"hf-triforce generate"``) and ``option``."""
    import torch

    from ..assets import load_model

    try:
        return load_model(name_or_path, getattr(torch, dtype), **config_overrides)
    except FileNotFoundError as error:
        raise SystemExit(f"{command}: {option}: {error}") from error


def _serve(args) -> int:
    import os
    import signal
    import time

    from ..assets import MODELS
    from ..serving.deployment import ServerSettings, triforce_setting

    if args.model not in MODELS and not Path(args.model).is_dir() and args.address is None:
        raise SystemExit(f"hf-triforce serve: model must be one of {sorted(MODELS)} or a local model folder, "
                         f"got {args.model!r}")
    try:
        triforce_setting(args.triforce_config)
    except ValueError as error:
        raise SystemExit(f"hf-triforce serve: --triforce-config: {error}") from error
    threads = args.threads or (None if args.address else max(1, (os.cpu_count() or 1) // args.replicas))
    model = args.model if args.model in MODELS else str(Path(args.model).resolve())
    settings = ServerSettings(model=model, served_name=args.served_model_name or args.model,
                              triforce=args.triforce_config, store_bytes=args.prefix_store_bytes,
                              min_prefix_tokens=args.prefix_min_tokens, threads=threads, dtype=args.dtype,
                              max_batch_size=args.max_batch_size)
    from ..serving.launch import StartFailed, launch, shutdown

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # leaves through `shutdown`, which stops a local cluster
    try:
        try:
            launch(settings, host=args.host, port=args.port, replicas=args.replicas, autoscaling=args.autoscaling,
                   address=args.address, max_replicas_per_node=args.max_replicas_per_node,
                   proxy_location=args.proxy_location)
        except (ValueError, StartFailed) as error:
            raise SystemExit(f"hf-triforce serve: {error}") from None
        print(f"hf-triforce serve: {settings.served_name} at http://{args.host}:{args.port}/v1 (Ctrl-C stops)",
              flush=True)
        while True:
            time.sleep(3600)
    except KeyboardInterrupt:
        pass
    finally:
        shutdown()
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "demo":
        from ..assets import SHAKESPEARE_PLAYS
        from .demo import run_demo

        if args.play not in SHAKESPEARE_PLAYS:
            raise SystemExit(f"hf-triforce demo: --play must be one of {', '.join(SHAKESPEARE_PLAYS)}")
        if args.context + args.new_tokens > 8192:
            raise SystemExit("hf-triforce demo: --context + --new-tokens must stay within SmolLM2's 8192 positions")
        from ..config import TriForceConfig

        draft = {"draft": args.draft} if args.draft else {}
        try:
            config = TriForceConfig(**draft, **config_fields(args))
        except ValueError as error:
            raise SystemExit(f"hf-triforce demo: {error}") from error
        return run_demo(args, config)
    if args.command == "generate":
        return _generate(args)
    return _serve(args)


if __name__ == "__main__":
    sys.exit(main())
