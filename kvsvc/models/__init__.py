"""From a Hugging Face ``config.json`` (or a spec file) to per-rank KV cache specs.

An engine reports its layers' specs itself; ``kvsvc plan`` and the demo have only a model
config. This package derives what the engine would report, rank by rank, for the families
in :data:`SUPPORTED_MODEL_TYPES`: llama, mistral/mixtral (sliding window), qwen2/qwen3
(``use_sliding_window`` + ``max_window_layers``), gemma/gemma2/gemma3 (interleaved sliding
windows), deepseek_v2/v3 (MLA), jamba (attention + Mamba) and whisper (cross-attention).
"""

from kvsvc.models.config import (
    bundled_config_path,
    list_bundled_configs,
    load_model_config,
    model_dtype,
    resolve_model_config,
    text_config,
)
from kvsvc.models.families import (
    SUPPORTED_MODEL_TYPES,
    LayerEntry,
    ModelLayers,
    ModelSpecOptions,
    default_max_model_len,
    default_max_num_encoder_input_tokens,
    layer_specs_all_ranks,
    layer_specs_for_rank,
    model_layers,
    total_num_kv_heads,
)
from kvsvc.models.mamba import MambaAlignment, align_attention_to_mamba, mamba1_state_shapes
from kvsvc.models.parallel import get_pp_indices, kv_heads_per_rank
from kvsvc.models.specfile import (
    dump_spec_file,
    extract_layer_index,
    load_spec_file,
    parse_spec_file,
    spec_file_dict,
    split_specs_over_ranks,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "LayerEntry",
    "MambaAlignment",
    "ModelLayers",
    "ModelSpecOptions",
    "align_attention_to_mamba",
    "bundled_config_path",
    "default_max_model_len",
    "default_max_num_encoder_input_tokens",
    "dump_spec_file",
    "extract_layer_index",
    "get_pp_indices",
    "kv_heads_per_rank",
    "layer_specs_all_ranks",
    "layer_specs_for_rank",
    "list_bundled_configs",
    "load_model_config",
    "load_spec_file",
    "mamba1_state_shapes",
    "model_dtype",
    "model_layers",
    "parse_spec_file",
    "resolve_model_config",
    "spec_file_dict",
    "split_specs_over_ranks",
    "text_config",
    "total_num_kv_heads",
]
