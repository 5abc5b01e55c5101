"""kvsvc: a KV-cache manager for LLM engines, run as a gRPC service."""

__version__ = "0.1.0"
