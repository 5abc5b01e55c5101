"""Load: many engine processes on one pool, with event subscribers attached, for a while.

Processes: one ``kvsvc serve`` (one pool), one real CPU worker agent (``kvsvc worker``, a
one-layer spec: the engine path does not depend on the model's size), ``--clients``
engine processes, and one subscriber process holding ``--readers`` WatchEvents streams
that read everything and ``--stuck`` streams that never read (a client with HTTP/2's
initial 64 KiB window, so the server's writes to it block: what a hung router looks like).

Each engine is a scheduler loop over the typed client, one ``Step`` per iteration: a
decode token for each running request, the frees of the requests that finished (after
16-128 output tokens), and admissions that refill it to ``--requests`` running requests
(a prompt of one of four shared 256-token system prompts plus 32-512 tokens of its own,
all of it scheduled at once). A decode that gets NO_SPACE is preempted on the next step
(it stops there); an admission that gets NO_SPACE waits for a later step. Anything else
that goes wrong is an error: a failed RPC, an operation the server rejected.

Figures (after ``--warmup`` seconds, over ``--seconds``): Steps and their rate, errors,
Step latency p50/p99 (as the engines saw it), the server's RSS when the measurement began
and when it ended (growth, goal < 5 %), what each subscriber got (batches, gap markers,
sequence breaks: must be 0) and the stuck ones' outcome (cut by the server with
RESOURCE_EXHAUSTED after ``--stuck-timeout`` s), and the server's own subscriber counters.

Abuse mode (``--abuse``): the same load twice, without and then with an abuser beside the
engines for the measured time: ``--abuse-framed`` connections to the framed transport that
say hello and then hold their slot, a fresh framed client that tries one Step a second (an
engine that restarts), one admission whose ``lora_name`` is ``--abuse-string-bytes`` long,
and ``--abuse-prompts`` admissions of a whole ``max_model_len`` prompt with nothing
scheduled (no block each, the whole prompt held); and, back to back for the whole
measured time (issue 32), free-queue pages far into the queue (the offset attack), and
Steps with fresh call ids that each ask for a 65,536-id page (the reply-cache attack: a
kept reply is bounded in bytes per caller and per pool, a read-only one not kept). The
table puts the engines' Step p50/p99
and the server's peak RSS of both runs side by side, and what each abuse got: a refusal is
reported as one (its status code), not as a crash. Goal: the engines are served throughout,
and the server's RSS stays bounded.

Usage: python benchmarks/load_bench.py [--clients 64] [--seconds 30] [--warmup 10] [--json]
       [--abuse [--abuse-framed 64] [--abuse-string-bytes 1MiB] [--abuse-prompts 1000]]
"""

from __future__ import annotations

import argparse
import array
import contextlib
import json
import multiprocessing as mp
import random
import re
import socket
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvsvc_client import KVCacheClient  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports  # noqa: E402
from kvsvc.units import parse_bytes  # noqa: E402
from kvsvc.v1 import frames_pb2, kvcache_pb2, kvcache_pb2_grpc  # noqa: E402
from kvsvc.wire.frames import MAGIC, PREFIX, frame, hello_header  # noqa: E402

POOL = "load"
GOAL_RSS_GROWTH_PCT = 5.0
BLOCK = 16
TINY_SPECS = {
    "model.layers.0.self_attn.attn": {
        "type": "full_attention",
        "block_size": BLOCK,
        "num_kv_heads": 1,
        "head_size": 64,
        "dtype": "float16",
    }
}
SYSTEM_PROMPTS = [[(p * 7919 + t) % 30000 + 1 for t in range(256)] for p in range(4)]
# What a stuck router looks like to the server: HTTP/2's initial window, never read.
SMALL_WINDOW = (("grpc.http2.bdp_probe", 0),)
MAX_MODEL_LEN = 2048
# The framed transport's connection cap in this benchmark (the server's
# frames_max_connections): small, so that --abuse-framed connections can reach it.
FRAMES_MAX_CONNECTIONS = 32


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


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
        call = stub.WatchEvents(kvcache_pb2.WatchEventsRequest(pool=POOL, from_sequence=1))
        calls.append(call)
        threads.append(threading.Thread(target=read, args=(slot, call), daemon=True))
        threads[-1].start()
    stuck_calls = [
        stuck_stub.WatchEvents(kvcache_pb2.WatchEventsRequest(pool=POOL, from_sequence=1))
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


def _status(exc: BaseException) -> str:
    """How a refusal reads in the table: its status code, else the exception's type."""
    code = getattr(exc, "code", None)
    name = code().name if callable(code) else getattr(code, "name", None)
    return str(name or type(exc).__name__)


def _hold_framed_slot(host: str, port: int) -> tuple[socket.socket | None, str]:
    """Connect, say hello with a made-up token, keep the connection (its slot) open.
    Returns the socket (None: refused or closed) and how the hello was answered."""
    sock = socket.create_connection((host, port), timeout=10)
    try:
        hello = hello_header((("authorization", "Bearer not-a-token"),))
        sock.sendall(MAGIC + frame(hello))
        prefix = sock.recv(PREFIX.size, socket.MSG_WAITALL)
        if len(prefix) < PREFIX.size:
            sock.close()
            return None, "closed"
        header_len, body_len = PREFIX.unpack(prefix)
        data = sock.recv(header_len + body_len, socket.MSG_WAITALL)
        header = frames_pb2.FrameHeader.FromString(data[:header_len])
    except OSError as exc:
        sock.close()
        return None, type(exc).__name__
    if header.code != 0:
        sock.close()
        return None, f"code {header.code}"
    return sock, "held"


def _count(report: dict[str, int], outcome: str) -> None:
    report[outcome] = report.get(outcome, 0) + 1


def _offset_attack(address: str, until: float, report: dict[str, int]) -> None:
    """Issue 32's offset attack, back to back until ``until``: 13-byte zero-operation Steps
    whose free-queue page starts at 2^31 - 1 or in the middle of the pool (it cost
    O(offset) on the event loop: 0.4-0.9 s at 4M blocks), and an ordered read of the whole
    queue, page after page (what vLLM on kvsvc does at start, which must keep working)."""
    with grpc.insecure_channel(address) as channel:
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        usage = stub.GetUsage(kvcache_pb2.GetUsageRequest(pool=POOL), timeout=30)
        offsets = [2**31 - 1, usage.num_blocks // 2]
        i = 0
        while time.monotonic() < until:
            i += 1
            if i % 10:
                request = kvcache_pb2.StepRequest(
                    pool=POOL,
                    free_queue_head_limit=65536 if i % 2 == 0 else 16,
                    free_queue_head_offset=offsets[i % 2],
                )
                try:
                    stub.Step(request, timeout=30)
                    _count(report, "far page served")
                except grpc.RpcError as exc:
                    _count(report, f"far page {exc.code().name}")
                continue
            offset = 0
            try:
                while True:
                    page = stub.Step(
                        kvcache_pb2.StepRequest(
                            pool=POOL, free_queue_head_limit=4096, free_queue_head_offset=offset
                        ),
                        timeout=30,
                    ).free_queue_head
                    offset += len(page)
                    if len(page) < 4096:
                        break
                _count(report, "whole queue read")
            except grpc.RpcError as exc:  # another engine moved the queue between pages
                _count(report, f"whole queue {exc.code().name}")


def _reply_cache_attack(address: str, until: float, report: dict[str, int]) -> None:
    """Issue 32's reply-cache attack until ``until``: Steps with fresh call ids and a full
    65,536-id page each, zero-operation ones (1,100 took a server from 108 to 333 MB, its
    snapshot to 187 MB) and ones that admit and free a request, so every reply is kept."""
    with grpc.insecure_channel(address) as channel:
        stub = kvcache_pb2_grpc.KVCacheServiceStub(channel)
        i = 0
        while time.monotonic() < until:
            i += 1
            request = kvcache_pb2.StepRequest(
                pool=POOL, call_id=f"abuse-reply-{i}", free_queue_head_limit=65536
            )
            if i % 2:
                kind = kvcache_pb2.STEP_OPERATION_TYPE_ALLOCATE if i % 4 == 1 else None
                request.types.append(kind or kvcache_pb2.STEP_OPERATION_TYPE_FREE)
                request.request_ids.append(f"abuse-reply-{i // 4}")
                request.num_token_ids.append(16 if kind else 0)
                request.token_ids.extend([i % 30000 + 1] * (16 if kind else 0))
                request.num_new_tokens.append(16 if kind else 0)
                request.num_lookahead_tokens.append(0)
                request.num_rejected_tokens.append(0)
                if kind:
                    request.starts[0].SetInParent()
            try:
                stub.Step(request, timeout=30)
                _count(report, "served")
            except grpc.RpcError as exc:
                _count(report, exc.code().name)
        if i % 4 in (1, 2):  # the last admission's free was not sent
            free = kvcache_pb2.FreeRequest(pool=POOL, request_ids=[f"abuse-reply-{i // 4}"])
            with contextlib.suppress(grpc.RpcError):
                stub.Free(free, timeout=30)


def abuser_main(
    address: str, frames: str, args: argparse.Namespace, start: Any, until: float, results: Any
) -> None:
    """The abuse (see the module docstring), from the start of the measured time to
    ``until``; reports what each part got."""
    report: dict[str, Any] = {}
    start.wait()
    report["offset_attack"], report["reply_cache_attack"] = {}, {}
    attacks = [
        threading.Thread(target=_offset_attack, args=(address, until, report["offset_attack"])),
        threading.Thread(
            target=_reply_cache_attack, args=(address, until, report["reply_cache_attack"])
        ),
    ]
    for attack in attacks:
        attack.start()
    host, _, port = frames.rpartition(":")
    held: list[socket.socket] = []
    hellos: dict[str, int] = {}
    for _ in range(args.abuse_framed):
        try:
            sock, outcome = _hold_framed_slot(host, int(port))
        except OSError as exc:
            sock, outcome = None, type(exc).__name__
        hellos[outcome] = hellos.get(outcome, 0) + 1
        if sock is not None:
            held.append(sock)
    report["framed_hellos"] = hellos
    with KVCacheClient(address, pool=POOL) as kv:
        from kvsvc_client import HashingContext, RequestStart

        name = "x" * args.abuse_string_bytes
        start_big = RequestStart(hashing=HashingContext(lora_name=name))
        try:
            kv.allocate("abuse-long-string", list(range(1, 65)), 64, start=start_big)
            report["long_string"] = "admitted"
        except Exception as exc:  # a refusal: its code
            report["long_string"] = _status(exc)
        admitted = refused = 0
        refusals: dict[str, int] = {}
        ids: list[str] = []
        for first in range(0, args.abuse_prompts, 100):
            step = kv.step()
            batch = [f"abuse-{i}" for i in range(first, min(first + 100, args.abuse_prompts))]
            for i, request_id in enumerate(batch):
                prompt = [(first + i) % 30000 + 1] * MAX_MODEL_LEN
                step.allocate(request_id, prompt, 0, start=True)
            try:
                results_ = step.send(timeout=60)
            except Exception as exc:
                refusals[_status(exc)] = refusals.get(_status(exc), 0) + len(batch)
                refused += len(batch)
                continue
            errors = set(results_.error_indices())
            for i, request_id in enumerate(batch):
                if i in errors:
                    refused += 1
                    code = _status(results_[i])
                    refusals[code] = refusals.get(code, 0) + 1
                else:
                    admitted += 1
                    ids.append(request_id)
        report["zero_block_prompts"] = {"admitted": admitted, "refused": refusals}
        # A restarting engine on the framed transport, once a second.
        probes: dict[str, int] = {}
        while time.monotonic() < until:
            try:
                with KVCacheClient(f"frames:{frames}", pool=POOL) as fresh:
                    fresh.usage()
                outcome = "served"
            except Exception as exc:
                outcome = _status(exc)
            probes[outcome] = probes.get(outcome, 0) + 1
            time.sleep(1.0)
        report["fresh_framed_engine"] = probes
        for first in range(0, len(ids), 1000):
            kv.free(*ids[first : first + 1000])
        if report["long_string"] == "admitted":
            kv.free("abuse-long-string")
    for sock in held:
        sock.close()
    for attack in attacks:
        attack.join()
    results.put(report)


def scrape(metrics_port: int) -> dict[str, float]:
    """The server's event-stream figures of the pool, from /metrics."""
    wanted = {
        "kvsvc_event_subscribers": "subscribers",
        "kvsvc_event_subscribers_cut_total": "cut",
        "kvsvc_event_subscribers_lagged_total": "lagged",
        "kvsvc_event_subscribers_refused_total": "refused",
        "kvsvc_event_buffer_bytes": "buffer_bytes",
        "kvsvc_event_batches_dropped_total": "batches_dropped",
    }
    with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
        text = reply.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in wanted and sample.labels.get("pool") == POOL:
                out[wanted[sample.name]] = sample.value
    return out


def run(args: argparse.Namespace, abuse: bool = False) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    children: list[Child] = []
    processes: list[Any] = []
    with tempfile.TemporaryDirectory() as tmp:
        spec_file = Path(tmp) / "tiny.json"
        spec_file.write_text(json.dumps(TINY_SPECS))
        server_config = Path(tmp) / "server.toml"
        server_config.write_text(f"frames_max_connections = {FRAMES_MAX_CONNECTIONS}\n")
        try:
            server = spawn(
                "server",
                [
                    "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "127.0.0.1:0",
                    "--pool", POOL, "--max-model-len", str(MAX_MODEL_LEN),
                    "--log-level", "WARNING",
                    "--subscriber-write-timeout", str(args.stuck_timeout),
                    "--event-buffer", str(args.event_buffer),
                    "--frames-listen", "127.0.0.1:0", "--config", str(server_config),
                ],
            )  # fmt: skip
            children.append(server)
            port, metrics_port = wait_for_ports(server)
            address = f"127.0.0.1:{port}"
            frames = next(
                line.rsplit(" ", 1)[1] for line in server.lines if "kvsvc frames on" in line
            )
            worker_args = [
                "worker", "--server", address, "--pool", POOL, "--rank", "0",
                "--world-size", "1", "--device", "cpu", "--spec-file", str(spec_file),
                "--kv-cache-memory", args.kv_cache_memory,
            ]  # fmt: skip
            children.append(spawn("worker", worker_args))
            with KVCacheClient(address, pool=POOL) as kv:
                kv.wait_until_ready(timeout=120)
                num_blocks = kv.usage().num_blocks

            ready, results, sub_results = ctx.Queue(), ctx.Queue(), ctx.Queue()
            start, stop_subscribers = ctx.Event(), ctx.Event()
            times = ctx.Array("d", 2)
            subscriber_proc = ctx.Process(
                target=subscribers_main,
                args=(address, args.readers, args.stuck, ready, stop_subscribers, sub_results),
            )
            subscriber_proc.start()
            processes.append(subscriber_proc)
            for i in range(args.clients):
                proc = ctx.Process(
                    target=engine_main,
                    args=(i, address, args.requests, ready, start, times, results),
                )
                proc.start()
                processes.append(proc)
            for _ in range(args.clients + 1):  # every engine connected, subscribers attached
                ready.get(timeout=300)
            began = time.monotonic()
            times[0] = began + args.warmup
            times[1] = began + args.warmup + args.seconds
            abuse_results, abuse_start = ctx.Queue(), ctx.Event()
            if abuse:
                abuser = ctx.Process(
                    target=abuser_main,
                    args=(address, frames, args, abuse_start, times[1], abuse_results),
                )
                abuser.start()
                processes.append(abuser)
            start.set()
            time.sleep(args.warmup)
            abuse_start.set()
            rss_warm = rss_bytes(server.process.pid)
            rss_max = rss_warm
            while time.monotonic() < times[1]:
                time.sleep(min(1.0, max(0.0, times[1] - time.monotonic())))
                rss_max = max(rss_max, rss_bytes(server.process.pid))
            rss_end = rss_bytes(server.process.pid)
            outcomes = [results.get(timeout=120) for _ in range(args.clients)]
            abuse_report = abuse_results.get(timeout=120) if abuse else {}
            stop_subscribers.set()
            readers, stuck = sub_results.get(timeout=60)
            server_figures = scrape(metrics_port)
            with KVCacheClient(address, pool=POOL) as kv:
                usage = kv.usage()
        finally:
            for proc in processes:
                proc.join(10)
                if proc.is_alive():
                    proc.kill()
            stop_all(children)

    latencies: list[float] = []
    counts: dict[str, int] = {}
    steps = errors = 0
    first_error = ""
    for _, n, e, raw, c, text in outcomes:
        steps += n
        errors += e
        first_error = first_error or text
        samples = array.array("d")
        samples.frombytes(raw)
        latencies.extend(samples)
        for key, value in c.items():
            counts[key] = counts.get(key, 0) + value
    for report in stuck:
        match = re.search(r"from_sequence=(\d+)", report["details"])
        report["resume_from"] = int(match.group(1)) if match else None
        del report["details"]
    return {
        "clients": args.clients,
        "seconds": args.seconds,
        "warmup_seconds": args.warmup,
        "requests_per_client": args.requests,
        "pool_blocks": num_blocks,
        "event_buffer_batches": args.event_buffer,
        "steps": steps,
        "steps_per_s": round(steps / args.seconds, 1),
        "errors": errors,
        "first_error": first_error,
        "step_p50_ms": round(statistics.median(latencies) * 1e3, 3) if latencies else 0.0,
        "step_p99_ms": round(percentile(latencies, 0.99) * 1e3, 3) if latencies else 0.0,
        "operations": counts,
        "rss_warm_mib": round(rss_warm / 2**20, 1),
        "rss_end_mib": round(rss_end / 2**20, 1),
        "rss_max_mib": round(rss_max / 2**20, 1),
        "rss_growth_pct": round((rss_end - rss_warm) / rss_warm * 100, 2),
        "readers": readers,
        "stuck": stuck,
        "server": server_figures,
        "blocks_back": usage.num_free_blocks == usage.num_blocks and usage.num_requests == 0,
        "abuse": abuse_report,
    }


def print_abuse_table(quiet: dict[str, Any], abused: dict[str, Any], args: Any) -> None:
    """The two runs side by side, and what each abuse got."""
    report = abused["abuse"]
    rows = [
        (
            "engines' Step p50 / p99",
            f"{quiet['step_p50_ms']:.2f} / {quiet['step_p99_ms']:.2f} ms without abuse, "
            f"{abused['step_p50_ms']:.2f} / {abused['step_p99_ms']:.2f} ms with it",
        ),
        (
            "engines' Steps, errors",
            f"{quiet['steps']:,} ({quiet['errors']} errors) without, {abused['steps']:,} "
            f"({abused['errors']} errors) with",
        ),
        (
            "server peak RSS",
            f"{quiet['rss_max_mib']:.1f} MiB without abuse, "
            f"{abused['rss_max_mib']:.1f} MiB with it",
        ),
        (
            f"{args.abuse_framed} framed slot holders (cap {FRAMES_MAX_CONNECTIONS})",
            ", ".join(f"{n} {k}" for k, n in report.get("framed_hellos", {}).items()),
        ),
        (
            "a fresh framed engine, once a second",
            ", ".join(f"{n} {k}" for k, n in report.get("fresh_framed_engine", {}).items()),
        ),
        (f"a {args.abuse_string_bytes:,}-byte lora_name", str(report.get("long_string"))),
        (
            "free-queue pages at 2^31-1 / mid-pool; whole-queue reads",
            ", ".join(f"{n:,} {k}" for k, n in report.get("offset_attack", {}).items()),
        ),
        (
            "Steps with fresh call ids and 65,536-id pages",
            ", ".join(f"{n:,} {k}" for k, n in report.get("reply_cache_attack", {}).items()),
        ),
    ]
    zero = report.get("zero_block_prompts", {})
    refused = ", ".join(f"{n} {k}" for k, n in zero.get("refused", {}).items()) or "none"
    rows.append(
        (
            f"{args.abuse_prompts:,} zero-block {MAX_MODEL_LEN}-token prompts",
            f"{zero.get('admitted', 0)} admitted, refused: {refused}",
        )
    )
    print(
        f"kvsvc load benchmark, abuse mode: {quiet['clients']} engine processes x "
        f"{quiet['requests_per_client']} running requests, {quiet['seconds']:g} s measured "
        "per run"
    )
    width = max(len(r[0]) for r in rows)
    for name, text in rows:
        print(f"  {name.ljust(width)}  {text}")


def print_table(figures: dict[str, Any]) -> None:
    ops = figures["operations"]
    rows = [
        ("Steps", f"{figures['steps']:,} ({figures['steps_per_s']:,.0f}/s)"),
        (
            "errors",
            f"{figures['errors']}" + (f" ({figures['first_error']})" if figures["errors"] else ""),
        ),
        (
            "Step latency p50 / p99",
            f"{figures['step_p50_ms']:.2f} ms / {figures['step_p99_ms']:.2f} ms",
        ),
        (
            "operations",
            f"{ops.get('decodes', 0):,} decodes, {ops.get('admissions', 0):,} admissions, "
            f"{ops.get('frees', 0):,} frees, {ops.get('preemptions', 0):,} preemptions, "
            f"{ops.get('no_space_admissions', 0):,} admissions deferred (NO_SPACE)",
        ),
        (
            "server RSS warm / end (max)",
            f"{figures['rss_warm_mib']:.1f} / {figures['rss_end_mib']:.1f} MiB "
            f"({figures['rss_max_mib']:.1f}): {figures['rss_growth_pct']:+.2f}% "
            f"(goal < {GOAL_RSS_GROWTH_PCT:g}%)",
        ),
    ]
    for i, r in enumerate(figures["readers"]):
        rows.append(
            (
                f"reader {i + 1}",
                f"{r.get('batches', 0):,} batches, {r.get('gaps', 0)} gap markers, "
                f"{r.get('breaks', 0)} sequence breaks",
            )
        )
    for i, s in enumerate(figures["stuck"]):
        resume = f", resume from_sequence={s['resume_from']}" if s["resume_from"] else ""
        rows.append(
            (f"stuck {i + 1} (never read)", f"{s['end']} after {s['messages']} messages{resume}")
        )
    srv = figures["server"]
    rows.append(
        (
            "server subscriber counters",
            f"cut {srv.get('cut', 0):.0f}, lagged {srv.get('lagged', 0):.0f}, refused "
            f"{srv.get('refused', 0):.0f}; buffer {srv.get('buffer_bytes', 0) / 2**20:.1f} MiB, "
            f"{srv.get('batches_dropped', 0):,.0f} batches dropped",
        )
    )
    rows.append(("every block back at the end", "yes" if figures["blocks_back"] else "NO"))
    print(
        f"kvsvc load benchmark: {figures['clients']} engine processes x "
        f"{figures['requests_per_client']} running requests, {figures['seconds']:g} s after a "
        f"{figures['warmup_seconds']:g} s warm-up, one pool ({figures['pool_blocks']:,} blocks, "
        f"replay buffer {figures['event_buffer_batches']:,} batches)"
    )
    width = max(len(r[0]) for r in rows)
    for name, text in rows:
        print(f"  {name.ljust(width)}  {text}")


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--clients", type=int, default=64, help="engine processes")
    parser.add_argument("--seconds", type=float, default=30.0, help="measured time")
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds before measuring")
    parser.add_argument("--requests", type=int, default=4, help="running requests per engine")
    parser.add_argument("--readers", type=int, default=3, help="subscribers that read")
    parser.add_argument("--stuck", type=int, default=1, help="subscribers that never read")
    parser.add_argument(
        "--stuck-timeout",
        type=float,
        default=5.0,
        help="the server's --subscriber-write-timeout (seconds)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default="32MiB",
        help="the pool's KV cache (small enough that its prefix index is full, and evicting, "
        "by the end of the warm-up)",
    )
    parser.add_argument(
        "--event-buffer",
        type=int,
        default=2000,
        help="the server's replay buffer, batches (full by the end of the warm-up)",
    )
    parser.add_argument(
        "--abuse", action="store_true", help="run without, then with, the abuse (see above)"
    )
    parser.add_argument(
        "--abuse-framed", type=int, default=64, help="framed connections that hold a slot"
    )
    parser.add_argument(
        "--abuse-string-bytes",
        type=parse_bytes,
        default=2**20,
        help="the long lora_name's bytes (default 1MiB)",
    )
    parser.add_argument(
        "--abuse-prompts", type=int, default=1000, help="zero-block max_model_len admissions"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    if args.abuse:
        quiet, abused = run(args), run(args, abuse=True)
        if args.json:
            print(json.dumps({"without_abuse": quiet, "with_abuse": abused}))
        else:
            print_abuse_table(quiet, abused, args)
        return 0 if quiet["errors"] == 0 and abused["errors"] == 0 else 1
    figures = run(args)
    if args.json:
        print(json.dumps(figures))
    else:
        print_table(figures)
    return 0 if figures["errors"] == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
