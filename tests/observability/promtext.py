"""Reading a Prometheus text scrape in tests: samples by name and labels."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

Labels = frozenset[tuple[str, str]]


def parse(text: str) -> dict[str, dict[Labels, float]]:
    """Sample name -> {labels: value} of a scrape (``_created`` samples included)."""
    out: dict[str, dict[Labels, float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out.setdefault(sample.name, {})[frozenset(sample.labels.items())] = sample.value
    return out


def value(samples: dict[str, dict[Labels, float]], name: str, **labels: str) -> float:
    """The one sample of ``name`` whose labels include ``labels``."""
    assert name in samples, f"{name} is not in the scrape"
    wanted = set(labels.items())
    found = [v for k, v in samples[name].items() if wanted <= k]
    assert len(found) == 1, f"{name}{labels}: {len(found)} samples match"
    return found[0]


def label_sets(samples: dict[str, dict[Labels, float]], name: str) -> list[dict[str, str]]:
    return [dict(k) for k in samples.get(name, {})]
