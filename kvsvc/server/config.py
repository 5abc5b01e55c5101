"""Server and pool configuration: from flags (one pool) or a TOML/JSON file (several).

A config file looks like::

    listen = "0.0.0.0:50051"
    metrics_listen = "0.0.0.0:9400"

    [[pools]]
    name = "llama"
    world_size = 2
    max_model_len = 8192
    hash_algo = "sha256_cbor"

Unknown keys are errors (a typo must not silently fall back to a default).
"""

from __future__ import annotations

import json
import tomllib
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

HASH_ALGOS = ("xxh3_128", "sha256_cbor")
LAYOUTS = ("layer_outer", "block_outer")
DEFAULT_LISTEN = "127.0.0.1:50051"
DEFAULT_METRICS_LISTEN = "127.0.0.1:9400"


class ConfigError(ValueError):
    """A server or pool setting is invalid; the message names it."""


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool: a model served by ``world_size`` worker ranks.

    Attributes:
        name: the pool's name; engines and agents name it in every call.
        world_size: ranks (TP x PP) that must register before the pool is planned.
        block_size: if set, every attention layer's block size must be a multiple of it.
        max_model_len: longest request; None = the agents' reported model length; -1 =
            auto-fit to memory.
        hash_algo: ``xxh3_128`` (fast, secret random seed unless ``hash_seed``) or
            ``sha256_cbor`` (vLLM-compatible hashes).
        hash_seed: seed of the first block's parent hash.
        enable_prefix_caching: share identical prefixes between requests.
        num_gpu_blocks_override: plan exactly this many blocks per rank.
        gpu_memory_utilization: when an agent reports only totals (kv_cache_bytes 0), the
            KV cache gets total x utilisation - non-KV usage.
        max_num_batched_tokens: a step's token budget (sizes sliding-window holdings).
        disable_hybrid_kv_cache_manager: allocate local-attention layers like full ones.
        layout: tensor layout of the plan (layer_outer or block_outer).
        max_requests: live requests the pool accepts (admissions beyond it are rejected).
    """

    name: str
    world_size: int = 1
    block_size: int | None = None
    max_model_len: int | None = None
    hash_algo: str = "xxh3_128"
    hash_seed: str | None = None
    enable_prefix_caching: bool = True
    num_gpu_blocks_override: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_batched_tokens: int = 8192
    disable_hybrid_kv_cache_manager: bool = False
    layout: str = "layer_outer"
    max_requests: int = 65536

    def __post_init__(self) -> None:
        where = f"pool {self.name!r}"
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise ConfigError(
                f"pool name {self.name!r}: use letters, digits, '-', '_' or '.' (non-empty)"
            )
        if self.world_size < 1:
            raise ConfigError(f"{where}: world_size must be >= 1, got {self.world_size}")
        if self.block_size is not None and self.block_size < 1:
            raise ConfigError(f"{where}: block_size must be >= 1, got {self.block_size}")
        if self.max_model_len is not None and self.max_model_len != -1 and self.max_model_len < 1:
            raise ConfigError(
                f"{where}: max_model_len must be positive or -1 (auto-fit), "
                f"got {self.max_model_len}"
            )
        if self.hash_algo not in HASH_ALGOS:
            raise ConfigError(
                f"{where}: unknown hash_algo {self.hash_algo!r}; valid: {', '.join(HASH_ALGOS)}"
            )
        if self.num_gpu_blocks_override is not None and self.num_gpu_blocks_override < 2:
            raise ConfigError(
                f"{where}: num_gpu_blocks_override must be >= 2 (one is the null block)"
            )
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(
                f"{where}: gpu_memory_utilization must be in (0, 1], "
                f"got {self.gpu_memory_utilization}"
            )
        if self.max_num_batched_tokens < 1:
            raise ConfigError(f"{where}: max_num_batched_tokens must be >= 1")
        if self.layout not in LAYOUTS:
            raise ConfigError(
                f"{where}: unknown layout {self.layout!r}; valid: {', '.join(LAYOUTS)}"
            )
        if self.max_requests < 1:
            raise ConfigError(f"{where}: max_requests must be >= 1")


@dataclass(frozen=True, slots=True)
class ServerConfig:
    """The whole server.

    Attributes:
        listen: gRPC address (``host:port``; port 0 picks a free one).
        metrics_listen: Prometheus ``/metrics`` address, or None for no endpoint.
        pools: the pools served (names unique).
        auth_token: when set, every kvsvc call must carry ``authorization: Bearer <token>``
            (health and reflection stay open for probes).
        max_message_bytes: largest request or response message.
        heartbeat_timeout_s: a rank silent this long makes its pool DEGRADED.
        event_buffer_batches: event batches kept for WatchEvents replay, per pool.
        event_buffer_events: events kept for replay, per pool (whichever bound is hit first).
        max_step_operations: operations one Step may carry.
    """

    pools: tuple[PoolConfig, ...]
    listen: str = DEFAULT_LISTEN
    metrics_listen: str | None = DEFAULT_METRICS_LISTEN
    auth_token: str | None = None
    max_message_bytes: int = 64 * 1024 * 1024
    heartbeat_timeout_s: float = 10.0
    event_buffer_batches: int = 10000
    event_buffer_events: int = 200_000
    max_step_operations: int = 8192

    def __post_init__(self) -> None:
        if not self.pools:
            raise ConfigError(
                "no pools configured: give --pool NAME or a config file with [[pools]]"
            )
        names = [p.name for p in self.pools]
        duplicates = sorted({n for n in names if names.count(n) > 1})
        if duplicates:
            raise ConfigError(f"duplicate pool name(s): {', '.join(duplicates)}")
        split_host_port(self.listen, "listen")
        if self.metrics_listen:
            split_host_port(self.metrics_listen, "metrics_listen")
        if self.max_message_bytes < 1024:
            raise ConfigError("max_message_bytes must be at least 1024")
        if self.heartbeat_timeout_s <= 0:
            raise ConfigError("heartbeat_timeout_s must be positive")
        if self.event_buffer_batches < 1:
            raise ConfigError("event_buffer_batches must be >= 1")
        if self.event_buffer_events < 1:
            raise ConfigError("event_buffer_events must be >= 1")
        if not 1 <= self.max_step_operations <= 1_000_000:
            raise ConfigError("max_step_operations must be in [1, 1000000]")


def split_host_port(address: str, what: str) -> tuple[str, int]:
    """Split ``host:port`` (IPv6 in brackets), raising ConfigError naming ``what``."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what}: expected HOST:PORT, got {address!r}")
    return host.strip("[]") or "0.0.0.0", int(port)


def _build(cls: type, data: dict[str, Any], where: str) -> Any:
    known = {f.name for f in fields(cls)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ConfigError(
            f"{where}: unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}"
        )
    try:
        return cls(**data)
    except TypeError as exc:
        raise ConfigError(f"{where}: {exc}") from None


def load_config_file(path: str | Path) -> dict[str, Any]:
    """Read a TOML (default) or JSON (``.json``) config file into a plain dict."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from None
    try:
        data = json.loads(raw) if path.suffix == ".json" else tomllib.loads(raw.decode())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ConfigError(
            f"config file {path} is not valid {'JSON' if path.suffix == '.json' else 'TOML'}: {exc}"
        ) from None
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path}: expected a table/object at the top level")
    return data


def server_config_from_dict(
    data: dict[str, Any], overrides: dict[str, Any] | None = None
) -> ServerConfig:
    """Build a ServerConfig from a config-file dict, with ``overrides`` (flags) on top."""
    data = dict(data)
    pools_data = data.pop("pools", [])
    if not isinstance(pools_data, list):
        raise ConfigError("'pools' must be a list of tables ([[pools]] in TOML)")
    pools = [
        _build(PoolConfig, dict(p), f"pools[{i}]") if isinstance(p, dict) else None
        for i, p in enumerate(pools_data)
    ]
    if any(p is None for p in pools):
        raise ConfigError("every entry of 'pools' must be a table")
    merged = {**data, **(overrides or {})}
    extra_pools = merged.pop("extra_pools", ())
    return _build(ServerConfig, {**merged, "pools": (*pools, *extra_pools)}, "server config")
