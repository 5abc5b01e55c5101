"""Tiny dummy-weight models of the attention kinds vLLM on kvsvc serves, as ``config.json``
dicts: each runs on vLLM's CPU backend here (random weights, no tokenizer)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.vllm.helpers import TINY_LLAMA_CONFIG

_COMMON: dict[str, Any] = {
    "hidden_size": 256,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "vocab_size": 8192,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "torch_dtype": "float32",
    "rope_theta": 10000.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}

# Gemma 3: two sliding-window (64 tokens) and two full-attention layers, so vLLM's hybrid
# allocator makes two KV cache groups: a sliding window one and a full-attention one.
TINY_GEMMA3_CONFIG: dict[str, Any] = {
    **_COMMON,
    "architectures": ["Gemma3ForCausalLM"],
    "model_type": "gemma3_text",
    "hidden_activation": "gelu_pytorch_tanh",
    "rope_local_base_freq": 10000.0,
    "query_pre_attn_scalar": 64,
    "sliding_window": 64,
    "layer_types": [
        "sliding_attention",
        "sliding_attention",
        "full_attention",
        "full_attention",
    ],
    "pad_token_id": 0,
    "tie_word_embeddings": True,
}

# Mistral-style: every layer has a 64-token sliding window (one sliding-window group).
TINY_MISTRAL_CONFIG: dict[str, Any] = {
    **_COMMON,
    "architectures": ["MistralForCausalLM"],
    "model_type": "mistral",
    "hidden_act": "silu",
    "sliding_window": 64,
}

# Llama 4 text: chunked local attention (64-token chunks) on the RoPE layers, full
# attention on the NoPE one; one local expert keeps the MoE tiny.
TINY_LLAMA4_CONFIG: dict[str, Any] = {
    **_COMMON,
    "architectures": ["Llama4ForCausalLM"],
    "model_type": "llama4_text",
    "hidden_act": "silu",
    "intermediate_size_mlp": 512,
    "num_local_experts": 1,
    "num_experts_per_tok": 1,
    "interleave_moe_layer_step": 1,
    "attention_chunk_size": 64,
    "no_rope_layers": [1, 1, 1, 0],
    "use_qk_norm": True,
    "attn_temperature_tuning": False,
    "rope_scaling": None,
}

MODELS: dict[str, dict[str, Any]] = {
    "llama": TINY_LLAMA_CONFIG,
    "gemma3": TINY_GEMMA3_CONFIG,
    "mistral": TINY_MISTRAL_CONFIG,
    "llama4": TINY_LLAMA4_CONFIG,
}


def write_model(name: str, directory: Path) -> Path:
    """Write model ``name``'s ``config.json`` into ``directory``; return the directory."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(MODELS[name]))
    return directory
