"""A Redis at maxmemory (noeviction) refuses an enqueue with an error that says so, and stores nothing of it.

The test's own small redis-server (`--maxmemory`) is filled by the producer itself, with jobs; then every producer
path is refused with `BrokerFull` naming memory (the API: a 503 with Retry-After; the CLI: one line, exit 3), and
the database holds exactly what it held before: no record, no claim, no message, nothing parked. `pipeline queues`
shows the memory against maxmemory, and warns when the policy would evict jobs.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from pipeline.constants import ENQUEUE_IDEMPOTENCY_KEY
from tests.support.api import ApiServer
from tests.support.procs import running
from tests.support.replicas import CallFailed, Node, ProducerProcess

pytestmark = pytest.mark.ha

MAXMEMORY = 4 * 1024 * 1024
PAYLOAD = {"message": "x" * 900}


@pytest.fixture(scope="module")
def small_redis(work_dir: Path) -> Iterator[Node]:
    yield from running(Node(work_dir / f"full-{uuid.uuid4().hex[:8]}", "full", "--maxmemory", str(MAXMEMORY)))


@pytest.fixture(scope="module")
def producer(small_redis: Node, work_dir: Path) -> Iterator[ProducerProcess]:
    yield from running(ProducerProcess(work_dir / "logs" / "full-producer.log", {"REDIS_URL": small_redis.url}))


@pytest.fixture(scope="module")
def api(small_redis: Node, work_dir: Path) -> Iterator[ApiServer]:
    yield from running(ApiServer("full", work_dir / "logs", {"REDIS_URL": small_redis.url}))


@pytest.fixture(scope="module")
def full(small_redis: Node, producer: ProducerProcess, api: ApiServer) -> int:
    """Fill the Redis with jobs until the producer is refused even one; return how many it accepted.

    Batches shrink as it fills: a request's own bytes count against maxmemory while Redis reads it, so a big batch
    is refused while a single job still fits. Once full, maxmemory is lowered to 512 KiB under what Redis uses, so
    the allocator's give and take (buffers freed between calls) cannot let one more job in later."""
    accepted = 0
    for size in (200, 20, 1):
        for _ in range(2000):
            try:
                accepted += len(producer.call("enqueue_many", kind="probe", payloads=[PAYLOAD] * size))
            except CallFailed as refused:
                error = refused
                break
        else:
            pytest.fail("the Redis never filled")
        assert error.kind == "BrokerFull", error
    assert accepted > 0
    client = small_redis.client()
    client.config_set("maxmemory", str(int(client.info("memory")["used_memory"]) - 512 * 1024))
    return accepted


def snapshot(client: redis.Redis) -> dict[bytes, object]:
    """Every key with its type and size: what an enqueue would change."""
    sizes = {
        b"string": client.strlen,
        b"list": client.llen,
        b"zset": client.zcard,
        b"hash": client.hlen,
        b"set": client.scard,
    }
    found: dict[bytes, object] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        found[key] = (kind, sizes[kind](key) if kind in sizes else None)
    return found


def test_every_producer_path_is_refused_naming_memory_and_stores_nothing(
    small_redis: Node, producer: ProducerProcess, full: int
) -> None:
    client = small_redis.client()
    before = snapshot(client)
    key = f"full-{uuid.uuid4().hex}"
    for op, args in (
        ("enqueue", {"kind": "probe", "payload": PAYLOAD}),
        ("enqueue", {"kind": "probe", "payload": PAYLOAD, "key": key}),
        ("enqueue", {"kind": "probe", "payload": PAYLOAD, "key": key, "countdown": 3600}),
        ("enqueue_many", {"kind": "probe", "payloads": [PAYLOAD] * 3}),
    ):
        with pytest.raises(CallFailed) as refused:
            producer.call(op, **args)
        assert refused.value.kind == "BrokerFull", refused.value
        assert "memory" in refused.value.message and "maxmemory" in refused.value.message
    assert client.get(ENQUEUE_IDEMPOTENCY_KEY.format(task="pipeline.probe", key=key)) is None
    assert snapshot(client) == before, "a refused enqueue left something behind"


def test_the_cli_says_memory_in_one_line(small_redis: Node, producer: ProducerProcess, full: int) -> None:
    human = producer.call("cli", args=["enqueue", "probe", json.dumps(PAYLOAD)])
    assert human["code"] == 3, human
    (line,) = human["stderr"].strip().splitlines()
    assert line.startswith("error: ") and "out of memory" in line and "maxmemory" in line
    machine = producer.call("cli", args=["enqueue-many", "probe", json.dumps([PAYLOAD]), "--json"])
    assert machine["code"] == 3 and "maxmemory" in json.loads(machine["stdout"])["error"]


def test_the_api_answers_503_naming_memory(small_redis: Node, api: ApiServer, full: int) -> None:
    client = small_redis.client()
    before = snapshot(client)
    with api.client() as http:
        one = http.post("/jobs/probe", json=PAYLOAD, headers={"Idempotency-Key": f"api-{uuid.uuid4().hex}"})
        many = http.post("/jobs/probe/batch", json=[PAYLOAD] * 5)
    for response in (one, many):
        assert response.status_code == 503, response.text
        assert int(response.headers["Retry-After"]) > 0
        assert "memory" in response.json()["detail"]
    assert snapshot(client) == before


def test_queues_shows_memory_against_maxmemory_and_warns_on_an_evicting_policy(
    small_redis: Node, producer: ProducerProcess, full: int
) -> None:
    shown = producer.call("cli", args=["queues", "--json"])
    assert shown["code"] == 0, shown
    memory = json.loads(shown["stdout"])["memory"]
    limit = int(small_redis.client().config_get("maxmemory")["maxmemory"])
    assert memory["max_bytes"] == limit and memory["used_bytes"] > limit and memory["used_ratio"] > 1
    assert memory["policy"] == "noeviction" and memory["warning"] is None
    human = producer.call("cli", args=["queues"])
    assert (
        f"of {limit / 1024 / 1024:.1f} MiB maxmemory (1" in human["stdout"] and "policy noeviction" in human["stdout"]
    )
    assert "warning" not in human["stderr"]
    client = small_redis.client()
    client.config_set("maxmemory-policy", "allkeys-lru")
    try:
        human = producer.call("cli", args=["queues"])
        evicting = json.loads(producer.call("cli", args=["queues", "--json"])["stdout"])["memory"]
    finally:
        client.config_set("maxmemory-policy", "noeviction")
    assert "warning: maxmemory-policy is allkeys-lru" in human["stderr"]
    assert evicting["policy"] == "allkeys-lru" and "noeviction" in evicting["warning"]
