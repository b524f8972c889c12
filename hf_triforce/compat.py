"""The ONLY module that touches transformers internals: private names and behaviour that is not public API.

Written against transformers 5.24 and audited against 5.25 (declared range ``TESTED_TRANSFORMERS``; what the
5.25 audit found is listed at ``TESTED_TRANSFORMERS``). Every name and every behaviour
listed here has a test in ``tests/test_integration_contract.py`` that fails loudly when upstream changes it.
Other modules use transformers' public API only (``Cache``, logits processors, stopping criteria, ``generate``)
and reach anything else through the functions below:

- ``GenerationMixin.generate`` is wrapped (``ORIGINAL_GENERATE`` is kept): ``generate(custom_generate=fn)``
  calls ``fn(model, input_ids, logits_processor=, stopping_criteria=, generation_config=, <fn's own kwargs>,
  **model_kwargs)`` after its setup, but drops ``streamer=`` and ``tokenizer=`` on the way (5.24, 5.25);
- ``CacheLayerMixin`` (the per-layer cache base class) and the masks built from ``get_mask_sizes`` /
  ``get_seq_length`` of the cache;
- attention functions: the registries ``ALL_ATTENTION_FUNCTIONS`` / ``ALL_MASK_ATTENTION_FUNCTIONS``, the
  per-model-file ``eager_attention_forward``, ``config._attn_implementation`` switched per call, and
  forward ``**kwargs`` reaching the attention function (how a call's `QueryRecorder` travels);
- the decoder's ``rotary_emb`` module (``forward(x, position_ids[, layer_type]) -> (cos, sin)``: Gemma 3 takes
  the layer's type, its local and global layers rotate with different bases);
- the per-layer cache structure of a config (``cache_utils.get_layer_types_and_kwargs``, what ``DynamicCache``
  follows: ``"sliding_attention"`` layers with their ``sliding_window``), and the sliding-window mask built
  from a cache's ``is_sliding`` layers, ``get_mask_sizes`` and ``get_seq_length``;
- ``GenerateDecoderOnlyOutput`` (the output class TriForce's output extends);
- ``hf_quantizer.remove_quantization_config`` (a GGUF-loaded model is marked quantized until it is removed);
- GGUF loading's tensor processors and name map (``modeling_gguf_pytorch_utils``: ``TENSOR_PROCESSORS``,
  ``TensorProcessor``, ``get_gguf_hf_weights_map``), with which ``from_pretrained(gguf_file=...)`` puts a file's
  tensors into the model (``gguf_tensor_map``: Llama's query and key rows unpermuted);
- ``PrefixConstrainedLogitsProcessor``'s callback and rows per batch id (``prefix_constraint``);
- ``CompileConfig._compile_all_devices``: ``generate`` compiles its decoding forward on CUDA-like devices only
  unless it is set (``compile_everywhere``; the bench's compiled static-cache baseline on the CPU);
- transformers' assisted-generation loop (``assisted_decoding``): ``GenerationMixin._assisted_decoding``, which asks
  ``self._get_candidate_generator(...)`` for its `CandidateGenerator` (no public hook in 5.24/5.25), calls
  ``get_candidates(input_ids)`` and ``update_candidate_strategy(input_ids, new_logits, n_matches)`` (after
  ``cache.crop(-rejected)``), feeds its first iteration through ``prepare_inputs_for_generation(...,
  next_sequence_length=None, is_first_iteration=True)`` (the whole sequence, even after a pre-filled cache), applies
  the call's processors to the verifier's logits, and accepts sampled candidates by ``_speculative_sampling``
  (``q = candidate_logits.softmax``, ``p = new_logits.softmax``, residual ``max(p - q, 0)``).

Other libraries' attributes read here, with the same contract tests:

- torch's ``Tensor._version`` (``version_counter``: every in-place write bumps it; no public name in torch 2.13);
- peft's tuner layers' ``active_adapters``, ``merged_adapters`` and ``disable_adapters`` (``adapter_state``: which
  adapters a model runs, for the int8 drafting copy and a saved prefill's fingerprint);

- bitsandbytes ``Linear8bitLt.state.threshold`` (the LLM.int8 outlier threshold; > 0 mixes rows);
- accelerate's dispatch hooks (``device_map=`` / ``offload_folder=``): ``_hf_hook`` with its
  ``execution_device``, ``weights_map`` and ``tied_params_map``, ``_old_forward`` (the forward a hook wraps),
  and the public ``align_module_device`` / ``has_offloaded_params``.
"""

from __future__ import annotations

import inspect
import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import torch
from transformers import GenerationMixin, cache_utils
from transformers.cache_utils import Cache, CacheLayerMixin, get_layer_types_and_kwargs
from transformers.generation.candidate_generator import CandidateGenerator
from transformers.generation.utils import GenerateDecoderOnlyOutput
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

# 5.25 against 5.24: every private name and behaviour listed above is unchanged. Around them, Falcon's attention goes
# through the AttentionInterface (ALiBi Falcon adds its position bias to the mask: `kernels.attention`),
# `_assisted_decoding` reads `candidate_generator.num_drafting_tokens` and `_speculative_sampling` accepts with
# `r < p/q` (neither used here; the upstream patch follows them), and `from_pretrained` kernelizes by default.
TESTED_TRANSFORMERS = (">=5.24", "<5.26")
ORIGINAL_GENERATE = GenerationMixin.generate
# the cache layers of a `QuantizedCache`, which keep their entries quantized (``keys`` / ``values`` hold at most the
# unquantized residual): ``BaseQuantizedLayer`` (the fp8 and the group-wise layers) where transformers has it, else
# ``QuantizedLayer`` (the group-wise ones)
QUANTIZED_CACHE_LAYERS = tuple(getattr(cache_utils, name) for name in ("BaseQuantizedLayer", "QuantizedLayer")
                               if hasattr(cache_utils, name))

__all__ = [
    "Cache",
    "CacheLayerMixin",
    "CandidateGenerator",
    "GenerateDecoderOnlyOutput",
    "ORIGINAL_GENERATE",
    "QUANTIZED_CACHE_LAYERS",
    "TESTED_TRANSFORMERS",
    "adapter_state",
    "assisted_decoding",
    "attention_function",
    "builds_sliding_masks",
    "bnb_outlier_threshold",
    "execution_device",
    "layer_devices",
    "hook_state",
    "materialized",
    "offloaded_modules",
    "prefix_constraint",
    "strip_hooks",
    "attention_implementation",
    "install_generate",
    "layer_rotary",
    "layer_windows",
    "module_window",
    "num_layers",
    "register_attention",
    "remove_quantization_config",
    "rotary_embedding",
]


def _attention_registry():
    """transformers' ``ALL_ATTENTION_FUNCTIONS`` (an ``AttentionInterface``), imported on first use:
    ``transformers.modeling_utils`` imports every installed quantization stack (its quantizers import torchao,
    which prints load failures and costs seconds), so ``import hf_triforce`` must not import it. Any model
    already has it imported by the time one of the functions below runs."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return ALL_ATTENTION_FUNCTIONS


def attention_function(name: str, module: torch.nn.Module) -> Callable:
    """The attention function ``name`` as ``module`` would call it (eager lives in each model's file)."""
    if name == "eager":  # each model file defines its own eager attention (softcapping, sinks, ...)
        return sys.modules[type(module).__module__].eager_attention_forward
    return _attention_registry()[name]


def attention_names() -> list[str]:
    """Registered attention implementation names."""
    return list(_attention_registry().valid_keys())


def is_registered_attention(name: str) -> bool:
    return name in _attention_registry()


def register_attention(name: str, function: Callable, masks_like: str) -> None:
    """Register ``function`` as attention implementation ``name``, building masks as ``masks_like`` does."""
    from transformers.modeling_utils import AttentionInterface  # see _attention_registry

    AttentionInterface.register(name, function)
    AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[masks_like])


@contextmanager
def attention_implementation(model, name: str) -> Iterator[str]:
    """Switch ``model`` to attention implementation ``name`` for the block; yields the one it had."""
    config = model.config
    original = config._attn_implementation
    config._attn_implementation = name
    try:
        yield original or "eager"
    finally:
        config._attn_implementation = original


def current_attention_implementation(model) -> str:
    return model.config._attn_implementation or "eager"


def rotary_embedding(model) -> torch.nn.Module | None:
    """The decoder's rotary embedding module (``None`` where the decoder has none)."""
    return getattr(model.get_decoder(), "rotary_emb", None)


SUPPORTED_LAYER_TYPES = ("full_attention", "sliding_attention")


def num_layers(config) -> int:
    """Decoder layers of the text model (a multimodal model's config nests it: ``get_text_config``)."""
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    return config.num_hidden_layers


def layer_windows(config) -> list[int | None]:
    """Per decoder layer: ``None`` for full attention, the window ``W`` for sliding-window attention.

    Read the way ``DynamicCache(config=...)`` reads it (``get_layer_types_and_kwargs``), so every tier keeps
    what plain ``generate``'s cache keeps. Any other layer type (``chunked_attention`` of Llama 4, linear
    attention, convolutions, shared-KV layers, ...) raises a ValueError naming it.
    """
    config = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
    types, kwargs = get_layer_types_and_kwargs(config)
    unsupported = sorted({str(t) for t in types if t not in SUPPORTED_LAYER_TYPES})
    if unsupported:
        raise ValueError(
            f"triforce_config=: the model has {unsupported} layers (config.layer_types); TriForce supports "
            f"{' and '.join(SUPPORTED_LAYER_TYPES)} layers"
        )
    windows = [None if t == "full_attention" else int(kw["sliding_window"]) for t, kw in zip(types, kwargs)]
    distinct = {w for w in windows if w is not None}
    if len(distinct) > 1 or (distinct and distinct != {getattr(config, "sliding_window", None)}):
        raise ValueError(f"triforce_config=: sliding layers with windows {sorted(distinct)}; transformers masks them "
                         f"with config.sliding_window={getattr(config, 'sliding_window', None)}, TriForce needs one")
    return windows


def builds_sliding_masks(model) -> bool:
    """Whether the decoder's ``forward`` builds sliding-window masks (transformers' hybrid models name them in the
    code: ``create_sliding_window_causal_mask`` / ``"sliding_attention"``). Moshi's config declares sliding layers
    but its decoder masks them as full layers: its attention then sees whatever its cache keeps, which differs
    between the prefill (everything) and decoding (the last ``W - 1`` tokens)."""
    return "sliding" in inspect.getsource(type(model.get_decoder()).forward)


_MODULE_WINDOWS: weakref.WeakKeyDictionary[torch.nn.Module, int | None] = weakref.WeakKeyDictionary()


def module_window(module: torch.nn.Module, kwargs: dict) -> int | None:
    """The sliding window of the attention layer ``module`` (None: full attention): the ``sliding_window`` its
    forward passes to the attention function, else its layer's type in its config (Qwen2-MoE passes none)."""
    if kwargs.get("sliding_window") is not None:
        return int(kwargs["sliding_window"])
    if module not in _MODULE_WINDOWS:
        config, index = getattr(module, "config", None), getattr(module, "layer_idx", None)
        window = None
        if config is not None and index is not None:
            try:
                types, layer_kwargs = get_layer_types_and_kwargs(config)
                window = layer_kwargs[index].get("sliding_window") if types[index] != "full_attention" else None
            except (AttributeError, IndexError, TypeError):
                window = getattr(config, "sliding_window", None)  # a config without per-layer structure
        _MODULE_WINDOWS[module] = window
    return _MODULE_WINDOWS[module]


def layer_rotary(model, layer_idx: int) -> Callable | None:
    """``f(x, position_ids) -> (cos, sin)`` of decoder layer ``layer_idx``: the decoder's ``rotary_emb``, given the
    layer's type where its ``forward`` takes a ``layer_type`` (per-layer-type bases). None where there is none."""
    rotary = rotary_embedding(model)
    if rotary is None:
        return None
    if "layer_type" not in inspect.signature(rotary.forward).parameters:
        return rotary
    config = model.config.get_text_config(decoder=True)
    layer_type = get_layer_types_and_kwargs(config)[0][layer_idx]
    return lambda x, position_ids: rotary(x, position_ids, layer_type)


def remove_quantization_config(model) -> None:
    """Drop the quantization marker a GGUF load leaves (weights are already dequantized)."""
    if getattr(model, "hf_quantizer", None) is not None:
        model.hf_quantizer.remove_quantization_config(model)


def gguf_tensor_map(model, architecture: str | None) -> tuple[object, dict[str, str]]:
    """``(processor, names)``: transformers' tensor processor for a GGUF file of ``architecture`` (its
    ``general.architecture``; the default processor where transformers has none for it), made on ``model``'s config,
    and the map from the file's tensor names to ``model``'s parameter names -- what ``from_pretrained(gguf_file=...)``
    loads with. ``processor.process(weights=, name=, tensor_key_mapping=, parsed_parameters=)`` returns the tensor as
    loaded (``.weights``, a numpy array) and its name (``.name``)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS, TensorProcessor, get_gguf_hf_weights_map

    processor = TENSOR_PROCESSORS.get(architecture, TensorProcessor)(config=model.config.to_dict())
    return processor, get_gguf_hf_weights_map(model, processor)


def version_counter(tensor: torch.Tensor) -> int:
    """``tensor``'s version counter: every in-place write to it (or a view of it) bumps it."""
    return tensor._version


def prefix_constraint(processor) -> tuple[Callable, int]:
    """A ``PrefixConstrainedLogitsProcessor``'s ``prefix_allowed_tokens_fn`` and its rows per batch id (``generate``
    builds it with ``max(num_beams, num_return_sequences)``)."""
    return processor._prefix_allowed_tokens_fn, processor._num_beams


def compile_everywhere():
    """A ``CompileConfig`` that ``generate`` honours on every device, the CPU included: with a compileable cache
    (``StaticCache``) it decodes through ``torch.compile`` of the model's forward."""
    from transformers import CompileConfig

    config = CompileConfig()
    config._compile_all_devices = True
    return config


def bnb_outlier_threshold(module: torch.nn.Module) -> float | None:
    """The LLM.int8 outlier threshold of a bitsandbytes ``Linear8bitLt`` (None for any other module)."""
    if type(module).__name__ != "Linear8bitLt" or not type(module).__module__.startswith("bitsandbytes"):
        return None
    return float(module.state.threshold)


def adapter_state(model: torch.nn.Module) -> tuple:
    """Which adapters each adapter-carrying layer runs and whether they are merged (empty without adapters).

    Read from the attributes PEFT's tuner layers expose (``active_adapters``, ``merged_adapters``,
    ``disable_adapters``); modules without ``active_adapters`` do not contribute.
    """
    state = []
    for name, module in model.named_modules():
        active = getattr(module, "active_adapters", None)
        if active is None or callable(active):  # the model's own active_adapters() is a method
            continue
        state.append((name, tuple(active), tuple(getattr(module, "merged_adapters", ())),
                      bool(getattr(module, "disable_adapters", False))))
    return tuple(state)


def execution_device(module: torch.nn.Module) -> torch.device | None:
    """The device an accelerate hook runs ``module`` on (None: no hook; the module runs where its weights are)."""
    hook = getattr(module, "_hf_hook", None)
    device = getattr(hook, "execution_device", None)
    if device is None:
        return None
    return torch.device(f"cuda:{device}" if isinstance(device, int) else device)


def layer_devices(model: torch.nn.Module) -> list[torch.device | None]:
    """The execution device of each decoder layer, in order: its accelerate hook's (``device_map=``; a layer
    offloaded to disk or CPU runs on its hook's device), else the device of its weights. ``None`` for every
    layer of a decoder that keeps its layers elsewhere than ``.layers`` (a cache layer is then allocated where
    its entries are computed)."""
    layers = getattr(model.get_decoder(), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList) or len(layers) != num_layers(model.config):
        return [None] * num_layers(model.config)
    devices = []
    for index, layer in enumerate(layers):
        device = execution_device(layer)
        if device is None:
            device = next((p.device for p in layer.parameters() if p.device.type != "meta"), None)
        if device is None:
            raise ValueError(f"decoder layer {index} has neither an accelerate hook nor loaded weights")
        devices.append(device)
    return devices


def offloaded_modules(model: torch.nn.Module) -> list[str]:
    """Names of the modules whose weights accelerate keeps offloaded (CPU or disk) and loads per forward."""
    from accelerate.utils import has_offloaded_params

    return [name for name, module in model.named_modules() if has_offloaded_params(module)]


@contextmanager
def materialized(model: torch.nn.Module) -> Iterator[None]:
    """Within the block, every offloaded module of ``model`` holds its real weights on its execution device."""
    from accelerate.utils import align_module_device

    with ExitStack() as stack:
        for name in offloaded_modules(model):
            stack.enter_context(align_module_device(model.get_submodule(name)))
        yield


def hook_state(model: torch.nn.Module) -> dict[int, object]:
    """Objects a copy of ``model`` must share rather than duplicate: each hook's weights map (offloaded weights)
    and tied-parameter map, keyed by ``id`` (a ``copy.deepcopy`` memo)."""
    shared = {}
    for module in model.modules():
        hook = getattr(module, "_hf_hook", None)
        for attribute in ("weights_map", "tied_params_map"):
            value = getattr(hook, attribute, None)
            if value is not None:
                shared[id(value)] = value
    return shared


def strip_hooks(model: torch.nn.Module) -> None:
    """Remove accelerate hooks from ``model`` (a private copy) without moving or reloading any weight."""
    for module in model.modules():
        if "_hf_hook" in module.__dict__:
            del module._hf_hook
        if "_old_forward" in module.__dict__:
            module.forward = module._old_forward
            del module._old_forward


def install_generate(generate: Callable | None) -> None:
    """Install ``generate`` on every model (``None``: transformers' own)."""
    GenerationMixin.generate = ORIGINAL_GENERATE if generate is None else generate


@contextmanager
def _instance_attributes(obj, **values) -> Iterator[None]:
    """Set attributes on the instance ``obj`` for the block (shadowing its class's), then restore what it had."""
    missing = object()
    saved = {name: obj.__dict__.get(name, missing) for name in values}
    for name, value in values.items():
        setattr(obj, name, value)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is missing:
                delattr(obj, name)
            else:
                setattr(obj, name, value)


def assisted_decoding(model, candidate_generator: CandidateGenerator, input_ids: torch.LongTensor, logits_processor,
                      stopping_criteria, generation_config, streamer=None, **model_kwargs):
    """transformers' own assisted-generation loop (``GenerationMixin._assisted_decoding``), batch size 1, driven by
    ``candidate_generator``: the model verifies its candidates (greedy: the longest prefix equal to its argmax;
    sampling with candidate logits: ``_speculative_sampling``), crops the cache to what it accepted and calls the
    generator's ``update_candidate_strategy``. Returns what ``_assisted_decoding`` returns.

    For the call, ``model._get_candidate_generator`` answers ``candidate_generator`` (transformers 5.24/5.25 take no
    generator from the caller), and the first iteration feeds only what ``model_kwargs["cache"]`` does not hold yet:
    the stock loop feeds the whole sequence on its first iteration, so a cache pre-filled with the start of the
    sequence would get those tokens a second time (at positions counted after them). A transformers that already
    trims it (the upstream patch) passes ``next_sequence_length`` itself, which is then left as it is."""
    prepare = model.prepare_inputs_for_generation

    def prepare_inputs(input_ids, next_sequence_length=None, is_first_iteration=False, **kwargs):
        cache = kwargs.get("cache")
        if is_first_iteration and next_sequence_length is None and cache is not None:
            cached = int(cache.get_seq_length())
            if 0 < cached < input_ids.shape[1]:
                next_sequence_length = input_ids.shape[1] - cached
        return prepare(input_ids, next_sequence_length=next_sequence_length, is_first_iteration=is_first_iteration,
                       **kwargs)

    def get_candidate_generator(**kwargs) -> CandidateGenerator:
        return candidate_generator

    with _instance_attributes(model, _get_candidate_generator=get_candidate_generator,
                              prepare_inputs_for_generation=prepare_inputs):
        return model._assisted_decoding(input_ids, logits_processor=logits_processor,
                                        stopping_criteria=stopping_criteria, generation_config=generation_config,
                                        synced_gpus=False, streamer=streamer, **model_kwargs)


class ServeRequestHandling:
    """`transformers serve`'s request handling (``transformers.cli.serving``, 5.24-5.25), run without its model
    manager, for `hf_triforce.serving.requests`: its chat and text completion handlers' chat-template rendering
    (``render_messages``, on a text-only engine) and OpenAI-fields-to-``generate`` mapping
    (``_build_generation_kwargs``). Imported on first use: the serving extra brings fastapi and openai."""

    def __init__(self, tokenizer) -> None:
        from transformers.cli.serving.chat_completion import ChatCompletionHandler
        from transformers.cli.serving.completion import CompletionHandler
        from transformers.cli.serving.utils import GenerationState, Modality

        state = GenerationState()
        self.handlers = {"chat": ChatCompletionHandler(None, state), "text": CompletionHandler(None, state)}
        # what the chat rendering reads of an engine
        self.engine = type("TextEngine", (), {"processor": tokenizer, "modality": Modality.LLM, "use_cb": False})()

    def render_chat(self, body: dict) -> dict:
        """``body["messages"]`` through the chat template with ``add_generation_prompt=True``: ``input_ids`` [1, n]."""
        return self.handlers["chat"].render_messages(self.engine, body["messages"], body)

    def generation_kwargs(self, endpoint: str, body: dict, generation_config) -> dict:
        """``generate`` arguments of the request over ``generation_config`` (``max_new_tokens``, ``do_sample``,
        ``temperature``, ``top_p``, ``top_k``, ``eos_token_id``, ``seed``, ``stop_strings``, penalties)."""
        return self.handlers[endpoint]._build_generation_kwargs(body, generation_config)


def rust_tokenizer(tokenizer):
    """The ``tokenizers.Tokenizer`` behind a fast tokenizer (``PreTrainedTokenizerFast._tokenizer``, what
    `transformers serve`'s ``Detokenizer`` streams with); ValueError for a tokenizer without one."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None:
        raise ValueError(f"streaming needs a fast (Rust) tokenizer; {type(tokenizer).__name__} is not one")
    return backend
