"""A Redis at maxmemory (policy noeviction) filled by the typed producer, and a worker command started on it.

`full_node` starts a redis-server of the test's own (no persistence) and sets its `maxmemory` ROOM_BYTES above what
it holds empty; `fill` enqueues `pipeline.probe` jobs through a producer process (`tests.support.replicas`) until
Redis refuses one for memory, as the producer must say (`BrokerFull` naming maxmemory), and returns the ids it
accepted. `celery_worker` and `pipeline_command` are the worker commands (`celery -A pipeline worker`, `pipeline
worker`, `pipeline run`) to run on it with `tests.support.procs.Command`. `states` reads the stored result of every
job, as any result reader does.
"""

from __future__ import annotations

import json
import sys
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import redis

from tests.support.replicas import CallFailed, Node, ProducerProcess

#: Room above the empty Redis's memory: about 750 probe jobs fill it (each with its record).
ROOM_BYTES = 2 * 1024 * 1024
PAYLOAD = {"message": "x" * 200}


def full_node(directory: Path) -> Node:
    """A started redis-server whose maxmemory is ROOM_BYTES above what it uses now (policy noeviction)."""
    node = Node(directory, "full").start()
    client = node.client()
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + ROOM_BYTES)
    return node


def fill(producer: ProducerProcess) -> list[str]:
    """Enqueue probe jobs until Redis refuses even one for memory; the ids of the jobs it accepted. Batches shrink
    as it fills (a request's own bytes count against maxmemory while Redis reads it)."""
    accepted: list[str] = []
    for size in (100, 10, 1):
        for _ in range(100_000 // size):
            try:
                accepted += [str(job) for job in producer.call("enqueue_many", kind="probe", payloads=[PAYLOAD] * size)]
            except CallFailed as exc:
                refused = exc
                break
        else:
            raise AssertionError("the Redis never filled")
        assert refused.kind == "BrokerFull" and "maxmemory" in refused.message, refused
    return accepted


def states(client: redis.Redis, ids: Sequence[str]) -> Counter[str]:
    """How many of `ids` have each stored state (`missing`: no result stored)."""
    found: Counter[str] = Counter()
    for start in range(0, len(ids), 500):
        chunk = ids[start : start + 500]
        for raw in client.mget([f"celery-task-meta-{job}" for job in chunk]):
            found[json.loads(raw)["status"] if raw else "missing"] += 1
    return found


def celery_worker(*args: str) -> list[str]:
    return [sys.executable, "-m", "celery", "-A", "pipeline", "worker", "-l", "INFO", *args]


def pipeline_command(*args: str) -> list[str]:
    return [sys.executable, "-m", "pipeline", *args]
