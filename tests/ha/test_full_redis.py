"""A Redis at `maxmemory` (policy noeviction, what a queue must run with) filled by a backlog is drained by its
workers: every job the broker accepted runs once, and the workers neither loop on reconnects nor log the full
Redis as a lost connection.

The broker is a redis-server of the test's own whose `maxmemory` is set a few MB above what it holds at start; a
producer enqueues ledger jobs until Redis refuses one for memory. The jobs record their completions in a ledger
Redis that is not the broker (it never fills). Every worker command started on a full Redis as users start it:
tests/ha/test_full_redis_workers.py.
"""

from __future__ import annotations

import collections
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Exchange, Producer, Queue
from kombu.exceptions import OperationalError

from pipeline.broker import is_oom
from pipeline.delivery import full, transport
from pipeline.delivery.lease import Leases
from tests.support.procs import RedisServer, wait_for, waiting

pytestmark = pytest.mark.ha

#: Room above the empty broker's memory: a backlog of about 450 jobs fills it.
ROOM_BYTES = 1024 * 1024


@pytest.fixture
def full_broker(own_redis: RedisServer) -> RedisServer:
    client = own_redis.client()
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) + ROOM_BYTES)
    return own_redis


@pytest.fixture
def producer(full_broker: RedisServer) -> Iterator[Celery]:
    app = Celery("full-producer", broker=full_broker.url, set_as_current=False)
    app.conf.update(task_serializer="json", accept_content=["json"], broker_connection_retry=False)
    yield app
    app.close()


def _fill(producer: Celery, key: str) -> list[str]:
    """Enqueue ledger jobs until Redis refuses one for memory; the ids of those it accepted."""
    accepted: list[str] = []
    payload = {"key": key}
    refused: BaseException | None = None
    for _ in range(50_000):
        try:
            result = producer.send_task("test.ledger", args=[dict(payload)], queue="default", retry=False)
        except (OperationalError, redis.exceptions.ResponseError) as exc:
            refused = exc
            break
        accepted.append(str(result.id))
    assert refused is not None, "Redis never filled"
    cause = refused.__cause__ or refused.__context__ or refused
    assert is_oom(cause) or "maxmemory" in str(refused), repr(refused)
    return accepted


def _refused_within(client: redis.Redis, writes: int, size: int) -> bool:
    """Whether one of `writes` writes of `size` bytes is refused for memory. Redis refuses a write only while it is
    over its limit, and the refused publish's buffers, freed after it, can leave it a few KB under: a write or a few
    may still fit."""
    for n in range(writes):
        try:
            client.set(f"probe:{n}", "x" * size)
        except redis.exceptions.ResponseError as exc:
            return "maxmemory" in str(exc)
    return False


@pytest.mark.parametrize("pool", ["prefork", "solo"])
def test_a_backlog_that_filled_redis_is_drained_with_every_accepted_job_run_once(
    full_broker: RedisServer, ledger_redis: RedisServer, producer: Celery, make_worker: Any, pool: str
) -> None:
    key = uuid.uuid4().hex
    env = {"REDIS_URL": full_broker.url, "TEST_LEDGER_URL": ledger_redis.url, "LEASE_SECONDS": "10"}
    make_worker(f"first-{pool}-{key[:6]}", env=env, concurrency=2, pool=pool).stop()  # its bindings are in place
    accepted = _fill(producer, key)
    assert len(accepted) > 200
    broker = full_broker.client()
    assert _refused_within(broker, 10, 10_000)  # still full: a tenth of the room does not fit
    worker = make_worker(f"full-{pool}-{key[:6]}", env=env, concurrency=2, pool=pool)
    ledger = ledger_redis.client()
    wait_for(lambda: ledger.llen(f"test:done:{key}") >= len(accepted), 120, 0.5, what="the backlog to drain")
    wait_for(lambda: broker.hlen("unacked") == 0 and waiting(broker, "default") == 0, 30, 0.2, what="nothing held")
    done = collections.Counter(x.decode() for x in ledger.lrange(f"test:done:{key}", 0, -1))
    assert set(done) == set(accepted)  # every accepted job ran (lost = 0)
    assert max(done.values()) == 1  # none twice
    log = worker.log()
    assert "Connection to broker lost" not in log and "Cannot connect" not in log  # a full Redis is not an outage
    assert "Redis is at maxmemory" in log  # said so instead


@pytest.mark.parity
def test_a_binding_in_place_is_kept_on_a_full_redis_as_kombu_writes_it(own_redis: RedisServer) -> None:
    """The worker transport binds a queue as kombu's own does (the same binding sets), and on a full Redis keeps a
    binding already in place where kombu's SADD is refused; a binding that is not there is skipped, and written once
    Redis has room again (kombu's binding refresh, every second)."""
    queue = Queue("full-q", Exchange("full-x", "direct"), "full-key")
    client = own_redis.client()

    def bindings() -> dict[bytes, set[bytes]]:
        return {key: client.smembers(key) for key in client.scan_iter("_kombu.binding.*")}

    def declare(transport_cls: Any) -> Any:
        with Connection(own_redis.url, transport=transport_cls) as conn:
            channel = conn.default_channel
            queue.bind(channel).declare()
            Producer(channel).publish({"n": 1}, exchange=queue.exchange, routing_key="full-key", priority=3)
            Producer(channel).publish({"n": 2}, exchange=queue.exchange, routing_key="full-key")
            return channel.queue_declare("full-q", passive=True)  # its size, as Celery reads it

    kombus, kombu_size = bindings(), declare("redis")
    kombus = bindings()
    client.flushall()
    ours_transport = transport.bound(Leases())
    assert declare(ours_transport) == kombu_size and kombu_size.message_count == 2
    assert bindings() == kombus and kombus
    client.delete("full-q", *(f"full-q\x06\x16{p}" for p in range(10)))
    client.rpush("filler", *("x" * 10_000 + str(i) for i in range(100)))
    client.config_set("maxmemory", int(client.info("memory")["used_memory"]) - 256 * 1024)
    try:
        with (
            Connection(own_redis.url, transport="redis") as conn,
            pytest.raises(redis.exceptions.ResponseError, match="maxmemory"),
        ):
            queue.bind(conn.default_channel).declare()  # kombu's own: refused though nothing would change
        with Connection(own_redis.url, transport=ours_transport) as conn:
            queue.bind(conn.default_channel).declare()  # kept
            other = Queue("full-other", Exchange("full-x", "direct"), "other-key")
            other.bind(conn.default_channel).declare()  # skipped
            assert bindings() == kombus and full.STATE.full
            client.config_set("maxmemory", 0)
            full.STATE.checked_at = 0.0  # the check for room is due
            conn.default_channel.maybe_refresh_binding_expiry()  # kombu's timer calls it every second
            assert not full.STATE.full
            (key,) = kombus
            assert bindings() == {key: {*kombus[key], b"other-key\x06\x16\x06\x16full-other"}}
    finally:
        client.config_set("maxmemory", 0)
        full.STATE.room()
