"""Side-by-side decoding benchmark: one prefill, then every method alternating on copies of that prefix.

Decode time excludes the prefill (reported apart); each method's median over ``repeats`` rounds is
reported with its ratio to plain `generate` and to the best plain decoding (the faster of ``static`` and
``static-compiled``: a StaticCache, eager or with ``generate``'s own compile), acceptance per tier and cache
memory. ``static-compiled`` compiles on a warm-up call before the timed rounds (its compile seconds reported); a
TriForce method makes its weight copies and route timings on one (`warms_up`: not ``vanilla``, whose warm-up would
repeat its draft's pass over the prompt; a timed call's one-off set-up seconds are subtracted).
``lookup`` and ``assisted`` run from scratch (transformers' assisted decoding mishandles a pre-filled cache) and
the shared prefill time is subtracted from their totals: an approximation; ``assisted`` still pays its draft
model's prefill of the whole prompt, as it does on every call. Methods: ``plain`` (DynamicCache), ``static``
(StaticCache), ``static-compiled``, ``lookup`` (HF prompt lookup), ``assisted`` (HF assisted generation with the
draft model), ``streaming-self`` (StreamingLLM-cache self-speculation: TriForce without its middle tier),
``triforce-self``, ``triforce-ngram`` and ``triforce-draft`` (the draft model as Force 1); a ``-int8`` suffix runs
Force 1 and Force 2 on int8 copies (``draft_precision="int8"``). Greedy by default; with ``sampling`` every method
samples with the same settings and seed, and the "identical" column does not apply. ``llama.cpp`` and
``llama.cpp-lookup`` run another engine on the same GGUF (`llama_cpp_engine.LlamaCppEngine`, prefilled once each,
passed to `compare` as ``engines``, each in its own process: `peer_process.PeerProcess`); their greedy rows say how
many leading tokens match plain `generate` (its arithmetic differs), and a peer whose process dies is reported as
crashed in its row while every other method runs on.
"""

from __future__ import annotations

import copy
import hashlib
import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm
from transformers import DynamicCache

from hf_triforce.caches.saved_prefill import load_prefill, save_prefill
from hf_triforce.compat import compile_everywhere
from hf_triforce.forwards.forward import prefill
from hf_triforce.stats import TriForceStats
from hf_triforce.tools.timing import PREFILL_CHUNK, prefill_prefix, static_copy, timed_generate

from .methods import METHODS, TUNED_GAMMAS, chosen_gammas, method_named
from .peer_process import PeerCrashed


def speculative(method: str) -> bool:
    return not method_named(method).baseline


@dataclass
class Run:
    method: str
    budget: int | None = None  # set when one run compares several retrieval budgets
    seconds: list[float] = field(default_factory=list)
    new_tokens: int = 0
    sequences: torch.Tensor | None = None
    stats: TriForceStats | None = None
    compile_seconds: float | None = None  # the warm-up call of a compiled method (compile + a few tokens)
    copy_seconds: float | None = None  # its drafting weight copies: by its warm-up call, else by its first timed call
    decoded: int | None = None  # lookup / assisted: tokens timed after their first new token (`DecodeClock`)
    crashed: str | None = None  # a peer engine whose process died: how and when (no speed is reported)

    @property
    def label(self) -> str:
        return self.method if self.budget is None else f"{self.method} (budget {self.budget})"

    @property
    def tokens_per_second(self) -> float:
        """Decode speed: tokens over the median seconds (lookup, assisted: those after their first new token, over
        the seconds after it, `DecodeClock`); NaN for a crashed peer."""
        if self.crashed is not None:
            return float("nan")
        if not self.seconds:
            return 0.0
        # a call whose new tokens all came in its first chunk timed none of them: no speed, not new_tokens over ~0 s
        return (self.new_tokens if self.decoded is None else self.decoded) / statistics.median(self.seconds)


class DecodeClock:
    """A `generate` streamer that notes when the first new tokens arrive: lookup and assisted generation prefill the
    prompt (and the draft model) inside their own call, so they are timed from there. Subtracting the shared prefill
    gave negative times at 8k (a one-shot bf16 prefill is faster than the chunked one), subtracting a 2-token call of
    their own 8.6x "speedups" at 16k (decoding is a tenth of such a call: its noise swamps it)."""

    def __init__(self) -> None:
        self.calls, self.first, self.after_first = 0, 0.0, 0

    def put(self, value) -> None:
        self.calls += 1
        if self.calls == 2:  # the first put is the prompt; the second, the first new token(s)
            self.first = time.perf_counter()
        elif self.calls > 2:
            self.after_first += value.numel()

    def end(self) -> None:
        pass


CHECKPOINT_TOKENS = 8192  # a long prefill's progress written every this many tokens (a 64k prefill: ~8 writes)


def saved_prefix(model, ids: torch.Tensor, directory: Path,
                 checkpoint_tokens: int = CHECKPOINT_TOKENS) -> tuple[DynamicCache, float, str]:
    """`prefill_prefix` kept in ``directory`` (one safetensors file per prompt, named by its tokens' hash): read back
    where a file of this prompt was saved for this model, else computed and saved. A prefill longer than
    ``checkpoint_tokens`` writes its progress every ``checkpoint_tokens`` (multiples of `prefill_prefix`'s chunk, so
    the chunks and their bytes are those of one uninterrupted pass) to a ``.partial.safetensors`` file beside, and an
    interrupted one resumes from it. Returns the cache, the seconds this call took and what was done
    (``"loaded <file>"``, ``"computed, saved to <file>"``, with the tokens resumed from, or why a file was
    refused)."""
    chunk = PREFILL_CHUNK
    if checkpoint_tokens < chunk or checkpoint_tokens % chunk:
        raise ValueError(f"saved_prefix: checkpoint_tokens must be a positive multiple of {chunk}, "
                         f"got {checkpoint_tokens}")
    prompt = ids[:, :-1]
    digest = hashlib.sha256(prompt.contiguous().numpy().tobytes()).hexdigest()[:16]
    path = Path(directory) / f"prefill-{prompt.shape[1]}-{digest}.safetensors"
    partial = path.with_name(path.name.replace(".safetensors", ".partial.safetensors"))
    start = time.perf_counter()
    refused = ""
    if path.exists():
        stored, why = _read_prefix(path, model, prompt)
        if why is None and stored[0].shape[1] == prompt.shape[1]:
            return stored[1], time.perf_counter() - start, f"loaded {path}"
        refused = f"{why or f'{path} holds other tokens'}; "
    cache, done = DynamicCache(config=model.config), 0
    if partial.exists():
        stored, why = _read_prefix(partial, model, prompt)
        if why is None and stored[0].shape[1] % chunk == 0:
            cache, done = stored[1], stored[0].shape[1]
            refused += f"resumed from {done} tokens in {partial}; "
        else:
            refused += f"{why or f'{partial} ends inside a chunk'}; "
    with torch.no_grad():
        while done < prompt.shape[1]:
            end = min(done + checkpoint_tokens, prompt.shape[1])
            prefill(model, prompt[:, done:end], cache, chunk, show_progress=True)
            done = end
            if done < prompt.shape[1]:
                save_prefill(partial, model, prompt[:, :done], cache)
    save_prefill(path, model, prompt, cache)
    partial.unlink(missing_ok=True)
    return cache, time.perf_counter() - start, f"{refused}computed, saved to {path}"


def _read_prefix(path: Path, model, prompt: torch.Tensor) -> tuple[tuple[torch.Tensor, DynamicCache] | None,
                                                                   str | None]:
    """``(ids, cache)`` read from ``path`` where its ids begin ``prompt`` and it was saved for ``model``, else
    ``(None, why not)``."""
    try:
        stored_ids, cache = load_prefill(path, model)
    except ValueError as error:
        return None, str(error)
    length = stored_ids.shape[1]
    if length > prompt.shape[1] or not torch.equal(stored_ids, prompt[:, :length]):
        return None, f"{path} holds other tokens"
    return (stored_ids, cache), None


def method_kwargs(method: str, model, prefix: DynamicCache, max_len: int, budget: int, draft_model=None,
                  gammas: tuple[int | None, int | None] = (None, None), knobs: dict | None = None) -> dict:
    """generate kwargs of one method (`compare` has checked the names and the draft model).

    ``gammas``: TriForce's ``(gamma1, gamma2)``, each None for `TUNED_GAMMAS`; ``knobs``: other
    `TriForceConfig` fields (chunk_size, sink_tokens, window, ...).
    """
    spec = method_named(method)
    if method == "plain":
        return {"cache": copy.deepcopy(prefix)}
    if method == "static":
        return {"cache": static_copy(model, prefix, max_len)}
    if method == "static-compiled":  # generate compiles the decoding forward; on the CPU only when told to
        return {"cache": static_copy(model, prefix, max_len), "compile_config": compile_everywhere()}
    if method == "lookup":  # from scratch: HF's assisted decoding mishandles a pre-filled cache (5.24, 5.25)
        return {"prompt_lookup_num_tokens": 10}
    if method == "assisted":  # from scratch, like lookup
        return {"assistant_model": draft_model}
    config = spec.config(budget, gammas, sequence_length=max_len, draft_model=draft_model, **(knobs or {}))
    return {"cache": prefix, "triforce_config": config, "return_dict_in_generate": True}


def measure(model, ids, prefix, method: str, new_tokens: int, budget: int, run: Run,
            draft_model=None, sampling: dict | None = None, seed: int = 0,
            gammas: tuple[int | None, int | None] = (None, None), knobs: dict | None = None,
            engines: dict | None = None, cache_tokens: int | None = None) -> None:
    """One timed run (greedy, or ``sampling`` kwargs seeded with ``seed``); ``lookup`` and ``assisted``
    prefill the prompt themselves (and assisted its draft model): they are timed from their first new token on
    (`DecodeClock`: decoding is timed, not prompt processing). Every other method starts from the shared prefix
    with its copy made before the clock (plain's deep copy, static's StaticCache); a TriForce method copies it inside
    `generate`, and that copy (`TriForceDetail.prefix_copy_seconds`) is not timed either.
    Methods of another engine run on ``engines[method]`` (prefilled already). ``cache_tokens``: new tokens the static
    caches make room for (default ``new_tokens``): a short warm-up compiles the shape of the timed run."""
    if method_named(method).other_engine:
        if run.crashed is not None:  # its process is gone: nothing more to time
            return
        try:
            seconds, sequences = engines[method].decode(ids, new_tokens, sampling, seed)
        except PeerCrashed as crash:
            run.crashed = str(crash)
            return
        run.seconds.append(seconds)
        run.new_tokens, run.sequences = sequences.shape[1] - ids.shape[1], sequences
        return
    room = cache_tokens if cache_tokens is not None else new_tokens  # the static caches' length: the compiled shape
    kwargs = method_kwargs(method, model, prefix, ids.shape[1] + room + 16, budget, draft_model, gammas, knobs)
    kwargs.update(sampling or {"do_sample": False})
    clock = DecodeClock() if method in ("lookup", "assisted") else None
    if clock is not None:
        kwargs["streamer"] = clock
    seconds, out = timed_generate(model, ids, new_tokens, seed, **kwargs)  # TriForce: less its set-up seconds
    if clock is not None:  # from the first new token on: their prefills (the draft model's included) are not timed
        seconds = time.perf_counter() - clock.first
        run.decoded = clock.after_first
    run.stats = getattr(out, "triforce_stats", None)
    # `TriForceStats.setup_seconds`, not timed: adopting the shared prefix (the static and plain methods copy it
    # before the clock), a draft model's pass over the prompt (prompt processing, as assisted generation's draft
    # prefill), and what a model's first call in a process pays once (a warm-up call pays it where one runs, and where
    # none does, `warms_up`, it is not decoding either)
    if run.stats is not None and run.copy_seconds is None and run.stats.detail.draft_copy_seconds:
        run.copy_seconds = run.stats.detail.draft_copy_seconds
    run.seconds.append(seconds)
    sequences = out.sequences if hasattr(out, "sequences") else out
    run.new_tokens = sequences.shape[1] - ids.shape[1]
    run.sequences = sequences


def compare(model, ids, methods, new_tokens: int, repeats: int, budget: int | list[int], draft_model=None,
            sampling: dict | None = None, gammas: tuple[int | None, int | None] = (None, None),
            knobs: dict | None = None, prefilled: tuple[DynamicCache, float] | None = None,
            engines: dict | None = None) -> tuple[list[Run], float]:
    """Prefill once, then ``repeats`` rounds over all methods in turn; returns runs and prefill seconds.

    ``sampling``: generate kwargs such as ``{"do_sample": True, "temperature": 0.8}``; round ``i`` seeds
    every method with ``i``. ``gammas``: TriForce's ``(gamma1, gamma2)``, None for `TUNED_GAMMAS`. Several
    ``budget`` values run each TriForce method once per budget (labelled with it). ``prefilled``: ``(cache,
    seconds)`` from an earlier `prefill_prefix` of the same prompt (read only), to share one prefill between
    calls (greedy and sampled rounds). ``engines``: ``{method: engine}`` for the methods of another engine
    (`llama_cpp_engine.LlamaCppEngine`, prefilled with the same prompt).
    """
    missing = [m for m in methods if m not in METHODS]
    if missing:
        raise ValueError(f"methods must be among {tuple(METHODS)}, got {missing}")
    needs_draft = [m for m in methods if METHODS[m].needs_draft_model]
    if draft_model is None and needs_draft:
        raise ValueError(f"methods {needs_draft} need a draft model (draft_model=...)")
    no_engine = [m for m in methods if METHODS[m].other_engine and m not in (engines or {})]
    if no_engine:
        raise ValueError(f"methods {no_engine} run another engine: pass it in engines={{method: engine}}")
    budgets = [budget] if isinstance(budget, int) else list(budget)
    if len(set(budgets)) != len(budgets):
        raise ValueError(f"budget values must differ, got {budgets}")
    if prefilled is None:
        start = time.perf_counter()
        prefilled = prefill_prefix(model, ids), time.perf_counter() - start
    prefix, prefill_seconds = prefilled
    several = len(budgets) > 1
    runs = [Run(m, b) for m in methods for b in (budgets if several and speculative(m) else [None])]
    # outside the timed rounds, what a model's first call pays once: generate's compile (kept per model and shape), a
    # TriForce method's drafting weight copies (lean, int8: kept per model; 23 s for Qwen2.5-1.5B's int4 copy)
    for run in runs:
        spec = method_named(run.method)
        if warms_up(spec):
            warm_up = Run(run.method)
            start = time.perf_counter()
            measure(model, ids, prefix, run.method, min(new_tokens, 4), run.budget or budgets[0], warm_up,
                    draft_model, sampling, gammas=gammas, knobs=knobs, engines=engines,
                    cache_tokens=new_tokens)
            if spec.compiled:
                run.compile_seconds = time.perf_counter() - start
            else:
                run.copy_seconds = warm_up.stats.detail.draft_copy_seconds
    for round_index in tqdm(range(repeats), desc=f"decode {ids.shape[1]} ctx", unit="round"):
        for run in runs:
            measure(model, ids, prefix, run.method, new_tokens, run.budget or budgets[0], run, draft_model, sampling,
                    seed=round_index, gammas=gammas, knobs=knobs, engines=engines)
    return runs, prefill_seconds


def warms_up(spec) -> bool:
    """Whether `compare` runs a method once before its timed rounds: a compiled method (its compile) and a TriForce
    method (its weight copies, route timings and kernel builds, which `measure` also subtracts from a timed call) --
    except one whose Force 1 fills a full draft cache (``vanilla``): its warm-up would repeat the draft model's pass
    over the whole prompt (~23 minutes for Qwen2.5-Coder-0.5B at 64k on two cores) for nothing a timed call counts."""
    return spec.compiled or (not spec.baseline and not spec.full_draft_cache)


def best_plain(runs: list[Run]) -> Run | None:
    """The faster of ``static`` and ``static-compiled`` among ``runs`` (None: neither ran)."""
    candidates = [run for run in runs if run.method in ("static", "static-compiled")]
    return max(candidates, key=lambda run: run.tokens_per_second) if candidates else None


def table(runs: list[Run], sampled: bool = False) -> str:
    """Markdown table; ratios against ``plain`` and the best plain decoding where present (`best_plain`), no
    identity check if ``sampled``."""
    by_name = {run.label: run for run in runs}
    base, best = by_name.get("plain", runs[0]), best_plain(runs)
    best_name = f"vs best plain ({best.method})" if best else "vs best plain"
    lines = [f"| method | decode tok/s | vs plain | {best_name} | F2 acc. (per position) | "
             "F3 acc. (per position) | tok/F3 step | "
             "cache MB full/retr./draft | steps plain/2/3 levels | identical |", "|" + "---|" * 10]
    for run in runs:
        if run.crashed is not None:
            lines.append(f"| {run.label} | crashed: {run.crashed} |" + " - |" * 8)
            continue
        s = run.stats
        cells = [f"{s.force2_acceptance:.2f} ({s.force2_position_acceptance:.2f})",
                 f"{s.force3_acceptance:.2f} ({s.force3_position_acceptance:.2f})", f"{s.tokens_per_force3_step:.2f}",
                 f"{s.detail.full_cache_bytes / 2**20:.0f}/{s.detail.retrieval_cache_bytes / 2**20:.1f}/"
                 f"{s.detail.draft_cache_bytes / 2**20:.1f}",
                 "/".join(str(s.plan_steps.get(levels, 0)) for levels in (1, 2, 3))] if s else ["-"] * 5
        vs_best = f"{run.tokens_per_second / best.tokens_per_second:.2f}x" if best else "-"
        same = "n/a (sampled)" if sampled else identity(run, base)
        label = run.label if run.compile_seconds is None else f"{run.label} (compile {run.compile_seconds:.0f} s)"
        if run.copy_seconds is not None and run.copy_seconds >= 0.5:
            label += f" (weight copies {run.copy_seconds:.0f} s, first call)"
        lines.append(f"| {label} | {run.tokens_per_second:.2f} | "
                     f"{run.tokens_per_second / base.tokens_per_second:.2f}x | {vs_best} | "
                     + " | ".join(cells) + f" | {same} |")
    return "\n".join(lines)


def kernels_note(runs: list[Run]) -> str:
    """What a TriForce run among ``runs`` ran on the CPU, for a table's heading: the kernels' build target and
    status, the target's weights (as the model holds them, or the layers with GGUF blocks for the ``"gguf"`` route:
    `cpu_kernels["gguf"]`), the attention route (`TriForceDetail.attention_kernel`), the linear routes by group and row
    count, and the calls that left their route (`TriForceDetail.linear_bypassed`); "" where no TriForce run served a
    CPU model."""
    detail = next((run.stats.detail for run in runs if run.stats is not None and run.stats.detail.cpu_kernels), None)
    if detail is None:
        return ""
    kernels = detail.cpu_kernels
    routes = "; ".join(f"{group} " + " ".join(f"{rows}:{route}" for rows, route in by_rows.items())
                       for group, by_rows in detail.linear_routes.items() if by_rows) or "none timed"
    bypassed = "".join(f", {calls} calls by F.linear ({why})" for why, calls in detail.linear_bypassed.items())
    gguf = kernels.get("gguf")
    weights = ("target weights as the model holds them" if gguf is None else "target weights at GGUF stored width ("
               + ", ".join(f"{kind} {count} layers" for kind, count in gguf["layers"].items())
               + f"; kernel {gguf['kernel']})")
    return (f"TriForce CPU kernels built for {kernels['target']}: {weights}, attention {detail.attention_kernel}, "
            f"linear kernel {kernels['linear']}, linear routes {routes}{bypassed}")


def identity(run: Run, base: Run) -> str:
    """"yes"/"NO" against plain `generate`; for another engine, how many leading new tokens match."""
    if not method_named(run.method).other_engine:
        return "yes" if torch.equal(run.sequences, base.sequences) else "NO"
    new, reference = run.sequences[0, -run.new_tokens:], base.sequences[0, -base.new_tokens:]
    differs = (new != reference[: new.shape[0]]).nonzero()
    same = int(differs[0]) if differs.numel() else new.shape[0]
    return f"first {same}/{new.shape[0]} tokens"


def to_json(context: int, runs: list[Run], prefill_seconds: float, sampling: dict | None = None,
            gammas: tuple[int | None, int | None] = (None, None), budgets: list[int] | None = None,
            text: str | None = None, prompt: str | None = None) -> dict:
    return {
        "context": context,
        "text": text,
        "prompt": prompt,
        "prefill_seconds": prefill_seconds,
        "sampling": sampling,
        "budgets": budgets,
        "gammas": {kind: chosen_gammas(gammas, kind) for kind in TUNED_GAMMAS},
        "best_plain": best.method if (best := best_plain(runs)) else None,
        "methods": {
            run.label: {
                "decode_tokens_per_second": None if run.crashed else run.tokens_per_second,
                "crashed": run.crashed,
                "seconds": run.seconds,
                "new_tokens": run.new_tokens,
                "stats": run.stats.to_dict() if run.stats else None,
                "compile_seconds": run.compile_seconds,
                "copy_seconds": run.copy_seconds,
                "decoded_tokens": run.new_tokens if run.decoded is None else run.decoded,
                # the last round's new tokens (row 0): greedy continuations compared across runs and versions
                "new_token_ids": [] if run.sequences is None or not run.new_tokens
                else run.sequences[0, -run.new_tokens:].tolist(),
            }
            for run in runs
        },
    }


def speedups(result: dict) -> dict[str, float]:
    """Each method's decode speed over the best plain decoding of ``result`` (its ``best_plain``; plain ``generate``
    where no static run was made); a crashed peer has no speed and no entry."""
    methods = result["methods"]
    base = methods.get(result.get("best_plain") or "plain") or next(iter(methods.values()))
    return {name: m["decode_tokens_per_second"] / base["decode_tokens_per_second"] for name, m in methods.items()
            if m["decode_tokens_per_second"] is not None}


def plot(results: list[dict], path: Path) -> bool:
    """Speedup over the best plain decoding vs context (a line per method, text and mode: greedy solid, sampled
    dashed), and each TriForce method's Force-2/Force-3 acceptance; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series: dict[tuple, list[tuple[int, float, dict | None]]] = {}
    for result in results:
        mode = "sampled" if result.get("sampling") else "greedy"
        for method, ratio in speedups(result).items():
            key = (method, result.get("text"), mode)
            series.setdefault(key, []).append((result["context"], ratio, result["methods"][method]["stats"]))
    texts = sorted({key[1] or "" for key in series})
    colors = {}  # one color per method and text; greedy solid, sampled dashed
    fig, (speed, accept) = plt.subplots(1, 2, figsize=(12, 4.5))
    for (method, text, mode), points in series.items():
        if method in ("plain", "static", "static-compiled"):  # the baselines: plain's ratio is below 1, static's 1
            continue
        points.sort(key=lambda point: point[0])
        contexts = [point[0] for point in points]
        label = method + (f", {text}" if len(texts) > 1 else "") + f", {mode}"
        color = colors.setdefault((method, text), f"C{len(colors) % 10}")
        style = "-" if mode == "greedy" else "--"
        speed.plot(contexts, [point[1] for point in points], style, color=color, marker="o", label=label)
        stats = [point[2] for point in points]
        if all(stats) and mode == "greedy":
            accept.plot(contexts, [s["force3_acceptance"] for s in stats], "-", color=color, marker="o",
                        label=f"{label} F3")
            if any(s["force2_verified"] for s in stats):
                accept.plot(contexts, [s["force2_acceptance"] for s in stats], ":", color=color, marker="x",
                            label=f"{label} F2")
    speed.axhline(1.0, color="grey", lw=0.8)
    speed.set(xlabel="context tokens", ylabel="decode speed / best plain decoding", title="speedup", xscale="log")
    accept.set(xlabel="context tokens", ylabel="acceptance", title="acceptance per tier (greedy)", ylim=(0, 1.05),
               xscale="log")
    for axis in (speed, accept):
        axis.grid(alpha=0.3)
        axis.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


def write_results(results: list[dict], tables: list[str], out_dir: Path) -> None:
    """results.json, results.md and (with matplotlib) results.png in ``out_dir``."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    (out_dir / "results.md").write_text("\n\n".join(tables) + "\n")
    if not plot(results, out_dir / "results.png"):
        print("matplotlib is not installed (pip install hf-triforce[bench]): no results.png")
