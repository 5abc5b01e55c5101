"""How long the planner takes for large models: the server plans when a pool's ranks have
all registered, and ``kvsvc plan`` runs it interactively. Goal: under 50 ms.

Times ``plan_kv_cache`` alone (the specs are built once, as the server receives them) and,
separately, building the per-rank specs from a config. Prints a table, or one JSON object
with ``--json``.

    python benchmarks/plan_bench.py [--runs 30] [--json]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvsvc.models import (
    ModelSpecOptions,
    bundled_config_path,
    default_max_model_len,
    layer_specs_all_ranks,
    load_model_config,
    total_num_kv_heads,
)
from kvsvc.planner import AUTO_FIT, PlannerOptions, plan_kv_cache
from kvsvc.specs import KVCacheSpec, MLAAttentionSpec, SlidingWindowMLASpec

GOAL_MS = 50.0
GIB = 2**30


@dataclass
class Shape:
    name: str
    worker_specs: list[dict[str, KVCacheSpec]]
    memory: list[int]
    options: PlannerOptions
    build_specs: Callable[[], object] | None = None


def _hybrid_swa_128(pp: int, tp: int, auto_fit: bool) -> Shape:
    # Gemma-3-like: 3 sliding-window layers to 1 full-attention layer, 128 layers
    config = {
        "model_type": "gemma3_text",
        "num_hidden_layers": 128,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "sliding_window": 4096,
        "sliding_window_pattern": 4,
        "max_position_embeddings": 131072,
        "torch_dtype": "bfloat16",
    }
    opts = ModelSpecOptions(tp=tp, pp=pp)
    specs = layer_specs_all_ranks(config, opts)
    name = f"hybrid full+SWA 1:3, 128 layers, TP={tp} PP={pp}" + (", auto-fit" if auto_fit else "")
    return Shape(
        name,
        specs,
        [40 * GIB] * len(specs),
        PlannerOptions(
            max_model_len=AUTO_FIT if auto_fit else 131072,
            derived_max_model_len=131072,
            tensor_parallel_size=tp,
            total_num_kv_heads=8,
        ),
        lambda: layer_specs_all_ranks(config, opts),
    )


def _hybrid_mamba_128(pp: int) -> Shape:
    # Jamba-like: one attention layer in 8, the rest Mamba-1, 128 layers
    config = dict(load_model_config(bundled_config_path("jamba-v0.1")), num_hidden_layers=128)
    opts = ModelSpecOptions(tp=2, pp=pp)
    specs = layer_specs_all_ranks(config, opts)
    return Shape(
        f"hybrid attention+Mamba 1:7, 128 layers, TP=2 PP={pp}",
        specs,
        [40 * GIB] * len(specs),
        PlannerOptions(
            max_model_len=default_max_model_len(config),
            tensor_parallel_size=2,
            enable_prefix_caching=False,
        ),
        lambda: layer_specs_all_ranks(config, opts),
    )


def _bundled(name: str, tp: int, pp: int, auto_fit: bool) -> Shape:
    config = load_model_config(bundled_config_path(name))
    opts = ModelSpecOptions(tp=tp, pp=pp)
    specs = layer_specs_all_ranks(config, opts)
    return Shape(
        f"{name}, TP={tp} PP={pp}" + (", auto-fit" if auto_fit else ""),
        specs,
        [60 * GIB] * len(specs),
        PlannerOptions(
            max_model_len=AUTO_FIT if auto_fit else default_max_model_len(config),
            derived_max_model_len=default_max_model_len(config),
            tensor_parallel_size=tp,
            total_num_kv_heads=total_num_kv_heads(config),
        ),
        lambda: layer_specs_all_ranks(config, opts),
    )


def _packed_mla_128(pp: int) -> Shape:
    # DeepSeek-V4-like mixed pages: MLA + indexer pairs and sliding-window MLA layers,
    # packed block-outermost
    specs: dict[str, KVCacheSpec] = {}
    for i in range(128):
        if i % 2 == 0:
            specs[f"model.layers.{i}.attn"] = MLAAttentionSpec(
                block_size=64, num_kv_heads=1, head_size=576, dtype="bfloat16"
            )
            specs[f"model.layers.{i}.indexer"] = MLAAttentionSpec(
                block_size=64, num_kv_heads=1, head_size=132, dtype="uint8"
            )
        else:
            specs[f"model.layers.{i}.attn"] = SlidingWindowMLASpec(
                block_size=64, num_kv_heads=1, head_size=1024, dtype="bfloat16", sliding_window=128
            )
    per_stage = 128 // pp
    workers = [
        {n: s for n, s in specs.items() if int(n.split(".")[2]) // per_stage == stage}
        for stage in range(pp)
    ]
    return Shape(
        f"packed MLA+indexer+SWA-MLA, 128 layers, block-outer, PP={pp}",
        workers,
        [40 * GIB] * pp,
        PlannerOptions(max_model_len=131072, layout="block_outer"),
    )


def _time(fn: Callable[[], object], runs: int) -> list[float]:
    fn()  # warm-up
    samples = []
    for _ in range(runs):
        start = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def measure(runs: int) -> dict[str, Any]:
    shapes = [
        _hybrid_swa_128(pp=4, tp=1, auto_fit=False),
        _hybrid_swa_128(pp=4, tp=2, auto_fit=True),
        _hybrid_mamba_128(pp=4),
        _bundled("llama-3.1-8b", tp=8, pp=1, auto_fit=False),
        _bundled("deepseek-v3", tp=8, pp=2, auto_fit=True),
        _bundled("gemma-3-12b", tp=2, pp=2, auto_fit=True),
        _packed_mla_128(pp=4),
    ]
    results = []
    for shape in shapes:
        plan_ms = _time(lambda s=shape: plan_kv_cache(s.worker_specs, s.memory, s.options), runs)
        plan = plan_kv_cache(shape.worker_specs, shape.memory, shape.options)
        specs_ms = _time(shape.build_specs, runs) if shape.build_specs else None
        median = statistics.median(plan_ms)
        results.append(
            {
                "shape": shape.name,
                "layers": len({n for w in shape.worker_specs for n in w}),
                "ranks": len(shape.worker_specs),
                "groups": len(plan.global_groups),
                "num_blocks": plan.num_blocks,
                "max_model_len": plan.max_model_len,
                "plan_median_ms": round(median, 3),
                "plan_p90_ms": round(sorted(plan_ms)[int(0.9 * (len(plan_ms) - 1))], 3),
                "ratio_to_goal": round(median / GOAL_MS, 4),
                "specs_median_ms": round(statistics.median(specs_ms), 3) if specs_ms else None,
            }
        )
    return {
        "goal_ms": GOAL_MS,
        "runs": runs,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "results": results,
        "all_under_goal": all(r["plan_median_ms"] < GOAL_MS for r in results),
    }


def render(report: dict[str, Any]) -> str:
    headers = [
        "shape",
        "layers",
        "ranks",
        "groups",
        "plan ms (median)",
        "p90",
        "x goal",
        "specs ms",
    ]
    rows = [
        [
            r["shape"],
            str(r["layers"]),
            str(r["ranks"]),
            str(r["groups"]),
            f"{r['plan_median_ms']:.2f}",
            f"{r['plan_p90_ms']:.2f}",
            f"{r['ratio_to_goal']:.3f}",
            "-" if r["specs_median_ms"] is None else f"{r['specs_median_ms']:.2f}",
        ]
        for r in report["results"]
    ]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    lines = [
        f"plan_kv_cache timing: median of {report['runs']} runs, goal {report['goal_ms']:.0f} ms "
        f"(Python {report['python']}, {report['machine']})",
        "  ".join(
            h.ljust(w) if i == 0 else h.rjust(w)
            for i, (h, w) in enumerate(zip(headers, widths, strict=True))
        ),
    ]
    for row in rows:
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(row, widths, strict=True))
            )
        )
    lines.append("all under goal: " + ("yes" if report["all_under_goal"] else "NO"))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--runs", type=int, default=30, help="timed runs per shape (default 30)")
    parser.add_argument("--json", action="store_true", help="print the figures as one JSON object")
    args = parser.parse_args(argv)
    if args.runs < 1:
        parser.error("--runs must be >= 1")
    report = measure(args.runs)
    print(json.dumps(report, indent=2) if args.json else render(report))
    return 0 if report["all_under_goal"] else 1


if __name__ == "__main__":
    sys.exit(main())
