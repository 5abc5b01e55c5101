"""What a pool's saved state was made for: the pool, the settings it was planned with,
each rank's registration and offered bytes, the plan's digest and the event epoch. A
state is loaded only into the pool and the plan it was made for.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import time
from typing import Any

from kvsvc import __version__
from kvsvc.server.config import PoolConfig
from kvsvc.server.persistence.records import StateError, new_store_id
from kvsvc.server.registration import Registration, registration_to_dict

# Pool settings a saved state was planned with: another value means another plan, so a
# restart with it is refused (the others may change between restarts).
PLAN_SETTINGS = (
    "world_size",
    "block_size",
    "max_model_len",
    "hash_algo",
    "enable_prefix_caching",
    "num_gpu_blocks_override",
    "max_num_batched_tokens",
    "disable_hybrid_kv_cache_manager",
    "layout",
)


# The PoolConfig fields a saved state does not carry in its settings: the name is the
# state's own, and the hash seed is in the core state itself.
_NOT_SAVED = ("name", "hash_seed")


def saved_settings(config: PoolConfig) -> dict[str, Any]:
    """Every setting of the pool but its name and seed, as a state records them: a
    ``kvsvc serve --restore`` of a snapshot configures the pool from these."""
    return {
        f.name: getattr(config, f.name)
        for f in dataclasses.fields(PoolConfig)
        if f.name not in _NOT_SAVED
    }


def pool_settings(identity: dict[str, Any]) -> dict[str, Any]:
    """The pool settings a saved state was made with: all of them (``pool_config``), or for
    a state written before kvsvc saved them all, the planning settings."""
    saved = identity.get("pool_config") or identity.get("settings") or {}
    if not isinstance(saved, dict):
        return {}
    known = {f.name for f in dataclasses.fields(PoolConfig)} - set(_NOT_SAVED)
    return {name: value for name, value in saved.items() if name in known}


def plan_digest(plan: Any) -> str:
    """A digest of a plan (its ``kvsvc plan --json`` form): a saved state is loaded only
    into the plan it was made for."""
    text = json.dumps(plan.to_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def new_identity(
    config: PoolConfig, epoch: str, plan: Any, regs: list[Registration], memory: list[int]
) -> dict[str, Any]:
    """What a state of this pool is made for: its planning settings and inputs (each
    rank's registration and offered bytes), the plan's digest and the event epoch."""
    return {
        "pool": config.name,
        "store_id": new_store_id(),
        "epoch": epoch,
        "created_at": time.time(),
        "kvsvc_version": __version__,
        "settings": {name: getattr(config, name) for name in PLAN_SETTINGS},
        "pool_config": saved_settings(config),
        "plan_ranks": [
            registration_to_dict(reg, available)
            for reg, available in zip(regs, memory, strict=True)
        ],
        "plan_digest": plan_digest(plan),
    }


def changed_settings(identity: dict[str, Any], config: PoolConfig) -> list[str]:
    """The planning settings ``config`` gives otherwise than the saved state has them, as
    ``name saved -> now``."""
    settings = identity.get("settings", {})
    return [
        f"{name} {settings.get(name)!r} -> {getattr(config, name)!r}"
        for name in PLAN_SETTINGS
        if settings.get(name) != getattr(config, name)
    ]


def check_made_for(
    identity: dict[str, Any],
    config: PoolConfig,
    where: str,
    remedy: str = "give the pool the settings the state was made with",
) -> None:
    """Refuse a saved state made for another pool, or planned with other settings than
    ``config`` has now.

    Args:
        remedy: what the refusal tells the user to do (the caller knows where the state
            came from: a state directory's files, or a ``--restore`` file).

    Raises:
        StateError: naming the pool, or the settings that changed.
    """
    if identity.get("pool") != config.name:
        raise StateError(f"{where} is pool {identity.get('pool')!r}'s state, not this pool's")
    changed = changed_settings(identity, config)
    if changed:
        raise StateError(
            f"{where} was planned with other settings than the config has now "
            f"({'; '.join(changed)}): {remedy}"
        )


def check_plan(identity: dict[str, Any], plan: Any, where: str) -> None:
    """Refuse a saved state whose plan this kvsvc does not make again from its inputs.

    Raises:
        StateError: naming the kvsvc version that made it.
    """
    if plan_digest(plan) != identity.get("plan_digest"):
        raise StateError(
            f"{where} was made for another plan than this kvsvc makes from the same "
            f"inputs (made by kvsvc {identity.get('kvsvc_version')}, this is "
            f"{__version__}): run that version, or start the pool afresh without this state"
        )
