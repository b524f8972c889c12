"""Int8 copies of a model's linear layers, for the drafting tiers (CPU only).

Force 1 and Force 2 only have to report the distribution they drew from (`sampling.verify_chain` does the rest), so
they may run a cheaper copy of a model; Force 3 computes the target itself, so the output stays exactly the target's.

The copy shares the config, every non-linear parameter and every buffer with the original; each `nn.Linear` is
replaced by an `Int8Linear` (int8 weights per output channel, each input row quantized to int8 on its own, int32
sums by `torch._int_mm`) except the MLP output projections (``intermediate_size -> hidden_size``), kept fp32: their
inputs carry activation outliers. It is made once per model object and reused: if you change the model's weights
afterwards, call `forget_int8_copy`.

Row independence (exactness): Force 2's q at row ``i`` must be a function of the sequence up to ``i`` only, never of
the call's other rows (the drafts being verified, other rows of a batch). `Int8Linear` quantizes every row with its
own scale, so each output row is a function of its input row alone, bit for bit, at every call size. torch.ao's
dynamic-int8 linears take one activation scale per call (they mix rows: the enumerated law is off by 3e-2,
tests/test_batch.py), and weight-only int8 is dearer than fp32 (docs/experiments.md, "Lean drafting tiers").

Device maps (accelerate ``device_map=``, ``offload_folder=``): every execution device must be the CPU. The copy is
made once from the loaded weights and holds them in CPU memory (`int8_copy_bytes` reports its size).

Adapters (PEFT LoRA and the like): linears held in a `nn.ModuleDict` (the per-adapter ``lora_A``/``lora_B``) stay
fp32; the adapted base layers are quantized. A copy remembers which adapters were active and merged when it was made
(`adapter_state`); changing them afterwards makes the next call build a fresh copy, so the drafting tiers follow the
adapter Force 3 runs.
"""

from __future__ import annotations

import copy
import itertools
import weakref

import torch
from torch import nn

from ..compat import adapter_state, execution_device, hook_state, materialized, strip_hooks

_COPIES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_SMALLEST_ROW_MAX = 1e-30  # a row of zeros gets this as its max: 127 / it stays finite in fp32, rows quantize to 0


def _row_max(rows: torch.Tensor) -> torch.Tensor:
    """``[n, 1]``: the largest magnitude of each row (its quantization scale is that / 127)."""
    return rows.abs().amax(-1, keepdim=True).clamp_min_(_SMALLEST_ROW_MAX)


class Int8Linear(nn.Module):
    """An `nn.Linear` with int8 weights whose input rows are each quantized on their own (to int8, by max / 127).

    Weights: symmetric per output channel (scale = the channel's max magnitude / 127). Output row ``i`` is
    ``(round(x_i * 127 / m_i) @ W_q^T) * m_i * w_scale + bias`` with ``m_i`` = max |x_i|: the integer products
    are summed in int32 (`torch._int_mm`, exact with VNNI; |sum| <= 127^2 * in_features), and every other step
    is elementwise or a reduction over row ``i`` alone, so each output row is a function of its input row only,
    bit for bit, whatever the other rows of the call hold. ``bias`` is the original's (shared).
    """

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()
        channel_max = weight.abs().amax(1).clamp_min(_SMALLEST_ROW_MAX)
        self.register_buffer("weight_int8", torch.round(weight * (127 / channel_max)[:, None]).to(torch.int8))
        self.register_buffer("weight_scale", channel_max / (127 * 127))  # both int8 scales' 1/127
        self.bias = linear.bias

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        rows = hidden.reshape(-1, self.in_features)
        row_max = _row_max(rows)
        quantized = rows.mul(127 / row_max).round_().to(torch.int8)
        out = torch.mul(torch._int_mm(quantized, self.weight_int8.t()), row_max * self.weight_scale)
        if self.bias is not None:
            out.add_(self.bias)
        return out.reshape(*hidden.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def int8_available() -> bool:
    """Whether this torch build multiplies int8 matrices on the CPU (`torch._int_mm`)."""
    if not hasattr(torch, "_int_mm"):
        return False
    try:
        torch._int_mm(torch.ones(1, 8, dtype=torch.int8), torch.ones(8, 8, dtype=torch.int8))
    except RuntimeError:
        return False
    return True


def int8_copy(model: nn.Module) -> nn.Module:
    """The cached int8 copy of ``model`` (an fp32 model on CPU)."""
    cached = _COPIES.get(model)
    state = adapter_state(model)
    if cached is not None and cached[1] == state:
        return cached[0]
    check_int8_eligible(model)
    with materialized(model):  # offloaded weights loaded for the copy's own use (quantized, or shared fp32)
        shared = {id(t): t for t in itertools.chain(model.parameters(), model.buffers())}
        shared[id(model.config)] = model.config
        shared.update(hook_state(model))
        clone = copy.deepcopy(model, shared)  # new modules, the same tensors
        strip_hooks(clone)  # every execution device is the CPU (checked): the copy needs no device hooks
        for name in int8_layer_names(clone):
            owner, _, attribute = name.rpartition(".")
            setattr(clone.get_submodule(owner), attribute, Int8Linear(clone.get_submodule(name)))
    clone.eval()
    _COPIES[model] = (clone, state)
    return clone


def int8_copy_bytes(model: nn.Module) -> int:
    """Bytes the cached int8 copy of ``model`` holds beyond the model's resident tensors (0: no copy)."""
    cached = _COPIES.get(model)
    if cached is None:
        return 0
    own = {t.data_ptr() for t in itertools.chain(model.parameters(), model.buffers())}
    total = 0
    for module in cached[0].modules():
        for tensor in itertools.chain(module.parameters(recurse=False), module.buffers(recurse=False)):
            if tensor.data_ptr() not in own:
                total += tensor.nbytes
    return total


def check_int8_eligible(model: nn.Module) -> None:
    """Raise the error `int8_copy` would raise for ``model`` (checked before a long prefill)."""
    for name, module in model.named_modules():
        device = execution_device(module)
        if device is None:  # no hook: where its weights are (offloaded weights sit on "meta" between forwards)
            device = next((p.device for p in module.parameters(recurse=False) if p.device.type != "meta"), None)
        if device is not None and device.type != "cpu":
            raise ValueError(f"TriForceConfig.draft_precision='int8' runs on CPU only; module {name or 'model'!r} "
                             f"runs on {device} (use draft_precision='model' there)")
    if next(model.parameters()).dtype != torch.float32:
        raise ValueError("TriForceConfig.draft_precision='int8' quantizes an fp32 model; this one is "
                         f"{next(model.parameters()).dtype}")
    if not int8_available():
        raise RuntimeError("TriForceConfig.draft_precision='int8' needs torch._int_mm on the CPU, "
                           f"which torch {torch.__version__} does not provide")


def int8_layer_names(model: nn.Module) -> list[str]:
    """Names of the `nn.Linear` layers the int8 copy quantizes: all but the MLP output projections and adapters."""
    config = model.config
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    intermediate, hidden = getattr(text, "intermediate_size", None), getattr(text, "hidden_size", None)
    in_adapter_containers = {
        id(child) for module in model.modules() if isinstance(module, nn.ModuleDict) for child in module.values()
    }
    return [
        name for name, module in model.named_modules()
        if type(module) is nn.Linear and id(module) not in in_adapter_containers
        and not (module.in_features == intermediate and module.out_features == hidden)
    ]


def drafting_model(model: nn.Module, precision: str) -> nn.Module:
    """The model as Force 1 / Force 2 run it: itself (``"model"``) or its int8 copy (``"int8"``)."""
    return int8_copy(model) if precision == "int8" else model


def forget_int8_copy(model: nn.Module) -> None:
    """Drop the cached copy of ``model`` (after its weights changed)."""
    _COPIES.pop(model, None)
