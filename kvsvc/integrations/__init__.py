"""Engines on kvsvc: each subpackage plugs one engine's KV cache manager into a kvsvc pool.

Subpackages import their engine lazily; ``kvsvc`` itself never depends on one.
"""
