"""The slowest admissions of a long run on a big pool: the prefix index's regrowth.

A pool whose blocks are all cached turns every admission into inserts and deletes in the
prefix index. A Python dict that keeps losing and gaining entries regrows its table every
~(its size) insertions, copying every entry while the inserting call waits: on an
81,920-block pool one dict of the hashes stalled an admission for 4-12 ms about every
1,450 admissions (the stall grows with the pool; vLLM's own index is one dict too).
kvsvc's index is kept in shards of ~1,000 entries (:func:`kvsvc.core.block_pool.shard_count`),
which regrow in tens of microseconds, as often in all.

Measured in this process, in interleaved rounds (the same machine moments for each):

- ``kvsvc``: the server's call, ``PoolKVCache.allocate`` of a new 2048-token prompt (half
  of it the prefix every admission shares, as rpc_bench's), its events taken after each
  call as the server drains them; the index in shards (the default);
- ``kvsvc, one dict``: the same with ``index_shards=1`` (the index as it was before);
- ``vLLM``: its in-process admission where vLLM is importable (the request's block hashes,
  ``get_computed_blocks``, ``allocate_slots``), as rpc_bench measures it.

Each pool is first filled until it has cycled (every free block cached), then each
admission is timed and its request freed (untimed). The server's collector settings apply
to all (``handler_split.server_gc``). Printed per engine: p50, p99, p99.9 and the slowest
call, how many calls took over 1 ms, and the ratios to vLLM's in the same run.

Usage: python benchmarks/tail_bench.py [--json] [--quick] [--blocks N] [--admissions N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from handler_split import server_gc  # noqa: E402
from kvsvc_client._wire import allocate_request  # noqa: E402

from kvsvc.core import PoolKVCache, RequestStart  # noqa: E402
from kvsvc.server.calls import decode_allocate  # noqa: E402
from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec  # noqa: E402
from kvsvc.v1 import kvcache_pb2 as pb  # noqa: E402

BLOCK_SIZE = 16
PROMPT_TOKENS = 2048
SHARED = list(range(1, 1025))
# rpc_bench's server pool (320 MiB of its tiny model's KV cache).
DEFAULT_BLOCKS = 81_920
SLOW_US = 1000.0


def prompt_of(i: int, salt: int) -> list[int]:
    """Admission ``i``'s prompt: the shared half, then 1024 tokens of its own."""
    return SHARED + [(i * 7919 + salt * 104729 + j) % 30000 + 1 for j in range(1024)]


class KvsvcAdmissions:
    """Admissions through ``PoolKVCache.allocate``, as the server's handler calls it."""

    def __init__(self, num_blocks: int, index_shards: int | None, salt: int) -> None:
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype="float16"
        )
        config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)]
        )
        self.cache = PoolKVCache(
            config,
            max_model_len=8192,
            hash_algo="xxh3_128",
            enable_events=True,
            index_shards=index_shards,
        )
        self.salt = salt
        self.i = 0

    @property
    def shards(self) -> int:
        return int(self.cache.manager.block_pool.shard_mask) + 1

    @property
    def evictions(self) -> int:
        """Cached blocks whose hash this pool has evicted so far (each one reused)."""
        return int(self.cache.manager.block_pool.num_evictions)

    def one(self) -> float:
        self.i += 1
        request_id = f"new-{self.i}"
        tokens = prompt_of(self.i, self.salt)
        data = allocate_request("bench", request_id, tokens, PROMPT_TOKENS, 0, True)
        call = decode_allocate(pb.AllocateRequest.FromString(data.SerializeToString()), "")
        cache = self.cache
        started = time.perf_counter()
        outcome = cache.allocate(
            call.request_id,
            call.tokens,
            call.num_new_tokens,
            call.num_lookahead_tokens,
            call.start or RequestStart(),
            packed_token_ids=call.packed,
        )
        cache.take_events()
        took = (time.perf_counter() - started) * 1e6
        assert outcome.ok, outcome
        cache.free([request_id])
        cache.take_events()
        return took


class VllmAdmissions:
    """vLLM's in-process admission of the same prompts (rpc_bench's ``VllmManager``)."""

    def __init__(self, v: Any, num_blocks: int) -> None:
        import core_bench

        self.cb = core_bench
        self.v = v
        self.manager = core_bench.vllm_manager(v, num_blocks, BLOCK_SIZE, 8192)
        self.hasher = core_bench.vllm_hasher(v, "xxh3_128", BLOCK_SIZE)
        self.i = 0

    def one(self) -> float:
        self.i += 1
        prompt = prompt_of(self.i, 0)
        manager = self.manager
        started = time.perf_counter()
        request = self.cb.vllm_request(self.v, f"new-{self.i}", prompt, self.hasher)
        hits, num_hits, _ = manager.get_computed_blocks(request)
        blocks = manager.allocate_slots(request, len(prompt) - num_hits, num_hits, hits)
        took = (time.perf_counter() - started) * 1e6
        assert blocks is not None
        manager.free(request)
        return took


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: list[float]) -> dict[str, float]:
    return {
        "p50_us": round(statistics.median(samples), 1),
        "p99_us": round(percentile(samples, 0.99), 1),
        "p999_us": round(percentile(samples, 0.999), 1),
        "max_us": round(max(samples), 1),
        "over_1ms": sum(1 for s in samples if s > SLOW_US),
        "n": len(samples),
    }


def run(num_blocks: int, admissions: int, rounds: int) -> dict[str, Any]:
    import core_bench

    kvsvc = {
        "kvsvc": KvsvcAdmissions(num_blocks, None, salt=1),
        "kvsvc, one dict": KvsvcAdmissions(num_blocks, 1, salt=2),
    }
    engines: dict[str, Callable[[], float]] = {name: pool.one for name, pool in kvsvc.items()}
    v = core_bench.load_vllm()
    if v is not None:
        engines["vLLM"] = VllmAdmissions(v, num_blocks).one
    # Fill each pool until it has cycled: every admission after evicts cached blocks.
    fill = num_blocks // ((PROMPT_TOKENS - len(SHARED)) // BLOCK_SIZE) + 10
    samples: dict[str, list[float]] = {name: [] for name in engines}
    with server_gc():
        for one in engines.values():
            for _ in range(fill):
                one()
        cycled = {name: pool.evictions for name, pool in kvsvc.items()}
        per_round = max(1, admissions // rounds)
        for _ in range(rounds):
            for name, one in engines.items():
                samples[name].extend(one() for _ in range(per_round))
    figures: dict[str, Any] = {
        "num_blocks": num_blocks,
        "admissions": per_round * rounds,
        "shards": {name: pool.shards for name, pool in kvsvc.items()},
        "vllm": str(v.version) if v is not None else None,
    }
    for name, values in samples.items():
        figures[name] = summary(values)
    # Blocks whose hash the timed admissions evicted: each of them reused a cached block.
    for name, pool in kvsvc.items():
        figures[name]["evictions"] = pool.evictions - cycled[name]
    if "vLLM" in samples:
        vllm = figures["vLLM"]
        for name in kvsvc:
            mine = figures[name]
            mine["p50_vs_vllm"] = round(mine["p50_us"] / vllm["p50_us"], 3)
            mine["p999_vs_vllm"] = round(mine["p999_us"] / vllm["p999_us"], 3)
            mine["max_vs_vllm"] = round(mine["max_us"] / vllm["max_us"], 3)
    return figures


def render(figures: dict[str, Any]) -> str:
    lines = [
        f"Admissions of new 2048-token prompts on a cycled {figures['num_blocks']:,}-block pool, "
        f"{figures['admissions']:,} timed per engine (microseconds; in this process)",
        f"{'engine':<34}{'p50':>9}{'p99':>9}{'p99.9':>9}{'max':>9}{'> 1 ms':>8}  ratio",
    ]
    for name in ("kvsvc", "kvsvc, one dict", "vLLM"):
        if name not in figures:
            continue
        f = figures[name]
        label = name
        if name in figures["shards"]:
            count = figures["shards"][name]
            label += f" ({count} shard{'s' if count > 1 else ''})"
        if name == "vLLM":
            label = f"vLLM {figures['vllm']} in-process"
        ratio = ""
        if "p50_vs_vllm" in f:
            ratio = (
                f"p50 {f['p50_vs_vllm']:.2f}x vLLM, p99.9 {f['p999_vs_vllm']:.2f}x, "
                f"max {f['max_vs_vllm']:.2f}x"
            )
        lines.append(
            f"{label:<34}{f['p50_us']:>9.1f}{f['p99_us']:>9.1f}{f['p999_us']:>9.1f}"
            f"{f['max_us']:>9.1f}{f['over_1ms']:>8}  {ratio}"
        )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="a small pool, few admissions")
    parser.add_argument("--blocks", type=int, default=DEFAULT_BLOCKS, help="blocks per pool")
    parser.add_argument("--admissions", type=int, default=6000, help="timed admissions per engine")
    args = parser.parse_args()
    figures = run(4096, 300, 3) if args.quick else run(args.blocks, args.admissions, 20)
    print(json.dumps(figures) if args.json else render(figures))
    return 0


if __name__ == "__main__":
    sys.exit(main())
