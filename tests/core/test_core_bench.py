"""The core benchmark runs (small sizes) and reports every key the issue asks for."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "benchmarks" / "core_bench.py"


def test_quick_run_prints_the_json_keys(capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("core_bench", BENCH)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["core_bench"] = module  # dataclasses look their module up there
    try:
        spec.loader.exec_module(module)
    finally:
        del sys.modules["core_bench"]
    assert module.main(["--quick", "--json", "--runs", "2"]) == 0
    results = json.loads(capsys.readouterr().out)
    for key in (
        "pool_build_1m_s",
        "pool_bytes_per_block",
        "alloc_free_cycle_us",
        "hash_xxh3_tokens_per_s",
        "hash_sha256_tokens_per_s",
        "decode_allocate_us_p50",
        "prompt_allocate_us_p50",
        "hit_rate",
    ):
        assert results[key] > 0, key
    # 16 requests sharing half of each prompt: the first misses, the rest hit half.
    assert results["hit_rate"] == pytest.approx(15 / 32)
    assert module.main(["--quick", "--runs", "1"]) == 0
    assert "pool build, 1M blocks" in capsys.readouterr().out
