"""Instructions per call of the pool's hot paths, counted by valgrind: a figure noise cannot move.

On the 2-core VM the benchmarks run on, two timed runs of the same build differ by 10-30%
(rpc_bench's server-side `apply` of a 256-decode Step read 210-253 us in three runs of one
build), so a change worth a few percent is invisible in wall time. The instructions a call
executes do not depend on what else the machine runs: this counts them with valgrind
(``cachegrind`` without its cache simulation), for the work rpc_bench's server does per call:

- ``step``: a Step of one decode token for each of 256 running requests (prompts of 64..79
  tokens, as rpc_bench's), decoded from its bytes, applied, its reply written, and the
  events it made drained as the server drains them; in a pool whose free blocks all hold
  cached prefixes, so that every block a decode takes evicts one (index removal and its
  event), as in a server that has run a while;
- ``allocate``: a new 2048-token admission whose first 1,024 tokens every admission shares
  (rpc_bench's), decoded, hashed, looked up, allocated, its reply written and its events
  drained; freed after (counted too: one admission's whole life).

- ``--server``: a framed Step of one decode token for each of 32 running requests (an
  engine's step in vllm_bench), counted in a whole ``kvsvc serve`` process: the frame's
  read, the event loop, the handler and its accounting, the reply's write, as well as the
  pool's work. Beside it, the same Step's handler work alone (``step`` at 32 decodes), so
  the difference is what a call costs around the pool: the transport and the glue. The
  server runs under valgrind with busy polling off (its spin depends on timing), its CPU
  agent beside it uncounted; each of the two servers is stopped with SIGTERM once its
  calls are made (the one without calls after waiting as long as the other's took, so
  their timers' work cancels too).

Each count is ``(I(n) - I(0)) / n``: a process that makes the pool and the requests of
``n`` calls and then the calls, less one that makes the same and no call, so the
interpreter's start, the imports and the setup cancel out. ``PYTHONHASHSEED`` is fixed, so
two runs of one build agree to a few hundred instructions. Both builds are counted where
the compiled one is installed (the pure-Python core in a process with
``KVSVC_PURE_PYTHON=1``), and their ratio printed. Needs valgrind (``apt-get install
valgrind``); a run takes a few minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from kvsvc_client import KVCacheClient
from kvsvc_client._wire import StepBuilder, allocate_request

import kvsvc.native
from kvsvc.core import PoolKVCache
from kvsvc.core.pool_types import RequestStart
from kvsvc.demo.processes import Child, wait_for_ports
from kvsvc.server.calls import apply_allocate, apply_step_call, decode_allocate, decode_step
from kvsvc.server.step_codec import parse_step_request
from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvsvc.v1 import kvcache_pb2 as pb

MODES = ("step", "allocate")
BATCH = 256
# --server: the requests of the whole-server Step (an engine's batch in vllm_bench), and
# its calls per figure.
SERVER_BATCH = 32
SERVER_CALLS = 300
QUICK_SERVER_CALLS = 100
BLOCK_SIZE = 16
SHARED_PREFIX = 1024
PROMPT = 2048
# Calls counted per mode (--quick: fewer; the per-call figure is the same to ~1%).
CALLS = 100
QUICK_CALLS = 20
_I_REFS = re.compile(r"I\s+refs:\s+([\d,]+)")


class Workload:
    """A pool shaped as rpc_bench's server's (one full-attention group, block size 16,
    xxh3_128, events on) and the calls of one mode, made ready before any is counted."""

    def __init__(self, mode: str, calls: int, batch: int = BATCH) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.counters = _Counters()
        # Room for the running requests and every block the counted calls take, all of
        # it cycled through cached prefixes below before the first counted call.
        blocks_per_request = -(-(80 + calls + 1) // BLOCK_SIZE) + 1
        num_blocks = batch * blocks_per_request + 2 * PROMPT // BLOCK_SIZE + 1
        spec = FullAttentionSpec(
            block_size=BLOCK_SIZE, num_kv_heads=1, head_size=64, dtype="float16"
        )
        config = KVCacheConfig(
            num_blocks=num_blocks, kv_cache_groups=[KVCacheGroupSpec(["layer0"], spec)]
        )
        self.cache = PoolKVCache(
            config, max_model_len=8192, hash_algo="xxh3_128", enable_events=True
        )
        if mode == "step":
            admit = StepBuilder("bench")
            for r in range(batch):
                length = 64 + r % 16
                prompt = [(r * 31 + j) % 30000 + 1 for j in range(length)]
                admit.allocate(f"dec-{r}", prompt, length, start=True)
            self._apply(admit.to_pb().SerializeToString())
        self._fill_with_cached_blocks()
        self.requests: list[bytes] = []
        # Allocate: one more admission first, made in both processes, so that the shared
        # prefix is cached for every counted one (as for rpc_bench's, after its first).
        for i in range(-1 if mode == "allocate" else 0, calls):
            if mode == "step":
                step = StepBuilder("bench")
                for r in range(batch):
                    step.allocate(f"dec-{r}", [i % 30000 + 1], 1)
                self.requests.append(step.to_pb().SerializeToString())
            else:
                prompt = list(range(1, SHARED_PREFIX + 1)) + [
                    (i * 7919 + j) % 30000 + 1 for j in range(PROMPT - SHARED_PREFIX)
                ]
                message = allocate_request("bench", f"new-{i}", prompt, PROMPT, 0, True)
                self.requests.append(message.SerializeToString())
        if mode == "allocate":
            self.call(self.requests.pop(0))

    def _fill_with_cached_blocks(self) -> None:
        """Admit and free distinct prompts until every free block has held a cached one:
        each block a counted call takes then evicts a prefix (untimed setup)."""
        pool = self.cache.manager.block_pool
        filler = 0
        while pool.num_evictions == 0:
            prompt = [(filler * 7919 + j) % 30000 + 1 for j in range(PROMPT)]
            request_id = f"fill-{filler}"
            outcome = self.cache.allocate(request_id, prompt, PROMPT, 0, RequestStart())
            if not outcome.ok:
                raise RuntimeError("the pool cannot hold one admission: make it larger")
            self.cache.free([request_id])
            filler += 1
        self.cache.take_event_batches()

    def _apply(self, data: bytes) -> bool:
        """A Step as the server's handler applies it (``apply_step_call``: the pool's work
        and the reply's bytes), then its events drained; whether it changed the pool."""
        columns = decode_step(parse_step_request(data), "", 1 << 20)
        reply, changed = apply_step_call(self.cache, columns, "", self.counters)
        reply.SerializeToString()
        self.cache.take_event_batches()
        return changed

    def run(self) -> None:
        """Make every call of this mode (what the counted process does after its setup)."""
        for data in self.requests:
            self.call(data)

    def call(self, data: bytes) -> None:
        """One call of this mode, from its request's bytes."""
        if self.mode == "step":
            if not self._apply(data) or self.counters.allocate_no_space:
                raise RuntimeError("a decode was not OK: the pool is too small")
            return
        # As the server's handler: the pool's work and the reply's bytes.
        call = decode_allocate(pb.AllocateRequest.FromString(data), "")
        reply, _, outcome = apply_allocate(self.cache, call)
        if not outcome.ok:
            raise RuntimeError("an admission got NO_SPACE: the pool is too small")
        reply.SerializeToString()
        self.cache.take_event_batches()
        self.cache.free([call.request_id])


class _Counters:
    """Where apply_step counts outcomes (the server's metrics; nothing here)."""

    allocate_ok = allocate_no_space = preempt_requests = free_requests = freed_blocks = 0


def parse_instructions(valgrind_stderr: str) -> int:
    """The ``I refs`` total of a cachegrind run's summary."""
    match = _I_REFS.search(valgrind_stderr)
    if match is None:
        raise RuntimeError(f"no instruction total in valgrind's output:\n{valgrind_stderr[-2000:]}")
    return int(match.group(1).replace(",", ""))


def per_call(with_calls: int, without_calls: int, calls: int) -> float:
    """Instructions per call from a run with ``calls`` calls and one with none."""
    if calls <= 0:
        raise ValueError(f"calls must be positive, got {calls}")
    return (with_calls - without_calls) / calls


def _counted_env(pure: bool) -> dict[str, str]:
    """A counted process's environment: the hash seed fixed, the build chosen."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop(kvsvc.native.PURE_ENV, None)
    if pure:
        env[kvsvc.native.PURE_ENV] = "1"
    return env


def count(valgrind: str, mode: str, calls: int, make: bool, pure: bool, batch: int = BATCH) -> int:
    """Instructions of one process: the workload of ``calls`` calls set up, then (``make``)
    the calls made. Both processes of a figure set up the same: only the calls differ."""
    env = _counted_env(pure)
    with tempfile.TemporaryDirectory(prefix="kvsvc-icount-") as tmp:
        done = subprocess.run(
            [
                valgrind,
                "--tool=cachegrind",
                "--cache-sim=no",
                f"--cachegrind-out-file={Path(tmp) / 'out'}",
                sys.executable,
                __file__,
                "--child",
                mode,
                str(calls),
                "make" if make else "setup-only",
                "--batch",
                str(batch),
            ],
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
    if done.returncode != 0:
        raise RuntimeError(
            f"the counted process failed ({done.returncode}):\n{done.stderr[-3000:]}"
        )
    return parse_instructions(done.stderr)


# The server's KV cache: one full-attention layer of rpc_bench's shape.
_SERVER_SPECS = {
    "model.layers.0.self_attn.attn": {
        "type": "full_attention",
        "block_size": BLOCK_SIZE,
        "num_kv_heads": 1,
        "head_size": 64,
        "dtype": "float16",
    }
}
_SERVER_START_S = 600.0  # a server's start under valgrind (its imports, interpreted)


def server_steps(target: str, calls: int, batch: int = SERVER_BATCH, pool: str = "bench") -> float:
    """The client of a counted server: admit ``batch`` requests of 64-79 tokens (one
    Step), then ``calls`` decode Steps of one token each, every one checked OK. Returns
    the seconds the decode Steps took (the uncounted twin waits as long)."""
    with KVCacheClient(target, pool=pool) as kv:
        kv.wait_until_ready(timeout=_SERVER_START_S)
        admit = kv.step()
        for r in range(batch):
            length = 64 + r % 16
            admit.allocate(
                f"dec-{r}", [(r * 31 + j) % 30000 + 1 for j in range(length)], length, start=True
            )
        if not all(result.ok for result in admit.send(timeout=_SERVER_START_S)):
            raise RuntimeError("the server refused an admission: make its pool larger")
        started = time.perf_counter()
        for i in range(calls):
            step = kv.step()
            for r in range(batch):
                step.allocate(f"dec-{r}", [i % 30000 + 1], 1)
            results = step.send(timeout=_SERVER_START_S)
            if len(results) != batch or results.no_space_indices() or results.error_indices():
                raise RuntimeError("a decode was not OK: the server's pool is too small")
        return time.perf_counter() - started


def server_count(valgrind: str, calls: int, pure: bool, wait_s: float = 0.0) -> tuple[int, float]:
    """Instructions of a whole ``kvsvc serve`` process (and the seconds its calls took)
    that served :func:`server_steps` with ``calls`` decode Steps over a framed Unix
    socket; with none, it waits ``wait_s`` before it is stopped."""
    env = _counted_env(pure)
    with tempfile.TemporaryDirectory(prefix="kvsvc-icount-") as tmp:
        spec_file = Path(tmp) / "specs.json"
        spec_file.write_text(json.dumps(_SERVER_SPECS))
        frames = f"unix:{tmp}/frames.sock"
        log = Path(tmp) / "valgrind.log"
        # fmt: off
        server = subprocess.Popen(
            [
                valgrind, "--tool=cachegrind", "--cache-sim=no", "--cachegrind-out-file=/dev/null",
                f"--log-file={log}", sys.executable, "-m", "kvsvc", "serve",
                "--listen", "127.0.0.1:0", "--frames-listen", frames,
                "--metrics-listen", "off", "--pool", "bench", "--max-model-len", "4096",
                "--busy-poll-us", "0",
            ],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )
        # fmt: on
        worker = None
        try:
            # Its output read (and kept for an error) as kvsvc's demo reads its servers'.
            counted = Child("counted server", server)
            counted.start_reader()
            port, _ = wait_for_ports(counted, timeout=_SERVER_START_S)
            # fmt: off
            worker = subprocess.Popen(
                [
                    sys.executable, "-m", "kvsvc", "worker", "--server", f"127.0.0.1:{port}",
                    "--pool", "bench", "--rank", "0", "--world-size", "1", "--device", "cpu",
                    "--spec-file", str(spec_file), "--kv-cache-memory", "64MiB",
                ],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )
            # fmt: on
            took = server_steps(f"frames:{frames}", calls)
            if not calls:
                time.sleep(wait_s)
        finally:
            if worker is not None:
                worker.terminate()
                worker.wait(60)
            server.terminate()
            server.wait(_SERVER_START_S)
        return parse_instructions(log.read_text()), took


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_CALLS} calls per mode")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--server",
        action="store_true",
        help=f"also count a whole server process's framed Step of {SERVER_BATCH} decodes",
    )
    parser.add_argument(
        "--child", nargs=3, metavar=("MODE", "CALLS", "MAKE"), help=argparse.SUPPRESS
    )
    parser.add_argument("--batch", type=int, default=BATCH, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        mode, calls, make = args.child[0], int(args.child[1]), args.child[2] == "make"
        workload = Workload(mode, calls, args.batch)
        if make:
            workload.run()
        return 0
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("instruction_counts: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    builds = ["compiled", "pure"] if kvsvc.native.BUILD == "mypyc" else ["pure"]
    calls = QUICK_CALLS if args.quick else CALLS
    figures: dict[str, Any] = {"calls": calls, "builds": builds}
    for mode in MODES:
        for build in builds:
            pure = build == "pure"
            figures[f"{mode}_{build}_instructions"] = round(
                per_call(
                    count(valgrind, mode, calls, True, pure),
                    count(valgrind, mode, calls, False, pure),
                    calls,
                )
            )
        if len(builds) == 2:
            figures[f"{mode}_compiled_vs_pure"] = round(
                figures[f"{mode}_compiled_instructions"] / figures[f"{mode}_pure_instructions"], 3
            )
    if args.server:
        server_calls = QUICK_SERVER_CALLS if args.quick else SERVER_CALLS
        figures["server_calls"] = server_calls
        build = builds[0]  # the compiled one where it is installed
        made, took = server_count(valgrind, server_calls, build == "pure")
        idle, _ = server_count(valgrind, 0, build == "pure", wait_s=took)
        whole = round(per_call(made, idle, server_calls))
        handler = round(
            per_call(
                count(valgrind, "step", calls, True, build == "pure", SERVER_BATCH),
                count(valgrind, "step", calls, False, build == "pure", SERVER_BATCH),
                calls,
            )
        )
        figures["server_step_build"] = build
        figures["server_step_instructions"] = whole
        figures["server_step_handler_instructions"] = handler
        figures["server_step_around_the_pool_instructions"] = whole - handler
    if args.json:
        print(json.dumps(figures))
        return 0
    print(f"kvsvc instructions per call (valgrind, {calls} calls per figure)")
    print(f"{'call':58} {'build':10} {'instructions':>14}  ratio")
    names = {
        "step": "Step, 256 decodes (decode, apply, reply, events drained)",
        "allocate": "Allocate, new 2048-token admission, and its free",
    }
    for mode in MODES:
        for build in builds:
            ratio = (
                f"{figures[f'{mode}_compiled_vs_pure']:.2f}x the pure core"
                if build == "compiled"
                else ""
            )
            instructions = figures[f"{mode}_{build}_instructions"]
            print(f"{names[mode]:58} {build:10} {instructions:>14,}  {ratio}")
    if args.server:
        whole = figures["server_step_instructions"]
        handler = figures["server_step_handler_instructions"]
        build = figures["server_step_build"]
        print(
            f"\nframed Step, {SERVER_BATCH} decodes, the whole server process "
            f"({figures['server_calls']} calls)"
        )
        rows = (
            ("all of it: transport, event loop, handler, pool", whole),
            (f"the handler's work (Step, {SERVER_BATCH} decodes, as above)", handler),
            ("around the pool: transport, event loop, glue", whole - handler),
        )
        for name, instructions in rows:
            print(f"  {name:56} {build:10} {instructions:>14,}  {instructions / whole:.2f} of it")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
