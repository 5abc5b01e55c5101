"""A conversation-shaped request trace for ``kvsvc replay``, in Mooncake's JSONL format.

The shared trace in the repository's sibling ``traces/`` folder has no common first
block; real conversation traffic has one (a system prompt) in nearly every request, and
follow-up turns that extend an earlier prompt. That is the shape where routing by the
cached prefix alone collapses onto one engine (the longest prefix of every new
conversation is the system prompt, cached where the first one went). This makes such a
trace, shaped like Mooncake's public conversation trace (kvcache-ai/Mooncake,
``FAST25-release/traces/conversation_trace.jsonl``: about 12,000 requests an hour, mean
prompt about 12k tokens, an infinite cache hitting about 37% of prompt tokens):

- conversations start as a Poisson process; each starts with the shared system block and
  a user text of log-normal length (median ``--first-median`` tokens);
- a conversation goes on with probability ``--follow``: the next turn comes after an
  exponential think time (mean ``--think`` seconds) and its prompt is the previous one's
  full blocks, then the previous answer and a new user text (new blocks);
- outputs are log-normal (median 300 tokens), at most 2,000.

Usage: ``python benchmarks/conversation_trace.py OUT.jsonl [--minutes 20] [--seed 1]``,
then ``kvsvc replay OUT.jsonl``. The defaults give, for 20 minutes: ~3,400 requests, mean
prompt ~11k tokens, an infinite-cache hit ratio of ~0.32.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
from pathlib import Path

BLOCK = 512


def conversations(
    seed: int,
    minutes: float,
    rate: float,
    first_median: int,
    follow: float,
    added_median: int,
    think_s: float,
) -> list[dict[str, object]]:
    """The trace's requests, by arrival (see the module's docstring)."""
    rng = random.Random(seed)
    next_id = 1
    out: list[dict[str, object]] = []
    end = minutes * 60
    t = 0.0
    while True:
        t += rng.expovariate(rate * (1 - follow))  # new conversations
        if t >= end:
            break
        length = BLOCK + max(
            100, min(int(rng.lognormvariate(math.log(first_median), 1.0)), 150_000)
        )
        blocks = [0]  # the system prompt's block
        for _ in range(-(-length // BLOCK) - 1):
            blocks.append(next_id)
            next_id += 1
        at = t
        while at < end:
            output = max(1, min(2000, int(rng.lognormvariate(math.log(300), 0.9))))
            out.append(
                {
                    "timestamp": int(at * 1000),
                    "input_length": length,
                    "output_length": output,
                    "hash_ids": list(blocks),
                }
            )
            if rng.random() > follow:
                break
            keep = length // BLOCK  # the full blocks; the partial last one is extended
            length += output + max(10, int(rng.lognormvariate(math.log(added_median), 1.0)))
            blocks = blocks[:keep]
            for _ in range(-(-length // BLOCK) - keep):
                blocks.append(next_id)
                next_id += 1
            at += rng.expovariate(1 / think_s)
    out.sort(key=lambda row: row["timestamp"])  # type: ignore[arg-type, return-value]
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", help="the JSONL file to write")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--minutes", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=3.34, help="requests per second")
    parser.add_argument("--first-median", type=int, default=5500, help="first user text, tokens")
    parser.add_argument("--follow", type=float, default=0.4, help="chance of a next turn")
    parser.add_argument("--added-median", type=int, default=2500, help="a turn's new text")
    parser.add_argument("--think", type=float, default=300.0, help="mean think time, s")
    args = parser.parse_args(argv)
    rows = conversations(
        args.seed, args.minutes, args.rate, args.first_median, args.follow,
        args.added_median, args.think,
    )  # fmt: skip
    Path(args.out).write_text("".join(json.dumps(row) + "\n" for row in rows))
    prompts = [int(row["input_length"]) for row in rows]  # type: ignore[call-overload]
    print(
        f"{args.out}: {len(rows):,} requests over {args.minutes:g} min, mean prompt "
        f"{sum(prompts) / len(prompts):,.0f} tokens",
        file=sys.stderr,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
