"""The cluster commands' bad input: one line naming the flag, exit status 2, nothing run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvsvc.cluster.commands import read_tokens_file
from kvsvc.cluster.indexer import read_sources_file
from tests.cluster.redis_procs import require_redis_package

require_redis_package()


def kvsvc(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsvc", *args], capture_output=True, text=True, timeout=60
    )


def test_an_indexer_without_sources_or_with_a_bad_one_stops_at_once() -> None:
    result = kvsvc("indexer", "--redis", "redis://127.0.0.1:1")
    assert result.returncode == 2 and "--source HOST:PORT/POOL" in result.stderr
    result = kvsvc("indexer", "--redis", "redis://127.0.0.1:1", "--source", "nopool")
    assert result.returncode == 2 and "expected HOST:PORT/POOL" in result.stderr


def test_an_unreachable_redis_is_named() -> None:
    # Its /metrics on any free port: the ports are checked before Redis is asked.
    result = kvsvc(
        "indexer",
        "--redis",
        "redis://127.0.0.1:1",
        "--source",
        "h:1/p",
        "--metrics-listen",
        "127.0.0.1:0",
    )
    assert result.returncode == 1 and "--redis redis://127.0.0.1:1" in result.stderr


def test_a_tokens_file_with_a_word_that_is_no_token_id(tmp_path: Path) -> None:
    path = tmp_path / "prompt"
    path.write_text("1 2 3\n4 x5 6\n")
    with pytest.raises(ValueError, match=r"word 5 \('x5'\) is not a token id"):
        read_tokens_file(str(path))
    path.write_text("1 2 2147483648")
    with pytest.raises(ValueError, match="word 3"):
        read_tokens_file(str(path))
    result = kvsvc("ctl", "score", "--redis", "redis://127.0.0.1:1", "--tokens-file", str(path))
    assert result.returncode == 2 and "--tokens-file" in result.stderr


def test_a_sources_file_names_its_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "sources"
    path.write_text("# fleet\n10.0.0.1:50051/llama\n\nnot-a-source\n")
    with pytest.raises(ValueError, match="line 4"):
        read_sources_file(str(path))
    path.write_text("# fleet\n10.0.0.1:50051/llama\nunix:/run/kvsvc.sock/llama\n")
    assert read_sources_file(str(path)) == ["10.0.0.1:50051/llama", "unix:/run/kvsvc.sock/llama"]
