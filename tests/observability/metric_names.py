"""Which metric names kvsvc exports, and which ones a PromQL expression reads.

The exported names come from the code itself: the server's and the agent's registries
are built (no server started) and every metric family they describe is expanded into the
sample names a scrape shows (counters ``_total``, histograms ``_bucket``/``_sum``/
``_count``, info ``_info``). Families are used rather than samples so that a series with
no sample yet (per-rank gauges before any rank registered) still counts as exported.
"""

from __future__ import annotations

import re
from functools import cache
from typing import Any

# Sample-name suffixes of each family type (prometheus_client's families strip them).
_SUFFIXES: dict[str, tuple[str, ...]] = {
    "counter": ("_total",),
    "gauge": ("",),
    "info": ("_info",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gaugehistogram": ("_bucket", "_gsum", "_gcount"),
    "summary": ("", "_sum", "_count"),
    "stateset": ("",),
    "unknown": ("",),
}


def sample_names(registry: Any) -> set[str]:
    """Every sample name a scrape of ``registry`` can show (``_created`` left out)."""
    names: set[str] = set()
    for family in registry.collect():
        names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
    return names


@cache
def _server_registry() -> Any:
    """A kvsvc server's registry (one pool, ``p``; the server is built, not started)."""
    from kvsvc.server.app import KvsvcServer
    from kvsvc.server.config import PoolConfig, ServerConfig

    server = KvsvcServer(ServerConfig(pools=(PoolConfig(name="p"),), metrics_listen=None))
    return server.metrics.registry


@cache
def server_metric_names() -> frozenset[str]:
    """The names the kvsvc server exports (its collector and its gRPC series)."""
    return frozenset(sample_names(_server_registry()))


@cache
def server_wide_metric_names() -> frozenset[str]:
    """The server's ``kvsvc_`` names of the whole process, not of a pool: families whose
    samples a fresh server (with a pool) already shows, none of them with a ``pool``
    label. A family with no sample yet is not among them."""
    names: set[str] = set()
    for family in _server_registry().collect():
        samples = family.samples
        if (
            family.name.startswith("kvsvc_")
            and samples
            and all("pool" not in sample.labels for sample in samples)
        ):
            names |= {family.name + suffix for suffix in _SUFFIXES[family.type]}
    return frozenset(names)


@cache
def agent_metric_names() -> frozenset[str]:
    """The names a worker agent exports (skips without torch: kvsvc.worker imports it)."""
    import pytest

    pytest.importorskip("torch", reason="kvsvc.worker imports torch (the worker extra)")
    from kvsvc.worker.metrics import AgentMetrics

    return frozenset(sample_names(AgentMetrics("p", 0, "cpu").registry))


def exported_metric_names() -> frozenset[str]:
    return server_metric_names() | agent_metric_names()


# ---------------------------------------------------------------- PromQL

_KEYWORDS = frozenset(
    {
        # aggregation operators and their modifiers
        "sum",
        "min",
        "max",
        "avg",
        "group",
        "stddev",
        "stdvar",
        "count",
        "count_values",
        "bottomk",
        "topk",
        "quantile",
        "limitk",
        "limit_ratio",
        "by",
        "without",
        # binary operators and vector matching
        "and",
        "or",
        "unless",
        "atan2",
        "on",
        "ignoring",
        "group_left",
        "group_right",
        "bool",
        "offset",
        # literals
        "inf",
        "nan",
    }
)
_LABEL_LIST_OPENERS = frozenset({"by", "without", "on", "ignoring", "group_left", "group_right"})
_TOKEN = re.compile(
    r"""
    (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'|`[^`]*`)
    | (?P<duration>\[[^\]]*\])
    | (?P<variable>\$\{[^}]*\}|\$[A-Za-z_][A-Za-z0-9_]*|\[\[[^\]]*\]\])
    | (?P<number>(?<![A-Za-z_:])[0-9]+(?:\.[0-9]*)?(?:e[+-]?[0-9]+)?)
    | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
    | (?P<punct>[{}()\[\],])
    | (?P<other>\S)
    """,
    re.VERBOSE,
)


def promql_metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (functions, keywords, labels and strings skipped).

    Handles what dashboards and rules use: selectors with matchers, ``by``/``without``/
    ``on``/``ignoring``/``group_*`` label lists, function calls, range durations, Grafana
    variables (``$pool``, ``${pool}``, ``$__rate_interval``), string literals. A
    ``{__name__=...}`` selector is not resolved (kvsvc's artefacts never use one).
    """
    tokens = [(m.lastgroup, m.group()) for m in _TOKEN.finditer(expr) if m.lastgroup is not None]
    names: set[str] = set()
    brace_depth = 0
    label_list_depth: int | None = None  # paren depth of an open label list
    paren_depth = 0
    for i, (kind, text) in enumerate(tokens):
        following = tokens[i + 1][1] if i + 1 < len(tokens) else ""
        if kind == "punct":
            if text == "{":
                brace_depth += 1
            elif text == "}":
                brace_depth -= 1
            elif text == "(":
                paren_depth += 1
            elif text == ")":
                if label_list_depth == paren_depth:
                    label_list_depth = None
                paren_depth -= 1
            continue
        if kind != "ident" or brace_depth > 0 or label_list_depth is not None:
            continue
        lowered = text.lower()
        if lowered in _LABEL_LIST_OPENERS and following == "(":
            label_list_depth = paren_depth + 1
            continue
        if lowered in _KEYWORDS or following == "(":
            continue  # an operator, or a function / aggregation call
        names.add(text)
    return names


def unknown_metric_names(expr: str, known: frozenset[str]) -> set[str]:
    """Names ``expr`` reads that are not in ``known``."""
    return promql_metric_names(expr) - known
