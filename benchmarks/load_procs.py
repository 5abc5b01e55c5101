"""The load benchmark's engine and subscriber processes (benchmarks/load_bench.py runs them):
an engine's scheduler loop over the typed client, and event subscribers that read every
batch or never read. Apart from load_bench.py so each stays one concern (and under the
size the house allows); the processes are started with multiprocessing's spawn, which
imports this module by name.
"""

from __future__ import annotations

import array
import os
import random
import threading
import time
from typing import Any

import grpc
from kvsvc_client import KVCacheClient

from kvsvc.v1 import kvcache_pb2, kvcache_pb2_grpc

POOL = "load"
BLOCK = 16
SYSTEM_PROMPTS = [[(p * 7919 + t) % 30000 + 1 for t in range(256)] for p in range(4)]
# What a stuck router looks like to the server: HTTP/2's initial window, never read.
SMALL_WINDOW = (("grpc.http2.bdp_probe", 0),)


class Engine:
    """One engine's scheduler loop (see the module docstring)."""

    def __init__(self, kv: KVCacheClient, index: int, requests: int, seed: int) -> None:
        self.kv = kv
        self.index = index
        self.requests = requests
        self.rng = random.Random(seed)
        self.running: dict[str, int] = {}  # request id -> output tokens still to make
        self.finished: list[str] = []
        self.preempted: list[str] = []
        self.waiting: list[tuple[str, list[int]]] = []
        self.serial = 0
        self.counts = {
            "admissions": 0,
            "decodes": 0,
            "frees": 0,
            "preemptions": 0,
            "no_space_admissions": 0,
        }

    def _new_request(self) -> tuple[str, list[int]]:
        self.serial += 1
        own = self.rng.randint(32, 512)
        salt = self.index * 1_000_003 + self.serial * 7_919
        prompt = self.rng.choice(SYSTEM_PROMPTS) + [(salt + t) % 30000 + 1 for t in range(own)]
        return f"e{self.index}-{self.serial}", prompt

    def step(self) -> tuple[float, int]:
        """One scheduling step; returns its latency (s) and the operations it rejected."""
        step = self.kv.step()
        kinds: list[tuple[str, str]] = []
        for request_id in self.finished:
            step.free(request_id)
            kinds.append(("free", request_id))
        for request_id in self.preempted:
            step.preempt(request_id)
            kinds.append(("preempt", request_id))
        self.finished, self.preempted = [], []
        for request_id in self.running:
            step.allocate(request_id, [self.rng.randint(1, 30000)], 1)
            kinds.append(("decode", request_id))
        while len(self.running) + len(self.waiting) < self.requests:
            self.waiting.append(self._new_request())
        admitting = self.waiting
        self.waiting = []
        for request_id, prompt in admitting:
            step.allocate(request_id, prompt, len(prompt), start=True)
            kinds.append(("admit", request_id))
        started = time.perf_counter()
        results = step.send(timeout=60)
        latency = time.perf_counter() - started
        rejected = set(results.error_indices())
        no_space = set(results.no_space_indices())
        prompts = dict(admitting)
        for i, (kind, request_id) in enumerate(kinds):
            if i in rejected:
                continue
            if kind == "decode":
                if i in no_space:
                    del self.running[request_id]
                    self.preempted.append(request_id)
                    self.counts["preemptions"] += 1
                    continue
                self.counts["decodes"] += 1
                self.running[request_id] -= 1
                if self.running[request_id] <= 0:
                    del self.running[request_id]
                    self.finished.append(request_id)
            elif kind == "admit":
                if i in no_space:
                    self.waiting.append((request_id, prompts[request_id]))
                    self.counts["no_space_admissions"] += 1
                    continue
                self.counts["admissions"] += 1
                self.running[request_id] = self.rng.randint(16, 128)
            else:
                self.counts["frees"] += 1
        return latency, len(rejected)

    def drain(self) -> None:
        """Free everything this engine holds (every block goes back)."""
        ids = [*self.running, *self.finished]
        if ids:
            self.kv.free(*ids)
        if self.preempted:
            self.kv.free(*self.preempted, preempted=True)
        self.running, self.finished, self.preempted = {}, [], []


def engine_main(
    index: int,
    address: str,
    requests: int,
    ready: Any,
    start: Any,
    times: Any,
    results: Any,
) -> None:
    """An engine process: ready, wait for the start, warm up, measure, drain, report."""
    steps = errors = 0
    latencies = array.array("d")
    error_text = ""
    try:
        with KVCacheClient(address, pool=POOL) as kv:
            engine = Engine(kv, index, requests, seed=index)
            kv.usage()  # connected
            ready.put(index)
            start.wait()
            measure_from, until = times[0], times[1]
            while (now := time.monotonic()) < until:
                try:
                    latency, rejected = engine.step()
                except Exception as exc:  # an RPC that failed: counted, and reported once
                    errors += 1
                    error_text = error_text or f"{type(exc).__name__}: {exc}"
                    time.sleep(0.01)
                    continue
                errors += rejected
                if now >= measure_from:
                    steps += 1
                    latencies.append(latency)
            engine.drain()
            counts = engine.counts
    except Exception as exc:
        errors += 1
        error_text = error_text or f"{type(exc).__name__}: {exc}"
        counts = {}
    results.put((index, steps, errors, latencies.tobytes(), counts, error_text))


def subscribers_main(
    address: str, readers: int, stuck: int, ready: Any, stop: Any, results: Any
) -> None:
    """Readers that take every message and check the sequence; streams that never read."""
    channel = grpc.insecure_channel(address)
    stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
    stuck_channel = grpc.insecure_channel(address, options=SMALL_WINDOW)
    stuck_stub = kvcache_pb2_grpc.KVCacheServiceStub(stuck_channel)
    reports: list[dict[str, Any]] = [{} for _ in range(readers)]
    calls: list[Any] = []
    admin = os.environ.get("KVSVC_ADMIN_TOKEN")  # --tokens: the stream is an operator's
    metadata = (("authorization", f"Bearer {admin}"),) if admin else None

    def read(slot: int, call: Any) -> None:
        report = reports[slot] = {"batches": 0, "gaps": 0, "breaks": 0, "end": "open"}
        expected = 0
        try:
            for message in call:
                if message.gap:
                    report["gaps"] += 1
                    expected = message.oldest_available_sequence
                    continue
                if expected and message.sequence != expected:
                    report["breaks"] += 1
                expected = message.sequence + 1
                report["batches"] += 1
        except grpc.RpcError as exc:
            report["end"] = exc.code().name

    threads = []
    for slot in range(readers):
        call = stub.WatchEvents(
            kvcache_pb2.WatchEventsRequest(pool=POOL, from_sequence=1), metadata=metadata
        )
        calls.append(call)
        threads.append(threading.Thread(target=read, args=(slot, call), daemon=True))
        threads[-1].start()
    stuck_calls = [
        stuck_stub.WatchEvents(
            kvcache_pb2.WatchEventsRequest(pool=POOL, from_sequence=1), metadata=metadata
        )
        for _ in range(stuck)
    ]
    ready.put("subscribers")
    stop.wait()
    # Now the stuck ones read what the server had under way, and how their stream ended.
    stuck_reports: list[dict[str, Any]] = []
    for call in stuck_calls:
        report: dict[str, Any] = {"messages": 0, "end": "still open", "details": ""}

        def drain(call: Any = call, report: dict[str, Any] = report) -> None:
            try:
                for _ in call:
                    report["messages"] += 1
            except grpc.RpcError as exc:
                report["end"] = exc.code().name
                report["details"] = exc.details() or ""

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        reader.join(10)
        call.cancel()
        reader.join(5)
        stuck_reports.append(report)
    for call in calls:
        call.cancel()
    for thread in threads:
        thread.join(5)
    results.put((reports, stuck_reports))
    channel.close()
    stuck_channel.close()
