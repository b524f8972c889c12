"""Custom transformers `Cache` subclasses of the three tiers."""

from .buffer import BufferCache, BufferLayer
from .retrieval import RetrievalCache
from .sink_window import SinkWindowCache

__all__ = ["BufferCache", "BufferLayer", "RetrievalCache", "SinkWindowCache"]
