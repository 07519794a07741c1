"""Reading a Prometheus endpoint over HTTP in tests: samples keyed by name and labels."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(port: int, path: str = "/metrics") -> Samples:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as resp:  # loopback
        text = resp.read().decode()
    samples: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            samples[(s.name, frozenset(s.labels.items()))] = s.value
    return samples


def value(samples: Samples, name: str, **labels: str) -> float | None:
    """The sample `name` whose labels include `labels`, summed over any other labels; None if absent."""
    want = set(labels.items())
    found = [v for (n, lab), v in samples.items() if n == name and want <= lab]
    return sum(found) if found else None


def try_scrape(port: int) -> Samples | None:
    try:
        return scrape(port)
    except OSError:
        return None
