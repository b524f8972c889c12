"""`hf-triforce-bench project`: projected speed of each tier and plan on a machine we cannot run on (a roofline model).

One concept: the seconds of one forward of a dense decoder, from its shape (a transformers config) and a device,

    seconds = weight bytes / bandwidth + KV bytes read / (bandwidth, or the host link's for an offloaded cache)
              + matmul FLOPs / FLOP/s + attention FLOPs / attention FLOP/s + layers x per-layer overhead

(the terms add: nothing assumes memory traffic and arithmetic overlap, which fits the CPU measurements; on a GPU
at decoding sizes the FLOP terms are small either way; a forward of several rows may read its weights at its own
``gemm_bandwidth``, CPU BLAS packing them). Weight bytes are every matrix a forward reads: each
layer's q/k/v/o and MLP matrices and the output layer (the embedding lookup reads a few rows only); KV bytes are
``2 x layers x KV heads x head dim x dtype bytes`` per cached token; matmul FLOPs ``2 x rows x those weights``;
attention FLOPs ``4 x rows x heads x head dim x cached tokens x layers``. Dense full-attention layers only (a
config with experts is refused; sliding-window layers are priced as full).

Each tier is that forward on its own cache (`tier_seconds`): Force 3 and plain decoding on the full context (over
the host link with ``TriForceConfig(full_cache_device="cpu")``), Force 2 on the retrieval budget, Force 1 ("self")
on the sink + window cache, a draft model on its own sink + window cache (TriForce with a draft as Force 1) or on
its own full cache (vanilla speculative decoding, drafter ``"vanilla"``), plus the retrieval selection of each
Force-3 step. Force 1 and Force 2 read the weights at ``TriForceConfig.draft_precision`` (`tier_precision`: the
default ``"auto"`` is lean-int4 on a CPU, as the library resolves it, and the model's own weights on a GPU, where
the lean copies do not run): a lean-int4 copy holds the layers' projections in int4 with a bf16 scale and zero point
per 32 inputs and the output layer in int8 (`ModelShape.precision_weight_bytes`: ~1/6 of fp32's bytes), whose
weight-only kernels read at the device's ``quantized_bandwidth`` and multiply at its ``quantized_flops``; the KV
cache and attention stay in the model's dtype. Tokens per second of every plan then come from the adaptive policy's
own cost model (`hf_triforce.decoding.policy.AdaptivePolicy`, given these tier costs and fixed acceptance rates): the
same expected-tokens formula and plan arithmetic that choose plans at run time, so the projection cannot drift from
it.

Devices are presets for public specs (`DEVICES`: GPUs by their datasheet's bandwidth and FLOP/s, with the per-layer
overhead of this stack fitted on an H200), explicit numbers (a CPU by its measured bandwidth and FLOP/s, ``--cpu``), or
presets read from a JSON file (`load_devices`, ``--devices``: the CPUs that ``benchmarks/project_calibration.py``
fitted on this project's runs are in ``docs/bench/calibration/devices.json``, beside their measurements); models
are presets (`MODELS`, transcribed from the models' published config.json), a local model folder or a config dict.
Everything here is a projection: no number it prints was measured.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from hf_triforce.config import DRAFT_PRECISIONS
from hf_triforce.decoding.policy import AcceptanceRate, AdaptivePolicy, Plan, expected_tokens
from hf_triforce.decoding.tiers import AUTO_PRECISION, FORCE2_PRECISION, LEAN_DTYPES
from hf_triforce.kernels.lean import INT4_GROUP_SIZE, LEAN_PRECISIONS

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Force 1 / Force 2 weights (`TriForceConfig.draft_precision`): "auto" resolves as the library does (`tier_precision`)
_CONCRETE_PRECISIONS = tuple(p for p in DRAFT_PRECISIONS if p != "auto")
# the model dtypes each drafting copy takes (the library refuses the rest): int8 quantizes fp32 models
# (`kernels.quantized.check_int8_eligible`), the lean copies `decoding.tiers.LEAN_DTYPES`
PRECISION_DTYPES = {"model": tuple(DTYPE_BYTES), "int8": ("float32",),
                    **{p: tuple(str(d).removeprefix("torch.") for d in dtypes) for p, dtypes in LEAN_DTYPES.items()}}
# the drafting copies whose products run weight-only quantized kernels (their bytes and FLOPs priced at a device's
# ``quantized_bandwidth`` / ``quantized_flops``; their fp32 or model-dtype parts at the plain rates)
_QUANTIZED_STORAGE = ("int8-row", "int8-channel", "int4")
_DTYPE_ALIASES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "torch.float32": "float32",
                  "torch.bfloat16": "bfloat16", "torch.float16": "float16"}

# Published config.json values (no network here): layers, hidden, MLP width, heads, KV heads, head dim, vocabulary,
# tied output layer, the dtype the checkpoint ships in.
MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, intermediate_size=1536, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, tie_word_embeddings=True,
                         dtype="float32"),
    "qwen2.5-coder-1.5b": dict(num_hidden_layers=28, hidden_size=1536, intermediate_size=8960, num_attention_heads=12,
                               num_key_value_heads=2, head_dim=128, vocab_size=151936, tie_word_embeddings=True,
                               dtype="bfloat16"),
    "qwen2.5-coder-0.5b": dict(num_hidden_layers=24, hidden_size=896, intermediate_size=4864, num_attention_heads=14,
                               num_key_value_heads=2, head_dim=64, vocab_size=151936, tie_word_embeddings=True,
                               dtype="bfloat16"),
    "llama-3.1-8b": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=14336, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=128, vocab_size=128256, tie_word_embeddings=False,
                         dtype="bfloat16"),
    "llama-3.2-1b": dict(num_hidden_layers=16, hidden_size=2048, intermediate_size=8192, num_attention_heads=32,
                         num_key_value_heads=8, head_dim=64, vocab_size=128256, tie_word_embeddings=True,
                         dtype="bfloat16"),
    # the paper's target: LLaMA-2-7B with 128k context (Yarn-Llama-2-7b-128k / LWM): LLaMA-2-7B's shape, MHA
    "llama-2-7b-128k": dict(num_hidden_layers=32, hidden_size=4096, intermediate_size=11008, num_attention_heads=32,
                            num_key_value_heads=32, head_dim=128, vocab_size=32000, tie_word_embeddings=False,
                            dtype="bfloat16"),
    # the paper's Force 1 for LLaMA-2: JackFram/llama-68m
    "llama-68m": dict(num_hidden_layers=2, hidden_size=768, intermediate_size=3072, num_attention_heads=12,
                      num_key_value_heads=12, head_dim=64, vocab_size=32000, tie_word_embeddings=False,
                      dtype="float32"),
}

# Per-layer overhead of one eager forward of this stack on an H200 (launches and Python: random-weight SmolLM2 and
# Qwen2.5-1.5B shapes are launch-bound there), fitted by benchmarks/project_calibration.py on docs/bench/gpu-h200*
# (docs/bench/calibration/calibration.json); used for every GPU preset (the same software). 0 models CUDA graphs.
GPU_LAYER_OVERHEAD = 0.97e-3

# Datasheet peak numbers (dense; bandwidth of the device memory; offload = a host link's practical rate).
DEVICES: dict[str, dict[str, Any]] = {
    "h200": dict(bandwidth=4.8e12, flops={"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
                 layer_overhead=GPU_LAYER_OVERHEAD, offload_bandwidth=50e9,
                 notes="H200 SXM: 4.8 TB/s HBM3e, 989 TFLOP/s bf16 dense, 67 fp32; PCIe 5.0 x16 ~50 GB/s"),
    "a100": dict(bandwidth=2.039e12, flops={"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                 layer_overhead=GPU_LAYER_OVERHEAD, offload_bandwidth=25e9,
                 notes="A100 80GB SXM: 2.04 TB/s HBM2e, 312 TFLOP/s bf16 dense, 19.5 fp32; PCIe 4.0 x16 ~25 GB/s"),
    "rtx4090": dict(bandwidth=1.008e12, flops={"bfloat16": 165e12, "float16": 165e12, "float32": 82.6e12},
                    layer_overhead=GPU_LAYER_OVERHEAD, offload_bandwidth=25e9,
                    notes="RTX 4090: 1.01 TB/s GDDR6X, 165 TFLOP/s bf16 dense (fp32 accumulate), 82.6 fp32; "
                    "PCIe 4.0 x16 ~25 GB/s"),
}


@dataclass(frozen=True)
class ModelShape:
    """What a forward reads and computes: a dense decoder's shape and the dtype of its weights and KV cache."""

    name: str
    layers: int
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    dtype: str
    gated_mlp: bool = True  # gate/up/down (Llama-style) vs up/down

    def __post_init__(self) -> None:
        for field_name in ("layers", "hidden", "intermediate", "heads", "kv_heads", "head_dim", "vocab"):
            value = getattr(self, field_name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"model {self.name}: {field_name} must be a positive integer, got {value!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"model {self.name}: heads ({self.heads}) must be a multiple of kv_heads "
                             f"({self.kv_heads})")
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"model {self.name}: dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @property
    def dtype_bytes(self) -> int:
        return DTYPE_BYTES[self.dtype]

    @property
    def matrices(self) -> dict[str, tuple[int, int]]:
        """``(output rows summed over the layers, input width)`` of each projection kind a forward reads, named as
        `hf_triforce.kernels.lean.PARTS`: fused q/k/v, o, fused gate/up (up only without a gate), down, the output
        layer (the embedding lookup reads a few rows only)."""
        q, kv = self.heads * self.head_dim, self.kv_heads * self.head_dim
        return {"qkv": (self.layers * (q + 2 * kv), self.hidden), "o": (self.layers * self.hidden, q),
                "gate_up": (self.layers * (2 if self.gated_mlp else 1) * self.intermediate, self.hidden),
                "down": (self.layers * self.hidden, self.intermediate), "head": (self.vocab, self.hidden)}

    @property
    def matrix_params(self) -> int:
        """Parameters of every matrix a forward reads: the layers' projections and the output layer."""
        return sum(rows * width for rows, width in self.matrices.values())

    @property
    def weight_bytes(self) -> int:
        """Bytes of the weights a forward of the model as given reads (`precision_weight_bytes` for a drafting copy)."""
        return self.matrix_params * self.dtype_bytes

    def part_formats(self, precision: str) -> dict[str, str]:
        """The storage of each projection kind (`matrices`) in the drafting copy of ``precision`` (a concrete
        ``TriForceConfig.draft_precision``, not ``"auto"``): ``"model"`` (the model's dtype), ``"fp32"``,
        ``"int8-row"`` (int8 + a bf16 scale per output row: the lean weight-only int8), ``"int8-channel"`` (int8 + an
        fp32 scale per output row: `kernels.quantized.Int8Linear`) or ``"int4"`` (int4 + a bf16 scale and zero point
        per `INT4_GROUP_SIZE` inputs per output row). ``"int8"`` (`kernels.quantized`) keeps the MLP down
        projections in the model's dtype; ``"lean-int4"`` has an int8 output layer (`kernels.lean.LEAN_PRECISIONS`)."""
        if precision == "model":
            return dict.fromkeys(self.matrices, "model")
        if precision == "int8":
            return {**dict.fromkeys(self.matrices, "int8-channel"), "down": "model"}
        if precision in LEAN_PRECISIONS:
            return {part: {"int8": "int8-row"}.get(kind, kind) for part, kind in LEAN_PRECISIONS[precision].items()}
        raise ValueError(f"draft_precision must be one of {_CONCRETE_PRECISIONS} here, got {precision!r}")

    def part_bytes(self, part: str, storage: str) -> int:
        """Bytes of projection kind ``part`` stored as ``storage`` (`part_formats`)."""
        rows, width = self.matrices[part]
        if storage == "model":
            return rows * width * self.dtype_bytes
        if storage == "fp32":
            return rows * width * 4
        if storage == "int8-row":
            return rows * width + 2 * rows
        if storage == "int8-channel":
            return rows * width + 4 * rows
        if storage == "int4":
            return rows * width // 2 + 4 * rows * (width // INT4_GROUP_SIZE)
        raise ValueError(f"storage must be model, fp32, int8-row, int8-channel or int4, got {storage!r}")

    def precision_weight_bytes(self, precision: str = "model") -> int:
        """Bytes of the weights one forward of the drafting copy of ``precision`` reads (``"model"``: `weight_bytes`).
        lean-int4 reads ~0.16 of an fp32 model's bytes (0.625 bytes a weight in the layers, 1 in the output layer)."""
        return sum(self.part_bytes(part, storage) for part, storage in self.part_formats(precision).items())

    @property
    def kv_bytes_per_token(self) -> int:
        return 2 * self.layers * self.kv_heads * self.head_dim * self.dtype_bytes

    def matmul_flops(self, rows: int) -> int:
        return 2 * rows * self.matrix_params

    def attention_flops(self, cached: int, rows: int) -> int:
        return 4 * rows * self.heads * self.head_dim * cached * self.layers


def _dtype_name(dtype: Any) -> str:
    name = str(dtype)
    name = _DTYPE_ALIASES.get(name, name)
    if name not in DTYPE_BYTES:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)} (or fp32/bf16/fp16), got {dtype!r}")
    return name


def model_shape(model: Any, dtype: str | None = None) -> ModelShape:
    """``model``: a `MODELS` name, a local folder with a config.json, a config dict (config.json keys) or a
    transformers ``PretrainedConfig``; ``dtype`` overrides the config's (default: its ``dtype``, else bfloat16)."""
    name = "config"
    if isinstance(model, str):
        if model in MODELS:
            name, config = model, dict(MODELS[model])
        elif Path(model).is_dir():
            from transformers import AutoConfig

            name, config = Path(model).name, AutoConfig.from_pretrained(model, local_files_only=True).to_dict()
        else:
            raise ValueError(f"model must be one of {sorted(MODELS)}, a local model folder or a config dict, "
                             f"got {model!r}")
    elif isinstance(model, dict):
        config = dict(model)
    elif hasattr(model, "to_dict"):
        config = model.to_dict()
    else:
        raise ValueError(f"model must be a preset name, a folder, a dict or a PretrainedConfig, got {type(model)}")
    config = config.get("text_config") or config
    if any(config.get(key) for key in ("num_experts", "num_local_experts", "n_routed_experts")):
        raise ValueError(f"model {name}: mixture-of-experts configs are not modelled (dense decoders only)")
    missing = [key for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size")
               if not config.get(key)]
    if missing:
        raise ValueError(f"model {name}: config lacks {missing}")
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    act = str(config.get("hidden_act") or config.get("activation_function") or "silu")
    return ModelShape(
        name=name, layers=config["num_hidden_layers"], hidden=hidden,
        intermediate=config.get("intermediate_size") or 4 * hidden, heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads, head_dim=config.get("head_dim") or hidden // heads,
        vocab=config["vocab_size"],
        dtype=_dtype_name(dtype if dtype is not None else config.get("dtype") or config.get("torch_dtype")
                          or "bfloat16"),
        gated_mlp=act in ("silu", "swish", "swiglu", "gelu_pytorch_tanh") and "intermediate_size" in config)


@dataclass(frozen=True)
class Device:
    """Effective rates of one device for one dtype: bytes/s of its memory (and of the host link that streams an
    offloaded full cache; 0: none), matmul and attention FLOP/s, seconds of overhead per layer per forward, and
    optionally the bytes/s at which a forward of several rows reads the weights (``gemm_bandwidth``: CPU BLAS
    packs the weights for a product of several rows, docs/results.md, "Linear layers of a few rows on the CPU"; None:
    ``bandwidth``).

    ``cpu``: the lean and int8 drafting copies run here (the library runs them on the CPU only). ``quantized_bandwidth``
    / ``quantized_flops``: bytes/s at which a weight-only int8/int4 product reads (and dequantizes) its weights and
    its FLOP/s (None: ``bandwidth`` / ``flops``; the int4 CPU kernel unpacks every weight, so it reads well below the
    memory's rate: fitted per CPU by benchmarks/project_calibration.py).

``gqa_attention_flops`` / ``copy_bandwidth``: what plain ``generate`` on a DynamicCache pays beyond a static decode
(`plain_generate_seconds`): the FLOP/s of its one-row attention over a grouped-query cache (no mask, so SDPA runs
with ``enable_gqa``, a slower CPU path than the packed one a static decode takes: 5-10x in bf16 on a Zen 4) and
the bytes/s of ``torch.cat`` growing every layer's keys and values by one entry (None: ``attention_flops`` /
``bandwidth``; fitted on ``benchmarks/plain_generate_gqa.py`` by benchmarks/project_calibration.py)."""

    name: str
    bandwidth: float
    flops: float
    attention_flops: float
    layer_overhead: float
    offload_bandwidth: float = 0.0
    gemm_bandwidth: float | None = None  # bytes/s of the weights in a forward of several rows (None: bandwidth)
    quantized_bandwidth: float | None = None  # bytes/s of int8/int4 weights (None: bandwidth)
    quantized_flops: float | None = None  # FLOP/s of weight-only int8/int4 products (None: flops)
    gqa_attention_flops: float | None = None  # FLOP/s of a maskless GQA decode's attention (None: attention_flops)
    copy_bandwidth: float | None = None  # bytes/s of a DynamicCache's growing copies (None: bandwidth)
    cpu: bool = False
    notes: str = ""

    def __post_init__(self) -> None:
        for field_name in ("bandwidth", "flops", "attention_flops"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"device {self.name}: {field_name} must be a number above 0, got {value!r}")
        for field_name in ("gemm_bandwidth", "quantized_bandwidth", "quantized_flops", "gqa_attention_flops",
                           "copy_bandwidth"):
            value = getattr(self, field_name)
            if value is not None and not (isinstance(value, (int, float)) and value > 0):
                raise ValueError(f"device {self.name}: {field_name} must be above 0 or None, got {value!r}")
        for field_name in ("layer_overhead", "offload_bandwidth"):
            value = getattr(self, field_name)
            if not isinstance(value, (int, float)) or value < 0:
                raise ValueError(f"device {self.name}: {field_name} must be a number >= 0, got {value!r}")


PRESET_KEYS = {"bandwidth", "flops", "attention_flops", "layer_overhead", "offload_bandwidth", "gemm_bandwidth",
               "quantized_bandwidth", "quantized_flops", "gqa_attention_flops", "copy_bandwidth", "cpu", "notes"}
PER_DTYPE_KEYS = ("flops", "attention_flops", "quantized_bandwidth", "quantized_flops", "gqa_attention_flops")


def load_devices(path: str | Path) -> dict[str, dict[str, Any]]:
    """Device presets from a JSON file ``{"devices": {name: preset}}``, each preset as in `DEVICES` (``flops``,
    ``attention_flops``, ``quantized_*`` and ``gqa_attention_flops`` by dtype name, the other rates plain numbers);
    checked here, so that a wrong file fails with its name and the key."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ValueError(f"devices file {path}: {error}") from error
    if not isinstance(data, dict) or not isinstance(data.get("devices"), dict):
        raise ValueError(f"devices file {path}: expected an object with a 'devices' object, name -> preset")
    for name, preset in data["devices"].items():
        missing = sorted({"bandwidth", "flops", "layer_overhead"} - set(preset))
        unknown = sorted(set(preset) - PRESET_KEYS)
        if missing or unknown:
            raise ValueError(f"devices file {path}: device {name!r}: missing {missing}, unknown {unknown} (keys: "
                             f"{sorted(PRESET_KEYS)})")
        per_dtype = [key for key in PER_DTYPE_KEYS if preset.get(key) is not None and not isinstance(preset[key], dict)]
        if per_dtype:
            raise ValueError(f"devices file {path}: device {name!r}: {per_dtype} must map dtype names to numbers")
        preset.setdefault("offload_bandwidth", 0.0)
        preset.setdefault("notes", f"from {path}")
    return data["devices"]


def device(name: str, dtype: str, presets: dict[str, dict[str, Any]] | None = None,
           **overrides: float | None) -> Device:
    """A preset for ``dtype`` (its FLOP/s for that dtype) from `DEVICES` or ``presets`` (`load_devices`), with any of
    `Device`'s numbers overridden (None: keep the preset's). ``name`` not a preset: every number must be given
    (``attention_flops`` defaults to ``flops``)."""
    presets = {**DEVICES, **(presets or {})}
    dtype = _dtype_name(dtype)
    given = {key: value for key, value in overrides.items() if value is not None}
    unknown = sorted(set(given) - {"bandwidth", "flops", "attention_flops", "layer_overhead", "offload_bandwidth",
                                   "gemm_bandwidth", "quantized_bandwidth", "quantized_flops",
                                   "gqa_attention_flops", "copy_bandwidth", "cpu"})
    if unknown:
        raise ValueError(f"device: unknown parameters {unknown}")
    if name in presets:
        preset = presets[name]
        if "flops" not in given and dtype not in preset["flops"]:
            raise ValueError(f"device {name} has FLOP/s for {sorted(preset['flops'])} only; give flops for {dtype}")
        values = dict(bandwidth=preset["bandwidth"], flops=preset["flops"].get(dtype),
                      attention_flops=(preset.get("attention_flops") or {}).get(dtype),
                      layer_overhead=preset["layer_overhead"], offload_bandwidth=preset["offload_bandwidth"],
                      gemm_bandwidth=preset.get("gemm_bandwidth"),
                      quantized_bandwidth=(preset.get("quantized_bandwidth") or {}).get(dtype),
                      quantized_flops=(preset.get("quantized_flops") or {}).get(dtype),
                      gqa_attention_flops=(preset.get("gqa_attention_flops") or {}).get(dtype),
                      copy_bandwidth=preset.get("copy_bandwidth"), cpu=preset.get("cpu", False))
        values.update(given)
        notes = preset["notes"]
    else:
        needed = [key for key in ("bandwidth", "flops", "layer_overhead") if key not in given]
        if needed:
            raise ValueError(f"device {name!r} is not one of {sorted(presets)}: give {needed}")
        values = dict(offload_bandwidth=0.0, attention_flops=None, gemm_bandwidth=None)
        values.update(given)
        notes = "explicit numbers"
    if values["attention_flops"] is None:
        values["attention_flops"] = values["flops"]
    return Device(name=name, notes=notes, **values)


def forward_seconds(model: ModelShape, dev: Device, cached: int, rows: int = 1, offloaded: bool = False,
                    precision: str = "model", logits_rows: int | None = None, maskless_gqa: bool = False) -> float:
    """Seconds of one forward of ``rows`` query rows over ``cached`` cache entries (module docstring);
    ``offloaded``: the cache streams over ``dev.offload_bandwidth``. ``precision``: the weights as a drafting tier
    holds them (a concrete ``TriForceConfig.draft_precision``, `ModelShape.part_formats`): weight-only quantized
    parts read at ``dev.quantized_bandwidth`` and multiply at ``dev.quantized_flops``; the cache and attention
    stay in the model's dtype (the lean copies write the model's own cache entries). ``logits_rows``: rows the
    output layer computes (default ``rows``; 1 for a cache fill, which keeps the last row's logits only).
    ``maskless_gqa``: its attention takes plain ``generate``'s maskless path (`attention_seconds`)."""
    if cached < 0 or rows < 1:
        raise ValueError(f"forward_seconds: cached must be >= 0 and rows >= 1, got {cached}, {rows}")
    if offloaded and not dev.offload_bandwidth:
        raise ValueError(f"device {dev.name} has no offload_bandwidth: it cannot stream an offloaded cache")
    plain_rate = dev.bandwidth if rows == 1 or dev.gemm_bandwidth is None else dev.gemm_bandwidth
    weights = compute = 0.0
    for part, storage in model.part_formats(precision).items():
        quantized = storage in _QUANTIZED_STORAGE
        part_rows = rows if part != "head" or logits_rows is None else logits_rows
        out_rows, width = model.matrices[part]
        weights += model.part_bytes(part, storage) / ((dev.quantized_bandwidth or dev.bandwidth) if quantized
                                                      else plain_rate)
        compute += 2 * part_rows * out_rows * width / ((dev.quantized_flops or dev.flops) if quantized else dev.flops)
    attention = attention_seconds(model, dev, cached, rows, offloaded, maskless_gqa)
    return weights + compute + attention + model.layers * dev.layer_overhead


def attention_seconds(model: ModelShape, dev: Device, cached: int, rows: int = 1, offloaded: bool = False,
                      maskless_gqa: bool = False) -> float:
    """The attention part of `forward_seconds`: the cache's KV bytes read (over the host link if ``offloaded``)
    and the attention FLOPs, at ``dev.attention_flops`` or, ``maskless_gqa`` (a one-row decode without a mask on a
    grouped-query model: plain ``generate`` on a DynamicCache), at ``dev.gqa_attention_flops`` where given."""
    kv = model.kv_bytes_per_token * cached / (dev.offload_bandwidth if offloaded else dev.bandwidth)
    rate = dev.attention_flops
    if maskless_gqa and model.kv_heads < model.heads and dev.gqa_attention_flops is not None:
        rate = dev.gqa_attention_flops
    return kv + model.attention_flops(cached, rows) / rate


def cache_copy_seconds(model: ModelShape, dev: Device, cached: int) -> float:
    """One DynamicCache update of a decoding step: ``torch.cat`` reads and writes every cached entry of every layer
    (keys and values) to append one, at ``dev.copy_bandwidth`` (``bandwidth`` where not given)."""
    return 2 * cached * model.kv_bytes_per_token / (dev.copy_bandwidth or dev.bandwidth)


def fill_seconds(model: ModelShape, dev: Device, rows: int, precision: str = "model") -> float:
    """Seconds of filling an empty cache with ``rows`` tokens by one forward (a draft model's sink+window cache:
    another model cannot copy the target's entries), the last row's logits only; its causal attention sees on
    average half the rows."""
    return forward_seconds(model, dev, rows // 2, rows, precision=precision, logits_rows=1)


def selection_seconds(model: ModelShape, dev: Device, context: int, budget: int, chunk_size: int,
                      offloaded: bool = False) -> float:
    """One retrieval selection: read the chunk summaries (a mean key per chunk and KV head) and score them, then
    gather the budget's entries (read, over the host link if offloaded, and written)."""
    chunks = context // chunk_size
    summaries = chunks * model.layers * model.kv_heads * model.head_dim * model.dtype_bytes
    score_flops = 2 * chunks * model.layers * model.heads * model.head_dim
    gathered = budget * model.kv_bytes_per_token
    read = gathered / (dev.offload_bandwidth if offloaded else dev.bandwidth)
    return ((summaries + gathered) / dev.bandwidth + read + score_flops / dev.attention_flops
            + model.layers * dev.layer_overhead)


def plain_generate_seconds(model: ModelShape, dev: Device, context: int) -> float:
    """One token of plain ``generate`` on a growing ``DynamicCache``: the forward, with its attention on the maskless
    grouped-query path (`attention_seconds`), plus the cache's copy (`cache_copy_seconds`); a static cache
    (`tier_seconds`' ``plain``) has neither."""
    return forward_seconds(model, dev, context, maskless_gqa=True) + cache_copy_seconds(model, dev, context)


@dataclass(frozen=True)
class Acceptance:
    """Per-token acceptance rates (geometric: a chain of g proposals yields ``expected_tokens(rate, g)`` tokens).

    force3: Force 2 (retrieval cache) -> Force 3. force2: Force 1 = the target on its sink + window cache -> Force 2.
    streaming: the target on its sink + window cache -> Force 3 (two levels, StreamingLLM self-speculation).
    draft: a draft model -> the target (vanilla speculative decoding; also a draft as Force 1 -> Force 2, and a
    draft on its sink + window cache -> Force 3)."""

    force3: float = 0.9
    force2: float = 0.6
    streaming: float = 0.6
    draft: float = 0.6

    def __post_init__(self) -> None:
        for field_name, value in asdict(self).items():
            if not isinstance(value, (int, float)) or not 0.0 <= value <= 1.0:
                raise ValueError(f"acceptance {field_name} must be in [0, 1], got {value!r}")


def _triforce_config(config):
    from hf_triforce.config import TriForceConfig

    return config if config is not None else TriForceConfig()


def tier_precision(precision: str, dev: Device, models: list[ModelShape] | tuple = ()) -> str:
    """``TriForceConfig.draft_precision`` made concrete for Force 1 / Force 2 of ``models`` on ``dev``, as the
    library resolves it (`decoding.tiers.resolve_draft_precision`): ``"auto"`` is `AUTO_PRECISION` (lean-int4) where
    every model can be copied (a CPU device, a dtype of `PRECISION_DTYPES`, widths the int4 group divides), else
    ``"model"``; an explicit lean or int8 precision where the library would refuse it raises, naming it."""
    if precision not in DRAFT_PRECISIONS:
        raise ValueError(f"draft_precision must be one of {DRAFT_PRECISIONS}, got {precision!r}")
    if precision == "model":
        return precision
    refusals = []
    if not dev.cpu:
        refusals.append(f"it runs on CPU only and device {dev.name} is not a CPU (Device.cpu)")
    concrete = AUTO_PRECISION if precision == "auto" else precision
    for model in models:
        if model.dtype not in PRECISION_DTYPES[concrete]:
            allowed = " or ".join(PRECISION_DTYPES[concrete])
            refusals.append(f"it copies {allowed} models; {model.name} is {model.dtype}")
        bad = sorted({model.matrices[part][1] for part, storage in model.part_formats(concrete).items()
                      if storage == "int4" and model.matrices[part][1] % INT4_GROUP_SIZE})
        if bad:
            refusals.append(f"{model.name}'s input widths {bad} are not multiples of the int4 group size "
                            f"{INT4_GROUP_SIZE}")
    if not refusals:
        return concrete
    if precision == "auto":
        return "model"
    raise ValueError(f"draft_precision={precision!r}: {'; '.join(refusals)} (use draft_precision='model')")


def tier_seconds(target: ModelShape, dev: Device, context: int, config=None, draft: ModelShape | None = None,
                 draft_device: Device | None = None) -> dict[str, dict[int, float]]:
    """Seconds per forward of each tier by rows, keyed as the policy's `TierCosts` (``force3``, ``force2``,
    ``draft:<drafter>``, ``select``), for ``context`` cached tokens and a `TriForceConfig` (default
    ``TriForceConfig()``: its budget, chunk, sink + window, gammas up to ``gamma1`` / ``gamma2``,
    ``full_cache_device`` and ``draft_precision``: Force 1 and Force 2 read their weights at that precision,
    `tier_precision`, Force 2 at `decoding.tiers.FORCE2_PRECISION`'s); ``draft`` adds drafters ``draft`` (sink +
    window, at the drafting precision; its cache's one-time fill is not included, `fill_seconds`) and ``vanilla``
    (the draft as given on its full cache: HF assisted generation)."""
    if isinstance(context, bool) or not isinstance(context, int) or context < 1:
        raise ValueError(f"context must be a positive integer, got {context!r}")
    config = _triforce_config(config)
    on = draft_device or dev
    precision = tier_precision(config.draft_precision, dev, [target] + ([draft] if draft is not None else []))
    if draft is not None and on is not dev and precision != "model":  # the draft on its own device: it must copy too
        precision = tier_precision(config.draft_precision, on, [draft])
    force2 = FORCE2_PRECISION.get(precision, precision)
    offloaded = config.full_cache_device == "cpu"
    budget, window = min(config.retrieval_budget, context), min(config.sink_tokens + config.window, context)
    tiers = {
        "force3": {r: forward_seconds(target, dev, context, r, offloaded) for r in range(1, config.gamma2 + 2)},
        "force2": {r: forward_seconds(target, dev, budget, r, precision=force2) for r in range(1, config.gamma1 + 2)},
        "draft:self": {1: forward_seconds(target, dev, window, precision=precision)},
        "select": {1: selection_seconds(target, dev, context, budget, config.chunk_size, offloaded)},
    }
    if draft is not None:
        tiers["draft:draft"] = {1: forward_seconds(draft, on, window, precision=precision)}
        tiers["draft:vanilla"] = {1: forward_seconds(draft, on, context)}
    return tiers


def assume_costs(policy: AdaptivePolicy, tiers: dict[str, dict[int, float]]) -> None:
    """Fix ``policy``'s tier costs instead of measuring them: ``tiers[tier][rows]`` seconds of a forward of ``rows``
    rows, each settled (observed `PolicyPriors.settled_timings` times)."""
    for tier, by_rows in tiers.items():
        for rows, seconds in by_rows.items():
            for _ in range(policy.priors.settled_timings):
                policy.costs.observe(tier, rows, seconds)


def assume_rates(policy: AdaptivePolicy, force3: float | None = None, direct: dict[str, float] | None = None,
                 force1: dict[str, float] | None = None, coverage: dict[str, float] | None = None) -> None:
    """Fix ``policy``'s acceptance rates instead of measuring them: ``force3`` Force 2 -> Force 3; ``direct[d]``
    drafter ``d`` -> Force 3 (two levels); ``force1[d]`` drafter ``d`` -> Force 2 (three levels; a lookup without its
    own entry uses ``direct``); ``coverage[d]`` how often a lookup proposes. Each rate is per token, geometric
    (`expected_tokens`), in [0, 1]."""
    named = [("force3", {"": force3} if force3 is not None else {}, None), ("direct", direct or {}, policy.direct),
             ("force1", force1 or {}, policy.force2_rate), ("coverage", coverage or {}, policy.lookup_coverage)]
    for label, rates, table in named:
        for name, rate in rates.items():
            if not 0.0 <= rate <= 1.0:
                raise ValueError(f"assume_rates: {label} rate {name or ''} must be in [0, 1], got {rate}")
            if table is not None and name not in table:
                raise ValueError(f"assume_rates: {label}: {name!r} is not among {tuple(table)}")
    if force3 is not None:
        policy.force3_rate = AcceptanceRate(force3)
    for rates, table in ((direct, policy.direct), (force1, policy.force2_rate), (coverage, policy.lookup_coverage)):
        for name, rate in (rates or {}).items():
            table[name] = AcceptanceRate(rate)


def planning_policy(tiers: dict[str, dict[int, float]], context: int, force3: float, direct: dict[str, float],
                    force1: dict[str, float], config=None) -> AdaptivePolicy:
    """The adaptive policy's cost model holding ``tiers`` (each ``draft:<name>`` tier a drafter priced per token
    like a model drafter) and fixed rates: ``force3`` Force 2 -> Force 3, ``direct[name]`` drafter -> Force 3,
    ``force1[name]`` drafter -> Force 2 (the drafters of three-level plans, where ``context`` exceeds the budget)."""
    config = _triforce_config(config)
    drafters = {name.split(":", 1)[1]: "model" for name in tiers if name.startswith("draft:")}
    three = tuple(name for name in force1 if name in drafters) if context > config.retrieval_budget else ()
    policy = AdaptivePolicy(drafters, three, config.gamma1, config.gamma2, explore_every=config.explore_every,
                            refresh_every=config.refresh_interval)
    assume_costs(policy, tiers)
    assume_rates(policy, force3=force3, direct={k: v for k, v in direct.items() if k in drafters},
                 force1={k: v for k, v in force1.items() if k in three})
    return policy


KIND_LABELS = {(1, ""): "plain decoding", (2, "vanilla"): "vanilla speculative decoding (draft, its full cache)",
               (2, "self"): "StreamingLLM self-speculation (2 levels)", (2, "draft"): "draft on sink+window (2 levels)",
               (3, "self"): "TriForce, Force 1 = self", (3, "draft"): "TriForce, Force 1 = draft",
               (3, ""): "TriForce without Force 1 (Force 2 drafts alone)"}


@dataclass(frozen=True)
class PlanProjection:
    label: str
    plan: str
    tokens_per_step: float
    seconds_per_step: float
    tokens_per_second: float
    speedup: float  # over plain decoding


def project_plans(target: ModelShape, dev: Device, context: int, acceptance: Acceptance, config=None,
                  draft: ModelShape | None = None) -> tuple[dict[str, dict[int, float]], list[PlanProjection]]:
    """``(tier seconds, the best plan of each kind)``: for each kind of plan (`KIND_LABELS`) the gammas (up to the
    config's) with the most tokens/s as the policy predicts them."""
    config = _triforce_config(config)
    tiers = tier_seconds(target, dev, context, config, draft)
    policy = planning_policy(tiers, context, acceptance.force3,
                             {"self": acceptance.streaming, "draft": acceptance.draft, "vanilla": acceptance.draft},
                             {"self": acceptance.force2, "draft": acceptance.draft}, config)
    return tiers, rank_plans(policy)


def rank_plans(policy: AdaptivePolicy) -> list[PlanProjection]:
    """The best plan of each kind (`KIND_LABELS`) as ``policy`` predicts it, with its speedup over plain decoding
    (the policy's one-row Force-3 forward)."""
    best: dict[tuple, tuple[float, Plan]] = {}
    for plan in policy.candidates():
        key = (plan.levels, plan.drafter)
        speed = policy.tokens_per_second(plan)
        if key not in best or speed > best[key][0]:
            best[key] = (speed, plan)
    plain = best[(1, "")][0]
    out = []
    for key, (speed, plan) in sorted(best.items()):
        tokens, seconds = policy.predict(plan)
        out.append(PlanProjection(KIND_LABELS[key], plan.name, tokens, seconds, speed, speed / plain))
    return out


def rate_for_tokens(tokens: float, gamma: int) -> float:
    """The per-token rate at which a chain of ``gamma`` yields ``tokens`` per verification (inverse of
    `expected_tokens`, by bisection; tokens in [1, gamma + 1])."""
    if not 1.0 <= tokens <= gamma + 1:
        raise ValueError(f"tokens per verification must be in [1, {gamma + 1}] for gamma {gamma}, got {tokens}")
    low, high = 0.0, 1.0
    for _ in range(60):
        middle = (low + high) / 2
        low, high = (middle, high) if expected_tokens(middle, gamma) < tokens else (low, middle)
    return (low + high) / 2


# -- command line ---------------------------------------------------------------------------------------------
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="llama-3.1-8b",
                        help=f"target: one of {', '.join(MODELS)} or a local model folder (default llama-3.1-8b)")
    parser.add_argument("--draft-model", default=None, help="draft (vanilla speculative decoding, TriForce's Force 1 "
                        "as a draft): a preset or a local folder")
    parser.add_argument("--dtype", default=None, help="weights and KV cache dtype (default: the config's)")
    parser.add_argument("--device", default="h200", help=f"one of {', '.join(DEVICES)}, a preset of --devices, or a "
                        "name with explicit --bandwidth --flops --layer-overhead (default h200)")
    parser.add_argument("--devices", default=None, help="a JSON file of device presets (e.g. the CPUs fitted on this "
                        "project's runs: docs/bench/calibration/devices.json)")
    parser.add_argument("--bandwidth", type=float, default=None, help="memory bandwidth, bytes/s")
    parser.add_argument("--flops", type=float, default=None, help="matmul FLOP/s in the dtype")
    parser.add_argument("--attention-flops", type=float, default=None, help="attention FLOP/s (default --flops)")
    parser.add_argument("--layer-overhead", type=float, default=None,
                        help="seconds per layer per forward (launches, Python; 0: CUDA graphs)")
    parser.add_argument("--offload-bandwidth", type=float, default=None, help="host link bytes/s (offloading)")
    parser.add_argument("--gemm-bandwidth", type=float, default=None, help="bytes/s of the weights in a forward of "
                        "several rows (CPU BLAS packs them; default: --bandwidth)")
    parser.add_argument("--quantized-bandwidth", type=float, default=None, help="bytes/s of int8/int4 drafting "
                        "weights (weight-only kernels unpack them; default: the preset's, else --bandwidth)")
    parser.add_argument("--quantized-flops", type=float, default=None,
                        help="FLOP/s of int8/int4 drafting products (default: the preset's, else --flops)")
    parser.add_argument("--gqa-attention-flops", type=float, default=None, help="FLOP/s of plain generate's "
                        "attention on a grouped-query model (a DynamicCache decode: SDPA with enable_gqa; default: the "
                        "preset's, else --attention-flops)")
    parser.add_argument("--copy-bandwidth", type=float, default=None, help="bytes/s of a DynamicCache's torch.cat "
                        "copies (default: the preset's, else --bandwidth)")
    parser.add_argument("--cpu", action="store_true", help="the device is a CPU (explicit devices; the presets "
                        "know): the lean and int8 drafting precisions run only there")
    parser.add_argument("--draft-precision", default="auto", choices=DRAFT_PRECISIONS,
                        help="TriForceConfig.draft_precision: the weights Force 1 / Force 2 read (default auto: "
                        f"{AUTO_PRECISION} on a CPU for fp32/bf16 models, the model's own weights elsewhere)")
    parser.add_argument("--offload", action="store_true", help="the full cache in host memory "
                        "(TriForceConfig(full_cache_device='cpu')), streamed over the host link")
    parser.add_argument("--contexts", type=int, nargs="+", default=[32768, 131072])
    parser.add_argument("--budget", type=int, default=4096, help="retrieval budget (default 4096)")
    parser.add_argument("--gamma1", type=int, default=2, help="most Force-1 tokens per Force-2 round (default 2)")
    parser.add_argument("--gamma2", type=int, default=6, help="most tokens per Force-3 step (default 6)")
    defaults = Acceptance()
    for field_name, text in (("force3", "Force 2 -> Force 3"), ("force2", "Force 1 (self) -> Force 2"),
                             ("streaming", "self on sink+window -> Force 3"), ("draft", "draft -> target")):
        parser.add_argument(f"--accept-{field_name}", type=float, default=getattr(defaults, field_name),
                            help=f"per-token acceptance, {text} (default {getattr(defaults, field_name)})")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def run(args: argparse.Namespace) -> int:
    from hf_triforce.config import TriForceConfig

    target = model_shape(args.model, args.dtype)
    draft = model_shape(args.draft_model, target.dtype) if args.draft_model else None
    presets = load_devices(args.devices) if args.devices else None
    dev = device(args.device, target.dtype, presets, bandwidth=args.bandwidth, flops=args.flops,
                 attention_flops=args.attention_flops, layer_overhead=args.layer_overhead,
                 offload_bandwidth=args.offload_bandwidth, gemm_bandwidth=args.gemm_bandwidth,
                 quantized_bandwidth=args.quantized_bandwidth, quantized_flops=args.quantized_flops,
                 gqa_attention_flops=args.gqa_attention_flops, copy_bandwidth=args.copy_bandwidth,
                 cpu=True if args.cpu else None)
    acceptance = Acceptance(args.accept_force3, args.accept_force2, args.accept_streaming, args.accept_draft)
    config = TriForceConfig(retrieval_budget=args.budget, gamma1=args.gamma1, gamma2=args.gamma2,
                            full_cache_device="cpu" if args.offload else None, draft_precision=args.draft_precision)
    precision = tier_precision(config.draft_precision, dev, [target] + ([draft] if draft else []))
    results = []
    for context in args.contexts:
        tiers, plans = project_plans(target, dev, context, acceptance, config, draft)
        results.append({"context": context, "tiers": {k: {str(r): s for r, s in v.items()} for k, v in tiers.items()},
                        "plain_generate_seconds": plain_generate_seconds(target, dev, context),
                        "plans": [asdict(p) for p in plans]})
    if args.json:
        print(json.dumps({"model": asdict(target), "draft": asdict(draft) if draft else None, "device": asdict(dev),
                          "draft_precision": precision, "acceptance": asdict(acceptance), "projections": results},
                         indent=1))
        return 0
    print(f"PROJECTION (not measured): {target.name} {target.dtype} on {dev.name} ({dev.notes}); bandwidth "
          f"{dev.bandwidth:.3g} B/s, {dev.flops:.3g} FLOP/s, {dev.layer_overhead * 1e3:.3g} ms/layer overhead"
          f"{', full cache offloaded' if args.offload else ''}; Force 1 / Force 2 weights: {precision} "
          f"(draft_precision {config.draft_precision!r}); acceptance {asdict(acceptance)}")
    for result, context in zip(results, args.contexts):
        tiers = result["tiers"]
        print(f"\n### context {context}\n\n| tier | ms per forward |\n|---|---|")
        print(f"| Force 3 / plain, 1 row | {tiers['force3']['1'] * 1e3:.2f} |")
        print(f"| plain `generate` (DynamicCache: its copy, maskless attention), 1 token | "
              f"{result['plain_generate_seconds'] * 1e3:.2f} |")
        print(f"| Force 3, {args.gamma2 + 1} rows | {tiers['force3'][str(args.gamma2 + 1)] * 1e3:.2f} |")
        print(f"| Force 2, {args.gamma1 + 1} rows ({FORCE2_PRECISION.get(precision, precision)}) | "
              f"{tiers['force2'][str(args.gamma1 + 1)] * 1e3:.2f} |")
        print(f"| Force 1 (self, sink+window, {precision}) | {tiers['draft:self']['1'] * 1e3:.2f} |")
        for name in ("draft", "vanilla"):
            if f"draft:{name}" in tiers:
                print(f"| draft model ({f'sink+window, {precision}' if name == 'draft' else 'full cache, model'}) | "
                      f"{tiers[f'draft:{name}']['1'] * 1e3:.2f} |")
        print("\n| plan | best gammas | tokens/step | ms/step | tokens/s | vs plain |\n|---|---|---|---|---|---|")
        for p in result["plans"]:
            print(f"| {p['label']} | {p['plan']} | {p['tokens_per_step']:.2f} | {p['seconds_per_step'] * 1e3:.2f} | "
                  f"{p['tokens_per_second']:.1f} | {p['speedup']:.2f}x |")
    return 0


