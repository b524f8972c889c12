"""Decoding methods the tools compare, as records, and the one place CLI arguments become a `TriForceConfig`.

A TriForce method is a drafter from the registry (``hf_triforce.drafters.DRAFTERS``; ``draft`` names the
``--draft-model``), a number of levels and a drafting precision, with a fixed plan:
``triforce-<drafter>[-int8|-lean-int4]`` and the two-level ``streaming-self[-int8|-lean-int4]``; or the adaptive policy:
``triforce-auto[-int8|-lean-int4]`` (self drafts, free n-gram lookups, three levels, the bench's knobs), ``default``
(``TriForceConfig()`` with no argument: what a user gets) and ``default-draft`` (``TriForceConfig(draft=<the draft
model>)``, nothing else set). ``vanilla``: vanilla speculative decoding on the library's loop and kernels: the draft
model on its own full cache (a window that holds the whole sequence), two levels, `STREAMING_GAMMA` tokens per
verification, verified by the target on its full cache. Baselines: ``plain`` (DynamicCache), ``static``
(StaticCache, eager) and ``static-compiled`` (StaticCache with ``generate``'s own ``torch.compile`` of the decoding
forward, told to compile on every device): the faster of these two is "the best plain decoding" that every table
compares with; ``lookup`` (HF prompt lookup), ``assisted`` (HF assisted generation with the draft model);
another engine where installed: ``llama.cpp`` and ``llama.cpp-lookup`` (its prompt-lookup speculative decoding)
on the same GGUF (`llama_cpp_engine`).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from hf_triforce.config import DEFAULT_WINDOW, TriForceConfig
from hf_triforce.drafters import DRAFTERS
from hf_triforce.drafters.registry import MODEL_DRAFTER

# (gamma1, gamma2) per drafter kind, each at its best measured setting: a lookup drafter costs nothing, so
# it drafts more per Force-2 step; sweeps of SmolLM2 at 4k, 8k and 8k at another text offset
# (docs/config.md, docs/bench/gamma-sweep/) put (3, 8) first for n-gram drafts every time. Model drafters
# keep TriForceConfig's defaults.
TUNED_GAMMAS = {"lookup": (3, 8), "model": (2, 6)}
STREAMING_GAMMA = 4  # two levels: Force-1 tokens per Force-3 step


@dataclass(frozen=True)
class Method:
    """One way of decoding. ``baseline`` methods are transformers' own; the others run TriForce."""

    name: str
    baseline: bool = False
    drafter: str = ""  # registry name; "draft" = the --draft-model
    levels: int = 3
    precision: str = "model"
    policy: str = "fixed"
    library_default: bool = False  # TriForceConfig() exactly, whatever the bench's knobs
    engine: str = "transformers"  # "llama.cpp": another engine on the same GGUF (a baseline)
    full_draft_cache: bool = False  # Force 1's window holds the whole sequence (vanilla speculative decoding)

    @property
    def compiled(self) -> bool:
        """Compiles on its first call (`bench.compare` warms it up outside the timed rounds)."""
        return self.name == "static-compiled"

    @property
    def needs_draft_model(self) -> bool:
        return self.name == "assisted" or self.drafter == "draft"

    @property
    def other_engine(self) -> bool:
        """Runs on another engine than transformers (llama.cpp), not through ``generate``."""
        return self.engine != "transformers"

    @property
    def kind(self) -> str:
        """The drafter's kind ("model" or "lookup"), which picks the tuned gammas."""
        return DRAFTERS[MODEL_DRAFTER if self.drafter == "draft" else self.drafter].kind

    def config(self, budget: int, gammas: tuple[int | None, int | None] = (None, None), sequence_length: int = 0,
               **overrides) -> TriForceConfig:
        """The `TriForceConfig` of this method (None gammas: `TUNED_GAMMAS` for its kind). ``sequence_length``: the
        prompt and new tokens, the window of a method with a full draft cache (required there)."""
        if self.baseline:
            raise ValueError(f"method {self.name!r} is a transformers baseline, not a TriForce method")
        if self.library_default:  # what a user gets: TriForceConfig() (with the draft model, if the method has one)
            return TriForceConfig(draft=overrides["draft_model"]) if self.drafter == "draft" else TriForceConfig()
        gamma1, gamma2 = chosen_gammas(gammas, self.kind)
        draft_model = overrides.pop("draft_model", None)
        draft = draft_model if self.drafter == "draft" else self.drafter
        settings = dict(draft=draft, retrieval_budget=budget, chunk_size=8, sink_tokens=16, window=DEFAULT_WINDOW,
                        gamma1=gamma1, gamma2=gamma2 if self.levels == 3 else STREAMING_GAMMA, levels=self.levels,
                        draft_precision=self.precision, policy=self.policy)
        settings.update(overrides)
        if self.full_draft_cache:
            if sequence_length < 1:
                raise ValueError(f"method {self.name!r} sizes the draft's cache to the sequence: pass sequence_length "
                                 f"(prompt + new tokens), got {sequence_length}")
            settings.update(sink_tokens=0, window=sequence_length)
        return TriForceConfig(**settings)


def _all_methods() -> dict[str, Method]:
    methods = [Method("plain", baseline=True), Method("static", baseline=True),
               Method("static-compiled", baseline=True), Method("lookup", baseline=True),
               Method("assisted", baseline=True), Method("llama.cpp", baseline=True, engine="llama.cpp"),
               Method("llama.cpp-lookup", baseline=True, engine="llama.cpp")]
    methods.append(Method("default", drafter="self", policy="auto", library_default=True))
    methods.append(Method("default-draft", drafter="draft", policy="auto", library_default=True))
    methods.append(Method("vanilla", drafter="draft", levels=2, precision="auto", full_draft_cache=True))
    methods += [Method(f"triforce-auto{s}", drafter="self", policy="auto", precision=p)
                for p, s in (("model", ""), ("int8", "-int8"), ("lean-int4", "-lean-int4"))]
    drafters = [name if name != MODEL_DRAFTER else "draft" for name in DRAFTERS]
    for precision, suffix in (("model", ""), ("int8", "-int8"), ("lean-int4", "-lean-int4")):
        methods.append(Method(f"streaming-self{suffix}", drafter="self", levels=2, precision=precision))
        methods += [Method(f"triforce-{d}{suffix}", drafter=d, precision=precision) for d in drafters]
    return {m.name: m for m in methods}


METHODS: dict[str, Method] = _all_methods()
DEFAULT_EXCLUDED = ("streaming-self-int8", "triforce-draft-int8", "triforce-suffix", "triforce-suffix-int8",
                    # fp32 / bf16 Llama, Mistral, Qwen2 on the CPU only: named with --methods
                    *(name for name in METHODS if name.endswith("-lean-int4")),
                    "llama.cpp", "llama.cpp-lookup")  # optional engine: named with --methods


def method_named(name: str) -> Method:
    if name not in METHODS:
        raise ValueError(f"method must be one of {tuple(METHODS)}, got {name!r}")
    return METHODS[name]


def chosen_gammas(gammas: tuple[int | None, int | None], kind: str) -> tuple[int, int]:
    """``gammas`` with each None replaced by the tuned value for drafter ``kind``."""
    return tuple(given or tuned for given, tuned in zip(gammas, TUNED_GAMMAS[kind]))


def describe_gammas(gammas: tuple[int | None, int | None]) -> str:
    return ", ".join(f"gamma1/gamma2 {'/'.join(map(str, chosen_gammas(gammas, kind)))} ({kind} drafts)"
                     for kind in TUNED_GAMMAS)


def add_triforce_arguments(parser: argparse.ArgumentParser, positive) -> None:
    """The TriForce knobs every command takes (defaults: None = the command's own choice)."""
    group = parser.add_argument_group("TriForce")
    group.add_argument("--budget", type=positive, nargs="+", default=[512],
                       help="retrieval budget(s) in tokens (default 512); bench runs each TriForce method per budget")
    group.add_argument("--chunk-size", type=positive, default=8, help="tokens per retrieval chunk (default 8)")
    group.add_argument("--gamma1", type=positive, default=None,
                       help="Force-1 tokens per Force-2 step (default 3 with lookup drafters, 2 with models)")
    group.add_argument("--gamma2", type=positive, default=None,
                       help="Force-2 tokens per Force-3 step (default 8 with lookup drafters, 6 with models)")
    group.add_argument("--sink-tokens", type=int, default=16, help="Force-1 cache sink tokens (default 16)")
    group.add_argument("--window", type=positive, default=DEFAULT_WINDOW,
                       help=f"Force-1 cache window (default {DEFAULT_WINDOW}, TriForceConfig's)")


def knobs_from_args(args: argparse.Namespace) -> dict:
    """`TriForceConfig` fields set by `add_triforce_arguments` other than the budget and the gammas."""
    return dict(chunk_size=args.chunk_size, sink_tokens=args.sink_tokens, window=args.window)


def config_from_args(args: argparse.Namespace, method: Method, budget: int | None = None,
                     draft_model=None, **overrides) -> TriForceConfig:
    """The `TriForceConfig` a command runs ``method`` with, from its parsed TriForce arguments."""
    return method.config(budget if budget is not None else args.budget[0], (args.gamma1, args.gamma2),
                         draft_model=draft_model, **knobs_from_args(args), **overrides)
