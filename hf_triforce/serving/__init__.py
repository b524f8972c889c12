"""Serving TriForce: an OpenAI-compatible server (``hf-triforce serve``) as a Ray Serve deployment, one replica on one
machine or many across a Ray cluster, each with a store of prefilled prefixes (docs/serving.md).

`PrefixStore` and `Engine` need only torch and transformers; the deployment (`hf_triforce.serving.deployment`,
`hf_triforce.serving.launch`) needs the ``serve`` extra: ``pip install hf-triforce[serve]``.
"""

from .engine import Answer, Engine, Job
from .prefix_store import PrefixStore, prefix_view

__all__ = ["Answer", "Engine", "Job", "PrefixStore", "prefix_view"]
