"""hf-triforce: exact TriForce hierarchical speculative decoding for transformers.

``import hf_triforce`` enables ``model.generate(ids, triforce_config=TriForceConfig(...))``.
"""

from .caches import RetrievalCache, SinkWindowCache
from .candidates import TriForceCandidateGenerator
from .config import TriForceConfig
from .integration import TriForceGenerateOutput, disable, enable, triforce_generate
from .stats import TriForceStats

__version__ = "0.1.0"
__all__ = [
    "RetrievalCache",
    "SinkWindowCache",
    "TriForceCandidateGenerator",
    "TriForceConfig",
    "TriForceGenerateOutput",
    "TriForceStats",
    "disable",
    "enable",
    "triforce_generate",
]

enable()
