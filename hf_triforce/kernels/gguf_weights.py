"""A GGUF model's linear layers read at their stored width: the file's quantized blocks attached to the weights they
are, for `linear_routes`' ``"gguf"`` route (`gguf_linear`'s kernel; docs/deployment.md, "The CPU kernels").

`attach_gguf` reads the file's tensors of the types the kernel takes (`gguf_linear.TYPES`), puts their rows in the
model's order (transformers' own tensor processor: Llama's query and key rows are stored permuted) and keeps each
beside the weight of the model's `nn.Linear` it was loaded into (a tied output layer included), after checking that
the kernel's values are that weight's, bit for bit. Opt-in: `load_gguf` (a file loaded and attached) or `attach_gguf`
(a model loaded otherwise from the same values).

The blocks serve the weight only while it holds their values: `attach_gguf` keeps the sha256 of each weight's bytes,
and `verify`, run once per call before any route is timed or taken, hashes them again and refuses blocks whose weight
holds other values (a write through ``.data``, which the version counter does not see: peft's ``merge_and_unload``),
another dtype or shape; `matrix_of` also refuses, at each forward, a weight whose version counter moved. Attach again,
or `detach_gguf`. The hash costs a read of the attached fp32 weights per call (`digests`: ~0.6 s per GB on one core,
divided among torch's threads). Tensors of other types stay on the fp32 routes; `describe` counts what is attached.
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

from .. import compat
from ..digests import tensor_digest, tensor_digests
from . import gguf_linear
from .gguf_linear import TYPES, BlockMatrix


@dataclass(frozen=True)
class _Attached:
    matrix: BlockMatrix
    version: int  # the weight's version counter when attached: an in-place write bumps it
    digest: bytes  # sha256 of the weight's bytes when attached (`tensor_digest`): a write through .data changes it
    source: str  # the GGUF tensor's name, for errors


# id(weight tensor) -> (a weak reference to it, its attached blocks): dropped with the tensor; a model's deep copy does
# not carry them (a WeakKeyDictionary would compare tensors by value on a hash collision)
_ATTACHED: dict[int, tuple[weakref.ref, _Attached]] = {}


def _remember(weight: torch.Tensor, attached: _Attached) -> None:
    key = id(weight)
    _ATTACHED[key] = (weakref.ref(weight, lambda _, key=key: _ATTACHED.pop(key, None)), attached)


def _attached(weight: torch.Tensor) -> _Attached | None:
    entry = _ATTACHED.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else None


def _linear_weights(model: nn.Module) -> dict[int, torch.Tensor]:
    """``{id(weight): weight}`` of the model's `nn.Linear` layers (a tied output layer's weight is the embedding's)."""
    return {id(module.weight): module.weight for module in model.modules() if isinstance(module, nn.Linear)}


def _row_order(processor, name: str, rows: int, mapping: dict) -> tuple[np.ndarray, str] | None:
    """``(order, name)``: the row order transformers' ``processor`` gives the GGUF tensor ``name`` of ``rows`` rows
    (row ``i`` of the model's weight is the file's row ``order[i]``) and the tensor's name after processing; None
    where the processor does more than reorder rows."""
    index = np.arange(rows, dtype=np.float64).reshape(rows, 1)
    result = processor.process(weights=index, name=name, tensor_key_mapping=mapping, parsed_parameters={})
    order = np.asarray(result.weights)
    if order.shape != (rows, 1) or not np.array_equal(np.sort(order[:, 0]), index[:, 0]):
        return None
    return order[:, 0].astype(np.int64), result.name


def attach_gguf(model: nn.Module, path: str | Path) -> dict[str, int]:
    """Attach the GGUF file ``path``'s quantized blocks (types `gguf_linear.TYPES`) to ``model``'s `nn.Linear`
    weights they were loaded into; returns the layers attached by type (`describe`). ``model`` must hold the file's
    values in fp32 (loaded from it by transformers, or from a checkpoint of those values). ValueError naming the
    argument: no such file; a weight of another dtype or shape than the file's, or values other than the file's (not
    the model of this file); no tensor of a type the kernel reads."""
    try:
        from gguf import GGUFReader
    except ImportError as error:
        raise ImportError(f"attach_gguf reads GGUF files with the gguf package: pip install gguf ({error})") from error
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"attach_gguf: path {str(path)!r} is not a file")
    reader = GGUFReader(path)
    field = reader.fields.get("general.architecture")
    architecture = field.contents() if field is not None else None
    processor, mapping = compat.gguf_tensor_map(model, architecture)
    weights = _linear_weights(model)
    check = gguf_linear.dequantize if gguf_linear.available() else gguf_linear.reference_dequantize
    found: list[tuple[torch.Tensor, _Attached]] = []
    for tensor in reader.tensors:
        kind = tensor.tensor_type.name
        if kind not in TYPES:
            continue
        rows = int(tensor.data.shape[0])
        ordered = _row_order(processor, tensor.name, rows, mapping)
        if ordered is None or ordered[1] not in mapping:
            continue
        order, name = ordered
        hf_name = mapping[name]
        try:
            weight = model.get_parameter(hf_name)
        except AttributeError:
            continue
        if id(weight) not in weights:  # not a linear layer's weight (an untied input embedding)
            continue
        columns = int(tensor.shape[0])
        if weight.dtype != torch.float32 or tuple(weight.shape) != (rows, columns):
            raise ValueError(f"attach_gguf: model weight {hf_name} is {weight.dtype} {tuple(weight.shape)}; the file's "
                             f"{tensor.name} holds float32 ({rows}, {columns}) values (load the model in float32)")
        matrix = BlockMatrix(kind, torch.from_numpy(np.ascontiguousarray(tensor.data[order])), columns)
        if not torch.equal(check(matrix).view(torch.int32), weight.detach().view(torch.int32)):
            raise ValueError(f"attach_gguf: model weight {hf_name} differs from the values of {tensor.name} in "
                             f"{path.name}: model is not the model of this file")
        found.append((weight, _Attached(matrix, compat.version_counter(weight), tensor_digest(weight), tensor.name)))
    if not found:
        raise ValueError(f"attach_gguf: {path.name} holds no linear weight of {', '.join(TYPES)} for this model")
    for weight, attached in found:
        _remember(weight, attached)
    return describe(model)


def load_gguf(path: str | Path, **kwargs) -> tuple[nn.Module, object]:
    """``(model, tokenizer)`` of the GGUF file ``path`` (transformers' ``from_pretrained(folder, gguf_file=name)``,
    fp32, ``kwargs`` passed on) with its quantized blocks attached (`attach_gguf`): TriForce's target forward reads
    them at their stored width, while plain ``generate`` runs transformers' forward on the same values in fp32."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.is_file():
        raise ValueError(f"load_gguf: path {str(path)!r} is not a file")
    if kwargs.get("dtype", torch.float32) != torch.float32:
        raise ValueError(f"load_gguf: dtype must be torch.float32 (the file's values exactly), got {kwargs['dtype']}")
    kwargs["dtype"] = torch.float32
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, **kwargs).eval()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    attach_gguf(model, path)
    return model, tokenizer


def detach_gguf(model: nn.Module) -> None:
    """Forget the blocks attached to ``model``'s weights (its layers take the fp32 routes only)."""
    for weight in _linear_weights(model).values():
        if _attached(weight) is not None:
            del _ATTACHED[id(weight)]


def matrix_of(weight: torch.Tensor) -> BlockMatrix | None:
    """The blocks attached to ``weight`` (None: none). RuntimeError where the weight was written in place since they
    were attached (they no longer hold its values)."""
    attached = _attached(weight)
    if attached is None:
        return None
    if compat.version_counter(weight) != attached.version:
        raise RuntimeError(f"the weight loaded from GGUF tensor {attached.source} was changed in place after "
                           "attach_gguf: its attached blocks no longer hold its values (attach_gguf again, or "
                           "detach_gguf)")
    return attached.matrix


def verify(weights: Iterable[torch.Tensor]) -> None:
    """Check that the blocks attached to each of ``weights`` still hold its values: its dtype and shape are the
    blocks' (float32 ``[out_features, in_features]``) and the sha256 of its bytes is the one taken when attached
    (`tensor_digests`, over torch's threads; weights without blocks are skipped). RuntimeError naming the GGUF
    tensor where not (a write through ``.data``, ``merge_and_unload``, a dtype conversion), or where `matrix_of`
    refuses it."""
    checked = {id(weight): weight for weight in weights if _attached(weight) is not None}
    if not checked:
        return
    for weight in checked.values():
        attached = _attached(weight)
        shape = (attached.matrix.out_features, attached.matrix.in_features)
        if weight.dtype != torch.float32 or tuple(weight.shape) != shape:
            raise RuntimeError(f"the weight loaded from GGUF tensor {attached.source} is {weight.dtype} "
                               f"{tuple(weight.shape)}; its attached blocks hold float32 {shape} values "
                               "(detach_gguf before converting the model)")
        matrix_of(weight)  # an in-place write since attached
    digests = dict(zip(checked, tensor_digests(list(checked.values()))))
    for key, weight in checked.items():
        attached = _attached(weight)
        if digests[key] != attached.digest:
            raise RuntimeError(f"the weight loaded from GGUF tensor {attached.source} holds other values than its "
                               "attached blocks (written after attach_gguf, e.g. through .data or peft's "
                               "merge_and_unload): attach_gguf again, or detach_gguf")


def describe(model: nn.Module) -> dict[str, int]:
    """``{type: layers}`` of ``model``'s `nn.Linear` layers read at their stored width (``{}``: none attached)."""
    counts = Counter(attached.matrix.kind for module in model.modules() if isinstance(module, nn.Linear)
                     if (attached := _attached(module.weight)) is not None)
    return dict(sorted(counts.items()))
