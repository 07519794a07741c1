"""The worker transport's batch fetch and its deferred acknowledgements, on a real redis-server.

No worker here: a kombu `Connection` on `pipeline.runtime.transport` consumes the way a worker's consumer does
(`drain_events` through kombu's poll cycle). One `drain_events` handles one reply of the fetch script, so what one
call delivers is what one fetch took.
"""

from __future__ import annotations

import base64
import contextlib
import json
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub, set_event_loop

from pipeline.constants import DELIVERIES_KEY, HEADER_DELIVERY_COUNT, LEASE_KEY
from pipeline.runtime import fetch, lease
from tests.support.procs import RedisServer

pytestmark = pytest.mark.faults


@pytest.fixture
def name(queue_name: str, own_redis: RedisServer) -> str:
    own_redis.client().script_load(fetch.FETCH)  # so the first poll fetches (no NOSCRIPT round)
    return queue_name


@pytest.fixture
def loop() -> Iterator[Hub]:
    """A kombu hub as the event loop of this thread, as a worker's consumer has (acknowledgements deferred)."""
    hub = Hub()
    hub._loop_thread = threading.get_ident()
    set_event_loop(hub)
    yield hub
    set_event_loop(None)
    hub.close()


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), name)


def _publish(conn: Connection, name: str, bodies: list[Any]) -> None:
    producer = Producer(conn.channel())
    for body in bodies:
        producer.publish(body, exchange=_queue(name).exchange, routing_key=name, declare=[_queue(name)])


def _drain_once(conn: Connection) -> None:
    with contextlib.suppress(TimeoutError):
        conn.drain_events(timeout=1)


def _consumer(conn: Connection, name: str, prefetch: int, got: list[Any], on_message: Any = None) -> Consumer:
    channel = conn.channel()
    channel.basic_qos(0, prefetch, False)
    return Consumer(channel, [_queue(name)], callbacks=[on_message or (lambda body, message: got.append(message))])


def _records(client: Any) -> tuple[int, int, int, int]:
    return client.hlen("unacked"), client.zcard("unacked_index"), client.hlen(LEASE_KEY), client.hlen(DELIVERIES_KEY)


def test_a_fetch_takes_what_the_prefetch_allows_oldest_first_and_never_more(
    own_redis: RedisServer, conn: Connection, name: str
) -> None:
    _publish(conn, name, [{"n": n} for n in range(7)])
    client = own_redis.client()
    got: list[Any] = []
    with _consumer(conn, name, 3, got):
        _drain_once(conn)
        assert [m.payload["n"] for m in got] == [0, 1, 2]  # one fetch, three messages, in order
        _drain_once(conn)
        assert len(got) == 3 and client.llen(name) == 4  # the prefetch is full: nothing more taken
        assert _records(client) == (3, 3, 3, 3)
        assert lease.held() == {m.delivery_tag for m in got}
        assert all(m.headers[HEADER_DELIVERY_COUNT] == 1 for m in got)
        got[0].ack()  # no event loop here: written at once
        assert _records(client) == (2, 2, 2, 2)
        _drain_once(conn)
        assert [m.payload["n"] for m in got] == [0, 1, 2, 3]  # one slot free: one message
        for message in got[1:]:
            message.ack()
        while len(got) < 7:
            before = len(got)
            _drain_once(conn)
            assert len(got) > before and client.hlen("unacked") <= 3
            for message in got[before:]:
                message.ack()
    assert [m.payload["n"] for m in got] == list(range(7))
    assert _records(client) == (0, 0, 0, 0) and client.llen(name) == 0 and lease.held() == set()


def test_a_batch_dead_letters_its_poison_element_and_delivers_the_rest_in_order(
    own_redis: RedisServer, conn: Connection, name: str
) -> None:
    _publish(conn, name, [{"n": 0}])
    client = own_redis.client()
    client.lpush(name, b"\xff not json")
    _publish(conn, name, [{"n": 2}])
    got: list[Any] = []
    with _consumer(conn, name, 5, got):
        _drain_once(conn)
    assert [m.payload["n"] for m in got] == [0, 2]
    assert client.llen(name) == 0 and _records(client) == (2, 2, 2, 2)  # the poison element is no longer tracked


def test_acks_on_the_event_loop_are_carried_by_the_next_fetch_or_flushed_together(
    own_redis: RedisServer, conn: Connection, name: str, loop: Hub
) -> None:
    _publish(conn, name, [{"n": n} for n in range(6)])
    client = own_redis.client()
    got: list[Any] = []
    with _consumer(conn, name, 2, got) as consumer:
        qos = consumer.channel.qos
        _drain_once(conn)
        assert len(got) == 2
        for message in got:
            message.ack()  # deferred: the slot is free at once, the records stay until the next call
        assert qos.can_consume() and _records(client) == (2, 2, 2, 2)
        _drain_once(conn)  # the fetch acknowledges them first, then takes two more
        assert [m.payload["n"] for m in got] == [0, 1, 2, 3]
        assert _records(client) == (2, 2, 2, 2) and not (lease.held() & {m.delivery_tag for m in got[:2]})
        client.hset(LEASE_KEY, got[3].delivery_tag, "peer:1:abc")  # a peer took this one over: fenced
        got[2].ack()
        got[3].ack()
        qos.flush_acks(carry=False)  # what the next tick does when no fetch can carry them
        assert client.hexists("unacked", got[3].delivery_tag) and not client.hexists("unacked", got[2].delivery_tag)
        assert client.hget(LEASE_KEY, got[3].delivery_tag) == b"peer:1:abc"
        client.hdel(LEASE_KEY, got[3].delivery_tag)
        client.hdel("unacked", got[3].delivery_tag)
        while len(got) < 6:
            _drain_once(conn)
        for message in got[4:]:
            message.ack()
        qos.flush_acks(carry=False)
    assert [m.payload["n"] for m in got] == list(range(6))
    assert client.hlen("unacked") == 0 and client.hlen(LEASE_KEY) == 0 and lease.held() == set()


def test_a_delivery_that_raises_puts_the_rest_of_its_batch_back_at_the_head_in_order(
    own_redis: RedisServer, conn: Connection, name: str
) -> None:
    """A solo worker's SIGTERM runs through the job being delivered: that job goes back (as the I/O profile
    promises), and so do the batch's later ones, which were fetched and leased but never handed to Celery."""
    _publish(conn, name, [{"n": n} for n in range(5)])
    client = own_redis.client()
    got: list[Any] = []

    def stop_at_the_second(body: Any, message: Any) -> None:
        got.append(message)
        if len(got) == 2:
            raise SystemExit("SIGTERM in the job")

    with _consumer(conn, name, 4, got, stop_at_the_second), pytest.raises(SystemExit):
        _drain_once(conn)
    assert [m.payload["n"] for m in got] == [0, 1]
    # 1 (whose delivery raised), 2 and 3 back at the head, oldest first; 4 was never fetched
    assert [_n(raw) for raw in reversed(client.lrange(name, 0, -1))] == [1, 2, 3, 4]
    assert lease.held() == {got[0].delivery_tag}  # the job that ran is still this worker's, until acknowledged
    assert client.hlen("unacked") == 1 and client.hlen(LEASE_KEY) == 1


def _n(raw: bytes) -> int:
    envelope = json.loads(raw)
    return int(json.loads(base64.b64decode(envelope["body"]))["n"])
