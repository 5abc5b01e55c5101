"""kvsvc's vLLM-format KV event stream against stock vLLM 0.32's own, for the same workload.

Stock vLLM runs a tiny dense Llama and a tiny hybrid Gemma 3 (two 64-token sliding-window
layers, two full-attention layers: a sliding-window and a full-attention KV cache group)
on the CPU with its own ZMQ publisher (``kv_events_config``), and answers four prompts one
at a time: a prompt, one that shares its first three blocks, a long one that evicts, the
first again; then its prefix cache is reset. A consumer written for vLLM reads each
stream with vLLM's own classes.

- ``test_kvsvc_pool_streams_what_stock_vllm_streams``: a ``kvsvc serve --kv-events-zmq``
  pool planned from the engine's own layer specs (a test rank registers what vLLM's
  worker reported, converted as kvsvc's worker converts them) and its block count is
  driven through the engine API with the operations vLLM's scheduler made: admission of
  the whole prompt, one Allocate per decode step with the token stock vLLM sampled, Free
  at the end, then a reset. kvsvc's stream must be stock vLLM's, event for event and
  field for field (hashes as 64-bit ints, vLLM's default, group index, kind and sliding
  window of every group), and its cache hits stock vLLM's.
- ``test_vllm_on_kvsvc_streams_what_stock_vllm_streams``: vLLM itself on kvsvc, the same
  prompts, the stream of kvsvc's publisher. It runs for the dense model; for the hybrid
  one it is skipped while kvsvc's vLLM scheduler refuses models with more than one KV
  cache group, and runs as soon as that refusal is gone.

Both engines run with vLLM's defaults, so the sliding-window group caches only the blocks
a later hit can reach (``prefix_cache_retention_interval=0``), and a step whose blocks
were all skipped is still reported, without hashes, as vLLM reports it.

Batches are compared as one stream of events: vLLM sends one batch per engine step, kvsvc
one per engine call that changed the index, and their timestamps are their own.
"""

from __future__ import annotations

import contextlib
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kvsvc_client import HashingContext, RequestStart

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
pytest.importorskip("vllm")
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvsvc.integrations.vllm import vllm_kwargs  # noqa: E402
from kvsvc.integrations.vllm.manager import KvsvcError  # noqa: E402
from tests.server.harness import FakeRank  # noqa: E402
from tests.vllm.helpers import (  # noqa: E402
    KV_CACHE_BYTES,
    POOL,
    cleanup_after_failed_start,
    driver_worker,
    engine_core,
    kvsvc_server,
    make_llm,
    release_llm,
)
from tests.vllm.models import write_model  # noqa: E402
from tests.vllm.zmq_consumer import subscribe  # noqa: E402

pytestmark = pytest.mark.e2e

MAX_MODEL_LEN = 320
MAX_TOKENS = 12  # the first prompt's decode steps complete a block
# Blocks (null included): the long prompt needs 10 per group, so it evicts what the first
# prompts cached.
NUM_BLOCKS = {"dense": 16, "hybrid": 24}
MODELS = {"dense": "llama", "hybrid": "gemma3"}  # tests.vllm.models' names
# What kvsvc's vLLM scheduler says when it refuses a model (kvsvc.integrations.vllm).
REFUSAL = "serves models with one full-attention KV cache group"


def make_prompts() -> list[tuple[list[int], str | None]]:
    """(prompt, cache salt) each."""
    rng = random.Random(21)
    first = [rng.randrange(3, 8192) for _ in range(150)]
    sharing = first[:100] + [7] * 30  # three full blocks in common
    long = [rng.randrange(3, 8192) for _ in range(300)]
    # The repeat hits what the first cached; the salted one's first block carries the
    # salt as its extra key.
    return [
        (first, None), (first, None), (sharing, None), (long, None), (first, None),
        (sharing, "tenant-a"),
    ]  # fmt: skip


def stock_args(model: str) -> dict[str, Any]:
    return {
        "max_model_len": MAX_MODEL_LEN,
        "num_gpu_blocks_override": NUM_BLOCKS[model],
        "prefix_caching_hash_algo": "sha256_cbor",
    }


@dataclass
class Stream:
    """A ZMQ PUB stream read from its first batch: the events of every batch, in order."""

    sub: Any
    decoder: Any = field(default_factory=lambda: msgspec.msgpack.Decoder(type=KVEventBatch))
    events: list[Any] = field(default_factory=list)
    next_seq: int = 0

    def read_until_cleared(self, clears: int = 1, timeout: float = 20.0) -> list[Any]:
        """Every event up to the ``clears``-th AllBlocksCleared (the workload's last)."""
        deadline = time.monotonic() + timeout
        while sum(isinstance(e, AllBlocksCleared) for e in self.events) < clears:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"not {clears} AllBlocksCleared within {timeout} s"
            if not self.sub.poll(int(remaining * 1000)):
                continue
            _, seq, payload = self.sub.recv_multipart()
            assert int.from_bytes(seq, "big") == self.next_seq, "a batch is missing"
            self.next_seq += 1
            batch = self.decoder.decode(payload)
            assert batch.data_parallel_rank == 0
            self.events.extend(batch.events)
        self.sub.close(linger=0)
        return self.events


@dataclass
class Workload:
    """What stock vLLM did: its stream, and per prompt the tokens and cached tokens."""

    events: list[Any]
    tokens: list[list[int]]
    cached: list[int]
    specs: dict[str, Any]  # the engine's layer specs, as kvsvc's worker would register them
    groups: list[str]  # the engine's KV cache groups' spec classes


@pytest.fixture
def ctx() -> Iterator[Any]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def run_workload(llm: Any, stream: Stream, clears: int = 1) -> tuple[list[list[int]], list[int]]:
    """The prompts one at a time, then a prefix-cache reset (vLLM publishes what a step's
    scheduling drained, so a request too short to fill a block carries the reset out)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, detokenize=False, ignore_eos=True)
    tokens, cached = [], []
    for prompt, salt in make_prompts():
        tokens_prompt = TokensPrompt(prompt_token_ids=prompt)
        if salt is not None:
            tokens_prompt["cache_salt"] = salt
        (out,) = llm.generate([tokens_prompt], params, use_tqdm=False)
        tokens.append(list(out.outputs[0].token_ids))
        cached.append(out.num_cached_tokens)
    assert llm.reset_prefix_cache()
    llm.generate([TokensPrompt(prompt_token_ids=[5, 6])], params, use_tqdm=False)
    stream.read_until_cleared(clears)
    return tokens, cached


@pytest.fixture(scope="module", params=list(MODELS))
def stock(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Workload:
    from vllm.config import KVEventsConfig

    from kvsvc.integrations.vllm.specs import kvsvc_specs_from_vllm

    model = request.param
    directory = tmp_path_factory.mktemp(model)
    endpoint = f"ipc://{directory}/stock-events"
    context = zmq.Context()
    llm = make_llm(
        write_model(MODELS[model], directory / "model"),
        kv_events_config=KVEventsConfig(
            enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint
        ),
        **stock_args(model),
    )
    try:
        stream = Stream(subscribe(context, endpoint))
        tokens, cached = run_workload(llm, stream)
        config = engine_core(llm).scheduler.kv_cache_manager.kv_cache_config
        groups = [type(g.kv_cache_spec).__name__ for g in config.kv_cache_groups]
        specs = kvsvc_specs_from_vllm(driver_worker(llm).get_kv_cache_spec())
        return Workload(stream.events, tokens, cached, specs, groups)
    finally:
        release_llm(llm)
        context.destroy(linger=0)


def as_fields(event: Any) -> dict[str, Any]:
    return {"type": type(event).__name__, **msgspec.structs.asdict(event)}


def assert_same_stream(ours: list[Any], theirs: list[Any]) -> None:
    """Event for event, every field (the first difference is named)."""
    for i, (mine, stock) in enumerate(zip(ours, theirs, strict=False)):
        assert as_fields(mine) == as_fields(stock), f"event {i} differs"
    assert len(ours) == len(theirs), f"{len(ours)} events, stock vLLM sent {len(theirs)}"


def test_the_workload_stores_evicts_and_hits(stock: Workload) -> None:
    """The comparison is worth something: every group stores and evicts, and a prompt hits."""
    assert len(stock.groups) == (2 if "SlidingWindowSpec" in stock.groups else 1)
    for group in range(len(stock.groups)):
        assert any(isinstance(e, BlockStored) and e.group_idx == group for e in stock.events)
        assert any(isinstance(e, BlockRemoved) and e.group_idx == group for e in stock.events)
    assert any(stock.cached)
    stored = [e for e in stock.events if isinstance(e, BlockStored)]
    salted = [e.extra_keys for e in stored if e.extra_keys and e.extra_keys[0]]
    assert salted and all(keys[0] == ("tenant-a",) for keys in salted)
    assert all(isinstance(h, int) for e in stored for h in e.block_hashes)  # vLLM's default
    if len(stock.groups) == 2:
        windows = {e.kv_cache_spec_kind: e.kv_cache_spec_sliding_window for e in stored}
        assert windows == {"sliding_window": 64, "full_attention": None}


def test_kvsvc_pool_streams_what_stock_vllm_streams(
    stock: Workload, ctx: Any, tmp_path: Path
) -> None:
    endpoint = f"ipc://{tmp_path}/kvsvc-events"
    blocks = str(NUM_BLOCKS["hybrid" if len(stock.groups) == 2 else "dense"])
    with kvsvc_server(
        "--hash-algo", "sha256_cbor", "--num-gpu-blocks-override", blocks,
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-events-zmq", endpoint,
    ) as server:  # fmt: skip
        rank = FakeRank(server.address, POOL, 0, 1, stock.specs, KV_CACHE_BYTES)
        try:
            rank.register()
            rank.open_stream()
            assert not rank.wait_for_config().error
            rank.report()
            with server.client() as kvc:
                kvc.wait_until_ready(timeout=60)
                stream = Stream(subscribe(ctx, endpoint))
                cached = []
                for n, ((prompt, salt), tokens) in enumerate(
                    zip(make_prompts(), stock.tokens, strict=True)
                ):
                    request_id = f"r{n}"
                    start = RequestStart(HashingContext(cache_salt=salt) if salt else None)
                    admitted = kvc.allocate(request_id, prompt, len(prompt), start=start)
                    assert admitted.ok and admitted.num_scheduled_tokens > 0
                    cached.append(admitted.num_cached_tokens)
                    # Each decode step computes the token sampled last; the last sampled
                    # token finishes the request before it is computed.
                    for token in tokens[:-1]:
                        assert kvc.allocate(request_id, [token], 1).ok
                    kvc.free(request_id)
                assert kvc.reset_prefix_cache()
                events = stream.read_until_cleared()
        finally:
            rank.close()
    assert cached == stock.cached
    assert_same_stream(events, stock.events)


def test_vllm_on_kvsvc_streams_what_stock_vllm_streams(
    stock: Workload, ctx: Any, tmp_path: Path
) -> None:
    model = "hybrid" if len(stock.groups) == 2 else "dense"
    endpoint = f"ipc://{tmp_path}/kvsvc-events"
    with kvsvc_server(
        "--hash-algo", "sha256_cbor", "--num-gpu-blocks-override", str(NUM_BLOCKS[model]),
        "--max-model-len", str(MAX_MODEL_LEN), "--kv-events-zmq", endpoint,
    ) as server:  # fmt: skip
        model_dir = write_model(MODELS[model], tmp_path / "model")
        stream = Stream(subscribe(ctx, endpoint))
        try:
            llm = make_llm(model_dir, **stock_args(model), **vllm_kwargs(server.address, POOL))
        except KvsvcError as exc:
            if REFUSAL not in str(exc):
                raise
            cleanup_after_failed_start()
            pytest.skip(f"kvsvc's vLLM scheduler refuses this model for now: {exc}")
        try:
            # kvsvc's adapter clears the pool's index when an engine starts (its fresh
            # tensors hold nothing of what was cached); stock vLLM starts empty silently.
            tokens, cached = run_workload(llm, stream, clears=2)
        finally:
            with contextlib.suppress(Exception):
                release_llm(llm)
    assert (tokens, cached) == (stock.tokens, stock.cached)
    startup, *events = stream.events
    assert isinstance(startup, AllBlocksCleared)
    assert_same_stream(events, stock.events)
