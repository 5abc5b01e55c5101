"""What keeping the pools' state on disk costs, and what a restart takes (issue 10).

Figures, in one run:
  step256            a Step of one decode token for each of 256 running requests (the
                     rpc_bench workload), against a server without --state-dir, one with it
                     (state_synchronous = normal, the default) and one with "full"; the three
                     interleaved so they see the same machine (goal: normal adds <= 10% to p50)
  restart            a pool of 1M blocks with 10,000 live requests (512-token prompts, shared
                     prefixes, and the rest of the pool cached by requests that finished):
                     - snapshot: after a graceful stop (nothing to replay)
                     - journal: after kill -9, with the most journal the defaults let a
                       pool hold (twice state_snapshot_every's replay work: past it a
                       snapshot is taken whatever state_snapshot_min_interval_s says) of
                       each kind of load: 5,000-operation decode Steps, and single
                       Allocate/Free calls (a row each: the load that replays slowest per
                       unit of work) (goal: <= 2 s of load + replay)
                     each: the server's own load + replay time (its log line), and from
                     spawning `kvsvc serve` to the first answered engine call (process start,
                     imports and the agent's re-registration included) (goal: < 2 s)
  size               the state directory per live request and per cached block (snapshot
                     bytes; two pools that differ only in one of them), and journal bytes per
                     256-operation Step row

The agent of the restart pool is a protocol-level stand-in (no tensors: the server side is
what is measured; 1M blocks of real tensors would need 4 GiB). Usage:
python benchmarks/state_bench.py [--json] [--quick]
"""

from __future__ import annotations

import argparse
import json
import re
import signal
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import grpc

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "benchmarks"))

from kvsvc_client import ClientOptions, KVCacheClient, UnavailableError  # noqa: E402
from rpc_bench import TINY_SPECS, DecodeStep, interleaved, percentile  # noqa: E402

from kvsvc.convert import layer_specs_to_pb  # noqa: E402
from kvsvc.demo.processes import Child, spawn, stop_all, wait_for_ports  # noqa: E402
from kvsvc.server.persistence.writer import (  # noqa: E402
    DEFAULT_SNAPSHOT_EVERY,
    SNAPSHOT_OVERDUE_FACTOR,
    replay_units,
)
from kvsvc.specs.serde import spec_from_dict  # noqa: E402
from kvsvc.v1 import worker_pb2, worker_pb2_grpc  # noqa: E402

GOAL_STEP_OVERHEAD = 0.10
GOAL_RESTART_S = 2.0
GOAL_REPLAY_S = 2.0
BLOCK_BYTES = 2 * 16 * 64 * 2  # TINY_SPECS: K and V, 16 tokens x 64 x fp16
BIG_BLOCKS = 1_000_000
BIG_REQUESTS = 10_000
PROMPT = 512
_RESTORED = re.compile(r"state restored .* in ([0-9.]+) s \((\d+) live requests, (\d+) cached")
_REPLAYED = re.compile(r"(\d+) journal rows replayed")


def serve_args(pool: str, state_dir: Path | None, *extra: str) -> list[str]:
    args = [
        "serve", "--listen", "127.0.0.1:0", "--metrics-listen", "off", "--pool", pool,
        "--max-model-len", "4096", "--log-level", "WARNING", *extra,
    ]  # fmt: skip
    if state_dir is not None:
        args += ["--state-dir", str(state_dir)]
    return args


class StandInAgent:
    """Rank 0 of a pool over the real WorkerService: register, follow the plan stream,
    report an allocation with a fixed tensor identity (the same across restarts, as an
    agent whose tensors survive)."""

    def __init__(self, address: str, pool: str, memory: int) -> None:
        self.channel = grpc.insecure_channel(address)
        stub = worker_pb2_grpc.WorkerServiceStub(self.channel)
        specs = {name: spec_from_dict(spec) for name, spec in TINY_SPECS.items()}
        response = stub.Register(
            worker_pb2.RegisterRequest(
                pool=pool, rank=0, world_size=1, device="cpu", hostname="bench",
                layers=layer_specs_to_pb(specs), allocation_id="bench-tensors",
                memory=worker_pb2.MemoryProfile(total_bytes=memory, kv_cache_bytes=memory),
            ),
            timeout=60,
        )  # fmt: skip
        self.stream = stub.WatchPlan(
            worker_pb2.WatchPlanRequest(pool=pool, rank=0, session_id=response.session_id)
        )
        for update in self.stream:
            if update.HasField("config"):
                num_blocks = update.config.num_blocks
                break
        stub.ReportAllocation(
            worker_pb2.ReportAllocationRequest(
                pool=pool, rank=0, session_id=response.session_id, num_blocks=num_blocks,
                allocation_id="bench-tensors",
            ),
            timeout=60,
        )  # fmt: skip
        # Keep the stream open (the rank is live while it is) and drain it.
        self._reader = threading.Thread(target=self._drain, daemon=True)
        self._reader.start()

    def _drain(self) -> None:
        try:
            for _ in self.stream:
                pass
        except grpc.RpcError:
            pass

    def close(self) -> None:
        self.stream.cancel()
        self.channel.close()


def worker_args(address: str, pool: str, spec_file: Path) -> list[str]:
    return [
        "worker", "--server", address, "--pool", pool, "--rank", "0", "--world-size", "1",
        "--device", "cpu", "--spec-file", str(spec_file), "--kv-cache-memory", "96MiB",
    ]  # fmt: skip


def bench_steps(tmp: Path, rounds: int) -> dict[str, Any]:
    """Step p50/p99 of three servers (no state, normal, full) in one interleaved run."""
    spec_file = tmp / "tiny.json"
    spec_file.write_text(json.dumps(TINY_SPECS))
    children: list[Child] = []
    clients: list[KVCacheClient] = []
    try:
        benches: dict[str, tuple[Any, int]] = {}
        sizes: dict[str, Any] = {}
        for name, state, extra in (
            ("memory", None, ()),
            ("normal", tmp / "normal", ()),
            ("full", tmp / "full", ("--state-synchronous", "full")),
        ):
            server = spawn(f"server-{name}", serve_args("bench", state, *extra))
            children.append(server)
            port, _ = wait_for_ports(server)
            address = f"127.0.0.1:{port}"
            children.append(spawn(f"worker-{name}", worker_args(address, "bench", spec_file)))
            kv = KVCacheClient(address, pool="bench")
            clients.append(kv)
            kv.wait_until_ready(timeout=120)
            benches[name] = (DecodeStep(kv), 25)
            sizes[name] = state
        samples, _, _ = interleaved(rounds, **benches)
        journal = None
        if sizes["normal"] is not None:
            # Bytes a 256-operation Step adds to the journal (rows, their index, WAL pages
            # checkpointed into the file): the database's size over the rows it holds.
            with sqlite3.connect(sizes["normal"] / "bench.db") as conn:
                rows, payload = conn.execute(
                    "SELECT COUNT(*), SUM(LENGTH(payload)) FROM journal WHERE kind = 3"
                ).fetchone()
            journal = {"rows": rows, "payload_bytes_per_step": round(payload / max(rows, 1))}
        for bench, _ in benches.values():
            bench.close()
    finally:
        for kv in clients:
            kv.close()
        stop_all(children)
    out: dict[str, Any] = {}
    for name, values in samples.items():
        out[name] = {
            "p50_us": round(statistics.median(values), 1),
            "p99_us": round(percentile(values, 0.99), 1),
        }
    base = out["memory"]["p50_us"]
    for name in ("normal", "full"):
        out[name]["p50_overhead"] = round(out[name]["p50_us"] / base - 1, 3)
    out["journal"] = journal
    return out


def fill(kv: KVCacheClient, requests: int, seed: int = 1) -> dict[str, int]:
    """``requests`` live 512-token requests (a 256-token prefix shared by each group of
    16), and as many 1024-token ones admitted and freed (their blocks stay cached)."""
    import random

    rng = random.Random(seed)
    prefixes = [[rng.randrange(1, 30000) for _ in range(256)] for _ in range(requests // 16 + 1)]
    batch = 200
    for kind, count, length in (("done", requests, 1024), ("live", requests, PROMPT)):
        for first in range(0, count, batch):
            step = kv.step()
            ids = [f"{kind}-{i}" for i in range(first, min(count, first + batch))]
            for i, rid in enumerate(ids, start=first):
                prompt = prefixes[i // 16] + [rng.randrange(1, 30000) for _ in range(length - 256)]
                step.allocate(rid, prompt, length, start=True)
            results = step.send(timeout=120)
            assert all(r.ok for r in results), results
            if kind == "done":
                step = kv.step()
                for rid in ids:
                    step.free(rid)
                step.send(timeout=120)
    usage = kv.usage()
    return {"live_requests": usage.num_requests, "cached_blocks": usage.num_cached_blocks}


def decode_rows(kv: KVCacheClient, requests: int, work: int) -> tuple[int, int]:
    """Decode Steps (5,000 operations each) until about ``work`` replay units are
    journaled (as the server weighs them); returns the rows and operations sent."""
    sent = rows = units = 0
    token = 1
    while units < work:
        for first in range(0, requests, 5000):
            count = min(5000, requests - first)
            step = kv.step()
            for i in range(first, first + count):
                step.allocate(f"live-{i}", [token], 1)
            step.send(timeout=120)
            sent += count
            rows += 1
            units += replay_units(count, count)
            if units >= work:
                break
        token += 1
    return rows, sent


def single_call_rows(address: str, work: int, clients: int = 4) -> tuple[int, int]:
    """Single Allocate and Free calls (a 16-token admission, then its free: a journal row
    each) from ``clients`` engines at once, until about ``work`` replay units are
    journaled; returns the rows and operations sent."""
    per_pair = replay_units(1, 16) + replay_units(1, 0)
    pairs = max(1, work // per_pair)

    def engine(index: int) -> None:
        with KVCacheClient(address, pool="big", options=ClientOptions(timeout=120)) as kv:
            for n in range(index, pairs, clients):
                rid = f"single-{n}"
                assert kv.allocate(rid, [n % 30000 + 1] * 16, 16, start=True).ok
                kv.free(rid)

    threads = [threading.Thread(target=engine, args=(i,)) for i in range(clients)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return 2 * pairs, 2 * pairs


def restart(
    state_dir: Path, blocks: int, memory: int, *extra: str
) -> tuple[dict[str, Any], Child, str]:
    """Start `kvsvc serve` on ``state_dir`` and time it to the first answered engine call
    (the rank re-registers as soon as the server listens, as an agent retrying does)."""
    started = time.perf_counter()
    server = spawn(
        "server-restart",
        # INFO: the server logs its "state restored" line (once) at that level.
        serve_args(
            "big",
            state_dir,
            "--num-gpu-blocks-override",
            str(blocks + 1),
            "--log-level",
            "INFO",
            *extra,
        ),
    )
    try:
        port, _ = wait_for_ports(server, timeout=120)
        listening = time.perf_counter() - started
        address = f"127.0.0.1:{port}"
        agent = StandInAgent(address, "big", memory)
        quick = ClientOptions(timeout=30, backoff=0.005, max_backoff=0.02)
        with KVCacheClient(address, pool="big", options=quick) as kv:
            while True:
                try:
                    kv.block_table("live-0")
                    break
                except UnavailableError:  # until the rank reported
                    time.sleep(0.005)
            serving = time.perf_counter() - started
        agent.close()
        match = next((m for m in map(_RESTORED.search, server.lines) if m is not None), None)
        assert match is not None, server.output()
    except BaseException:
        stop_all([server])
        raise
    replayed = next((m for m in map(_REPLAYED.search, server.lines) if m is not None), None)
    figures = {
        "load_replay_s": float(match.group(1)),
        "rows_replayed": int(replayed.group(1)) if replayed else None,
        "listening_s": round(listening, 3),
        "first_call_s": round(serving, 3),
        "live_requests": int(match.group(2)),
        "cached_blocks": int(match.group(3)),
    }
    return figures, server, address


def bench_restart(tmp: Path, requests: int, blocks: int, scale: float = 1.0) -> dict[str, Any]:
    state_dir = tmp / "big"
    memory = (blocks + 1) * BLOCK_BYTES
    options = ClientOptions(timeout=120)
    server = spawn(
        "server-big", serve_args("big", state_dir, "--num-gpu-blocks-override", str(blocks + 1))
    )
    try:
        port, _ = wait_for_ports(server)
        address = f"127.0.0.1:{port}"
        agent = StandInAgent(address, "big", memory)
        with KVCacheClient(address, pool="big", options=options) as kv:
            built = fill(kv, requests)
        agent.close()
        server.stop(grace=120)  # graceful: ends with a snapshot
        snapshot_bytes = sum(p.stat().st_size for p in state_dir.iterdir())
        graceful, server, address = restart(state_dir, blocks, memory)
        server.stop(grace=120)
        # The most journal the defaults let a pool hold (just under the overdue bound),
        # of each kind of load, then kill -9. A server that takes no snapshot writes it
        # (the journal is the same rows a default server would hold at that moment).
        no_snapshots = tmp / "no-snapshots.toml"
        no_snapshots.write_text("state_snapshot_every = 1000000000000\n")
        work = int(0.98 * SNAPSHOT_OVERDUE_FACTOR * DEFAULT_SNAPSHOT_EVERY * scale)
        killed: dict[str, Any] = {}
        for load in ("decode_steps", "single_calls"):
            _, server, address = restart(state_dir, blocks, memory, "--config", str(no_snapshots))
            agent = StandInAgent(address, "big", memory)
            with KVCacheClient(address, pool="big", options=options) as kv:
                if load == "decode_steps":
                    rows, operations = decode_rows(kv, requests, work)
                else:
                    rows, operations = single_call_rows(address, work)
            agent.close()
            server.process.send_signal(signal.SIGKILL)
            server.process.wait(30)
            killed[load], server, address = restart(state_dir, blocks, memory)
            killed[load].update(journal_rows=rows, journal_operations=operations, units=work)
            server.stop(grace=120)  # a snapshot: the next load starts from an empty journal
    finally:
        stop_all([server])
    return {
        "built": built,
        "snapshot_dir_bytes": snapshot_bytes,
        "after_graceful_stop": graceful,
        "after_kill_with_journal": killed,
    }


def bench_sizes(tmp: Path, requests: int) -> dict[str, float]:
    """Snapshot bytes per live request and per cached block: a pool with live requests,
    the same after they all finished (their blocks stay cached), and an empty one."""
    sizes: dict[str, int] = {}
    counts: dict[str, dict[str, int]] = {}
    blocks = 100_000
    memory = (blocks + 1) * BLOCK_BYTES
    for case in ("empty", "finished", "live"):
        state_dir = tmp / f"size-{case}"
        server = spawn(
            f"server-{case}",
            serve_args("big", state_dir, "--num-gpu-blocks-override", str(blocks + 1)),
        )
        try:
            port, _ = wait_for_ports(server)
            address = f"127.0.0.1:{port}"
            agent = StandInAgent(address, "big", memory)
            with KVCacheClient(address, pool="big", options=ClientOptions(timeout=120)) as kv:
                if case != "empty":
                    step = kv.step()
                    for i in range(requests):
                        step.allocate(f"r{i}", [i + 1] * PROMPT, PROMPT, start=True)
                    assert all(r.ok for r in step.send(timeout=120))
                    if case == "finished":
                        kv.free(*[f"r{i}" for i in range(requests)])
                usage = kv.usage()
                counts[case] = {"requests": usage.num_requests, "cached": usage.num_cached_blocks}
            agent.close()
            server.stop(grace=60)  # ends with a snapshot
        finally:
            stop_all([server])
        sizes[case] = sum(p.stat().st_size for p in state_dir.glob("big.snapshot-*.db"))
    per_block = (sizes["finished"] - sizes["empty"]) / max(1, counts["finished"]["cached"])
    per_request = (sizes["live"] - sizes["finished"]) / max(1, counts["live"]["requests"])
    return {
        "bytes_per_cached_block": round(per_block, 1),
        "bytes_per_live_request": round(per_request, 1),
        "bytes_per_live_request_token": round(per_request / PROMPT, 2),
        "empty_pool_bytes_per_block": round(sizes["empty"] / blocks, 1),
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--quick", action="store_true", help="small sizes (a smoke run)")
    args = parser.parse_args()
    rounds = 3 if args.quick else 20
    requests = 500 if args.quick else BIG_REQUESTS
    blocks = 50_000 if args.quick else BIG_BLOCKS
    with tempfile.TemporaryDirectory() as name:
        tmp = Path(name)
        steps = bench_steps(tmp, rounds)
        restarts = bench_restart(tmp, requests, blocks, 0.1 if args.quick else 1.0)
        sizes = bench_sizes(tmp, 200 if args.quick else 1000)
    figures = {"step256": steps, "restart": restarts, "size": sizes, "quick": args.quick}
    if args.json:
        print(json.dumps(figures))
        return 0
    normal, full, memory = steps["normal"], steps["full"], steps["memory"]
    graceful, killed = restarts["after_graceful_stop"], restarts["after_kill_with_journal"]
    built = restarts["built"]
    print(
        f"kvsvc state benchmark ({'quick' if args.quick else 'full'} sizes; microseconds and "
        "seconds)"
    )
    rows = [
        ("Step 256 decode, no state dir", f"{memory['p50_us']:.0f}", f"{memory['p99_us']:.0f}", ""),
        (
            "  --state-dir (normal)",
            f"{normal['p50_us']:.0f}",
            f"{normal['p99_us']:.0f}",
            f"p50 +{normal['p50_overhead']:.1%} (goal <= {GOAL_STEP_OVERHEAD:.0%})",
        ),
        (
            "  --state-dir, full sync",
            f"{full['p50_us']:.0f}",
            f"{full['p99_us']:.0f}",
            f"p50 +{full['p50_overhead']:.1%}",
        ),
        (
            f"restart, {blocks:,} blocks, {built['live_requests']:,} live, "
            f"{built['cached_blocks']:,} cached: after a stop",
            f"{graceful['load_replay_s']:.2f} s load",
            f"{graceful['first_call_s']:.2f} s to serving",
            f"goal < {GOAL_RESTART_S:.0f} s",
        ),
        *(
            (
                f"  after kill -9, journal of {name}: {run['journal_rows']:,} rows, "
                f"{run['journal_operations']:,} operations",
                f"{run['load_replay_s']:.2f} s load+replay",
                f"{run['first_call_s']:.2f} s to serving",
                f"goal <= {GOAL_REPLAY_S:.0f} s",
            )
            for name, run in (
                ("decode Steps", killed["decode_steps"]),
                ("single calls", killed["single_calls"]),
            )
        ),
        (
            "state dir per live request (512 tokens)",
            f"{sizes['bytes_per_live_request']:.0f} B",
            "",
            "",
        ),
        ("state dir per cached block", f"{sizes['bytes_per_cached_block']:.1f} B", "", ""),
    ]
    if steps["journal"]:
        rows.append(
            (
                "journal per 256-op Step row",
                f"{steps['journal']['payload_bytes_per_step']} B",
                "",
                "",
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(4)]
    for row in rows:
        print("  ".join(c.ljust(widths[i]) for i, c in enumerate(row)).rstrip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
