"""The replay's results: one table per fleet size, one JSON object, one plot.

The plot needs matplotlib (the ``replay`` extra: ``pip install 'kvsvc[replay]'``); the
table and the JSON need nothing more.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvsvc.replay.bounds import Bound
from kvsvc.replay.run import PolicyResult

LABELS = {
    "round-robin": "round robin",
    "least-loaded": "least loaded",
    "prefix-only": "prefix only",
    "route": "Route",
}


@dataclass(slots=True)
class FleetRun:
    """Every policy's replay on one fleet size, with the bounds for its memory."""

    engines: int
    kv_tokens: int
    infinite: Bound
    shared: Bound
    policies: list[PolicyResult] = field(default_factory=list)


def _round(value: Any) -> Any:
    if isinstance(value, float):
        return round(value, 4)
    if isinstance(value, dict):
        return {k: _round(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_round(v) for v in value]
    return value


def to_json(header: dict[str, Any], runs: Sequence[FleetRun]) -> dict[str, Any]:
    """One object: the header (trace, model, weights, scale) and every run."""
    out_runs = []
    for run in runs:
        rr = next((p for p in run.policies if p.policy == "round-robin"), None)
        policies = {}
        for p in run.policies:
            entry = asdict(p)
            entry.pop("policy")
            entry["vs_round_robin"] = p.hit_ratio / rr.hit_ratio if rr and rr.hit_ratio else None
            entry["vs_shared_bound"] = (
                p.hit_ratio / run.shared.hit_ratio if run.shared.hit_ratio else None
            )
            policies[p.policy] = entry
        out_runs.append(
            {
                "engines": run.engines,
                "kv_tokens": run.kv_tokens,
                "bounds": {
                    "infinite_cache": asdict(run.infinite),
                    "shared_cache": asdict(run.shared),
                },
                "policies": policies,
            }
        )
    return _round({**header, "runs": out_runs})  # type: ignore[no-any-return]


def table(runs: Sequence[FleetRun]) -> str:
    """The plain table: per fleet size, the bounds and every policy."""
    lines = []
    head = (
        f"{'policy':<38} {'hit ratio':>9} {'x RR':>6} {'load max/mean':>13} "
        f"{'preempt':>7} {'queue p50/p99 s':>16} {'TTFT p50/p99 s':>16}"
    )
    for run in runs:
        lines.append(f"{run.engines} engines x {run.kv_tokens:,} tokens")
        lines.append(head)
        lines.append("-" * len(head))
        lines.append(f"{'infinite cache (bound)':<38} {run.infinite.hit_ratio:>9.3f}")
        lines.append(f"{'one cache of the whole memory (bound)':<38} {run.shared.hit_ratio:>9.3f}")
        rr = next((p for p in run.policies if p.policy == "round-robin"), None)
        for p in run.policies:
            ratio = f"{p.hit_ratio / rr.hit_ratio:.2f}" if rr and rr.hit_ratio else "-"
            queue = f"{p.queue_p50_s:.2f} / {p.queue_p99_s:.1f}"
            ttft = f"{p.ttft_p50_s:.2f} / {p.ttft_p99_s:.1f}"
            lines.append(
                f"{LABELS.get(p.policy, p.policy):<38} {p.hit_ratio:>9.3f} {ratio:>6} "
                f"{p.load_max_mean:>13.2f} {p.preemptions:>7} {queue:>16} {ttft:>16}"
            )
        lines.append("")
    return "\n".join(lines)


def plot(runs: Sequence[FleetRun], path: str | Path, title: str) -> None:
    """Hit ratio and load max/mean per policy against the fleet size (one row of two
    panels per ``kv_tokens``), the bounds dashed.

    Raises:
        ImportError: matplotlib is missing (the message says how to install it).
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        raise ImportError("--plot needs matplotlib: pip install 'kvsvc[replay]'") from None
    sizes = sorted({r.kv_tokens for r in runs})
    figure, axes = plt.subplots(len(sizes), 2, figsize=(11, 4.2 * len(sizes)), squeeze=False)
    for row, kv in enumerate(sizes):
        chosen = sorted((r for r in runs if r.kv_tokens == kv), key=lambda r: r.engines)
        engines = [r.engines for r in chosen]
        hit_axis, load_axis = axes[row]
        hit_axis.plot(
            engines, [r.infinite.hit_ratio for r in chosen], "k:", label="infinite cache (bound)"
        )
        hit_axis.plot(
            engines, [r.shared.hit_ratio for r in chosen], "k--",
            label="one cache of the whole memory (bound)",
        )  # fmt: skip
        names = [p.policy for p in chosen[0].policies]
        for name in names:
            results = [next(p for p in r.policies if p.policy == name) for r in chosen]
            label = LABELS.get(name, name)
            hit_axis.plot(engines, [p.hit_ratio for p in results], "o-", label=label)
            load_axis.plot(engines, [p.load_max_mean for p in results], "o-", label=label)
        hit_axis.set_title(f"prefix hit ratio ({kv:,} tokens per engine)")
        hit_axis.set_xlabel("engines")
        hit_axis.set_ylim(bottom=0)
        load_axis.set_title("load max/mean (tokens computed)")
        load_axis.set_xlabel("engines")
        load_axis.set_yscale("log")
        plain = FuncFormatter(lambda value, _: f"{value:g}")
        load_axis.yaxis.set_major_formatter(plain)
        load_axis.yaxis.set_minor_formatter(plain)
        load_axis.axhline(1.0, color="grey", linewidth=0.5)
        for axis in (hit_axis, load_axis):
            axis.set_xticks(engines)
            axis.grid(True, alpha=0.3)
        hit_axis.legend(fontsize=8)
        load_axis.legend(fontsize=8)
    figure.suptitle(title)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
