"""Where the server's handler time goes: Allocate's and Step's stages, in this process.

rpc_bench reads the server's mean time in each handler from its ``/metrics``; this says
what that time is made of. The server's own functions run here, in the stages a handler
runs them, on a core pool of the bench's shape (one full-attention group, block size 16,
xxh3_128), with the requests the Python client writes:

- ``decode``: the request's bytes to what the core is called with (the parser the
  transports use, then the handler's decoding: ``decode_allocate``, ``decode_step``);
  for Step also the same through a protobuf message (``decode_pb``), the path before the
  raw codec (kvsvc.server.step_codec);
- ``hash``: hashing the prompt's blocks (the pool's hasher on the packed prompt, as an
  admission hashes them: ``core`` below counts it, ``core_less_hash`` does not);
- ``core``: the pool's work (``PoolKVCache.allocate``; ``apply_step``);
- ``reply``: the reply's bytes (Step: written from the columns, ``StepResults.to_bytes``;
  ``reply_pb``: through a protobuf message, as before);
- ``core_cold``: ``core`` again, in a second run of the same calls where each call comes
  after ``EVICT_BYTES`` of other memory traffic. Run back to back the core finds its data
  in the CPU's caches; in a server, between two calls, the client, the transport and the
  machine's other work have evicted much of it. On this 2-core VM (2 MiB of L2 a core) the
  server's own timing of a 256-decode Step's pool work (``kvsvc_handler_stage_seconds``)
  read ~170 us against ~110 us back to back here; 2 MiB written before each call gave
  ~165 us, and even a 2 ms pause spent spinning (no memory traffic of this process)
  ~140 us: the rest of the machine evicts it too.

Each stage's samples give p50 and p99; ``gc`` counts the collections that ran during the
timed calls (``gc.callbacks``) and how many of the samples above twice their call's p50
overlapped one: what part of the tail is the collector's.
"""

from __future__ import annotations

import contextlib
import gc
import statistics
import time
from collections.abc import Iterator
from typing import Any

from kvsvc_client._wire import StepBuilder, allocate_request

from kvsvc.commands.serve import GC_THRESHOLDS
from kvsvc.core import PoolKVCache
from kvsvc.server.app import freeze_long_lived
from kvsvc.server.calls import decode_allocate, decode_step
from kvsvc.server.step import apply_step
from kvsvc.server.step_codec import parse_step_request
from kvsvc.server.wire import allocate_response
from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvsvc.v1 import kvcache_pb2 as pb

STATUS_NO_SPACE = pb.ALLOCATE_STATUS_NO_SPACE

BLOCK_SIZE = 16
# The admissions' pool: small enough that they fill it soon, so that each one evicts the
# cached blocks of earlier ones (index removals and their events), as in a server that has
# run a while. The Steps' pool is sized by their count instead (``_step_pool_blocks``).
NUM_BLOCKS = 4096
WARMUP = 100
MAX_MODEL_LEN = 8192
BATCH = 256
# Written before each call of the ``core_cold`` runs: twice this VM's L2 of a core.
EVICT_BYTES = 4 << 20


class _Evictor:
    """Evicts the CPU's caches (of this core, mostly) by copying ``EVICT_BYTES``."""

    def __init__(self, size: int) -> None:
        self._source = bytes(range(256)) * (size // 256)
        self._target = bytearray(len(self._source))

    def __call__(self) -> None:
        if self._source:
            self._target[:] = self._source


class GcWatch:
    """Counts the garbage collections (all generations) and their time, from
    ``gc.callbacks``, while it is installed."""

    def __init__(self) -> None:
        self.count = 0
        self.seconds = 0.0
        self._started = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.count += 1
            self.seconds += time.perf_counter() - self._started

    def __enter__(self) -> GcWatch:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._callback)


@contextlib.contextmanager
def server_gc() -> Iterator[None]:
    """The collector as ``kvsvc serve`` runs it, for the block: its thresholds, and what
    is alive now (the pool just built) frozen out of collections, as the server freezes
    its planned pools. With this process's defaults a young collection ran every few
    Steps and an old one walked the whole pool, a sample of up to 14 ms the server never
    has. Restored after (rpc_bench measures its client in this process)."""
    before = gc.get_threshold()
    gc.set_threshold(*GC_THRESHOLDS)
    freeze_long_lived()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


class _Counters:
    """Where apply_step counts outcomes (the server's metrics; nothing here)."""

    allocate_ok = allocate_no_space = preempt_requests = free_requests = freed_blocks = 0


def _cache(num_blocks: int = NUM_BLOCKS) -> PoolKVCache:
    spec = FullAttentionSpec(block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype="float16")
    config = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)]
    )
    return PoolKVCache(
        config, max_model_len=MAX_MODEL_LEN, hash_algo="xxh3_128", enable_events=True
    )


class _Stages:
    """Samples (microseconds) per stage: ``mark(name)`` ends the stage begun at the last
    mark (or at ``start``)."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = {}
        self._last = 0.0

    def start(self) -> None:
        self._last = time.perf_counter()

    def mark(self, name: str) -> None:
        now = time.perf_counter()
        self.samples.setdefault(name, []).append((now - self._last) * 1e6)
        self._last = now


def _admission_prompt(i: int) -> list[int]:
    """rpc_bench's admission: a shared 1024-token half, then 1024 tokens of its own."""
    return list(range(1, 1025)) + [(i * 7919 + j) % 30000 + 1 for j in range(1024)]


def allocate_stages(
    n: int, evict_bytes: int = 0
) -> tuple[dict[str, list[float]], list[float], int]:
    """``n`` new 2048-token admissions (each freed after, untimed), after ``WARMUP``
    untimed ones: the samples of each stage, of the handler's whole work, and the
    collections that ran. With ``evict_bytes``, that much memory is written before each
    call (untimed)."""
    cache = _cache()
    hasher = cache.manager.hasher
    evict = _Evictor(evict_bytes)
    stages = _Stages()
    whole: list[float] = []
    with server_gc(), GcWatch() as watch:
        for i in range(-WARMUP, n):
            data = allocate_request(
                "bench", f"new-{i}", _admission_prompt(i), 2048, 0, True
            ).SerializeToString()
            evict()
            started = time.perf_counter()
            stages.start()
            call = decode_allocate(pb.AllocateRequest.FromString(data), "")
            stages.mark("decode")
            outcome = cache.allocate(
                call.request_id,
                call.tokens,
                call.num_new_tokens,
                call.num_lookahead_tokens,
                call.start,
                packed_token_ids=call.packed,
            )
            stages.mark("core")
            allocate_response(outcome).SerializeToString()
            stages.mark("reply")
            whole.append((time.perf_counter() - started) * 1e6)
            assert outcome.ok, outcome
            # The same prompt's hashing alone (the core's share above that is hashing).
            stages.start()
            hasher.hash_blocks(
                call.tokens, 0, len(call.tokens) // BLOCK_SIZE, None, None, call.packed
            )
            stages.mark("hash")
            cache.free([call.request_id])
            if i < 0:
                stages.samples.clear()
                whole.clear()
                watch.count = 0
    return stages.samples, whole, watch.count


def _step_pool_blocks(n: int) -> int:
    """Blocks enough for ``BATCH`` requests of up to 79 prompt tokens to grow by ``n``
    tokens each (and the null block): no decode of the measured Steps runs out."""
    return BATCH * (-(-(79 + n) // BLOCK_SIZE) + 1) + 1


def step_stages(n: int, evict_bytes: int = 0) -> tuple[dict[str, list[float]], list[float], int]:
    """``n`` Steps of one decode token for each of 256 running requests (prompts of
    64..79 tokens, as rpc_bench's): the samples of each stage, of the handler's whole
    work, and the collections that ran.

    Every decode must get its slot: one answered NO_SPACE skips the append, the hashing
    and the caching that the server does for each (an earlier pool of 4,096 blocks ran
    out after ~150 Steps, and the figure read about half the work), so one fails the
    bench. With ``evict_bytes``, that much memory is written before each Step (untimed)."""
    cache = _cache(_step_pool_blocks(n))
    evict = _Evictor(evict_bytes)
    admit = StepBuilder("bench")
    for r in range(BATCH):
        length = 64 + r % 16
        prompt = [(r * 31 + j) % 30000 + 1 for j in range(length)]
        admit.allocate(f"dec-{r}", prompt, length, start=True)
    apply_step(cache, decode_step(admit.to_pb(), "", 1 << 20), _Counters())
    stages = _Stages()
    whole: list[float] = []
    with server_gc(), GcWatch() as watch:
        for it in range(n):
            step = StepBuilder("bench")
            for r in range(BATCH):
                step.allocate(f"dec-{r}", [it % 30000 + 1], 1)
            data = step.to_pb().SerializeToString()
            # The path before the raw codec, for comparison (not part of the handler).
            stages.start()
            decode_step(pb.StepRequest.FromString(data), "", 1 << 20)
            stages.mark("decode_pb")
            evict()
            started = time.perf_counter()
            stages.start()
            columns = decode_step(parse_step_request(data), "", 1 << 20)
            stages.mark("decode")
            results = apply_step(cache, columns, _Counters())
            stages.mark("core")
            data = results.to_bytes()
            stages.mark("reply")
            whole.append((time.perf_counter() - started) * 1e6)
            assert data is not None and len(results.statuses) == BATCH
            if STATUS_NO_SPACE in results.statuses:
                raise RuntimeError(
                    f"Step {it}: {results.statuses.count(STATUS_NO_SPACE)} decodes got "
                    "NO_SPACE: the pool is too small for the Steps measured"
                )
            # The reply through a protobuf message, as before the direct encoding.
            stages.start()
            results.to_pb().SerializeToString()
            stages.mark("reply_pb")
    return stages.samples, whole, watch.count


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def summary(samples: list[float]) -> tuple[float, float]:
    return statistics.median(samples), percentile(samples, 0.99)


def split_figures(allocations: int = 400, steps: int = 400) -> dict[str, float]:
    """The stages' p50 and p99 (microseconds) as rpc_bench's figures."""
    figures: dict[str, float] = {}
    for call, (stages, whole, collections) in (
        ("allocate_new", allocate_stages(allocations)),
        ("step256", step_stages(steps)),
    ):
        for stage, samples in {**stages, "handler": whole}.items():
            p50, p99 = summary(samples)
            figures[f"{call}_split_{stage}_p50_us"] = round(p50, 1)
            figures[f"{call}_split_{stage}_p99_us"] = round(p99, 1)
        figures[f"{call}_split_gc_collections"] = collections
    # The pool's work again with its caches cold (see the module's docstring).
    for call, (stages, _, _) in (
        ("allocate_new", allocate_stages(allocations, EVICT_BYTES)),
        ("step256", step_stages(steps, EVICT_BYTES)),
    ):
        p50, p99 = summary(stages["core"])
        figures[f"{call}_split_core_cold_p50_us"] = round(p50, 1)
        figures[f"{call}_split_core_cold_p99_us"] = round(p99, 1)
    figures["allocate_new_split_core_less_hash_p50_us"] = round(
        figures["allocate_new_split_core_p50_us"] - figures["allocate_new_split_hash_p50_us"], 1
    )
    return figures


if __name__ == "__main__":
    for key, value in split_figures().items():
        print(f"{key:48} {value}")
