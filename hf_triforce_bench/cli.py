"""`hf-triforce-bench decode | needle | project` (also `python -m hf_triforce_bench ...`): the measurement bench
beside the library (`hf-triforce demo | generate | serve`)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from hf_triforce.tools.cli import _load, _positive, _probability, _temperature

DECODE = "hf-triforce-bench decode"  # how the decode command names itself in its errors


def _positive_float(value: str) -> float:
    number = float(value)
    if number <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a factor above 1, got {value}")
    return number


def build_parser() -> argparse.ArgumentParser:
    from hf_triforce.assets import MODELS
    from hf_triforce.tools.prompts import PROMPTS

    from .methods import METHODS, add_triforce_arguments
    from .roofline import add_arguments as add_project_arguments
    from .texts import TEXTS

    model_help = f"one of {', '.join(MODELS)} or a local model folder"

    parser = argparse.ArgumentParser(prog="hf-triforce-bench", description="Measure TriForce against plain decoding")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("decode", help="decode speed of each method at several context lengths")
    bench.add_argument("--model", default=None, help=f"target: {model_help} (default smollm2-135m)")
    bench.add_argument("--draft-model", default=None,
                       help=f"draft for the 'assisted' and 'triforce-draft' methods: {model_help}")
    bench.add_argument("--text", choices=sorted(TEXTS), nargs="+", default=["essays"],
                       help="prompt text(s), each run at every context: Paul Graham's essays (default), SQuAD's "
                       "Wikipedia articles, Shakespeare's tragedies or Python's standard-library source")
    bench.add_argument("--prompt", choices=PROMPTS, default="question",
                       help="'question': the text in the chat template followed by a question about it (what an "
                       "instruct model gets; default); 'continue': the raw text, continued")
    bench.add_argument("--contexts", type=_positive, nargs="+", default=[4096], help="prompt lengths in tokens")
    bench.add_argument("--methods", nargs="+", choices=list(METHODS), default=None,
                       help="default: all but streaming-self-int8, triforce-draft-int8 and the suffix drafter "
                       "(the draft-model ones only with --draft-model)")
    bench.add_argument("--modes", nargs="+", choices=["greedy", "sampled"], default=["greedy", "sampled"],
                       help="decoding modes, each a table on one shared prefill (sampled: seeded per round, with "
                       "--temperature and --top-p; default both)")
    bench.add_argument("--sample", action="store_true", help="the same as --modes sampled")
    bench.add_argument("--temperature", type=_temperature, default=0.6, help="sampled mode (default 0.6)")
    bench.add_argument("--top-p", type=_probability, default=0.9, help="sampled mode (default 0.9)")
    bench.add_argument("--new-tokens", type=_positive, default=128)
    bench.add_argument("--repeats", type=_positive, default=3, help="rounds per method; the median is reported")
    bench.add_argument("--rope-factor", type=_positive_float, default=None,
                       help="extend a bundled model's RoPE (and its draft's) by this YaRN factor (needed beyond its "
                            "trained positions: SmolLM2's 8192, the Qwen pair's 32768)")
    bench.add_argument("--threads", type=_positive, default=None)
    bench.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default="float32",
                       help="dtype of the target and the draft model (default float32; bfloat16 and float16 halve the "
                            "bytes each forward reads, and the CPU kernels read them as they are)")
    bench.add_argument("--out", type=Path, default=Path("bench-results"), help="folder for JSON and markdown")
    bench.add_argument("--prefill-dir", type=Path, default=None,
                       help="folder of saved prefills (safetensors): each prompt's prefill is read from it where "
                            "saved for this model, dtype and RoPE, else computed and saved there (a long one writes "
                            "its progress every 8192 tokens and an interrupted one resumes from it)")
    bench.add_argument("--gguf-stored-width", nargs="?", const="", default=None, metavar="GGUF",
                       help="TriForce's target reads its linear layers' GGUF blocks (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, "
                            "Q4_K, Q6_K) at their stored width "
                            "from this GGUF file (without a file: the bundled --model's own; the model must hold its "
                            "values in float32); plain and static generate run transformers' fp32 forward of the "
                            "same values (hf_triforce.kernels.gguf_weights)")
    add_triforce_arguments(bench, _positive)

    needle = commands.add_parser("needle", help="Force-2 acceptance: retrieval vs StreamingLLM cache on a needle")
    needle.add_argument("--context", type=_positive, default=6000)
    needle.add_argument("--budget", type=_positive, default=512)
    needle.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])

    project = commands.add_parser("project", help="PROJECTED (not measured) seconds per forward of each tier and "
                                  "tokens/s of each plan for a model, device, context and acceptance (a roofline "
                                  "model priced by the adaptive policy's own formulas; hf_triforce_bench.roofline)")
    add_project_arguments(project)
    return parser


def _decode(args) -> int:
    import time

    import torch

    from hf_triforce import assets
    from hf_triforce.tools.prompts import document_prompt
    from hf_triforce.tools.timing import prefill_prefix

    from . import texts
    from .compare import compare, kernels_note, saved_prefix, table, to_json, write_results
    from .methods import DEFAULT_EXCLUDED, METHODS, describe_gammas, knobs_from_args

    methods = args.methods or [m for m, spec in METHODS.items()
                               if (args.draft_model or not spec.needs_draft_model) and m not in DEFAULT_EXCLUDED]
    if len(set(args.budget)) != len(args.budget):
        raise SystemExit(f"{DECODE}: --budget values must differ, got {args.budget}")
    needs_draft = [m for m in methods if METHODS[m].needs_draft_model]
    if needs_draft and args.draft_model is None:
        raise SystemExit(f"{DECODE}: methods {needs_draft} need --draft-model")
    bundled = args.model is None or args.model in assets.MODELS
    draft_bundled = args.draft_model is None or args.draft_model in assets.MODELS
    if args.rope_factor is not None and not (bundled and draft_bundled):
        raise SystemExit(f"{DECODE}: --rope-factor applies to the bundled models {sorted(assets.MODELS)} "
                         "only; set rope_parameters in your model's config instead")
    if args.threads:
        torch.set_num_threads(args.threads)
    asset = assets.MODELS[args.model or "smollm2-135m"] if bundled else None
    overrides = texts.yarn_rope(args.rope_factor, asset) if args.rope_factor else {}
    if bundled:  # checked before the (slow) load
        _check_contexts(args, int(asset.positions * (args.rope_factor or 1)))
    engine_methods = [m for m in methods if METHODS[m].other_engine]
    if engine_methods:
        from .llama_cpp_engine import llama_cpp_available

        if not bundled and args.model not in assets.MODELS:
            raise SystemExit(f"{DECODE}: methods {engine_methods} run llama.cpp on a bundled GGUF: --model "
                             f"must be one of {sorted(assets.MODELS)}")
        if not llama_cpp_available():
            raise SystemExit(f"{DECODE}: methods {engine_methods} need llama-cpp-python "
                             "(pip install llama-cpp-python; it compiles llama.cpp)")
    if args.gguf_stored_width == "" and not bundled:
        raise SystemExit(f"{DECODE}: --gguf-stored-width without a file reads a bundled model's GGUF: --model "
                         f"must be one of {sorted(assets.MODELS)}, or name the file")
    if args.gguf_stored_width is not None and args.dtype != "float32":
        raise SystemExit(f"{DECODE}: --gguf-stored-width needs --dtype float32 (the file's values exactly), "
                         f"got {args.dtype}")
    model, tokenizer = _load(DECODE, "--model", args.model, args.dtype, **overrides)
    if args.gguf_stored_width is not None:
        from hf_triforce.kernels.gguf_weights import attach_gguf

        gguf = args.gguf_stored_width or assets.gguf_path(asset)
        try:
            attached = attach_gguf(model, gguf)
        except ValueError as error:
            raise SystemExit(f"{DECODE}: --gguf-stored-width: {error}") from error
        print(f"target linear layers at GGUF stored width: {attached}", flush=True)
    _check_contexts(args, getattr(model.config, "max_position_embeddings", None) or 1 << 30)
    draft_overrides = texts.yarn_rope(args.rope_factor, assets.MODELS[args.draft_model]) \
        if args.rope_factor and args.draft_model else {}
    draft_model = _load(DECODE, "--draft-model", args.draft_model, args.dtype, **draft_overrides)[0] \
        if args.draft_model else None
    prompts = {}
    for text in dict.fromkeys(args.text):
        document = texts.TEXTS[text]()
        try:
            prompts.update({(text, context): document_prompt(tokenizer, document, context, args.prompt)
                            for context in args.contexts})
        except ValueError as error:
            raise SystemExit(f"{DECODE}: --text {text} --prompt {args.prompt}: {error}") from error
    modes = ["sampled"] if args.sample else list(dict.fromkeys(args.modes))
    sampled = {"do_sample": True, "temperature": args.temperature, "top_p": args.top_p}
    gammas = (args.gamma1, args.gamma2)
    results, tables = [], []
    for text, context in prompts:
        ids = prompts[text, context]
        if args.prefill_dir is None:
            start = time.perf_counter()
            prefilled = prefill_prefix(model, ids), time.perf_counter() - start
        else:
            cache, seconds, source = saved_prefix(model, ids, args.prefill_dir)
            print(f"prefill of {text} at {context} tokens: {source} ({seconds:.1f} s)", flush=True)
            prefilled = cache, seconds
        engines = _llama_cpp_engines(args, engine_methods, ids)
        for mode in modes:
            sampling = sampled if mode == "sampled" else None
            described = f"sampling (temperature {args.temperature}, top-p {args.top_p})" if sampling else "greedy"
            runs, prefill_seconds = compare(model, ids, methods, args.new_tokens, args.repeats, args.budget,
                                            draft_model, sampling, gammas, knobs_from_args(args), prefilled,
                                            engines)
            kernels = kernels_note(runs)  # TriForce's; plain and static run transformers' own
            attention_note = f", {kernels}" if kernels else ""
            attention = next((run.stats.detail.attention_kernel for run in runs if run.stats is not None), "")
            engine_prefill = "".join(f", {m} crashed" if e.crashed else f", {m} prefill {e.prefill_seconds:.1f} s"
                                     for m, e in engines.items())
            rendered = (f"### context {context} tokens, {text}, prompt '{args.prompt}', {described} "
                        f"(prefill {prefill_seconds:.1f} s{engine_prefill}, {args.new_tokens} new tokens, "
                        f"median of {args.repeats}, {args.dtype}, "
                        f"{describe_gammas(gammas)}, torch threads {torch.get_num_threads()}"
                        f"{attention_note})\n\n"
                        + table(runs, sampled=sampling is not None))
            print(rendered, flush=True)
            results.append({**to_json(context, runs, prefill_seconds, sampling, gammas, args.budget, text,
                                      args.prompt),
                            "model": args.model or "smollm2-135m", "draft_model": args.draft_model,
                            "dtype": args.dtype, "attention_kernel": attention})
            tables.append(rendered)
            write_results(results, tables, args.out)
        for engine in engines.values():
            engine.close()
    print(f"wrote {args.out}/results.json and results.md")
    return 0


def _llama_cpp_engines(args, methods: list[str], ids) -> dict:
    """A prefilled llama.cpp engine per method of that engine (same GGUF, threads and RoPE scaling), each in its own
    process (`peer_process.PeerProcess`): one that crashes, here or in `compare`, is reported in the table."""
    import torch

    from hf_triforce import assets

    from .llama_cpp_engine import LlamaCppEngine
    from .peer_process import PeerCrashed, PeerProcess

    engines = {}
    for method in methods:  # a bundled GGUF: `_decode` has checked the model where methods are given
        asset = assets.MODELS[args.model or "smollm2-135m"]
        engine = PeerProcess(method, LlamaCppEngine, dict(
            gguf=assets.gguf_path(asset),
            context=ids.shape[1] + args.new_tokens + 16, threads=torch.get_num_threads(),
            lookup=method.endswith("-lookup"), rope_factor=args.rope_factor,
            original_positions=asset.positions))
        try:
            engine.prefill(ids)
        except PeerCrashed as crash:  # every run of it is reported as crashed
            print(f"{DECODE}: {crash} during its prefill", flush=True)
        engines[method] = engine
    return engines


def _check_contexts(args, limit: int) -> None:
    too_long = [c for c in args.contexts if c + args.new_tokens > limit]
    if too_long:
        raise SystemExit(f"{DECODE}: contexts {too_long} + new tokens exceed {limit} positions; "
                         "pass --rope-factor (e.g. 4 for 32k) for SmolLM2, or extend your model's RoPE")


def _needle(args) -> int:
    from hf_triforce import assets

    from . import texts
    from .needle import needle_prompt, tier_acceptance

    if args.context > 8192:
        raise SystemExit("hf-triforce-bench needle: --context must be at most 8192 (SmolLM2's trained length)")
    model, tokenizer = assets.load_smollm2()
    print(f"| depth | retrieval acceptance | StreamingLLM acceptance | retrieval greedy | StreamingLLM greedy | "
          f"full model answers | (context {args.context}, budget {args.budget})")
    print("|---|---|---|---|---|---|")
    for depth in args.depths:
        prompt, answer = needle_prompt(tokenizer, texts.tragedies(), args.context, depth, code="4721-marmalade")
        r = tier_acceptance(model, prompt, answer, args.budget)
        print(f"| {depth:.2f} | {r['retrieval_acceptance']:.3f} | {r['streaming_acceptance']:.3f} | "
              f"{r['retrieval_greedy']:.2f} | {r['streaming_greedy']:.2f} | {'yes' if r['answer_found'] else 'no'} |",
              flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.command == "needle":
        return _needle(args)
    if args.command == "project":
        from .roofline import run

        try:
            return run(args)
        except ValueError as error:
            raise SystemExit(f"hf-triforce-bench project: {error}") from error
    return _decode(args)


if __name__ == "__main__":
    sys.exit(main())
