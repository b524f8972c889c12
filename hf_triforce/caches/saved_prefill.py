"""A prompt's prefilled cache written to disk and read back: a long document prefilled once, reused across processes.

`save_prefill` writes the token ids and the cache's keys and values in one safetensors file; `load_prefill` reads them
back into a `DynamicCache` for ``generate(ids, cache=cache, ...)``, which extends the cached prefix exactly as it
extends a fresh prefill (the same values, byte for byte).

File layout (safetensors): ``ids`` ``[batch, length]`` int64; ``keys.{layer}`` and ``values.{layer}``
``[batch, kv_heads, length, head_dim]`` in the model's dtype; metadata (strings): ``format``, ``model``
(`model_fingerprint`: the architecture, the active and merged adapters and every byte of the weights), ``dtype``,
``rope`` (the RoPE configuration and the context length), ``length``, ``checksum`` (sha256 over every tensor's bytes
in a fixed order).

A file is refused with the field named when the model it was saved for differs from the one loading it (another model
or other weights, adapter, dtype or RoPE configuration; the config's runtime flags, `RUNTIME_FIELDS`, do not count)
and when its bytes do not match its checksum. The fingerprint hashes the weights at each save and load (`digests`).
Models with sliding-window layers (which keep only their last window) are refused by `save_prefill`.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from transformers import DynamicCache

from .. import compat
from ..digests import tensor_digests
from .buffer import check_taken

FORMAT = "hf-triforce-prefill/1"
# config fields the fingerprint leaves out: token ids, output and cache switches, labels, names and versions change no
# key or value a prefill computes (the RoPE fields and the dtype are metadata fields of their own)
RUNTIME_FIELDS = ("pad_token_id", "bos_token_id", "eos_token_id", "sep_token_id", "decoder_start_token_id",
                  "use_cache", "output_attentions", "output_hidden_states", "return_dict", "torchscript",
                  "id2label", "label2id", "problem_type", "finetuning_task", "tokenizer_class", "prefix",
                  "task_specific_params", "_name_or_path", "transformers_version", "architectures",
                  "_attn_implementation_autoset", "torch_dtype", "dtype")
ROPE_FIELDS = ("rope_parameters", "rope_scaling", "max_position_embeddings")


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    return tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()


def model_fingerprint(model) -> str:
    """sha256 over the architecture (the config without `RUNTIME_FIELDS` and `ROPE_FIELDS`), the adapters each layer
    runs and those merged (`compat.adapter_state`: PEFT's active adapter, not only every adapter's weights) and every
    byte of every parameter, by name (`digests.tensor_digests`: ~0.6 s per GB on one core, divided among torch's
    threads)."""
    config = model.config.to_dict()
    for field in (*RUNTIME_FIELDS, *ROPE_FIELDS):
        config.pop(field, None)
    digest = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode())
    digest.update(json.dumps(compat.adapter_state(model)).encode())
    named = list(model.named_parameters())
    for (name, _), parameter_digest in zip(named, tensor_digests([parameter for _, parameter in named])):
        digest.update(name.encode())
        digest.update(parameter_digest)
    return digest.hexdigest()


def rope_description(model) -> str:
    """The RoPE configuration and context length of ``model`` as a canonical JSON string."""
    config = model.config
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    return json.dumps({"rope": rope, "max_position_embeddings": getattr(config, "max_position_embeddings", None)},
                      sort_keys=True, default=str)


def _model_dtype(model) -> str:
    return str(next(model.parameters()).dtype).removeprefix("torch.")


def _checksum(tensors: dict[str, torch.Tensor]) -> str:
    digest = hashlib.sha256()
    for name in sorted(tensors):
        digest.update(name.encode())
        digest.update(_tensor_bytes(tensors[name]))
    return digest.hexdigest()


def save_prefill(path: str | Path, model, input_ids: torch.LongTensor, cache) -> Path:
    """Write ``cache`` (a transformers `Cache` holding the prefill of ``input_ids`` ``[batch, length]`` by ``model``)
    to ``path`` (a ``.safetensors`` file, replaced if present); returns the path. ``cache``: one `check_taken` takes
    (not a `QuantizedCache`)."""
    check_taken(cache, "save_prefill: cache")
    length = int(cache.get_seq_length())
    if input_ids.dim() != 2 or input_ids.shape[1] != length:
        raise ValueError(f"save_prefill: input_ids must be [batch, {length}] (the cache holds {length} tokens), "
                         f"got {tuple(input_ids.shape)}")
    tensors = {"ids": input_ids.detach().to("cpu", torch.int64).contiguous()}
    for index, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            raise ValueError(f"save_prefill: cache layer {index} is a sliding-window layer, which keeps only its last "
                             "window; only caches of full-attention layers are saved")
        tensors[f"keys.{index}"] = layer.keys[:, :, :length].detach().to("cpu").contiguous()
        tensors[f"values.{index}"] = layer.values[:, :, :length].detach().to("cpu").contiguous()
    metadata = {"format": FORMAT, "model": model_fingerprint(model), "dtype": _model_dtype(model),
                "rope": rope_description(model), "length": str(length), "checksum": _checksum(tensors)}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    save_file(tensors, str(partial), metadata=metadata)
    partial.replace(path)  # a reader never sees a half-written file
    return path


def _same(field: str, stored: str | None, expected: str) -> bool:
    """The RoPE description compares by value (a YaRN factor of 2 is one of 2.0), the other fields as strings."""
    if field != "rope" or stored is None:
        return stored == expected
    try:
        return json.loads(stored) == json.loads(expected)
    except json.JSONDecodeError:
        return False


def _check_metadata(path, metadata: dict[str, str], model) -> None:
    """ValueError naming the first field of a file's ``metadata`` that does not fit ``model``."""
    if metadata.get("format") != FORMAT:
        raise ValueError(f"load_prefill: {path}: format is {metadata.get('format')!r}, expected {FORMAT!r}")
    expected = {"dtype": _model_dtype(model), "rope": rope_description(model), "model": model_fingerprint(model)}
    for field, value in expected.items():
        if not _same(field, metadata.get(field), value):
            raise ValueError(f"load_prefill: {path} was saved for another {field} ({field}: file "
                             f"{metadata.get(field)!r}, this model {value!r})")


def load_prefill(path: str | Path, model) -> tuple[torch.LongTensor, DynamicCache]:
    """The token ids ``[batch, length]`` and a `DynamicCache` of their prefill by ``model``, read from ``path``.
    Raises ValueError naming the field (``format``, ``model``, ``dtype``, ``rope``, ``checksum``) where the file was
    saved for another model or is damaged."""
    try:
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata() or {}
            _check_metadata(path, metadata, model)  # before reading the (large) tensors
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}
    except (SafetensorError, OSError) as exc:
        raise ValueError(f"load_prefill: {path} is not a readable safetensors file ({exc})") from exc
    if _checksum(tensors) != metadata.get("checksum"):
        raise ValueError(f"load_prefill: {path}: checksum does not match its contents (a damaged file)")
    device = next(model.parameters()).device
    cache = DynamicCache(config=model.config)
    for index in range(len(cache.layers)):
        cache.update(tensors[f"keys.{index}"].to(device), tensors[f"values.{index}"].to(device), index)
    return tensors["ids"].to(device), cache
