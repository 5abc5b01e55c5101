"""Spec files: a model described directly as ``{layer_name: spec}`` instead of a config.

For models no family here covers, or to plan exactly what an engine reported. The file
holds one TP rank's layers (every rank of a stage has the same specs) in the
:mod:`kvsvc.specs` JSON form::

    {"model.layers.0.self_attn.attn": {"type": "full_attention", "block_size": 16,
                                        "num_kv_heads": 8, "head_size": 128,
                                        "dtype": "bfloat16"},
     ...}
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvsvc.errors import InvalidArgument
from kvsvc.models.parallel import get_pp_indices
from kvsvc.specs import KVCacheSpec, spec_from_dict, spec_to_dict

_INT_PART = re.compile(r"^\d+$")


def spec_file_dict(specs: dict[str, KVCacheSpec]) -> dict[str, Any]:
    """The JSON object of a spec file holding ``specs``."""
    return {name: spec_to_dict(spec) for name, spec in specs.items()}


def dump_spec_file(specs: dict[str, KVCacheSpec], path: str | Path) -> None:
    """Write ``specs`` as a spec file that :func:`load_spec_file` reads back equal."""
    Path(path).write_text(json.dumps(spec_file_dict(specs), indent=2) + "\n", encoding="utf-8")


def parse_spec_file(data: Any, *, source: str = "spec file") -> dict[str, KVCacheSpec]:
    """Build the layer specs from a decoded spec file.

    Raises:
        InvalidArgument: naming the layer whose spec is malformed.
    """
    if not isinstance(data, dict) or not data:
        raise InvalidArgument(
            "spec_file", f"{source} must be a non-empty JSON object of layer name -> spec"
        )
    specs: dict[str, KVCacheSpec] = {}
    for name, raw in data.items():
        try:
            specs[str(name)] = spec_from_dict(raw, where=f"layer {name!r}")
        except ValueError as exc:
            raise InvalidArgument("spec_file", f"{source}: {exc}") from None
    return specs


def load_spec_file(path: str | Path) -> dict[str, KVCacheSpec]:
    """Read a spec file (``{layer_name: spec dict}``).

    Raises:
        InvalidArgument: when the file is missing, not JSON, or a spec is malformed.
    """
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as exc:
        raise InvalidArgument("spec_file", f"cannot read {str(p)!r}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise InvalidArgument("spec_file", f"{str(p)!r} is not valid JSON: {exc}") from None
    return parse_spec_file(data, source=str(p))


def extract_layer_index(name: str) -> int:
    """The decoder-layer index in a vLLM layer name (``model.layers.7.self_attn.attn`` -> 7).

    Raises:
        InvalidArgument: when the name holds no index or more than one.
    """
    indices = [int(part) for part in name.split(".") if _INT_PART.match(part)]
    if len(indices) != 1:
        raise InvalidArgument(
            "spec_file",
            f"layer name {name!r} must contain exactly one numeric component (its layer "
            "index) to be split over pipeline stages",
        )
    return indices[0]


def split_specs_over_ranks(
    specs: dict[str, KVCacheSpec],
    *,
    tp: int = 1,
    pp: int = 1,
    partition: Sequence[int] | None = None,
) -> list[dict[str, KVCacheSpec]]:
    """Per-rank specs from one rank's full layer list: the PP split by layer index.

    The decoder stack is taken to be ``max index + 1`` layers long; every TP rank of a
    stage gets the same specs. Ranks are ordered ``pp_rank * tp + tp_rank``.
    """
    if tp < 1:
        raise InvalidArgument("tp", f"must be >= 1, got {tp}")
    if pp == 1:
        return [dict(specs) for _ in range(tp)]
    indexed = [(extract_layer_index(name), name, spec) for name, spec in specs.items()]
    num_layers = max(index for index, _, _ in indexed) + 1
    stages = []
    for pp_rank in range(pp):
        start, end = get_pp_indices(num_layers, pp_rank, pp, partition)
        stages.append({name: spec for index, name, spec in indexed if start <= index < end})
    return [dict(stages[rank // tp]) for rank in range(tp * pp)]
