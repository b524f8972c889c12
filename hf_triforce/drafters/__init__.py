"""Force-1 drafters: one file each, all listed in one registry.

Importing this package imports every module in it, and each drafter module registers itself (``self`` and
``model`` in `model`, ``ngram``, ``suffix``; a draft model object is the ``model`` drafter). `TriForceConfig`
validation, the CLI and the bench read `DRAFTERS`: a new drafter is one new file here, a `Drafter` subclass and a
call of `register_drafter` (or, outside the package, any module that registers one before the config is built).
"""

import importlib
import pkgutil

from .registry import DRAFTERS, DraftContext, Drafter, DrafterSpec, build_drafter, drafter_names, register_drafter

for _module in sorted(info.name for info in pkgutil.iter_modules(__path__) if info.name != "registry"):
    importlib.import_module(f"{__name__}.{_module}")

__all__ = ["DRAFTERS", "DraftContext", "Drafter", "DrafterSpec", "build_drafter", "drafter_names", "register_drafter"]
