"""vLLM on kvsvc: the scheduler's KV cache manager and the workers' memory plan live in kvsvc.

Turn it on with one call::

    from kvsvc.integrations.vllm import vllm_kwargs
    llm = vllm.LLM(model=..., **vllm_kwargs("127.0.0.1:50051", "vllm"))

or ``kvsvc vllm-args --server HOST:PORT --pool NAME`` for ``vllm serve``. Only the
``scheduler`` and ``worker`` modules import vLLM; importing this package does not.
"""

from kvsvc.integrations.vllm.config import (
    KvsvcSettings,
    settings_from_additional_config,
    vllm_kwargs,
    vllm_serve_flags,
)

__all__ = [
    "KvsvcSettings",
    "settings_from_additional_config",
    "vllm_kwargs",
    "vllm_serve_flags",
]
