"""Every worker command users start, started on a full Redis (maxmemory, policy noeviction), drains it.

A redis-server of the test's own is filled by the typed producer with `pipeline.probe` jobs until it refuses one
naming maxmemory (`tests.support.full`); then the command starts as users start it (mingle, gossip, heartbeats and
remote control on): `celery -A pipeline worker` with the prefork, solo and threads pools, and `pipeline worker`
(`pipeline run`: tests/integration/test_devstack.py). Every accepted job runs and its result is stored (counted from
the stored results, none missing); the worker never takes the refusals for a lost connection, says once that
Redis is full and once that it has room again (memory added), and then remote control reaches it. The exporter's
`pipeline_redis_full` is 1 while Redis is full and 0 once it has room.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from tests.support.full import celery_worker, fill, full_node, pipeline_command, states
from tests.support.procs import Command, free_port, wait_for, waiting
from tests.support.replicas import Node, ProducerProcess
from tests.support.scrape import try_scrape, value

pytestmark = pytest.mark.ha

#: The worker commands users start, with how many Celery workers each runs.
COMMANDS = {
    "celery-prefork": (celery_worker("-P", "prefork", "-c", "2", "-n", "full-prefork@%h"), 1),
    "celery-solo": (celery_worker("-P", "solo", "-n", "full-solo@%h"), 1),
    "celery-threads": (celery_worker("-P", "threads", "-c", "2", "-n", "full-threads@%h"), 1),
    "pipeline-worker": (pipeline_command("worker", "--processes", "2", "--name", "full", "-l", "INFO"), 2),
}


@pytest.fixture
def full_redis(work_dir: Path) -> Iterator[Node]:
    node = full_node(work_dir / f"full-{uuid.uuid4().hex[:8]}")
    yield node
    node.stop()


@pytest.fixture
def typed_producer(full_redis: Node, work_dir: Path) -> Iterator[ProducerProcess]:
    proc = ProducerProcess(
        work_dir / "logs" / f"full-producer-{uuid.uuid4().hex[:6]}.log", {"REDIS_URL": full_redis.url}
    )
    yield proc.start()
    proc.stop()


def pings(node: Node) -> list[object]:
    """The replies of `celery inspect ping` on `node`'s Redis (one per worker that remote control reaches)."""
    app = Celery("full-control", broker=node.url, set_as_current=False)
    try:
        return list(app.control.ping(timeout=1.0) or [])
    finally:
        app.close()


def refused_for_memory(broker: redis.Redis) -> bool:
    """A 10 KB write is refused for memory (after the few KiB freed since the fill's last refusal, a client's
    buffers, are taken)."""
    for n in range(20):
        try:
            broker.set(f"probe-{n}", "x" * 10_000)
        except redis.exceptions.ResponseError as exc:
            return "maxmemory" in str(exc)
    return False


def said_room(log: str) -> bool:
    """Every worker that said Redis is full has said since that it has room again."""
    return log.count("Redis has room again") == log.count("Redis is at maxmemory (") >= 1


def assert_said_once_per_change(log: str, workers: int) -> None:
    """No reconnect loop; each worker says once that Redis is full and once that it has room again, per change
    (Redis may dip below maxmemory while the first jobs are settled and fill again with their results: a change
    too, hence the bound); each write it skipped is said once per time Redis was full."""
    assert "Connection to broker lost" not in log and "Frequent restarts" not in log, log[-3000:]
    full, room = log.count("Redis is at maxmemory ("), log.count("Redis has room again")
    assert 1 <= full <= 3 * workers and room == full, (full, room)
    skipped = collections.Counter(line.split("] ", 1)[-1] for line in log.splitlines() if "skipped until" in line)
    assert skipped and max(skipped.values()) <= full, skipped
    assert any("maxmemory" in line and "remote-control" in line for line in skipped)


@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_worker_command_started_on_a_full_redis_runs_every_accepted_job(
    full_redis: Node, typed_producer: ProducerProcess, work_dir: Path, command: str
) -> None:
    accepted = fill(typed_producer)
    assert len(accepted) > 300
    broker = full_redis.client()
    assert refused_for_memory(broker), "full: nothing else fits"
    env = {"REDIS_URL": full_redis.url, "LOG_LEVEL": "INFO"}
    port = free_port()
    exporter = Command(
        pipeline_command("exporter", "--port", str(port), "--address", "127.0.0.1"),
        work_dir / "logs" / f"full-exporter-{port}.log",
        env,
    ).start()
    argv, workers = COMMANDS[command]
    worker = Command(argv, work_dir / "logs" / f"full-{command}-{uuid.uuid4().hex[:6]}.log", env)
    try:
        samples = wait_for(lambda: try_scrape(port), 20, 0.2, what="exporter /metrics")
        assert isinstance(samples, dict) and value(samples, "pipeline_redis_full") == 1
        worker.start()
        wait_for(lambda: states(broker, accepted)["SUCCESS"] == len(accepted), 60, 0.5, what="every accepted job")
        assert states(broker, accepted) == {"SUCCESS": len(accepted)}  # stored once each, none lost
        assert waiting(broker, "default") == 0 and broker.hlen("unacked") == 0
        # Results are stored past maxmemory (`store.lua`): room comes back as results expire, or as memory is added.
        broker.config_set("maxmemory", int(broker.info("memory")["used_memory"]) + 4 * 1024 * 1024)
        wait_for(lambda: said_room(worker.log()), 10, 0.2, what="every worker to say it has room again")
        assert value(wait_for(lambda: try_scrape(port), 10, 0.2), "pipeline_redis_full") == 0  # type: ignore[arg-type]
        wait_for(lambda: len(pings(full_redis)) == workers, 20, 0.5, what="remote control to reach every worker")
        assert worker.running()
        log = worker.log()
    finally:
        worker.stop()
        exporter.stop()
    assert_said_once_per_change(log, workers)
