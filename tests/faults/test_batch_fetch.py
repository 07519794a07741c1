"""The worker transport's batch fetch and its deferred acknowledgements, on a real redis-server.

No worker here: a kombu `Connection` on `pipeline.delivery.transport` consumes the way a worker's consumer does
(`drain_events` through kombu's poll cycle). One `drain_events` handles one reply of the fetch script, so what one
call delivers is what one fetch took.
"""

from __future__ import annotations

import base64
import contextlib
import json
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from kombu import Connection, Consumer, Exchange, Producer, Queue
from kombu.asynchronous import Hub

from pipeline.constants import (
    DELIVERIES_KEY,
    HEADER_DELIVERY_COUNT,
    HEADER_LEASE_OWNER,
    HEADER_RATE_GRANT,
    LEASE_KEY,
    RATE_LIMIT_KEY,
)
from pipeline.delivery import acks, fetch
from pipeline.delivery.lease import Leases
from pipeline.flows.record import Advanced, Carried
from pipeline.lua import source
from tests.support.compat import verified_as_installed
from tests.support.dlq import dead_lettered_as_undecodable
from tests.support.procs import RedisServer

pytestmark = pytest.mark.faults


@pytest.fixture
def name(queue_name: str, own_redis: RedisServer) -> str:
    own_redis.client().script_load(source(fetch.FETCH))  # so the first poll fetches (no NOSCRIPT round)
    return queue_name


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
    own_redis: RedisServer, conn: Connection, name: str, leases: Leases
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
        assert leases.held() == {m.delivery_tag for m in got}
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
            assert len(got) - before == min(3, 7 - before) and client.hlen("unacked") == len(got) - before
            for message in got[before:]:
                message.ack()
    assert [m.payload["n"] for m in got] == list(range(7))
    assert _records(client) == (0, 0, 0, 0) and client.llen(name) == 0 and leases.held() == set()


def test_a_batch_dead_letters_its_poison_element_and_delivers_the_rest_in_order(
    own_redis: RedisServer, conn: Connection, name: str
) -> None:
    _publish(conn, name, [{"n": 0}])
    client = own_redis.client()
    poison = f"\xff not json {name}".encode("latin-1")
    client.lpush(name, poison)
    _publish(conn, name, [{"n": 2}])
    got: list[Any] = []
    with _consumer(conn, name, 5, got):
        _drain_once(conn)
    assert [m.payload["n"] for m in got] == [0, 2]
    assert dead_lettered_as_undecodable(poison)
    assert client.llen(name) == 0 and _records(client) == (2, 2, 2, 2)  # the poison element is no longer tracked


def test_acks_on_the_event_loop_are_carried_by_the_next_fetch_or_flushed_together(
    own_redis: RedisServer, conn: Connection, name: str, loop: Hub, leases: Leases
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
        assert _records(client) == (2, 2, 2, 2) and not (leases.held() & {m.delivery_tag for m in got[:2]})
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
    assert client.hlen("unacked") == 0 and client.hlen(LEASE_KEY) == 0 and leases.held() == set()


def test_a_delivery_that_raises_puts_the_rest_of_its_batch_back_at_the_head_in_order(
    own_redis: RedisServer, conn: Connection, name: str, leases: Leases
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
    assert leases.held() == {got[0].delivery_tag}  # the job that ran is still this worker's, until acknowledged
    assert client.hlen("unacked") == 1 and client.hlen(LEASE_KEY) == 1


def _n(raw: bytes) -> int:
    envelope = json.loads(raw)
    return int(json.loads(base64.b64decode(envelope["body"]))["n"])


@pytest.fixture
def carried_backend(own_redis: RedisServer) -> Iterator[Any]:
    """The pipeline's result backend on this test's Redis, with a solo worker's carrier installed. Its one-trip store
    is a speed-only replacement, off on a version outside the verified ranges: the installed ones count as verified
    here, so the test checks the replacement whatever versions it runs on."""
    from pipeline.celery_app import get_app
    from pipeline.compat.results import RedisBackend

    with verified_as_installed():
        backend = RedisBackend(app=get_app(), url=own_redis.url)
        backend.carrier = acks.carry
        yield backend


def test_a_jobs_success_is_stored_by_the_call_that_acknowledges_it_and_never_overwrites_one(
    own_redis: RedisServer, conn: Connection, name: str, loop: Hub, carried_backend: Any, leases: Leases
) -> None:
    """As in a solo worker: each job runs inside its delivery and stores its SUCCESS; the results and the
    acknowledgements of a fetched batch wait for the next call (the fetch, or the tick's flush), which stores
    each result before it acknowledges."""
    _publish(conn, name, [{"n": n} for n in range(4)])
    client = own_redis.client()
    backend = carried_backend
    ids = [f"job-{n}" for n in range(4)]
    backend.store_result(ids[2], {"n": "first"}, "SUCCESS")  # not during a delivery: written at once
    assert backend.get_task_meta(ids[2], cache=False)["result"] == {"n": "first"}
    got: list[Any] = []

    def run(body: Any, message: Any) -> None:  # what Celery's solo pool does inside the delivery
        got.append(message)
        backend.mark_as_done(ids[body["n"]], {"n": body["n"]})
        message.ack()

    def written(n: int) -> bool:
        return bool(client.exists(backend.get_key_for_task(ids[n])))

    with _consumer(conn, name, 2, got, run) as consumer:
        _drain_once(conn)
        assert len(got) == 2
        # Neither result nor acknowledgement yet: both wait for the next call.
        assert not written(0) and not written(1)
        assert client.hexists("unacked", got[0].delivery_tag) and client.hexists("unacked", got[1].delivery_tag)
        _drain_once(conn)  # the fetch stores them, acknowledges them, takes two more
        assert len(got) == 4 and written(0) and written(1)
        assert not client.hexists("unacked", got[0].delivery_tag) and not client.hexists("unacked", got[1].delivery_tag)
        consumer.channel.qos.flush_acks(carry=False)  # what the tick does when no fetch comes
    assert backend.get_task_meta(ids[2], cache=False)["result"] == {"n": "first"}  # a SUCCESS is left alone
    for n in (0, 1, 3):
        meta = backend.get_task_meta(ids[n], cache=False)
        assert (meta["status"], meta["result"]) == ("SUCCESS", {"n": n})
        assert 0 < client.ttl(backend.get_key_for_task(ids[n])) <= backend.expires
    assert _records(client) == (0, 0, 0, 0) and leases.held() == set()


def test_results_held_for_an_acknowledgement_that_failed_are_stored_before_it_on_reconnect(
    own_redis: RedisServer, leases: Leases, carried_backend: Any
) -> None:
    client = own_redis.client()
    key = carried_backend.get_key_for_task("job-x")
    meta = carried_backend.encode({"status": "SUCCESS", "result": 1, "task_id": "job-x"})
    client.hset("unacked", "tag-x", "[]")
    client.zadd("unacked_index", {"tag-x": 1})
    client.hset(LEASE_KEY, "tag-x", leases.owner())
    leases.hold("tag-x")
    leases.remember(["tag-x"], ConnectionError("reply lost"), [(key, meta, 60, "tag-x")])
    leases.renew_once(client)
    assert carried_backend.get_task_meta("job-x", cache=False)["result"] == 1
    assert not client.hexists("unacked", "tag-x") and leases.held() == set() and leases.pending_acks() == 0


def _item(flow_id: str, i: int, message: Any, answers: list[Advanced], fails: bool = False) -> bool:
    """What a solo worker's fan-out item does as its job ends (`pipeline.flows.steps`): hand its node over."""

    def answered(done: Advanced) -> None:
        if fails:
            raise ConnectionError("the join could not be offered")
        answers.append(done)

    def record_now() -> Advanced:
        raise AssertionError("recorded by a call of its own: a fetch was coming")

    node = Carried(flow_id, f"split[{i}]", "split", json.dumps({"i": i}), f"job-{i}", 1000.0, answered, record_now)
    request = SimpleNamespace(delivery_info={"delivery_tag": message.delivery_tag}, **{HEADER_LEASE_OWNER: "me"})
    return acks.carry_node(node, request)


def test_a_fan_out_items_node_rides_the_next_fetch_and_its_job_is_acknowledged_after_the_answer(
    own_redis: RedisServer, conn: Connection, name: str, loop: Hub, leases: Leases
) -> None:
    """As in a solo worker: each item's node is recorded by the next fetch (no call of its own); its job's
    acknowledgement waits for that answer (which queues the join when the item completed its step) and goes with
    the call after. A node whose answer could not be acted on leaves its job unacknowledged, its lease given up."""
    client = own_redis.client()
    flow = "pipeline:flow:{f1}"
    client.hset(flow, mapping={"state": "running", "left": 1, "total": 3, "done": 0, "more:split": 3})
    _publish(conn, name, [{"n": n} for n in range(4)])
    got: list[Any] = []
    answers: list[Advanced] = []

    def run(body: Any, message: Any) -> None:  # what Celery's solo pool does inside the delivery
        got.append(message)
        if body["n"] < 3:
            assert _item("f1", body["n"], message, answers, fails=body["n"] == 2)
        message.ack()

    with _consumer(conn, name, 2, got, run) as consumer:
        qos = consumer.channel.qos
        _drain_once(conn)
        assert len(got) == 2 and client.hlen(f"{flow}:results") == 0  # nothing recorded yet
        qos.flush_acks()  # a fetch is coming: it carries them
        assert all(client.hexists("unacked", m.delivery_tag) for m in got)
        _drain_once(conn)  # records both nodes, takes two more; the items' jobs are not acknowledged by it
        assert len(got) == 4 and client.hlen(f"{flow}:results") == 2
        assert [(a.recorded, a.state, a.complete) for a in answers] == [(True, "running", False)] * 2
        assert all(client.hexists("unacked", m.delivery_tag) for m in got[:2])
        # The next fetch: the items' acknowledgements, now that they are recorded, and item 2's node: recorded, its
        # step complete; acting on that answer fails, so item 2 is given up, not acknowledged.
        _drain_once(conn)
        assert client.hget(flow, "more:split") == b"0" and len(answers) == 2
        qos.flush_acks(carry=False)
        assert [client.hexists("unacked", m.delivery_tag) for m in got] == [False, False, True, False]
        assert got[2].delivery_tag not in leases.held()  # given up: a sweep restores it, its next delivery finds it


def test_a_fetch_takes_each_rate_limited_jobs_slot_and_never_keeps_a_grant_the_message_carried(
    own_redis: RedisServer, conn: Connection, name: str
) -> None:
    """The job of a task with a cluster-wide limit gets its slot from the fetch that takes it (no ask of its own when
    it runs); a grant header a message arrives with is never taken for one (a forged or a copied slot)."""
    from tests.support.limited import limited  # registers `test.limited` (20/s) on the app the transport reads

    limiter = RATE_LIMIT_KEY.format(task=limited.name)
    forged = {"key": limiter, "slot": 1.0, "due": 1.0}
    producer = Producer(conn.channel())
    for task in (limited.name, "test.unlimited", limited.name):
        producer.publish(
            {"task": task},
            exchange=_queue(name).exchange,
            routing_key=name,
            declare=[_queue(name)],
            headers={"task": task, HEADER_RATE_GRANT: forged},
        )
    client = own_redis.client()
    client.delete(limiter)
    got: list[Any] = []
    with _consumer(conn, name, 5, got):
        _drain_once(conn)
        grants = [m.headers.get(HEADER_RATE_GRANT) for m in got]
        for message in got:
            message.ack()
    first, unlimited, second = grants
    assert unlimited is None
    assert first["key"] == second["key"] == limiter and client.exists(limiter)
    assert second["slot"] - first["slot"] == pytest.approx(0.05, abs=0.001)  # one interval apart: two slots taken
    assert first["slot"] > 1e9 and first["due"] > 1e9  # the fetch's own, not the message's
    client.delete(limiter)


def test_an_acknowledgement_deferred_on_a_closed_channel_is_not_given_up_with_a_second_lost_connection(
    own_redis: RedisServer, conn: Connection, name: str, loop: Hub, leases: Leases
) -> None:
    """A prefork job fetched before a Redis restart ends after the reconnect: its acknowledgement is deferred on the
    QoS of the channel the restart closed, for the next tick. A second lost connection before that tick makes Celery's
    `Consumer.on_close` forget the requests it holds, and the delivery step gives up the leases of those not running
    (`Leases.drop`): the finished job's must not be among them, or its acknowledgement is fenced and a sweep runs it
    again."""
    client = own_redis.client()
    got: list[Any] = []
    _publish(conn, name, [{"n": 1}])
    with _consumer(conn, name, 1, got) as consumer:
        _drain_once(conn)
        (message,) = got
        tag, channel = message.delivery_tag, consumer.channel
        channel.close()  # the restart: a lost connection closes the channel, the job goes on running
        message.ack()  # the job ended after the reconnect: deferred on the closed channel's QoS
        leases.drop(leases.held())  # a second lost connection: `on_close` keeps no request (this one ended)
        leases.renew_once(client)  # the renewal thread gives up what was dropped
        channel.qos.flush_acks()  # the tick after the reconnect: the channel is closed, so remembered
        leases.renew_once(client)  # and applied by the renewal thread
    assert not client.hexists("unacked", tag), "its acknowledgement was fenced: a sweep runs the job again"
    assert client.zcard("unacked_index") == 0 and not client.hexists(LEASE_KEY, tag)
    assert leases.held() == set() and leases.pending_acks() == 0
