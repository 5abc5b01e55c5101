"""Small traces in Mooncake's JSONL format, made for the replay tests (the shared trace
is not a fixture: the tests make their own of the same shape)."""

from __future__ import annotations

import json
from pathlib import Path


def write_trace(path: Path, rows: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def shared_first_block(
    requests: int,
    block: int,
    own_blocks: int = 3,
    every_ms: int = 100,
    output: int = 8,
    lead_ms: int = 0,
) -> list[dict[str, object]]:
    """Conversation-like: every prompt starts with the same block (a system prompt), then
    blocks of its own; prefix-only routing collapses onto one engine on it. The first
    request comes ``lead_ms`` before the others (so the index holds its blocks before they
    are routed, whatever the indexer's lag)."""
    return [
        {
            "timestamp": i * every_ms + (lead_ms if i else 0),
            "input_length": block * (1 + own_blocks),
            "output_length": output,
            "hash_ids": [0, *range(1 + i * own_blocks, 1 + (i + 1) * own_blocks)],
        }
        for i in range(requests)
    ]
