"""Which model and forward each tier runs: Force 1 and Force 2 at ``TriForceConfig.draft_precision``.

One call decides its tiers along one path, all in this module:

1. ``triforce_generate`` refuses, before the prefill, an explicit lean precision a drafting model cannot take
   (`check_lean_eligible` over `drafting_models`, the models Force 1 and Force 2 may run).
2. `resolved.resolve` resolves the config once per call, before anything is built, by `resolve_draft_precision`:
   ``"auto"`` by `lean_support` and `lean_refusal`, ``tier_compile="auto"`` by the device; every later step reads
   that `resolved.ResolvedConfig`, and `hierarchy.adaptive_policy` asks `lean_self_drafting` whether the target drafts.
3. A plan's first use builds each tier's model by `tier_model` (`hierarchy.Hierarchy`: Force 2 for its levels, and
   through `drafters.DraftContext.force1_model` Force 1 for `drafters.model`):
   a cached `LeanModel` (`lean_model`) or its compiled view, or `kernels.quantized.drafting_model`.
4. `tier_forward` names the forward each tier ran; `weight_bytes` and `kv_bytes_per_token` price the tiers.
5. Force 3's verification forward (`force3_forward`, asked by `force3.Force3` and `force3.RaggedForce3` before the
   prefill): transformers' forward, or the target's native lean forward at fixed shapes (``force3_compile``).

`hf_triforce.kernels.lean` only computes: it builds and runs the `LeanModel` of the precision it is handed.
"""

from __future__ import annotations

import weakref
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from .. import compat
from ..drafters.registry import spec_of
from ..kernels.lean import INT4_GROUP_SIZE, INT4_MM, INT4_PACK, INT8_MM, LEAN_PRECISIONS, LeanModel
from ..kernels.quantized import drafting_model

if TYPE_CHECKING:
    from ..config import TriForceConfig

# what TriForceConfig(draft_precision="auto") runs where the lean forward covers a model on a CUDA device
AUTO_GPU_PRECISION = "native"
# what TriForceConfig(draft_precision="auto"), the default, runs where the lean forward covers the model: the fastest
# drafter measured at nearly the fp32 model's agreement (docs/experiments.md, "Lean drafting tiers: ...")
AUTO_PRECISION = "lean-int4"
# what Force 2 runs for each lean draft precision (Force 1 runs the precision itself). For "lean-int4", Force 2 on the
# int4 copy lowers Force-3 acceptance but costs a fraction of an fp32 Force 2, and decodes as fast as any
# (docs/experiments.md, "Lean drafting tiers: ..."). Measured on a model dequantized from 4-bit
# (`kernels.lean.INT4_GROUP_SIZE`) only.
FORCE2_PRECISION = {"lean": "lean", "lean-int8": "lean-int8", "lean-int4": "lean-int4", "native": "native"}
# the model dtypes each lean precision copies: the quantized ones quantize fp32 or bf16 weights; "lean" multiplies by
# the fp32 weights themselves (a bf16 model's would be an fp32 copy twice its size). A bf16 model's activations are
# fp32 in the lean forward too; its caches keep the model's dtype (attention runs in it)
LEAN_DTYPES = {"lean": (torch.float32,), "lean-int8": (torch.float32, torch.bfloat16),
               "lean-int4": (torch.float32, torch.bfloat16),
               "native": (torch.float32, torch.bfloat16, torch.float16)}
CPU_ONLY_PRECISIONS = ("lean", "lean-int8", "lean-int4")  # their copies and kernels are the CPU's
SUPPORTED_CLASSES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")

_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> {precision: LeanModel}


def lean_support(model: nn.Module) -> str | None:
    """None where the lean forward computes ``model``'s architecture, else why not (the model then drafts with
    its eager forward)."""
    name = type(model).__name__
    if name not in SUPPORTED_CLASSES:
        return f"{name} is not one of {SUPPORTED_CLASSES}"
    config = model.config
    if getattr(config, "hidden_act", None) != "silu":
        return f"activation {getattr(config, 'hidden_act', None)!r} (the lean forward computes silu)"
    if getattr(config, "pretraining_tp", 1) != 1:
        return f"pretraining_tp={config.pretraining_tp}"
    if any(window is not None for window in compat.layer_windows(config)):
        return "sliding-window layers"
    rotary = compat.rotary_embedding(model)
    if rotary is None or compat.layer_rotary(model, 0) is not rotary:
        return "no single decoder rotary embedding"
    decoder = model.get_decoder()
    for index, layer in enumerate(decoder.layers):
        attention, mlp = layer.self_attn, layer.mlp
        linears = (attention.q_proj, attention.k_proj, attention.v_proj, attention.o_proj, mlp.gate_proj,
                   mlp.up_proj, mlp.down_proj, model.get_output_embeddings())
        if any(type(linear) is not nn.Linear for linear in linears):
            return f"decoder layer {index} has projections that are not plain nn.Linear (adapters, quantized layers)"
        subclassed = sorted({type(linear.weight.data).__name__ for linear in linears
                             if type(linear.weight.data) is not torch.Tensor})
        if subclassed:  # torchao's quantized weights: plain nn.Linear modules holding tensor subclasses
            return f"decoder layer {index} has weights of tensor subclasses {subclassed} (quantized weights)"
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if getattr(norm, "variance_epsilon", None) != decoder.norm.variance_epsilon:
                return f"decoder layer {index} has norms the lean forward does not compute"
    head = model.get_output_embeddings()
    if head.weight.shape[1] != config.hidden_size:
        return "an output layer that does not read the hidden state"
    return None


def lean_refusal(model: nn.Module, precision: str) -> Exception | None:
    """The error `lean_model` would raise for ``model`` at ``precision`` (None: it copies the model, or runs it as
    given where `lean_support` says the lean forward does not cover it)."""
    if precision not in LEAN_PRECISIONS:
        return ValueError(f"draft_precision must be one of {tuple(LEAN_PRECISIONS)} here, got {precision!r}")
    if lean_support(model) is not None:
        return None  # drafts with its eager forward (TriForceDetail.tier_forwards says why)
    for name, module in model.named_modules():
        if compat.execution_device(module) is not None:
            return ValueError(f"TriForceConfig.draft_precision={precision!r} copies the weights of a model loaded in "
                              f"one piece on the CPU; module {name or 'model'!r} runs under an accelerate hook "
                              "(device_map=): use draft_precision='int8' or 'model'")
    for name, parameter in model.named_parameters():
        if parameter.device.type != "cpu" and precision in CPU_ONLY_PRECISIONS:
            return ValueError(f"TriForceConfig.draft_precision={precision!r} runs on CPU only; parameter {name!r} "
                              f"is on {parameter.device} (use draft_precision='model' there)")
        if parameter.dtype not in LEAN_DTYPES[precision]:
            allowed = " or ".join(str(dtype).removeprefix("torch.") for dtype in LEAN_DTYPES[precision])
            return ValueError(f"TriForceConfig.draft_precision={precision!r} copies a {allowed} model; parameter "
                              f"{name!r} is {parameter.dtype}")
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    widths = {"qkv": config.hidden_size, "o": config.num_attention_heads * head_dim, "gate_up": config.hidden_size,
              "down": config.intermediate_size, "head": config.hidden_size}
    bad = sorted({widths[part] for part, kind in LEAN_PRECISIONS[precision].items()
                  if kind == "int4" and widths[part] % INT4_GROUP_SIZE})
    if bad:
        return ValueError(f"TriForceConfig.draft_precision={precision!r}: input widths {bad} are not multiples of the "
                          f"int4 group size {INT4_GROUP_SIZE}; use draft_precision='lean-int8'")
    kernels = {"int8": ("_weight_int8pack_mm", INT8_MM), "int4": ("_weight_int4pack_mm_for_cpu", INT4_MM)}
    for kind in sorted(set(LEAN_PRECISIONS[precision].values()) & set(kernels)):
        name, kernel = kernels[kind]
        if kernel is None or (kind == "int4" and INT4_PACK is None):
            return RuntimeError(f"TriForceConfig.draft_precision={precision!r} needs torch.ops.aten.{name}, which "
                                f"torch {torch.__version__} does not provide")
    return None


def check_lean_eligible(model: nn.Module, precision: str) -> None:
    """Raise the error `lean_model` would raise for ``model`` (checked before a long prefill)."""
    refusal = lean_refusal(model, precision)
    if refusal is not None:
        raise refusal


def resolve_draft_precision(config: TriForceConfig, target: nn.Module) -> tuple[TriForceConfig, str | None]:
    """``(config, why)``: ``config`` with ``draft_precision="auto"`` made concrete for ``target`` (and a draft model
    ``config.draft``): `AUTO_PRECISION` where the lean forward covers and can copy every drafting model, else
    ``"model"``, with ``why`` naming what kept it from the lean forward (None: it runs lean, or was not "auto")."""
    if config.draft_precision != "auto":
        return _resolve_tier_compile(config, target), None
    models = drafting_models(config, target)
    on_gpu = any(on_cuda(model) for model in models)
    precision = AUTO_GPU_PRECISION if on_gpu else AUTO_PRECISION
    reasons = []
    for model in models:
        refusal = lean_refusal(model, precision)  # None where lean_support says the lean forward does not cover it
        reason = lean_support(model) or (str(refusal) if refusal is not None else None)
        if reason is not None:
            reasons.append(reason)
    if reasons and config.tier_compile not in ("off", "auto"):
        raise ValueError(f"TriForceConfig(draft_precision='auto', tier_compile={config.tier_compile!r}): this model "
                         f"drafts with its eager forward ({'; '.join(reasons)}), which tier_compile does not compile; "
                         "use tier_compile='off'")
    resolved = replace(config, draft_precision="model" if reasons else precision)
    return _resolve_tier_compile(resolved, target), "; ".join(reasons) or None


def resolve_retrieval_dtype(config: TriForceConfig, target: nn.Module) -> TriForceConfig:
    """``config`` (its ``draft_precision`` concrete: `resolve_draft_precision`) with ``retrieval_dtype="auto"`` made
    concrete: ``"bfloat16"`` where Force 2 runs the lean forward on the CPU over an fp32 ``target`` (a bf16 cache
    halves the bytes each Force-2 forward reads), else ``"model"``. Raises ValueError where ``"bfloat16"`` was asked
    of a Force 2 that runs the model's eager forward (``draft_precision="auto"`` fell back to ``"model"``)."""
    lean = config.draft_precision in LEAN_PRECISIONS and lean_support(target) is None
    if config.retrieval_dtype == "bfloat16" and not lean:
        why = lean_support(target) if config.draft_precision in LEAN_PRECISIONS else \
            f"draft_precision={config.draft_precision!r}"
        raise ValueError(f"TriForceConfig.retrieval_dtype='bfloat16' needs Force 2's lean forward; this model's "
                         f"Force 2 runs its eager forward ({why}): use retrieval_dtype='model'")
    if config.retrieval_dtype != "auto":
        return config
    fp32_cpu = not on_cuda(target) and next(target.parameters()).dtype == torch.float32
    return replace(config, retrieval_dtype="bfloat16" if lean and fp32_cpu else "model")


def _resolve_tier_compile(config: TriForceConfig, target: nn.Module) -> TriForceConfig:
    """``tier_compile="auto"`` made concrete: CUDA graphs where the tiers run the native lean forward on a CUDA
    device (launch-bound otherwise), else ``"off"``."""
    if config.tier_compile == "graph" and not on_cuda(target):
        raise ValueError(f"TriForceConfig.tier_compile='graph' captures CUDA graphs; this model is on "
                         f"{next(target.parameters()).device} (use 'fixed' or 'compile' there)")
    if config.tier_compile != "auto":
        return config
    covered = all(lean_support(model) is None for model in drafting_models(config, target))
    return replace(config, tier_compile=_auto_tier_compile(config.draft_precision, target) if covered else "off")


def _auto_tier_compile(precision: str, model: nn.Module) -> str:
    """What ``tier_compile="auto"`` runs for ``model``'s tiers at ``precision``."""
    return "graph" if precision == "native" and on_cuda(model) else "off"


def on_cuda(model: nn.Module) -> bool:
    """Whether ``model`` has weights on a CUDA device."""
    return any(p.device.type == "cuda" for p in model.parameters())


def lean_model(model: nn.Module, precision: str):
    """The cached `LeanModel` of ``model`` at ``precision`` (a key of `LEAN_PRECISIONS`), or ``model`` itself
    where `lean_support` says the lean forward does not cover it."""
    if lean_support(model) is not None:
        return model
    copies = _COPIES.setdefault(model, {})
    if precision not in copies:
        check_lean_eligible(model, precision)
        copies[precision] = LeanModel(model, precision)
    return copies[precision]


def lean_copy_bytes(model: nn.Module) -> int:
    """Bytes the cached lean copies of ``model`` hold (0: none)."""
    return sum(copy.nbytes() for copy in _COPIES.get(model, {}).values())


def forget_lean_copy(model: nn.Module) -> None:
    """Drop the cached lean copies of ``model`` (after its weights changed)."""
    _COPIES.pop(model, None)


def drafting_models(config: TriForceConfig, target: nn.Module) -> list[nn.Module]:
    """The models whose copies Force 1 and Force 2 may run under ``config``: the target where Force 2 may run
    (``levels=3``) or the target may draft (a drafter that runs a model, ``"self"``; beside a draft model under
    ``policy="auto"``, the self drafter: `lean_self_drafting`), and the draft model ``config.draft`` if it is
    one. A lookup drafter (``"ngram"``, ``"suffix"``) verified by Force 3 directly (``levels=2``) runs none."""
    draft_model = not isinstance(config.draft, str)
    target_drafts = config.policy == "auto" if draft_model else spec_of(config.draft).kind == "model"
    return ([target] if config.levels == 3 or target_drafts else []) + ([config.draft] if draft_model else [])


def tier_model(model: nn.Module, precision: str, tier: int, tier_compile: str = "off"):
    """The model Force ``tier`` (1 or 2) runs for ``TriForceConfig.draft_precision`` ``precision``: a lean copy
    (`FORCE2_PRECISION` for Force 2; its `LeanModel.compiled` view unless ``tier_compile`` is ``"off"``), or
    `quantized.drafting_model` for ``"model"`` / ``"int8"``."""
    if precision in LEAN_PRECISIONS:
        if tier_compile == "auto":  # a tier built outside a call's resolved config (`resolve_draft_precision`)
            tier_compile = _auto_tier_compile(precision, model)
        lean = lean_model(model, precision if tier == 1 else FORCE2_PRECISION[precision])
        return lean if tier_compile == "off" or not isinstance(lean, LeanModel) else lean.compiled(tier_compile)
    return drafting_model(model, precision)


def lean_self_drafting(config: TriForceConfig, target) -> bool:
    """Whether the auto policy may also draft with ``target``'s own lean copy beside the draft model ``config.draft``:
    where that copy runs lean (Force 2 runs it anyway: no more weight memory; not the target's eager forward) and the
    self drafter keeps its tokens at their absolute positions (``draft_positions="slots"``, asked for the draft
    model, would re-rotate the target's keys, which the preflight checks for the configured drafter only). A short
    call does not repay a draft model's cache fill, where the lean copy drafts as well (docs/results.md,
    "Qwen2.5-Coder-1.5B-Instruct bf16 with its 0.5B sibling")."""
    if isinstance(config.draft, str) or config.draft_positions == "slots":
        return False
    return config.draft_precision in LEAN_PRECISIONS and lean_support(target) is None


def tier_forward(model, precision: str) -> str:
    """The forward a tier running ``model`` (what `tier_model` returned for ``precision``) computes with:
    ``"lean"`` (a `LeanModel`), ``"eager"`` (the transformers forward of a model as given or of its int8 copy), or
    ``"eager (<why>)"`` where a lean precision was asked for a model the lean forward does not cover."""
    if isinstance(model, LeanModel):
        return "lean"
    why = lean_support(model) if precision in LEAN_PRECISIONS else None
    return "eager" if why is None else f"eager ({why})"


def tier_forwards(models: dict, precision: str, lean_unavailable_reason: str | None, force3: str) -> dict[str, str]:
    """`TriForceDetail.tier_forwards`: per tier (``"force1 <drafter>"``, ``"force2"``) of ``models`` (tier -> the model
    it ran), its `tier_forward`; where ``draft_precision="auto"`` fell back to the models as given
    (``lean_unavailable_reason``, the reason `resolve_draft_precision` gave), that reason for every drafting tier;
    and ``"force3"``: ``force3``, what Force 3's verification ran (`force3_forward`'s description)."""
    if lean_unavailable_reason is not None:
        drafting = dict.fromkeys(models, f"eager (draft_precision='auto': {lean_unavailable_reason})")
    else:
        drafting = {tier: tier_forward(model, precision) for tier, model in models.items()}
    return {**drafting, "force3": force3}


def kv_bytes_per_token(model) -> int:
    """Bytes one position of ``model``'s KV cache holds (keys and values of every layer, in its dtype)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    dtype = next(model.parameters()).dtype
    return 2 * compat.num_layers(config) * kv_heads * head_dim * torch.finfo(dtype).bits // 8


def weight_bytes(model) -> int:
    """Bytes of weights one forward of ``model`` reads: a lean copy's (`LeanModel.weight_bytes`), or every parameter
    but an input embedding that is not also the output layer (a forward reads one row of it)."""
    if isinstance(model, LeanModel):
        return model.weight_bytes()
    embedding, head = model.get_input_embeddings(), model.get_output_embeddings()
    tied = getattr(head, "weight", None) is embedding.weight  # an int8 copy's output layer holds int8 buffers
    skip = set() if tied else {id(embedding.weight)}
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()] if id(t) not in skip}
    return sum(t.numel() * t.element_size() for t in tensors.values())


def force3_forward(model: nn.Module, config: TriForceConfig, batch: int = 1) -> tuple[LeanModel | None, str]:
    """Force 3's verification forward for ``config.force3_compile`` (``config`` resolved: `resolve_draft_precision`)
    and its `TriForceDetail.tier_forwards` entry: ``(view, description)``, ``view`` the target's `LeanModel.verifying`
    view that verifies its chains at fixed shapes, or None (transformers' forward of the model as given).

    ``"auto"``: the tiers' mode where they run as CUDA graphs or compiled on a CUDA device (``tier_compile``
    ``"graph"`` / ``"compile"``) and `force3_refusal` finds nothing against it; on the CPU transformers' forward
    (there its verification takes `kernels.attention.split_kv_sdpa` over long caches: faster than masked attention
    over the whole buffer). ``"fixed"``, ``"compile"``, ``"graph"``: that mode, or a ValueError saying why not.
    A candidate tree's forward stays eager (its mask is the tree's), and the description says so."""
    requested = config.force3_compile
    if requested == "off":
        return None, "eager"
    graphed = on_cuda(model) and config.tier_compile in ("graph", "compile")
    mode = requested if requested != "auto" else config.tier_compile if graphed else None
    if mode is None:
        return None, "eager"
    why = force3_refusal(model, config, batch, mode)
    if why is not None:
        if requested == "auto":
            return None, f"eager ({why})"
        raise ValueError(f"TriForceConfig.force3_compile={requested!r} runs Force 3 on the target's native lean "
                         f"forward at fixed shapes, which this call cannot: {why} (use force3_compile='auto' or 'off')")
    trees = "; candidate trees: eager (a tree's own mask)" if config.trees else ""
    return lean_model(model, "native").verifying(mode), f"{mode} (native){trees}"


def force3_refusal(model: nn.Module, config: TriForceConfig, batch: int, mode: str) -> str | None:
    """Why Force 3 cannot verify with ``model``'s native lean forward at fixed shapes in ``mode`` (None: it can):
    a batch (per-row masks), a family or layout the lean forward does not cover (`lean_support`: sliding windows
    included), a model it cannot read in place (accelerate hooks, other dtypes, several devices), a full cache
    streamed from host memory, CUDA graphs off CUDA."""
    if batch > 1:
        return f"a batch of {batch} verifies under per-row masks (batch size 1 only)"
    why = lean_support(model)
    if why is not None:
        return why
    hooked = next((name or "model" for name, module in model.named_modules()
                   if compat.execution_device(module) is not None), None)
    if hooked is not None:
        return f"module {hooked!r} runs under an accelerate hook (device_map=)"
    odd = next(((name, p.dtype) for name, p in model.named_parameters() if p.dtype not in LEAN_DTYPES["native"]), None)
    if odd is not None:
        return f"parameter {odd[0]!r} is {odd[1]}"
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        return f"its parameters are on several devices ({sorted(map(str, devices))})"
    if config.full_cache_device == "cpu":
        return "full_cache_device='cpu' streams the full cache from host memory layer by layer"
    if mode == "graph" and not on_cuda(model):
        return f"'graph' captures CUDA graphs and this model is on {devices.pop()} (use 'fixed' or 'compile' there)"
    return None
