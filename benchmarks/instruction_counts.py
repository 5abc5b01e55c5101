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
from pathlib import Path
from typing import Any

from kvsvc_client._wire import StepBuilder, allocate_request

import kvsvc.native
from kvsvc.core import PoolKVCache
from kvsvc.core.pool_types import RequestStart
from kvsvc.server.calls import apply_allocate, apply_step_call, decode_allocate, decode_step
from kvsvc.server.step_codec import parse_step_request
from kvsvc.specs import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from kvsvc.v1 import kvcache_pb2 as pb

MODES = ("step", "allocate")
BATCH = 256
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

    def __init__(self, mode: str, calls: int) -> None:
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        self.mode = mode
        self.counters = _Counters()
        # Room for the running requests and every block the counted calls take, all of
        # it cycled through cached prefixes below before the first counted call.
        blocks_per_request = -(-(80 + calls + 1) // BLOCK_SIZE) + 1
        num_blocks = BATCH * blocks_per_request + 2 * PROMPT // BLOCK_SIZE + 1
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
            for r in range(BATCH):
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
                for r in range(BATCH):
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


def count(valgrind: str, mode: str, calls: int, make: bool, pure: bool) -> int:
    """Instructions of one process: the workload of ``calls`` calls set up, then (``make``)
    the calls made. Both processes of a figure set up the same: only the calls differ."""
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    env.pop("KVSVC_PURE_PYTHON", None)
    if pure:
        env["KVSVC_PURE_PYTHON"] = "1"
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


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help=f"{QUICK_CALLS} calls per mode")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument(
        "--child", nargs=3, metavar=("MODE", "CALLS", "MAKE"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.child:
        mode, calls, make = args.child[0], int(args.child[1]), args.child[2] == "make"
        workload = Workload(mode, calls)
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
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
