"""Before the prefill: can this model run on TriForce's caches? One probe forward of one token says (once per model
and attention implementation: its findings are kept with the model, `_FINDINGS`), through the same cache class and
attention wrapper the tiers use, so that nothing fails after a prefill of minutes:

- a model whose config declares sliding-window layers builds sliding-window masks for them
  (`compat.builds_sliding_masks`; Moshi's window is only its cache's truncation);
- every decoder layer stores exactly one key/value entry per input token in its own cache layer (CPM-Ant prepends
  its prompt embeddings; a layer sharing another's entries cannot be rolled back by a length);
- with three levels, every layer's attention goes through transformers' ``AttentionInterface``, where the wrapper
  records the query Force-2 retrieval scores chunks with, and every layer Force 2 scores caches keys as wide as that
  query's heads (multi-head latent attention caches ``kv_lora_rank``-wide latents); with two levels, a layer whose
  attention bypasses the interface runs the model's eager attention (its own SDPA code may take a multi-token
  forward over a longer cache as square-causal), with chains and one prompt only;
- a model drafter (``draft="self"`` or a draft model) can re-rotate its keys (`make_layer_rerotations`);
- with candidate trees or a batch, no layer's attention mask carries a bias (ALiBi Falcon): a tree's nodes sit in
  cache slots, not at their positions, and a batch's per-row 4-D mask is not one the model can derive its bias
  from. A second probe (two tokens) reads the masks, only where trees or a batch are asked for.

Each failure is a ValueError naming the model, the layer and the option that avoids it.
"""

from __future__ import annotations

import weakref

import torch

from .. import compat
from ..caches.buffer import BufferCache, WindowLayer, full_attention_layer
from ..caches.sink_window import make_layer_rerotations
from ..config import TriForceConfig
from ..drafters.registry import spec_of
from ..forwards.forward import forward_logits
from ..kernels.attention import QueryRecorder, mask_adds_bias
from ..kernels.attention_function import PREFIX
from ..kernels.row_mixing import row_mixing_layers

PROBE_CAPACITY = 256
# What the probes found, per model and per what they depend on (`_probe_key`): a probe is a forward of the model
# (0.13 s of a 3.7 s SmolLM2 call at 16k), and what it finds (entries per token, widths, masks' biases) is the
# model's structure, not its weights or the prompt. Weak keys: a model's findings go with it.
_FINDINGS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _probe_key(model, what: str) -> tuple:
    """What a probe's finding depends on besides the model object: its attention implementation, the layer
    structure of its config and the classes of its decoder's modules (a swapped attention module probes anew). State
    kept elsewhere on the modules (e.g. Falcon's ``transformer.use_alibi`` set by hand) is not seen: after changing
    it, `forget_findings`."""
    classes = tuple(type(module) for module in model.get_decoder().modules())
    return (what, compat.current_attention_implementation(model), compat.num_layers(model.config),
            tuple(compat.layer_windows(model.config)), classes)


def forget_findings(model) -> None:
    """Drop what the probes found for ``model`` (after changing its modules' state by hand)."""
    _FINDINGS.pop(model, None)


def _found(model, what: str, probe):
    """``probe()``'s finding for ``model``, run once per `_probe_key`."""
    findings = _FINDINGS.setdefault(model, {})
    key = _probe_key(model, what)
    if key not in findings:
        findings[key] = probe()
    return findings[key]


def _probe_cache(model) -> BufferCache:
    """An empty `BufferCache` for a probe forward, with room for models that write more than one entry per token
    (counted by `_probe`, not an overflow error)."""
    return BufferCache(compat.num_layers(model.config), PROBE_CAPACITY, compat.layer_windows(model.config), rollback=1)


@torch.no_grad()
def _probe(model, token: torch.Tensor) -> tuple[list[int], dict[int, int], dict[int, int]]:
    """One token at position 0 on an empty `BufferCache`: entries stored per layer, the recorded query's per-head
    width by layer, and the cached keys' width by layer that Force 2 scores (not the window layers)."""
    cache = _probe_cache(model)
    recorder = QueryRecorder()
    forward_logits(model, token.to(model.device), cache, 0, 1, recorder)
    queries = {index: query.shape[-1] for index, query in recorder.queries.items()}
    keys = {index: layer.keys.shape[-1] for index, layer in enumerate(cache.layers)
            if not isinstance(layer, WindowLayer) and layer.is_initialized}
    return [layer.length for layer in cache.layers], queries, keys


def _check_retrieval_widths(model, queries: dict[int, int], keys: dict[int, int]) -> None:
    """Force 2 scores a layer's recorded query against the chunk means of its cached keys: the widths must agree.

    Multi-head latent attention (DeepSeek-V3 and the families built on its attention, transformers 5.x) caches its
    compressed latents (``kv_lora_rank`` wide) and expands them into keys inside the attention, so its query
    (``qk_nope_head_dim + qk_rope_head_dim`` wide) has no cached keys to be scored against. Where the two widths
    happen to agree the selection runs (exact, but scored against latents); where they differ, retrieval would
    fail after the prefill: refused here, naming the model, the layer, both widths and ``levels=2``.
    """
    for index, width in sorted(keys.items()):
        if index in queries and queries[index] != width:
            kind = getattr(model.config, "model_type", None)
            raise ValueError(
                f"triforce_config=: {type(model).__name__} (model_type {kind!r}) caches entries {width} wide in "
                f"decoder layer {index}, but the query Force-2 retrieval scores them with is {queries[index]} wide "
                "per head (multi-head latent attention caches compressed latents, not keys); use "
                "TriForceConfig(levels=2) with this model"
            )


@torch.no_grad()
def _biased_mask_layers(model, token: torch.Tensor) -> list[int]:
    """Decoder layers whose attention function receives a mask carrying a bias, on a two-token forward at positions
    0 and 1 (a one-token probe cannot tell: ALiBi's bias is 0 at key position 0)."""
    cache = _probe_cache(model)
    recorder = QueryRecorder(keep_masks=True)
    forward_logits(model, token.to(model.device).repeat(1, 2), cache, 0, 1, recorder)
    return sorted(index for index, mask in recorder.masks.items() if mask_adds_bias(mask))


def check_model(model, config: TriForceConfig, token: torch.Tensor, batch: bool = False) -> None:
    """Raise a ValueError, before any prefill, if ``model`` (or ``config``'s draft) cannot run on the tiers.

    ``token`` is ``[1, 1]``: a token of the prompt; ``batch``: the call decodes several rows. Call with the model
    switched to the recording attention.
    """
    name = type(model).__name__
    layers = getattr(model.get_decoder(), "layers", None)
    declared = compat.num_layers(model.config)
    if isinstance(layers, torch.nn.ModuleList) and len(layers) != declared:
        raise ValueError(
            f"triforce_config=: {name}'s decoder has {len(layers)} layers but its config's num_hidden_layers is "
            f"{declared} (Whisper maps it to the encoder's layers); TriForce sizes its caches by num_hidden_layers: "
            "this model is not supported"
        )
    windows = compat.layer_windows(model.config)
    if any(w is not None for w in windows) and not compat.builds_sliding_masks(model):
        raise ValueError(
            f"triforce_config=: {name}'s config declares sliding-window layers, but its decoder masks them as full "
            "attention (its attention sees whatever its cache keeps, all of it in the prefill, the last window when "
            "decoding); TriForce cannot reproduce that exactly: this model is not supported"
        )
    entries, recorded, cached = _found(model, "entries", lambda: _probe(model, token))
    odd = {index: n for index, n in enumerate(entries) if n != 1}
    if odd:
        raise ValueError(
            f"triforce_config=: {name} stores {sorted(set(odd.values()))} cache entries per input token in decoder "
            f"layers {sorted(odd)} (one per token is what TriForce's caches roll back by length); this model is not "
            "supported"
        )
    missing = sorted(set(range(len(entries))) - set(recorded))
    bypass = (f"triforce_config=: the attention of {name}'s decoder layers {missing} does not go through transformers' "
              "AttentionInterface")
    if config.levels == 3 and missing:
        raise ValueError(f"{bypass}, where TriForce records the query Force-2 retrieval needs; use "
                         "TriForceConfig(levels=2) with this model")
    base = compat.current_attention_implementation(model).removeprefix(PREFIX)
    if missing and base != "eager":
        raise ValueError(
            f"{bypass}, and its own {base!r} code may mask a multi-token forward over TriForce's caches as a square "
            "causal block (transformers 5.24's Falcon with SDPA gave other tokens than plain generate); "
            "TriForceConfig(levels=2) runs such a model with its eager attention only: load it with "
            "attn_implementation='eager'"
        )
    if missing and (config.trees or batch):
        # a tree's attention and a batch's per-row masks are applied by the wrapper in the interface; a layer that
        # bypasses it would attend with its own causal mask (a tree's siblings would see each other)
        what = "TriForceConfig(tree_nodes=0, force2_tree_nodes=0)" if config.trees else "one prompt per call"
        raise ValueError(f"{bypass}, where TriForce applies candidate trees' and batches' masks; use {what} with this "
                         "model")
    if config.levels == 3:
        _check_retrieval_widths(model, recorded, cached)
    if config.trees or batch:
        biased = _found(model, "biased masks", lambda: _biased_mask_layers(model, token))
        if biased:
            what = ("candidate trees (their nodes sit in cache slots, not at their positions, and tree attention "
                    "replaces the mask): use TriForceConfig(tree_nodes=0, force2_tree_nodes=0)" if config.trees else
                    "batches (the per-row 4-D mask of a batch is not one the model derives its bias from): generate "
                    "one prompt per call")
            raise ValueError(
                f"triforce_config=: {name} adds a bias to the attention mask of decoder layers {biased} (ALiBi); "
                f"TriForce does not support that with {what}"
            )
    if spec_of(config.draft).kind == "model":
        draft = model if isinstance(config.draft, str) else config.draft
        # a ValueError naming the layer whose keys cannot be moved; probed once per model, as the checks above
        _found(draft, "rerotations", lambda: make_layer_rerotations(draft))


BATCH_ATTENTION = ("sdpa", "eager")  # implementations that read the 4-D per-row mask


def check_batch_request(model, config: TriForceConfig, generation_config, streamer, prefix_cache) -> None:
    """Refuse, by parameter name and allowed values, what batches do not support yet."""
    if config.trees:
        raise ValueError("triforce_config=: batch size > 1 supports chains only: TriForceConfig.tree_nodes=0 and "
                         f"force2_tree_nodes=0 (got {config.tree_nodes} and {config.force2_tree_nodes})")
    if config.full_cache_device is not None:
        raise ValueError(f"triforce_config=: batch size > 1 supports TriForceConfig.full_cache_device=None only "
                         f"(got {config.full_cache_device!r})")
    if any(window is not None for window in compat.layer_windows(model.config)):
        raise ValueError("triforce_config=: batch size > 1 supports full-attention models only; this model has "
                         "sliding-window layers (their window counts cache columns, which differ from a row's "
                         "positions once rows accept different numbers of tokens)")
    base = compat.current_attention_implementation(model)
    if base not in BATCH_ATTENTION:
        raise ValueError(f"triforce_config=: batch size > 1 supports attn_implementation in {BATCH_ATTENTION} "
                         f"(got {base!r})")
    if row_mixing_layers(model):
        raise ValueError("triforce_config=: batch size > 1 is not supported on models with LLM.int8 layers whose "
                         "rows depend on each other (llm_int8_threshold > 0)")
    if streamer is not None:
        raise ValueError("triforce_config=: streamer= supports batch size 1 only (as transformers' streamers)")
    if generation_config.output_scores or generation_config.output_logits:
        raise ValueError("triforce_config=: output_scores/output_logits support batch size 1 only")
    if prefix_cache is not None:
        for index, layer in enumerate(prefix_cache.layers):
            if not full_attention_layer(layer):
                raise ValueError(f"cache=: layer {index} is a {type(layer).__name__}; a batch continues from the "
                                 "DynamicCache or StaticCache of a forward of the same left-padded batch")
