"""Force-1 drafters: one file each, all listed in one registry.

Importing this package registers the built-in drafters (``self``, ``ngram``, ``suffix``; a draft model object
is the ``model`` drafter). `TriForceConfig` validation, the CLI and the bench read `DRAFTERS`; a new drafter
is one file that calls `register_drafter`.
"""

from . import model, ngram, suffix  # noqa: F401  (each registers itself)
from .registry import DRAFTERS, DraftContext, Drafter, DrafterSpec, build_drafter, drafter_names, register_drafter

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "DrafterSpec", "build_drafter", "drafter_names", "register_drafter"]
