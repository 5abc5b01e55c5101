"""Lossless JSON form of specs and plans (``kvsvc plan --json``, spec files, state files).

Every spec is a dict with ``"type"`` (the concrete class, see ``SPEC_TYPES``) and its
fields; defaults are written out so a file is readable on its own.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvsvc.specs.base import KVCacheSpec
from kvsvc.specs.config import KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
from kvsvc.specs.dtypes import KVQuantMode, canonical_dtype
from kvsvc.specs.kinds import SPEC_TYPES, UniformTypeKVCacheSpecs


def spec_to_dict(spec: KVCacheSpec) -> dict[str, Any]:
    """A JSON-ready dict that :func:`spec_from_dict` turns back into an equal spec."""
    if isinstance(spec, UniformTypeKVCacheSpecs):
        return {
            "type": spec.type_name,
            "block_size": spec.block_size,
            "specs": {name: spec_to_dict(s) for name, s in spec.kv_cache_specs.items()},
        }
    out: dict[str, Any] = {"type": spec.type_name}
    for f in dataclasses.fields(spec):
        value = getattr(spec, f.name)
        if isinstance(value, KVQuantMode):
            value = value.name.lower()
        elif f.name == "shapes":
            value = [list(shape) for shape in value]
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def spec_from_dict(data: dict[str, Any], *, where: str = "spec") -> KVCacheSpec:
    """Build a spec from its dict form.

    Raises:
        ValueError: naming ``where`` and what is wrong (unknown type, missing or unknown
            field, bad value).
    """
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    type_name = data.get("type", data.get("kind"))
    cls = SPEC_TYPES.get(str(type_name))
    if cls is None:
        valid = ", ".join(sorted(SPEC_TYPES))
        raise ValueError(f"{where}: unknown spec type {type_name!r}; valid types: {valid}")
    if cls is UniformTypeKVCacheSpecs:
        inner = data.get("specs")
        if not isinstance(inner, dict) or not inner:
            raise ValueError(f"{where}: uniform_type needs a non-empty 'specs' object")
        return UniformTypeKVCacheSpecs(
            block_size=int(data["block_size"]),
            kv_cache_specs={
                name: spec_from_dict(s, where=f"{where}.specs.{name}") for name, s in inner.items()
            },
        )
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = set(data) - known - {"type", "kind"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) for {type_name}: {', '.join(sorted(unknown))}")
    kwargs: dict[str, Any] = {}
    for name in known:
        if name not in data or data[name] is None:
            continue
        value = data[name]
        if name == "kv_quant_mode":
            try:
                value = (
                    KVQuantMode[str(value).upper()]
                    if isinstance(value, str)
                    else KVQuantMode(value)
                )
            except (KeyError, ValueError):
                valid = ", ".join(m.name.lower() for m in KVQuantMode)
                raise ValueError(
                    f"{where}: unknown kv_quant_mode {value!r}; valid: {valid}"
                ) from None
        elif name == "dtype":
            value = canonical_dtype(str(value))
        elif name == "dtypes":
            value = tuple(canonical_dtype(str(v)) for v in value)
        elif name == "shapes":
            value = tuple(tuple(int(d) for d in shape) for shape in value)
        kwargs[name] = value
    try:
        return cls(**kwargs)
    except TypeError as exc:
        raise ValueError(f"{where}: {exc}") from None


def config_to_dict(config: KVCacheConfig) -> dict[str, Any]:
    return {
        "num_blocks": config.num_blocks,
        "tensors": [
            {
                "size": t.size,
                "layers": list(t.shared_by),
                "offset": t.offset,
                "block_stride": t.block_stride,
            }
            for t in config.kv_cache_tensors
        ],
        "groups": [
            {
                "layer_names": list(g.layer_names),
                "spec": spec_to_dict(g.kv_cache_spec),
                "is_eagle_group": g.is_eagle_group,
            }
            for g in config.kv_cache_groups
        ],
    }


def config_from_dict(data: dict[str, Any]) -> KVCacheConfig:
    return KVCacheConfig(
        num_blocks=int(data["num_blocks"]),
        kv_cache_tensors=[
            KVCacheTensor(
                size=int(t["size"]),
                shared_by=list(t["layers"]),
                offset=int(t.get("offset", 0)),
                block_stride=int(t.get("block_stride", 0)),
            )
            for t in data.get("tensors", [])
        ],
        kv_cache_groups=[
            KVCacheGroupSpec(
                layer_names=list(g["layer_names"]),
                kv_cache_spec=spec_from_dict(g["spec"], where=f"groups[{i}].spec"),
                is_eagle_group=bool(g.get("is_eagle_group", False)),
            )
            for i, g in enumerate(data.get("groups", []))
        ],
    )
