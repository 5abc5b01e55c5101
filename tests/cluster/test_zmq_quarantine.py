"""A ZMQ source that sends what the index cannot hold is quarantined, and Score goes on
for the others (issue 22, item 7), with a real redis-server, a real `kvsvc indexer` and
two real ZMQ publishers (vLLM's wire format): a healthy one and one whose BlockStored
claims a block size of 0, -16 or 2^62, a negative int block hash (msgpack carries none
over 64 bits), or a negative sliding window.

Before: the bad source's block size went into the index as it came, and every Score failed
after it, for every engine (INVALID_ARGUMENT blaming the caller, or UNKNOWN with an
OverflowError). Now the source is dropped from the index, logged once, counted
(``kvsvc_indexer_quarantines_total``), and the healthy engine is scored as before.
"""

from __future__ import annotations

import re
import threading
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsvc.demo.processes import Child, spawn
from tests.cluster.redis_procs import RedisServer, free_port, require_redis_package
from tests.tooling import missing, wait_for

require_redis_package()
try:
    import msgspec
    import zmq
except ImportError:
    missing("pyzmq and msgspec", "pip install -e '.[cluster]' (make venv installs them)")
pytestmark = pytest.mark.e2e

SEED = "the-quarantine-test-seed-0123456"
BLOCK_SIZE = 16
PROMPT = [*range(100, 100 + 4 * BLOCK_SIZE), 7]  # four full blocks, one token more


def batch_storing_the_prompt(block_size: int) -> bytes:
    """A KVEventBatch (msgpack) storing PROMPT's blocks, claiming ``block_size``."""
    from kvsvc.cluster.hashing import PromptHasher
    from kvsvc.integrations.vllm.events import BlockStored, KVEventBatch

    hashes = PromptHasher("xxh3_128", SEED).block_hashes(PROMPT, BLOCK_SIZE, BLOCK_SIZE)
    stored = BlockStored(
        block_hashes=hashes,
        parent_block_hash=None,
        token_ids=PROMPT[: len(hashes) * BLOCK_SIZE],
        block_size=block_size,
        lora_id=None,
        medium="GPU",
        lora_name=None,
    )
    return msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[stored]))  # type: ignore[no-any-return]


class Publisher:
    """A PUB socket sending one KVEventBatch over and over (a SUB that connects late
    misses what was sent before: the follower starts at whatever it gets first)."""

    def __init__(
        self, block_size: int, int_hashes: list[int] | None = None, window: int | None = None
    ) -> None:
        from kvsvc.cluster.hashing import PromptHasher
        from kvsvc.integrations.vllm.events import BlockStored, KVEventBatch

        hashes = PromptHasher("xxh3_128", SEED).block_hashes(PROMPT, BLOCK_SIZE, BLOCK_SIZE)
        stored = BlockStored(
            block_hashes=int_hashes if int_hashes is not None else hashes,
            parent_block_hash=None,
            token_ids=PROMPT[: len(hashes) * BLOCK_SIZE],
            block_size=block_size,
            lora_id=None,
            medium="GPU",
            lora_name=None,
            kv_cache_spec_kind="sliding_window" if window is not None else None,
            kv_cache_spec_sliding_window=window,
        )
        self.payload = msgspec.msgpack.encode(KVEventBatch(ts=time.time(), events=[stored]))
        self.port = free_port()
        self.endpoint = f"tcp://127.0.0.1:{self.port}"
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.bind(f"tcp://127.0.0.1:{self.port}")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        seq = 0
        while not self._stop.wait(0.05):
            self._socket.send_multipart([b"", seq.to_bytes(8, "big"), self.payload])
            seq += 1

    def __enter__(self) -> Publisher:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)
        self._socket.close(0)


@pytest.fixture()
def redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    server.start()
    try:
        yield server
    finally:
        server.stop()


def quarantines(metrics_port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=5) as reply:
        text = reply.read().decode()
    match = re.search(r"^kvsvc_indexer_quarantines_total (\S+)$", text, re.M)
    assert match, "no kvsvc_indexer_quarantines_total"
    return float(match.group(1))


# What a bad source sends (block size, int hashes, sliding window) and how its one
# quarantine line names it. Issue 32 item 9: a negative int hash made an OverflowError
# traceback about once a second and no quarantine; a window of -64 was taken silently.
BAD_SOURCES = {
    "block-size-0": ((0, None, None), "block_size 0"),
    "block-size-negative": ((-16, None, None), "block_size -16"),
    "block-size-huge": ((2**62, None, None), f"block_size {2**62}"),
    "negative-int-hash": ((BLOCK_SIZE, [5, -1, 7, 9], None), "an int block hash -1"),
    "negative-window": ((BLOCK_SIZE, None, -64), "kv_cache_spec_sliding_window -64"),
}


@pytest.mark.parametrize("bad_source", list(BAD_SOURCES))
def test_a_source_that_sends_what_the_index_cannot_hold_is_quarantined_and_the_others_scored(
    redis: RedisServer, bad_source: str
) -> None:
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import connect

    (bad_block_size, int_hashes, window), named = BAD_SOURCES[bad_source]
    with (
        Publisher(BLOCK_SIZE) as healthy,
        Publisher(bad_block_size, int_hashes, window) as bad,
    ):
        indexer: Child = spawn("indexer", [
            "indexer", "--redis", redis.url, "--metrics-listen", "127.0.0.1:0",
            "--zmq-source", healthy.endpoint, "--zmq-source", bad.endpoint,
            "--zmq-hash-algo", "xxh3_128", "--log-level", "WARNING",
        ])  # fmt: skip
        try:
            wait_for(
                lambda: any("metrics on port" in line for line in indexer.lines),
                what="the indexer to start",
            )
            (line,) = [line for line in indexer.lines if "metrics on port" in line]
            metrics_port = int(line.rsplit(" ", 1)[1])
            scorer = Scorer(connect(redis.url), SEED)
            expected = {healthy.endpoint: 4 * BLOCK_SIZE}
            wait_for(
                lambda: scorer.score(PROMPT, max_registry_age=0).scores == expected,
                what="the healthy source to be scored alone",
            )
            time.sleep(1.0)  # more bad batches arrive: still scored, one line, one count
            assert scorer.score(PROMPT, max_registry_age=0).scores == expected
            assert quarantines(metrics_port) == 1
        finally:
            indexer.stop(5)
    said = [line for line in indexer.lines if "quarantined" in line]
    assert len(said) == 1, indexer.output()
    assert bad.endpoint in said[0] and named in said[0], said[0]
    assert "Traceback" not in indexer.output()


def test_a_bad_entry_already_in_the_index_leaves_the_other_engines_scored(
    redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    """An entry an older indexer wrote (or a hand edit) with a block size of 0 beside a
    sound one: the sound one is scored, the bad one left out and logged once."""
    import json

    from kvsvc.cluster.layout import Keys
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.store import Tracking, connect

    client = connect(redis.url)
    sound = Tracking((0,), BLOCK_SIZE, BLOCK_SIZE, "xxh3_128", "")
    poisoned = Tracking((0,), BLOCK_SIZE, BLOCK_SIZE, "xxh3_128", "")
    poisoned.block_size = poisoned.hash_block_size = 0
    for engine_id, (name, tracking) in enumerate((("sound", sound), ("bad", poisoned))):
        entry = {"id": engine_id, **tracking.to_meta()}
        client.hset(Keys().sources, name, json.dumps(entry, sort_keys=True))
    scorer = Scorer(client, SEED)
    for _ in range(3):
        assert scorer.score(PROMPT, max_registry_age=0).scores == {"sound": 0}
    said = [r.getMessage() for r in caplog.records if "not scored" in r.getMessage()]
    assert said == ["engine bad is not scored: its index entry has block_size 0 (must be an "
                    "integer in [1, 1048576])"]  # fmt: skip


def test_a_source_that_turns_bad_after_good_batches_loses_its_entries(
    redis: RedisServer,
) -> None:
    """A source indexed from good batches that then sends a bad one: its entries go with
    the quarantine (its registry entry and its block bits), or routers would go on
    scoring the stale prefix of an engine the index no longer follows."""
    from kvsvc.cluster.indexer import Indexer
    from kvsvc.cluster.score import Scorer
    from kvsvc.cluster.source import IndexerOptions
    from kvsvc.cluster.store import connect

    client = connect(redis.url)
    scorer = Scorer(client, SEED)
    indexer = Indexer(client, IndexerOptions())
    with Publisher(BLOCK_SIZE) as turning:
        indexer.add_zmq_sources([turning.endpoint], "xxh3_128")
        try:
            follower = indexer.zmq_followers[turning.endpoint]
            wait_for(
                lambda: (
                    scorer.score(PROMPT, max_registry_age=0).scores
                    == {turning.endpoint: 4 * BLOCK_SIZE}
                ),
                what="the source to be scored",
            )
            turning.payload = batch_storing_the_prompt(0)
            wait_for(lambda: follower.state_name == "quarantined", what="the quarantine")
            wait_for(
                lambda: scorer.score(PROMPT, max_registry_age=0).scores == {},
                timeout=5,  # the purge follows the quarantine at once
                what="the quarantined source's entries to be dropped",
            )
            assert not list(client.scan_iter(match="kvsvc:b:*")), "block bits left behind"
        finally:
            indexer.stop()
