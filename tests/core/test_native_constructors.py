"""The core's hot dataclasses write their ``__init__`` out, and it matches their fields.

Compiled with mypyc, the ``__init__`` that ``dataclass`` generates stays an interpreted
function (called from compiled code with keywords, ~2,300 instructions), where a written
one compiles to a native constructor (the note in kvsvc.core.events). The classes made per
block, per call or per allocate write theirs; these tests check (in both builds) that each
written constructor takes exactly the dataclass's fields, in order, with their defaults, and
(in the compiled build) that it is native. Every other dataclass of a compiled module is
listed with why an interpreted constructor is fine for it, so a new one is a decision.
"""

from __future__ import annotations

import dataclasses
import importlib
import types
from typing import Any

import pytest

import kvsvc.native
from kvsvc.core.events import BlockRemoved, BlockStored, KVEventBatch
from kvsvc.core.manager import KVCacheBlocks
from kvsvc.core.pool_types import AllocateOutcome

# Made per block a decode caches or evicts, per call that changed the index, per allocate.
WRITTEN_OUT: tuple[type, ...] = (
    BlockStored,
    BlockRemoved,
    KVEventBatch,
    KVCacheBlocks,
    AllocateOutcome,
)
# The compiled modules' other dataclasses, and why the generated constructor is fine there.
GENERATED_IS_FINE: dict[str, str] = {
    "kvsvc.core.events.AllBlocksCleared": "no fields; made on a reset of the prefix index",
    "kvsvc.core.hashing.MultiModalItem": "frozen; made by the engine's side, per item",
    "kvsvc.core.hashing.HashingContext": "frozen; per admission, and only with extra keys",
    "kvsvc.core.pool_types.RequestStart": "frozen; one per admission",
    "kvsvc.core.pool_types.PreparedLookup": "frozen; one per admission's lookup",
    "kvsvc.core.pool_types.BlockTableView": "frozen; per table read by an operator",
    "kvsvc.core.pool_types.AdmissionRecord": "frozen; one per admission",
    "kvsvc.core.stats.PrefixCacheStats": "one per pool",
    "kvsvc.core.stats.UsageSnapshot": "frozen; one per usage read",
}


# Per class, a value of its declared type for each field, in field order, each distinct
# from the others of its type (so a constructor that swaps two fields shows it). The
# compiled constructors check the declared types, so the values must have them.
SAMPLES: dict[type, dict[str, Any]] = {
    BlockStored: {
        "block_hashes": [b"h1", b"h2"],
        "parent_block_hash": b"parent",
        "token_ids": [1, 2, 3],
        "block_size": 16,
        "lora_name": "adapter",
        "medium": "GPU",
        "group_index": 2,
        "group_kind": "full_attention",
        "extra_keys": [("cache_salt", "s"), None],
        "lora_id": 7,
    },
    BlockRemoved: {"block_hashes": [b"h"], "medium": "CPU", "group_index": 3},
    KVEventBatch: {"seq": 5, "timestamp": 12.5, "events": [BlockRemoved([b"x"], "GPU", 0)]},
    KVCacheBlocks: {"blocks": ([1, 2], [3])},
    AllocateOutcome: {
        "ok": True,
        "new_block_ids": ([4, 5],),
        "num_null_blocks": (1,),
        "num_cached_tokens": 32,
        "num_scheduled_tokens": 48,
        "num_computed_tokens": 80,
        "recompute": True,
        "released": False,
    },
}


def _values(cls: type) -> dict[str, Any]:
    values = SAMPLES[cls]
    assert list(values) == [field.name for field in dataclasses.fields(cls)]
    return values


def _default(field: dataclasses.Field[Any]) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    raise AssertionError(f"{field.name} has no default")


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda cls: cls.__name__)
def test_the_written_constructor_takes_the_fields_by_keyword_and_by_position(cls: type) -> None:
    values = _values(cls)
    by_keyword = cls(**values)
    by_position = cls(*values.values())
    for name, value in values.items():
        for made in (by_keyword, by_position):
            # Scalars come back equal (a native class keeps them unboxed), the rest as is.
            got = getattr(made, name)
            assert got == value and type(got) is type(value), name
            if isinstance(value, list | tuple | bytes | str):
                assert got is value, name
    assert by_keyword == by_position
    assert dataclasses.replace(by_keyword) == by_keyword


@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda cls: cls.__name__)
def test_the_written_constructor_gives_the_fields_defaults(cls: type) -> None:
    fields = dataclasses.fields(cls)
    required = {
        field.name: _values(cls)[field.name]
        for field in fields
        if field.default is dataclasses.MISSING and field.default_factory is dataclasses.MISSING
    }
    made = cls(**required)
    for field in fields:
        if field.name not in required:
            assert getattr(made, field.name) == _default(field), field.name
    # One more argument than the fields is refused, as the generated one refuses it.
    with pytest.raises(TypeError):
        cls(*_values(cls).values(), None)


def test_each_batch_gets_its_own_event_list() -> None:
    first, second = KVEventBatch(1, 0.0), KVEventBatch(2, 0.0)
    first.events.append(BlockRemoved([b"h"], "GPU", 0))
    assert second.events == []


@pytest.mark.skipif(kvsvc.native.BUILD != "mypyc", reason="the pure build has no native code")
@pytest.mark.parametrize("cls", WRITTEN_OUT, ids=lambda cls: cls.__name__)
def test_the_compiled_constructor_is_native(cls: type) -> None:
    assert not isinstance(cls.__dict__["__init__"], types.FunctionType), (
        f"{cls.__name__}.__init__ is interpreted: write it out (init=False)"
    )


def test_every_dataclass_of_a_compiled_module_is_accounted_for() -> None:
    modules = ["kvsvc.core." + name for name in _core_module_names()]
    modules += ["kvsvc.server.step", "kvsvc.server.step_codec", "kvsvc.server.wire"]
    found = set()
    for module_name in modules:
        module = importlib.import_module(module_name)
        for name, value in vars(module).items():
            if (
                isinstance(value, type)
                and dataclasses.is_dataclass(value)
                and value.__module__ == module_name
            ):
                found.add(f"{module_name}.{name}")
    written = {f"{cls.__module__}.{cls.__qualname__}" for cls in WRITTEN_OUT}
    assert found - written - set(GENERATED_IS_FINE) == set(), (
        "a dataclass of a compiled module is in neither list: write its __init__ out if "
        "it is made per call or per block, or say why not"
    )
    assert (written | set(GENERATED_IS_FINE)) - found == set()


def _core_module_names() -> list[str]:
    from pathlib import Path

    import kvsvc.core

    return sorted(
        path.stem
        for path in Path(kvsvc.core.__file__).parent.glob("*.py")
        if path.name != "__init__.py"
    )
