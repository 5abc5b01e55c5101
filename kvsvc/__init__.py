"""kvsvc: a KV-cache manager for LLM engines, run as a gRPC service."""

from kvsvc import native

__version__ = "0.1.0"

# Before anything imports kvsvc.core: its compiled build, where built (kvsvc.native).
native.install()
