"""An idle worker on several queues wakes at once on a job of any of them (`pipeline.queues.wake`), on a real
redis-server.

No worker here: a kombu `Connection` on `pipeline.delivery.transport` consumes the way a worker's consumer does, and
the jobs are published by another worker transport (its `_put` pushes the queue's marker) or by stock kombu (none:
the watches on the lists wake the consumer, `pipeline.delivery.watches`).
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue

from pipeline.delivery import transport
from pipeline.delivery.lease import Leases
from pipeline.queues.wake import WAKE_KEY, WAKE_MAX
from tests.support.procs import RedisServer

pytestmark = pytest.mark.faults


def _queue(name: str) -> Queue:
    return Queue(name, Exchange(name, "direct"), name)


def _publish(conn: Connection, name: str, body: Any) -> None:
    Producer(conn.channel()).publish(body, exchange=name, routing_key=name, declare=[_queue(name)])


@pytest.fixture
def publisher(own_redis: RedisServer) -> Iterator[Connection]:
    """Another worker's transport (a retry or a deferral sent from a worker publishes through it)."""
    with Connection(own_redis.url, transport=transport.bound(Leases(lease_seconds=30))) as other:
        yield other


def _calls(client: Any, command: str) -> int:
    return int(client.info("commandstats").get(f"cmdstat_{command}", {}).get("calls", 0))


def _consume(conn: Connection, names: list[str], got: list[Any], poll: float | None = None) -> Consumer:
    channel = conn.channel()
    if poll is not None:
        channel.wake_poll_s = poll
    for name in names:
        _queue(name)(channel).declare()
    return Consumer(channel, [_queue(n) for n in names], callbacks=[lambda body, message: got.append(message)])


def _drain_until(conn: Connection, got: list[Any], n: int, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while len(got) < n and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)


def _drain_until_waiting(conn: Connection, client: Any) -> None:
    """Drain until the channel sent a wait (BLMPOP): it fetched nothing and waits on its queues' markers."""
    waits = _calls(client, "blmpop")
    deadline = time.monotonic() + 30
    while _calls(client, "blmpop") == waits and time.monotonic() < deadline:
        with contextlib.suppress(TimeoutError):
            conn.drain_events(timeout=0.2)
    assert _calls(client, "blmpop") > waits, "the channel never waited"


def test_an_idle_consumer_of_several_queues_is_woken_by_the_marker_of_its_last_queue(
    own_redis: RedisServer, conn: Connection, publisher: Connection, queue_name: str
) -> None:
    """Five queues, a fallback poll of a minute: the job on the last queue can only start through its marker, which
    one BLMPOP over every queue's marker pops; nothing polls the queues' keys meanwhile (each list's watch, armed
    once, is armed again only after it answered)."""
    names = [f"{queue_name}-{n}" for n in range(5)]
    client = own_redis.client()
    got: list[Any] = []
    with _consume(conn, names, got, poll=60):
        _drain_until_waiting(conn, client)  # fetched nothing: now waiting on the markers
        blmove, fetches = _calls(client, "blmove"), _calls(client, "evalsha")
        _publish(publisher, names[-1], {"n": 1})
        _drain_until(conn, got, 1, 10)
    assert [m.payload for m in got] == [{"n": 1}]
    assert client.llen(WAKE_KEY.format(queue=names[-1])) == 0  # the marker was consumed by the wake
    assert _calls(client, "blmove") - blmove <= 1  # the watch that answered, armed again at the next wait
    assert _calls(client, "evalsha") - fetches <= 2  # the fetch after the wake (and the next one that finds nothing)


@pytest.mark.parametrize("priority", [None, 6])
def test_a_job_pushed_without_a_marker_wakes_an_idle_consumer_through_the_watches(
    own_redis: RedisServer, conn: Connection, queue_name: str, priority: int | None
) -> None:
    """A stock kombu publish (a stock Celery app's `apply_async`) pushes no marker. With a fallback poll of a
    minute, the job on the last of three queues (on its priority step's list when it has a priority) can only be
    fetched within the drain's 10 s through the watch on that list, which claims it and pushes the queue's marker."""
    names = [f"{queue_name}-{n}" for n in range(3)]
    client = own_redis.client()
    got: list[Any] = []
    with Connection(own_redis.url) as foreign, _consume(conn, names, got, poll=60):
        _drain_until_waiting(conn, client)  # fetched nothing: now waiting
        fetches = _calls(client, "evalsha")
        Producer(foreign.channel()).publish(
            {"n": 2}, exchange=names[-1], routing_key=names[-1], declare=[_queue(names[-1])], priority=priority
        )
        _drain_until(conn, got, 1, 10)
    assert [m.payload for m in got] == [{"n": 2}]
    assert client.exists(WAKE_KEY.format(queue=names[-1])) == 0  # no marker was involved
    assert _calls(client, "evalsha") - fetches <= 2  # the fetch after the wake (and the next one that finds nothing)


def test_two_idle_consumers_claim_a_message_pushed_without_a_marker_once(
    own_redis: RedisServer, conn: Connection, publisher: Connection, queue_name: str
) -> None:
    """Both consumers' watches answer with the same message; the first to claim it pushes the queue's one marker,
    which one of them pops: one claim, one marker, the message delivered once."""
    client = own_redis.client()
    got: list[Any] = []
    with (
        Connection(own_redis.url) as foreign,
        _consume(conn, [queue_name], got, poll=60),
        _consume(publisher, [queue_name], got, poll=60),
    ):
        for each in (conn, publisher):
            _drain_until(each, got, 1, 0.3)  # both waiting
        Producer(foreign.channel()).publish(
            {"n": 3}, exchange=queue_name, routing_key=queue_name, declare=[_queue(queue_name)]
        )
        deadline = time.monotonic() + 10
        while not got and time.monotonic() < deadline:
            for each in (conn, publisher):
                _drain_until(each, got, 1, 0.05)
        assert [m.payload for m in got] == [{"n": 3}]
        claims = list(client.scan_iter(match="pipeline:wake-claim:*"))
        assert claims == [f"pipeline:wake-claim:{got[0].delivery_tag}".encode()]
        assert client.llen(WAKE_KEY.format(queue=queue_name)) == 0  # the claim's one marker, popped by the wake
        client.lpush(WAKE_KEY.format(queue=queue_name), 1, 1)  # ends the waits (a minute each) the channels close on


def test_the_watches_are_armed_once_per_wait_and_dropped_with_the_channel(
    own_redis: RedisServer, conn: Connection, queue_name: str
) -> None:
    """One watch per consumed list (the queue at each priority step): armed when the channel waits, not again while
    it keeps waiting; their connections close with the channel."""
    client = own_redis.client()
    got: list[Any] = []
    before = len(client.client_list())
    consumer = _consume(conn, [queue_name], got, poll=0.05)
    with consumer:
        _drain_until(conn, got, 1, 0.3)
        armed = _calls(client, "blmove")
        assert armed == 4  # kombu's priority steps 0, 3, 6, 9
        assert len(client.client_list()) >= before + 4
        _drain_until(conn, got, 1, 0.5)  # ten more waits of 50 ms, each with its fetch
        assert _calls(client, "blmove") == armed
    conn.release()
    deadline = time.monotonic() + 10
    while len(client.client_list()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert len(client.client_list()) <= before


def test_markers_are_capped_restores_mark_and_control_replies_get_none(
    own_redis: RedisServer, conn: Connection, publisher: Connection, queue_name: str
) -> None:
    client = own_redis.client()
    marker = WAKE_KEY.format(queue=queue_name)
    for n in range(WAKE_MAX + 5):
        _publish(publisher, queue_name, {"n": n})
    assert client.llen(queue_name) == WAKE_MAX + 5
    assert client.llen(marker) == WAKE_MAX  # nobody consumes them: bounded
    reply = f"{queue_name}.reply.celery.pidbox"
    _publish(publisher, reply, {"reply": 1})
    assert client.llen(reply) == 1 and client.exists(WAKE_KEY.format(queue=reply)) == 0
    client.delete(marker, queue_name)
    _publish(publisher, queue_name, {"n": "requeued"})
    client.delete(marker)
    got: list[Any] = []
    with _consume(conn, [queue_name], got):
        _drain_until(conn, got, 1, 5)
        got[0].requeue()  # the holder's requeue puts it back with its marker: an idle peer starts it at once
    assert client.llen(queue_name) == 1 and client.llen(marker) == 1


@pytest.mark.parity
def test_a_marked_publish_writes_what_kombu_writes_and_the_queues_marker(
    own_redis: RedisServer, publisher: Connection, queue_name: str
) -> None:
    """The worker transport's `_put` is kombu's (the key of the message's priority, the envelope, the queue's
    expiry) plus the marker of the queue, whatever its priority step."""
    client = own_redis.client()
    queue = Queue(queue_name, Exchange(queue_name, "direct"), queue_name, expires=60)
    written = []
    with Connection(own_redis.url) as stock:
        for conn in (stock, publisher):
            Producer(conn.channel()).publish(
                {"n": 1}, exchange=queue.exchange, routing_key=queue_name, priority=3, declare=[queue]
            )
            (key,) = [k for k in client.scan_iter(match=f"{queue_name}*") if client.type(k) == b"list"]
            (element,) = client.lrange(key, 0, -1)
            envelope = json.loads(element)
            envelope["properties"].pop("delivery_tag")  # a fresh one per publish
            written.append((key, 0 < client.pttl(key) <= 60_000, envelope))
            client.delete(key)
    assert written[0] == written[1] and written[0][1]
    assert written[1][0] != queue_name.encode()  # the priority step's key
    assert client.llen(WAKE_KEY.format(queue=queue_name)) == 1  # the publisher's only (stock kombu marks nothing)


def test_a_channel_closed_while_it_waits_drops_the_wait_instead_of_reading_it_to_its_end(
    own_redis: RedisServer, conn: Connection, queue_name: str
) -> None:
    """A fallback poll of a minute (an idle worker's wait grows to WAKE_POLL_MAX_S): a close while the channel waits
    for a marker reads the wait's reply only if it comes soon, else drops its connection, which ends the wait in
    Redis. The close returns long before the minute, nothing is left blocked, and a marker pushed afterwards stays."""
    client = own_redis.client()
    got: list[Any] = []
    _consume(conn, [queue_name], got, poll=60).consume()
    _drain_until_waiting(conn, client)
    closed = threading.Event()
    threading.Thread(target=lambda: (conn.release(), closed.set()), daemon=True).start()
    assert closed.wait(40), "the close read the minute's wait to its end"
    deadline = time.monotonic() + 10
    while client.info("clients")["blocked_clients"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert client.info("clients")["blocked_clients"] == 0  # the wait and the watches ended with their connections
    marker = WAKE_KEY.format(queue=queue_name)
    client.lpush(marker, 1)
    assert client.llen(marker) == 1 and got == []
