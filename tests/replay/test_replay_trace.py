"""The replay's trace reader, its bounds (kvsvc's core), and its flags: bad input named,
nothing started."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.replay.bounds import cache_bound
from kvsvc.replay.trace import TraceError, read_trace
from tests.replay.traces import shared_first_block, write_trace


def test_equal_ids_are_equal_tokens_and_only_there(tmp_path: Path) -> None:
    path = write_trace(
        tmp_path / "t.jsonl",
        [
            {"timestamp": 5, "input_length": 40, "output_length": 2, "hash_ids": [7, 9, 11]},
            {"timestamp": 0, "input_length": 20, "output_length": 1, "hash_ids": [7, 8]},
        ],
    )
    first, second = read_trace(path, 16)
    assert (first.index, first.arrival_s) == (1, 0.0)  # sorted by arrival
    a, b = first.prompt_tokens(16), second.prompt_tokens(16)
    assert len(a) == 20 and len(b) == 40
    assert a[:16] == b[:16] and a[16:] != b[16:20]
    assert len(set(b)) == 40
    assert first.output_tokens(0, 3) != second.output_tokens(0, 3)


@pytest.mark.parametrize(
    ("line", "named"),
    [
        ("not json", "line 2: not JSON"),
        ("[1, 2]", "line 2: expected a JSON object"),
        ('{"timestamp": 0, "output_length": 1, "hash_ids": [1]}', "line 2: input_length"),
        ('{"timestamp": -1, "input_length": 3, "output_length": 1, "hash_ids": [1]}', "timestamp"),
        ('{"timestamp": 0, "input_length": 40, "output_length": 1, "hash_ids": [1]}', "1 hash_ids"),
        (
            '{"timestamp": 0, "input_length": 4, "output_length": 0, "hash_ids": [1]}',
            "output_length",
        ),
        ('{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": ["a"]}', "hash_ids"),
    ],
)
def test_a_bad_line_is_named(tmp_path: Path, line: str, named: str) -> None:
    good = '{"timestamp": 0, "input_length": 4, "output_length": 1, "hash_ids": [1]}'
    path = tmp_path / "t.jsonl"
    path.write_text(f"{good}\n{line}\n")
    with pytest.raises(TraceError, match=named):
        read_trace(path, 16)


def test_the_bounds_from_the_core(tmp_path: Path) -> None:
    """Every prompt shares its first block: an infinite cache hits it on every request
    but the first. So does a pool of one prompt's blocks (the core's LRU): the shared
    block is held while each prompt allocates its own, which evict the previous ones."""
    trace = read_trace(write_trace(tmp_path / "t.jsonl", shared_first_block(10, 16)), 16)
    infinite = cache_bound(trace, 16, None)
    assert (infinite.cached_tokens, infinite.prompt_tokens) == (9 * 16, 10 * 64)
    assert cache_bound(trace, 16, 4).cached_tokens == 9 * 16
    assert cache_bound(trace[:1], 16, None).cached_tokens == 0


def test_the_shared_cache_bound_is_bounded_by_its_memory(tmp_path: Path) -> None:
    """A, B, A, B with nothing in common: the repeats hit 3 of their 4 blocks (one token
    is left to compute) where both prompts fit (8 blocks, or infinite), nothing where
    one does (4 blocks: B evicted A)."""
    rows = [
        {"timestamp": i, "input_length": 64, "output_length": 1, "hash_ids": ids}
        for i, ids in enumerate([[1, 2, 3, 4], [5, 6, 7, 8]] * 2)
    ]
    trace = read_trace(write_trace(tmp_path / "t.jsonl", rows), 16)
    assert cache_bound(trace, 16, None).cached_tokens == 2 * 48
    assert cache_bound(trace, 16, 8).cached_tokens == 2 * 48
    assert cache_bound(trace, 16, 4).cached_tokens == 0


def kvsvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", *args], capture_output=True, text=True, timeout=60
    )


@pytest.mark.parametrize(
    ("flags", "named"),
    [
        (["--engines", "0"], "--engines"),
        (["--engines", "4,x"], "--engines"),
        (["--kv-tokens", "8"], "--kv-tokens 8 is less than one block"),
        (["--kv-tokens", "64"], "does not fit in --kv-tokens 64"),
        (["--policies", "round-robin,best"], "unknown best"),
        (["--time-scale", "0"], "--time-scale"),
        (["--load-weight", "-1"], "--load-weight"),
        (["--prefill-tps", "0"], "--prefill-tps"),
    ],
)
def test_bad_flags_are_named_and_nothing_starts(
    tmp_path: Path, flags: list[str], named: str
) -> None:
    trace = write_trace(tmp_path / "t.jsonl", shared_first_block(3, 16))
    result = kvsvc("replay", str(trace), "--trace-block-size", "16", *flags)
    assert result.returncode == 2 and named in result.stderr, result.stderr
    assert result.stdout == ""


def test_a_missing_trace_is_named(tmp_path: Path) -> None:
    result = kvsvc("replay", str(tmp_path / "nope.jsonl"))
    assert result.returncode == 2 and "nope.jsonl" in result.stderr
