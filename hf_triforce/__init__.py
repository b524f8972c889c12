"""hf-triforce: exact TriForce hierarchical speculative decoding for transformers.

``import hf_triforce`` enables ``model.generate(ids, triforce_config=TriForceConfig(...))``.
"""

from .caches import RetrievalCache, SinkWindowCache
from .caches.row_caches import RowCaches
from .caches.saved_prefill import load_prefill, save_prefill
from .candidates import TriForceCandidateGenerator
from .config import TriForceConfig
from .continuous import BatchRequest, ContinuousBatch
from .integration import TriForceGenerateOutput, disable, enable, triforce_generate
from .kernels.gguf_weights import attach_gguf, detach_gguf, load_gguf
from .stats import TriForceDetail, TriForceStats

__version__ = "0.1.0"
__all__ = [
    "BatchRequest",
    "ContinuousBatch",
    "RetrievalCache",
    "RowCaches",
    "SinkWindowCache",
    "TriForceCandidateGenerator",
    "TriForceConfig",
    "TriForceGenerateOutput",
    "TriForceDetail",
    "TriForceStats",
    "attach_gguf",
    "detach_gguf",
    "disable",
    "enable",
    "load_gguf",
    "load_prefill",
    "save_prefill",
    "triforce_generate",
]

enable()
