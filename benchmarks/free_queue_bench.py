"""What a page of a pool's free queue costs (``StepRequest.free_queue_head_offset``).

A 4M-block pool whose free queue is all LRU region (every block cached once, then freed:
a pool that served for a while), in the core (no RPC). Side by side in one run:

  before   the page as it was read until issue 32: ``islice`` over the queue from its
           front, O(offset) (what a 13-byte Step cost the event loop: 0.4-0.9 s)
  now      ``FreeBlockQueue.page``: from the nearest of the front, the back and the
           cursor the last page left; a start further than MAX_FREE_QUEUE_WALK links from
           all of them is refused before anything is read (``page_walk``, O(1))

Cases: the attack's offset 2^31 - 1 (past the end), 16 ids mid-pool (refused now: the
figure is the check that refuses it), the last page (read backward from the back now),
and the whole queue read page after page (vLLM on kvsvc's start: quadratic before).
Medians of ``--rounds`` runs.

Usage: python benchmarks/free_queue_bench.py [--blocks 4194304] [--rounds 5] [--json]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvsvc.core import MAX_FREE_QUEUE_WALK, FreeBlockQueue  # noqa: E402
from kvsvc.native import BUILD  # noqa: E402

PAGE = 65536


def lru_queue(num_blocks: int) -> FreeBlockQueue:
    """Every free id in the LRU region, in an order unlike the ids'."""
    queue = FreeBlockQueue(num_blocks)
    queue.popleft_n(num_blocks - 1)
    queue.append_n(range(num_blocks - 1, 0, -1))
    return queue


def before(queue: FreeBlockQueue, offset: int, limit: int = PAGE) -> list[int]:
    offset = min(offset, queue.num_blocks)
    return list(itertools.islice(queue, offset, offset + limit))


def now(queue: FreeBlockQueue, offset: int, limit: int = PAGE) -> list[int]:
    if queue.page_walk(offset, limit) > MAX_FREE_QUEUE_WALK:
        return []  # refused (INVALID_ARGUMENT): nothing is read
    return queue.page(offset, limit)


def whole(read: Callable[[FreeBlockQueue, int], list[int]], queue: FreeBlockQueue) -> int:
    offset = 0
    while True:
        page = read(queue, offset)
        offset += len(page)
        if len(page) < PAGE:
            return offset


def timed(fn: Callable[[], Any], rounds: int) -> float:
    samples = []
    for _ in range(rounds):
        started = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--blocks", type=int, default=4 << 20, help="pool size, null block in")
    parser.add_argument("--rounds", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    args = parser.parse_args()
    queue = lru_queue(args.blocks)
    free = args.blocks - 1
    cases: list[tuple[str, Callable[[], Any], Callable[[], Any]]] = [
        ("page at 2^31 - 1", lambda: before(queue, 2**31 - 1), lambda: now(queue, 2**31 - 1)),
        (
            "16 ids mid-pool",
            lambda: before(queue, free // 2, 16),
            lambda: now(queue, free // 2, 16),
        ),
        ("last page", lambda: before(queue, free - PAGE), lambda: now(queue, free - PAGE)),
    ]
    rows = []
    for name, old, new in cases:
        rows.append((name, timed(old, args.rounds), timed(new, args.rounds)))
    assert whole(now, queue) == free
    rows.append(
        (
            "whole queue, page after page",
            timed(lambda: whole(before, queue), 1),
            timed(lambda: whole(now, queue), args.rounds),
        )
    )
    figures = {
        "blocks": args.blocks,
        "build": BUILD,
        "seconds": {name: {"before": b, "now": n} for name, b, n in rows},
    }
    if args.json:
        print(json.dumps(figures))
        return 0
    print(
        f"free-queue pages of a {args.blocks:,}-block pool, all of it cached once ({BUILD} "
        f"core; medians of {args.rounds})"
    )
    print(f"  {'case':<30} {'before':>12} {'now':>12} {'now/before':>11}")
    for name, b, n in rows:
        print(f"  {name:<30} {b * 1e3:>10.3f}ms {n * 1e3:>10.3f}ms {n / b:>11.5f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
