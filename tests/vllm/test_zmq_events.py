"""`kvsvc serve --kv-events-zmq`: a consumer written for vLLM reads kvsvc's KV events unchanged.

A real `kvsvc serve` with two pools: `main` held by a real CPU worker agent, `hybrid`
(full + sliding-window groups) by a test rank over the Worker API. The engine client stores,
evicts and clears blocks; a ZMQ subscriber decodes every frame with vLLM's own classes
(`vllm.distributed.kv_events`) the way vLLM's consumers do and fills gaps from the replay
socket. Its events must be kvsvc's `WatchEvents` events, hash for hash.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import re
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

zmq = pytest.importorskip("zmq")
msgspec = pytest.importorskip("msgspec")
pytest.importorskip("vllm")
from kvsvc_client import KVCacheClient  # noqa: E402
from kvsvc_client import _types as client_types  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvsvc.cli import main as kvsvc_main  # noqa: E402
from kvsvc.core import events as kv  # noqa: E402
from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports  # noqa: E402
from tests.server.harness import FakeRank, hybrid_specs  # noqa: E402
from tests.vllm.zmq_consumer import replay, subscribe  # noqa: E402

BLOCK = 16  # llama-3.2-1b's block size, and hybrid_specs'
WINDOW = 64
TOPIC = "kvsvc@{pool}"
_EVENTS_LINE = re.compile(
    r"^kvsvc kv events of pool (\S+) on (\S+), replay on (\S+), topic '(.*)'$"
)


# --------------------------------------------------------------------------- consumer


@dataclass
class Consumer:
    """What a consumer of vLLM's events does: SUB, decode, on a sequence gap replay.

    It wants every batch from 0 (an indexer), so a first message after 0 is a gap too.
    """

    ctx: Any
    endpoint: str
    replay_endpoint: str
    topic: str
    decoder: Any = field(default_factory=lambda: msgspec.msgpack.Decoder(type=KVEventBatch))
    payloads: dict[int, bytes] = field(default_factory=dict)
    batches: dict[int, KVEventBatch] = field(default_factory=dict)
    live: list[int] = field(default_factory=list)
    replayed: list[int] = field(default_factory=list)
    next_seq: int = 0

    def __post_init__(self) -> None:
        self.sub = subscribe(self.ctx, self.endpoint, self.topic)

    def _take(self, seq: int, payload: bytes) -> None:
        assert seq == self.next_seq, (seq, self.next_seq)
        self.payloads[seq] = payload
        self.batches[seq] = self.decoder.decode(payload)
        self.next_seq = seq + 1

    def receive_until(self, seq: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while self.next_seq <= seq:
            remaining = deadline - time.monotonic()
            assert remaining > 0, f"batch {seq} did not come (have up to {self.next_seq - 1})"
            if not self.sub.poll(int(remaining * 1000)):
                continue
            topic, seq_bytes, payload = self.sub.recv_multipart()
            assert topic == self.topic.encode()
            got = int.from_bytes(seq_bytes, "big")
            if got > self.next_seq:  # missed some: ask the replay socket, as vLLM's do
                for r_topic, r_seq, r_payload in replay(
                    self.ctx, self.replay_endpoint, self.next_seq
                ):
                    assert r_topic == topic
                    if self.next_seq <= r_seq < got:
                        self._take(r_seq, r_payload)
                        self.replayed.append(r_seq)
            if got == self.next_seq:
                self._take(got, payload)
                self.live.append(got)

    def close(self) -> None:
        self.sub.close(linger=0)


# --------------------------------------------------------------------------- fixtures


@dataclass
class Server:
    address: str
    endpoints: dict[str, tuple[str, str, str]]  # pool -> (pub, replay, topic)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    pytest.importorskip("torch")
    config = tmp_path_factory.mktemp("zmq") / "pools.json"
    config.write_text(
        json.dumps(
            {
                "pools": [
                    # 10 usable blocks: a second prompt of 150 tokens evicts the first's.
                    {"name": "main", "max_model_len": 160, "num_gpu_blocks_override": 11},
                    {"name": "hybrid", "max_model_len": 256, "num_gpu_blocks_override": 64},
                ]
            }
        )
    )
    process = spawn(
        "server",
        [
            "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--config",
            str(config), "--log-level", "WARNING", "--kv-events-zmq", "tcp://*:0",
            "--kv-events-replay", "tcp://*:0", "--kv-events-topic", TOPIC,
        ],
    )  # fmt: skip
    agents: list[Child] = []
    rank: FakeRank | None = None
    try:
        port, _ = wait_for_ports(process)
        endpoints = {}
        for line in list(process.lines):
            match = _EVENTS_LINE.match(line)
            if match:
                endpoints[match.group(1)] = (match.group(2), match.group(3), match.group(4))
        assert set(endpoints) == {"main", "hybrid"}, process.output()
        address = f"127.0.0.1:{port}"
        worker_args = [
            "worker", "--server", address, "--pool", "main", "--rank", "0", "--world-size", "1",
            "--device", "cpu", "--model-config", "llama-3.2-1b", "--kv-cache-memory", "32MiB",
        ]  # fmt: skip
        agents.append(spawn("worker", worker_args))
        rank = FakeRank(address, "hybrid", 0, 1, hybrid_specs(window=WINDOW), 1 << 22)
        rank.register()
        rank.open_stream()
        assert not rank.wait_for_config().error
        rank.report()
        for pool in ("main", "hybrid"):
            with KVCacheClient(address, pool=pool) as client:
                client.wait_until_ready(timeout=60)
        yield Server(address, endpoints)
    finally:
        if rank is not None:
            rank.close()
        stop_all([process, *agents])


@pytest.fixture
def ctx() -> Iterator[Any]:
    context = zmq.Context()
    yield context
    context.destroy(linger=0)


def watch(address: str, pool: str, count: int) -> list[client_types.EventBatch]:
    """The first ``count`` batches of the pool's WatchEvents stream (from sequence 1)."""
    got: list[client_types.EventBatch] = []
    client = KVCacheClient(address, pool=pool)

    def follow() -> None:
        for batch in client.watch_events(from_sequence=1, reconnect=False):
            got.append(batch)
            if len(got) == count:
                return

    thread = threading.Thread(target=follow, daemon=True)
    thread.start()
    thread.join(10)
    client.close()
    assert len(got) == count, f"WatchEvents gave {len(got)} of {count} batches"
    return got


def as_int(block_hash: bytes) -> int:
    """A hash as vLLM publishes it by default (maybe_convert_block_hash)."""
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    converted = maybe_convert_block_hash(BlockHash(block_hash))
    assert isinstance(converted, int)
    return converted


def assert_same_events(zmq_batch: KVEventBatch, kvsvc_batch: client_types.EventBatch) -> None:
    """The ZMQ batch says what the WatchEvents batch says, in vLLM's words: int hashes,
    and one BlockRemoved per hash (vLLM reports evictions block by block)."""
    assert zmq_batch.ts == kvsvc_batch.timestamp
    assert zmq_batch.data_parallel_rank == 0
    theirs_events = iter(zmq_batch.events)
    for ours in kvsvc_batch.events:
        if isinstance(ours, client_types.BlockStored):
            theirs = next(theirs_events)
            assert isinstance(theirs, BlockStored)
            assert theirs.block_hashes == [as_int(h) for h in ours.block_hashes]
            parent = ours.parent_block_hash
            assert theirs.parent_block_hash == (None if parent is None else as_int(parent))
            assert theirs.token_ids == list(ours.token_ids)
            assert theirs.block_size == ours.block_size
            assert theirs.lora_name == (ours.lora_name or None)
            assert theirs.medium == ours.medium
            assert theirs.group_idx == ours.group_index
            assert theirs.kv_cache_spec_kind == ours.group_kind
            assert theirs.extra_keys == [None] * len(ours.block_hashes)
        elif isinstance(ours, client_types.BlockRemoved):
            for block_hash in ours.block_hashes:
                theirs = next(theirs_events)
                assert isinstance(theirs, BlockRemoved)
                assert theirs.block_hashes == [as_int(block_hash)]
                assert theirs.medium == ours.medium
                assert theirs.group_idx == ours.group_index
        else:
            assert isinstance(next(theirs_events), AllBlocksCleared)
    assert next(theirs_events, None) is None, "the ZMQ batch has more events"


# --------------------------------------------------------------------------- end to end


@pytest.mark.e2e
def test_vllm_consumer_reads_stored_removed_cleared(server: Server, ctx: Any) -> None:
    pub, replay_endpoint, topic = server.endpoints["main"]
    assert topic == "kvsvc@main"
    consumer = Consumer(ctx, pub, replay_endpoint, topic)
    first = list(range(1000, 1065))  # 4 full blocks + 1 token
    second = list(range(5000, 5150))  # 9 full blocks + 6: needs all 10 blocks
    with KVCacheClient(server.address, pool="main") as kvc:
        assert kvc.allocate("a", first, num_new_tokens=65, start=True).ok
        kvc.free("a")  # no change to the index: no batch
        assert kvc.allocate("b", second, num_new_tokens=150, start=True).ok
        kvc.free("b")
        assert kvc.reset_prefix_cache()
    consumer.receive_until(2)
    consumer.close()

    # The sequence as vLLM numbers it: 0, 1, 2 on this pool's socket.
    assert sorted(consumer.batches) == [0, 1, 2]
    assert 2 in consumer.live  # the stream itself works, not only the replay
    (stored,), evicted_then_stored, (cleared,) = (b.events for b in consumer.batches.values())
    assert isinstance(stored, BlockStored) and len(stored.block_hashes) == 4
    assert stored.parent_block_hash is None
    assert stored.token_ids == first[:64]
    assert (stored.block_size, stored.medium, stored.lora_id) == (BLOCK, "GPU", None)
    assert (stored.group_idx, stored.kv_cache_spec_kind) == (0, "full_attention")
    assert stored.kv_cache_spec_sliding_window is None
    assert all(isinstance(h, int) and 0 <= h < 1 << 64 for h in stored.block_hashes)
    # The second prompt took every block: the first prompt's cached ones were evicted,
    # each reported on its own as vLLM does.
    *removed, stored_again = evicted_then_stored
    assert all(isinstance(r, BlockRemoved) and len(r.block_hashes) == 1 for r in removed)
    assert sorted(r.block_hashes[0] for r in removed) == sorted(stored.block_hashes)
    assert isinstance(stored_again, BlockStored) and len(stored_again.block_hashes) == 9
    assert stored_again.token_ids == second[:144]
    assert isinstance(cleared, AllBlocksCleared)

    # kvsvc's own stream: batch s is ZMQ batch s - 1, event for event, hash for hash.
    watched = watch(server.address, "main", 3)
    assert [b.sequence for b in watched] == [1, 2, 3]
    for seq, batch in consumer.batches.items():
        assert_same_events(batch, watched[seq])

    # The replay socket serves the recent buffer, byte for byte what was published.
    everything = replay(ctx, replay_endpoint, 0)
    assert [(t, s) for t, s, _ in everything] == [(b"kvsvc@main", s) for s in (0, 1, 2)]
    assert [p for _, _, p in everything] == [consumer.payloads[s] for s in (0, 1, 2)]
    assert [s for _, s, _ in replay(ctx, replay_endpoint, 2)] == [2]
    assert replay(ctx, replay_endpoint, 3) == []  # nothing newer: just the end marker

    # A consumer that joins late sees the next batch live, finds it missed 0..2 and gets
    # them from the replay socket: it ends up with the same stream.
    late = Consumer(ctx, pub, replay_endpoint, topic)
    with KVCacheClient(server.address, pool="main") as kvc:
        assert kvc.allocate("c", list(range(9000, 9033)), num_new_tokens=33, start=True).ok
        kvc.free("c")
    late.receive_until(3)
    late.close()
    assert late.replayed == [0, 1, 2] and late.live == [3]
    assert [late.payloads[s] for s in (0, 1, 2)] == [consumer.payloads[s] for s in (0, 1, 2)]
    (newest,) = late.batches[3].events
    assert isinstance(newest, BlockStored) and len(newest.block_hashes) == 2
    assert_same_events(late.batches[3], watch(server.address, "main", 4)[3])


@pytest.mark.e2e
def test_each_pool_is_its_own_publisher(server: Server, ctx: Any) -> None:
    """A pool's own socket, topic and sequence from 0; groups carry their spec metadata."""
    pub, replay_endpoint, topic = server.endpoints["hybrid"]
    assert topic == "kvsvc@hybrid"
    assert pub != server.endpoints["main"][0]
    consumer = Consumer(ctx, pub, replay_endpoint, topic)
    with KVCacheClient(server.address, pool="hybrid") as kvc:
        assert kvc.allocate("h", list(range(80)), num_new_tokens=80, start=True).ok
        kvc.free("h")
    consumer.receive_until(0)
    consumer.close()
    assert list(consumer.batches) == [0]
    events = consumer.batches[0].events
    assert all(isinstance(e, BlockStored) for e in events)
    by_kind = {e.kv_cache_spec_kind: e for e in events}
    assert set(by_kind) == {"full_attention", "sliding_window"}
    assert by_kind["sliding_window"].kv_cache_spec_sliding_window == WINDOW
    assert by_kind["full_attention"].kv_cache_spec_sliding_window is None
    assert {e.group_idx for e in events} == {0, 1}
    full, window = by_kind["full_attention"], by_kind["sliding_window"]
    assert len(full.block_hashes) == 80 // BLOCK
    # The window's group caches only the blocks a later hit can reach (vLLM's default
    # retention) and reports the step's whole range of tokens, as vLLM does.
    assert 0 < len(window.block_hashes) < len(full.block_hashes)
    assert set(window.block_hashes) < set(full.block_hashes)  # the same chained hashes
    assert window.token_ids == full.token_ids == list(range(80))
    assert_same_events(consumer.batches[0], watch(server.address, "hybrid", 1)[0])


# --------------------------------------------------------------------------- unit level


def test_bytes_are_vllms_bytes() -> None:
    """kvsvc's structs encode exactly as vLLM's own classes do for the same events: extra
    keys untagged per block, removals one hash each, hashes as bytes when asked."""
    from kvsvc.integrations.vllm.events import to_vllm_batch

    h = [bytes([i]) * 16 for i in range(3)]
    lora = ("lora", "ad", "/adapters/ad")
    batch = kv.KVEventBatch(
        seq=7,
        timestamp=1234.5,
        events=[
            kv.BlockStored(h[:2], None, list(range(32)), 16, None, "GPU", 0, "full_attention"),
            kv.BlockStored(
                h[2:], h[1], list(range(16)), 16, "ad", "GPU", 1, "sliding_window",
                [(lora, ("mm", "img0", 3), ("cache_salt", "s"), ("prompt_embeds", b"d"))],
            ),
            kv.BlockRemoved(h[:2], "GPU", 1),
            kv.AllBlocksCleared(),
        ],
    )  # fmt: skip
    theirs = KVEventBatch(
        ts=1234.5,
        data_parallel_rank=0,
        events=[
            BlockStored(
                block_hashes=h[:2], parent_block_hash=None, token_ids=list(range(32)),
                block_size=16, lora_id=None, medium="GPU", lora_name=None,
                extra_keys=[None, None], group_idx=0, kv_cache_spec_kind="full_attention",
            ),
            BlockStored(
                block_hashes=h[2:], parent_block_hash=h[1], token_ids=list(range(16)),
                block_size=16, lora_id=None, medium="GPU", lora_name="ad",
                extra_keys=[("ad", ("img0", 3), "s", b"d")], group_idx=1,
                kv_cache_spec_kind="sliding_window", kv_cache_spec_sliding_window=64,
            ),
            BlockRemoved(block_hashes=h[:1], medium="GPU", group_idx=1),
            BlockRemoved(block_hashes=h[1:2], medium="GPU", group_idx=1),
            AllBlocksCleared(),
        ],
    )  # fmt: skip
    from kvsvc.integrations.vllm.compat import installed_version

    release = "{}.{}".format(*installed_version()[:2])  # the bytes of the vLLM installed
    ours = to_vllm_batch(batch, (None, 64), int_hashes=False, vllm_format=release)
    assert msgspec.msgpack.encode(ours) == msgspec.msgpack.encode(theirs)


def test_int_hashes_are_vllms_int_hashes_and_the_default(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without being asked, hashes go out as vLLM's default sends them (its
    VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES defaults to 1): maybe_convert_block_hash's ints."""
    from vllm import envs
    from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

    from kvsvc.integrations.vllm.events import to_vllm_batch
    from kvsvc.server.config import PoolConfig, ServerConfig

    monkeypatch.delenv("VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES", raising=False)
    assert envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES  # vLLM's own default
    assert ServerConfig(pools=(PoolConfig("p"),)).kv_events_int_hashes
    hashes = [bytes(range(i, i + 16)) for i in (0, 100)] + [hashlib.sha256(b"x").digest()]
    batch = kv.KVEventBatch(
        seq=1,
        timestamp=0.0,
        events=[
            kv.BlockStored(hashes[1:], hashes[0], [1] * 32, 16, None, "GPU", 0, "x"),
            kv.BlockRemoved(hashes[2:], "GPU", 0),
        ],
    )
    stored, removed = to_vllm_batch(batch).events
    # The tag is what reaches the wire; the default format is the newest release's struct.
    assert [type(e).__struct_config__.tag for e in (stored, removed)] == [
        "BlockStored",
        "BlockRemoved",
    ]
    assert stored.block_hashes == [maybe_convert_block_hash(BlockHash(h)) for h in hashes[1:]]
    assert stored.parent_block_hash == maybe_convert_block_hash(BlockHash(hashes[0]))
    assert removed.block_hashes == [maybe_convert_block_hash(BlockHash(hashes[2]))]
    assert all(isinstance(h, int) for h in [*stored.block_hashes, stored.parent_block_hash])


def test_a_full_queue_drops_the_oldest_and_the_gap_shows(ctx: Any) -> None:
    from kvsvc.integrations.vllm.events import ZmqEventPublisher as Publisher
    from kvsvc.server.kv_events_targets import KVEventsTarget

    target = KVEventsTarget("p", "inproc://pub", "inproc://replay", "t")
    publisher = Publisher(target, max_queue=2, context=ctx)
    for seq in range(1, 6):  # nobody consumes yet: 1, 2, 3 are pushed out
        publisher.submit(kv.KVEventBatch(seq=seq, timestamp=0.0, events=[kv.AllBlocksCleared()]))
    assert publisher.num_dropped_batches == 3
    publisher.start()
    try:
        deadline = time.monotonic() + 5
        while publisher.num_published_batches < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert [s for _, s, _ in replay(ctx, "inproc://replay", 0)] == [3, 4]
    finally:
        publisher.close()


def run_serve(*flags: str) -> int:
    return kvsvc_main(["serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", *flags])


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-events-replay", "tcp://*:5558"], "kv_events_replay set without kv_events_zmq"),
        (["--kv-events-topic", "kv"], "kv_events_topic set without kv_events_zmq"),
        (["--kv-events-zmq", "http://host:5557"], "expected a ZMQ endpoint"),
        (["--kv-events-zmq", "tcp://*:port"], "expected tcp://HOST:PORT"),
        (["--kv-events-zmq", "tcp://10.0.0.1:0"], "needs a real port"),
        (["--kv-events-zmq", "tcp://*:5557", "--kv-events-buffer", "0"], "kv_events_buffer"),
    ],
)
def test_bad_flags_exit_2_and_say_why(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert run_serve("--pool", "p", "--max-model-len", "64", *flags) == 2
    assert message in capsys.readouterr().err


def test_config_file_keys_and_the_endpoint_of_each_pool(tmp_path: Path) -> None:
    from kvsvc.cli import build_parser
    from kvsvc.commands.serve import build_config
    from kvsvc.server.kv_events_targets import KVEventsTarget, kv_events_targets

    config = tmp_path / "pools.json"
    config.write_text(
        json.dumps(
            {
                "kv_events_zmq": "tcp://*:5557",
                "kv_events_replay": "tcp://*:5600",
                "kv_events_topic": "kv@n1@{pool}",
                "kv_events_buffer_steps": 50,
                "kv_events_max_queue": 7,
                "kv_events_int_hashes": False,
                "pools": [{"name": "a"}, {"name": "b"}],
            }
        )
    )
    args = build_parser().parse_args(["serve", "--config", str(config), "--pool", "c"])
    server = build_config(args)
    assert (server.kv_events_buffer_steps, server.kv_events_max_queue) == (50, 7)
    assert not server.kv_events_int_hashes  # the file turns vLLM's default off
    args = build_parser().parse_args(["serve", "--config", str(config), "--kv-events-int-hashes"])
    assert build_config(args).kv_events_int_hashes  # the flag wins over the file
    args = build_parser().parse_args(
        ["serve", "--pool", "p", "--kv-events-zmq", "tcp://*:5557", "--no-kv-events-int-hashes"]
    )
    assert not build_config(args).kv_events_int_hashes
    assert kv_events_targets(server) == [
        KVEventsTarget("a", "tcp://*:5557", "tcp://*:5600", "kv@n1@a"),
        KVEventsTarget("b", "tcp://*:5558", "tcp://*:5601", "kv@n1@b"),
        KVEventsTarget("c", "tcp://*:5559", "tcp://*:5602", "kv@n1@c"),  # the flag's pool last
    ]
    # Flags win over the file; ipc paths get the pool's name, the first pool keeps its own.
    args = build_parser().parse_args(
        ["serve", "--config", str(config), "--kv-events-zmq", "ipc:///run/kv",
         "--kv-events-replay", "ipc:///run/kv-replay", "--kv-events-topic", ""]
    )  # fmt: skip
    assert [
        (t.endpoint, t.replay_endpoint, t.topic) for t in kv_events_targets(build_config(args))
    ] == [
        ("ipc:///run/kv", "ipc:///run/kv-replay", ""),
        ("ipc:///run/kv_b", "ipc:///run/kv-replay_b", ""),
    ]


def test_pools_whose_ports_collide_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "pools.toml"
    config.write_text('[[pools]]\nname = "a"\n[[pools]]\nname = "b"\n')
    flags = ["--kv-events-zmq", "tcp://*:5557", "--kv-events-replay", "tcp://*:5558"]
    assert run_serve("--config", str(config), *flags) == 2
    err = capsys.readouterr().err
    assert "kv_events_zmq of pool 'b' (tcp://*:5558) collides with kv_events_replay" in err


def test_a_port_in_use_fails_the_start(ctx: Any) -> None:
    from kvsvc.commands.serve import create_server
    from kvsvc.server.config import PoolConfig, ServerConfig

    blocker = ctx.socket(zmq.PUB)
    port = blocker.bind_to_random_port("tcp://*")
    config = ServerConfig(
        pools=(PoolConfig("a"), PoolConfig("b")),
        listen="127.0.0.1:0",
        metrics_listen=None,
        kv_events_zmq=f"tcp://*:{port - 1}",  # pool b's port is taken
    )
    # Tried with the server's other addresses before anything starts (a ListenError).
    with pytest.raises(
        OSError, match=f"cannot listen on tcp://\\*:{port} \\(KV events of pool b\\)"
    ):
        asyncio.run(create_server(config))
    blocker.close(linger=0)


def test_missing_pyzmq_says_install_the_extra(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "zmq", None)  # import zmq now raises ImportError
    monkeypatch.delitem(sys.modules, "kvsvc.integrations.vllm.events", raising=False)
    assert run_serve("--pool", "p", "--kv-events-zmq", "tcp://*:5557") == 2
    err = capsys.readouterr().err
    assert "pyzmq and msgspec" in err and "kvsvc[vllm]" in err and "zmq is missing" in err

    from kvsvc.commands.serve import build_server
    from kvsvc.server.config import PoolConfig, ServerConfig

    config = ServerConfig(pools=(PoolConfig("p"),), metrics_listen=None, kv_events_zmq="tcp://*:1")
    with pytest.raises(ImportError, match=r"kvsvc\[vllm\]"):
        build_server(config)


def test_the_server_imports_and_runs_without_pyzmq_or_msgspec() -> None:
    """Only the feature needs the extra: a server without it never imports zmq."""
    code = (
        "import sys; sys.modules['zmq'] = None; sys.modules['msgspec'] = None\n"
        "from kvsvc.commands.serve import build_config, build_server\n"
        "from kvsvc.server.config import PoolConfig, ServerConfig\n"
        "server = build_server(ServerConfig(pools=(PoolConfig('p'),), metrics_listen=None))\n"
        "assert not server.event_sinks\n"
        "assert 'kvsvc.integrations.vllm.events' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
