"""The broker's memory against maxmemory, as the exporter serves it and `pipeline queues --json` prints it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from pipeline.observability.exporter import QueueCollector
from tests.support.cli import run_cli
from tests.support.procs import RedisServer
from tests.support.scrape import Samples, value

pytestmark = pytest.mark.integration

LIMIT = 1536 * 1024 * 1024


@pytest.fixture
def limited(redis_server: RedisServer) -> Iterator[None]:
    """The session's Redis with a maxmemory far above its use for the test (restored to none after)."""
    client = redis_server.client()
    client.config_set("maxmemory", str(LIMIT))
    try:
        yield
    finally:
        client.config_set("maxmemory", "0")


def _collected() -> Samples:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in QueueCollector(("default",)).collect()
        for s in family.samples
    }


def _used(redis_server: RedisServer) -> int:
    return int(redis_server.client().info("memory")["used_memory"])


def test_the_exporter_serves_memory_used_and_zero_for_no_limit(redis_server: RedisServer) -> None:
    before = _used(redis_server)
    samples = _collected()
    after = _used(redis_server)
    used = value(samples, "pipeline_redis_memory_used_bytes")
    assert used is not None and 0.8 * min(before, after) <= used <= 1.2 * max(before, after)
    assert value(samples, "pipeline_redis_memory_max_bytes") == 0
    assert value(samples, "pipeline_broker_up") == 1


def test_the_exporter_and_queues_show_maxmemory(redis_server: RedisServer, limited: None) -> None:
    assert value(_collected(), "pipeline_redis_memory_max_bytes") == LIMIT
    shown = run_cli("queues", "--json")
    assert shown.returncode == 0, shown.stderr
    memory = json.loads(shown.stdout)["memory"]
    assert memory["max_bytes"] == LIMIT and memory["policy"] == "noeviction" and memory["warning"] is None
    assert 0 < memory["used_ratio"] < 0.5 and memory["used_bytes"] > 0
    human = run_cli("queues")
    assert "of 1.5 GiB maxmemory" in human.stdout and "policy noeviction" in human.stdout
