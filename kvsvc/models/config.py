"""Reading Hugging Face ``config.json`` files, bundled or from disk.

A published ``config.json`` often omits fields that equal the ``transformers`` default of
its class (Gemma 3's ``text_config`` lists only what differs from ``Gemma3TextConfig``), so
:func:`text_config` fills in the defaults that matter for the KV cache, per family.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.specs import canonical_dtype

_CONFIG_DIR = Path(__file__).resolve().parent / "configs"

# transformers' defaults for the fields the KV cache depends on, where a family's published
# configs rely on them.
_FAMILY_DEFAULTS: dict[str, dict[str, Any]] = {
    "gemma3_text": {
        "num_hidden_layers": 26,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "max_position_embeddings": 131072,
        "sliding_window": 4096,
        "sliding_window_pattern": 6,
    },
    "gemma2": {"head_dim": 256, "sliding_window": 4096, "max_position_embeddings": 8192},
    "qwen2": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "qwen3": {"use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 28},
    "jamba": {
        "attn_layer_period": 8,
        "attn_layer_offset": 4,
        "mamba_d_state": 16,
        "mamba_d_conv": 4,
        "mamba_expand": 2,
        "max_position_embeddings": 262144,
    },
    "whisper": {"max_source_positions": 1500, "max_target_positions": 448},
}

# Multimodal wrappers whose language model lives in ``text_config``.
_TEXT_CONFIG_WRAPPERS = ("gemma3",)


def list_bundled_configs() -> list[str]:
    """Names of the model configs shipped with kvsvc (for tests, demos and ``kvsvc plan``)."""
    return sorted(p.stem for p in _CONFIG_DIR.glob("*.json"))


def bundled_config_path(name: str) -> Path:
    """Path of a bundled config by name (``llama-3.2-1b``; case-insensitive, ``.json`` optional).

    Raises:
        InvalidArgument: for an unknown name, listing the bundled ones.
    """
    stem = name.strip().lower().removesuffix(".json")
    path = _CONFIG_DIR / f"{stem}.json"
    if not path.is_file():
        raise InvalidArgument(
            "model_config",
            f"no bundled config named {name!r}; bundled: {', '.join(list_bundled_configs())}",
        )
    return path


def load_model_config(path: str | Path) -> dict[str, Any]:
    """Read a Hugging Face ``config.json`` (a file, or a directory holding one).

    Raises:
        InvalidArgument: when the file is missing, is not JSON, or has no ``model_type``.
    """
    p = Path(path)
    if p.is_dir():
        p = p / "config.json"
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise InvalidArgument("model_config", f"cannot read {str(p)!r}: {exc.strerror}") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidArgument("model_config", f"{str(p)!r} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise InvalidArgument(
            "model_config", f"{str(p)!r} is not a Hugging Face config (no 'model_type' field)"
        )
    return data


def resolve_model_config(name_or_path: str | Path) -> tuple[dict[str, Any], str]:
    """Load a config given a path or the name of a bundled one; also return a display name.

    A path that exists wins over a bundled name, so a user's own ``llama-3.2-1b.json`` in
    the working directory is the one read.
    """
    p = Path(name_or_path)
    if p.exists():
        return load_model_config(p), str(p)
    if p.suffix == ".json" or "/" in str(name_or_path):
        # Looks like a path the user meant: say the file is missing, not "unknown name".
        return load_model_config(p), str(p)
    return load_model_config(bundled_config_path(str(name_or_path))), str(name_or_path)


def text_config(config: dict[str, Any]) -> dict[str, Any]:
    """The language-model part of ``config`` with the family defaults filled in.

    For multimodal wrappers (Gemma 3) this is ``text_config``, which inherits the wrapper's
    ``torch_dtype`` when it has none of its own.
    """
    cfg = dict(config)
    if cfg.get("model_type") in _TEXT_CONFIG_WRAPPERS and isinstance(cfg.get("text_config"), dict):
        inner = dict(cfg["text_config"])
        for key in ("torch_dtype", "dtype"):
            if key in cfg and key not in inner:
                inner[key] = cfg[key]
        inner.setdefault("model_type", f"{cfg['model_type']}_text")
        cfg = inner
    for key, value in _FAMILY_DEFAULTS.get(str(cfg.get("model_type")), {}).items():
        if cfg.get(key) is None:
            cfg[key] = value
    return cfg


def model_dtype(config: dict[str, Any], requested: str = "auto") -> str:
    """The dtype the engine runs the model in (and, with ``kv_cache_dtype=auto``, caches in).

    ``auto`` takes the checkpoint's ``torch_dtype``, except that float32 checkpoints run in
    bfloat16, as vLLM's ``auto`` does on GPUs that support it; with no dtype recorded,
    bfloat16 as well.

    Raises:
        InvalidArgument: for an unknown dtype name.
    """
    if requested != "auto":
        try:
            return canonical_dtype(requested)
        except ValueError as exc:
            raise InvalidArgument("dtype", str(exc)) from None
    cfg = text_config(config)
    raw = cfg.get("torch_dtype") or cfg.get("dtype") or config.get("torch_dtype")
    if raw is None:
        return "bfloat16"
    try:
        dtype = canonical_dtype(str(raw))
    except ValueError as exc:
        raise InvalidArgument("torch_dtype", str(exc)) from None
    return "bfloat16" if dtype == "float32" else dtype


def require_int(cfg: dict[str, Any], key: str) -> int:
    """A positive integer field of the config, or an error that names it."""
    value = cfg.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise InvalidArgument(
            key, f"the model config needs a positive integer '{key}', got {value!r}"
        )
    return value
