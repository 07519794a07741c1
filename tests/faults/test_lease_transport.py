"""The worker transport's atomic fetch, its lease records and fenced acknowledgements, on a real redis-server.

No worker here: a kombu `Connection` on `pipeline.delivery.transport` consumes the way a worker's consumer does
(`drain_events` through kombu's poll cycle: the fetch script, then the non-consuming wait).
"""

from __future__ import annotations

import contextlib
import json
import time
from typing import Any

import pytest
import redis
from kombu import Connection, Consumer, Exchange, Producer, Queue

from pipeline.constants import DELIVERIES_KEY, DELIVERY_LOG_KEY, HEADER_DELIVERY_COUNT, LEASE_KEY
from pipeline.delivery import transport
from pipeline.delivery.lease import Leases
from pipeline.lua import sha
from tests.support.dlq import dead_lettered_as_undecodable
from tests.support.procs import RedisServer

pytestmark = pytest.mark.faults


def _publish(conn: Connection, name: str, body: Any, priority: int | None = None) -> None:
    queue = Queue(name, Exchange(name, "direct"), name)
    Producer(conn.channel()).publish(
        body, exchange=queue.exchange, routing_key=name, declare=[queue], priority=priority
    )


def _drain(conn: Connection, name: str, n: int, timeout: float = 5) -> list[Any]:
    got: list[Any] = []
    queue = Queue(name, Exchange(name, "direct"), name)
    with Consumer(conn.channel(), [queue], callbacks=[lambda body, message: got.append(message)]):
        deadline = time.monotonic() + timeout
        while len(got) < n and time.monotonic() < deadline:
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=0.5)
    return got


def _lapsed(own_redis: RedisServer, conn: Connection, queue_name: str, n: int) -> tuple[Any, redis.Redis]:
    """A job published and fetched by this worker, its lease past (its holder stopped renewing)."""
    _publish(conn, queue_name, {"n": n})
    (message,) = _drain(conn, queue_name, 1)
    client = own_redis.client()
    client.zadd("unacked_index", {message.delivery_tag: time.time() - 60})
    return message, client


def _sweep_after_a_whole_lease(conn: Connection, leases: Leases) -> None:
    """The sweep of expired leases, this worker's renewals having succeeded for a whole lease."""
    leases._streak_since, leases._renewed_at = time.monotonic() - 60, time.monotonic()
    conn.default_channel.qos.restore_visible(interval=1)


def test_a_fetch_records_the_delivery_lease_count_and_history_in_one_step(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    _publish(conn, queue_name, {"n": 1})
    raw = own_redis.client().lindex(queue_name, 0)
    (message,) = _drain(conn, queue_name, 1)
    client = own_redis.client()
    tag = message.delivery_tag
    record = json.loads(client.hget("unacked", tag))
    assert record[0] == json.loads(raw) and record[1:] == [queue_name, queue_name]  # the element untouched
    assert client.hget(LEASE_KEY, tag).decode() == leases.owner()
    assert client.zscore("unacked_index", tag) is not None
    assert int(client.hget(DELIVERIES_KEY, tag)) == 1
    history = [json.loads(x) for x in client.lrange(DELIVERY_LOG_KEY.format(tag=tag), 0, -1)]
    assert len(history) == 1 and history[0]["worker"] and abs(history[0]["at"] - time.time()) < 10
    assert message.headers[HEADER_DELIVERY_COUNT] == 1
    assert tag in leases.held()

    message.ack()
    assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0
    assert client.hlen(LEASE_KEY) == 0 and client.hlen(DELIVERIES_KEY) == 0
    assert not client.exists(DELIVERY_LOG_KEY.format(tag=tag))
    assert tag not in leases.held()


def test_a_delivery_restored_after_its_lease_counts_its_second_delivery(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    first, client = _lapsed(own_redis, conn, queue_name, 2)
    leases.release(first.delivery_tag)  # and it was another worker: this one holds nothing of it
    _sweep_after_a_whole_lease(conn, leases)
    assert client.hlen(LEASE_KEY) == 0 and client.llen(queue_name) == 1  # back on its queue, lease cleared
    (second,) = _drain(conn, queue_name, 1)
    assert second.delivery_tag == first.delivery_tag
    assert second.headers[HEADER_DELIVERY_COUNT] == 2
    assert client.llen(DELIVERY_LOG_KEY.format(tag=second.delivery_tag)) == 2


def test_a_job_fetched_again_while_this_worker_still_holds_it_is_not_delivered_twice(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    """A worker frozen past its lease can fetch its own job back after a sweep restored it: the copy it holds goes
    on (under the new lease); the new delivery is not handed to Celery a second time."""
    held, client = _lapsed(own_redis, conn, queue_name, 8)
    _sweep_after_a_whole_lease(conn, leases)  # the lease expired: back on its queue
    assert client.llen(queue_name) == 1
    assert _drain(conn, queue_name, 1, timeout=2) == []  # fetched (the queue is empty) but not delivered again
    assert client.llen(queue_name) == 0 and client.hget(LEASE_KEY, held.delivery_tag).decode() == leases.owner()
    assert held.delivery_tag in leases.held() and leases.renew_once(client) == set()
    held.ack()
    assert client.hlen("unacked") == 0


def test_the_sweep_waits_a_whole_lease_of_renewals_and_skips_renewed_leases(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    _, client = _lapsed(own_redis, conn, queue_name, 3)
    now = time.monotonic()
    leases._streak_since, leases._renewed_at = now, now  # renewing since just now: e.g. Redis just came back
    conn.default_channel.qos.restore_visible(interval=1)
    assert client.hlen("unacked") == 1 and client.llen(queue_name) == 0
    leases._streak_since, leases._renewed_at = now - 60, now - 20  # its last renewal long ago: it was frozen
    conn.default_channel.qos.restore_visible(interval=1)
    assert client.hlen("unacked") == 1 and client.llen(queue_name) == 0
    leases.renew_once(client)  # what it does first once thawed: renewed, no longer expired
    leases._renewed_at = time.monotonic()
    conn.default_channel.qos.restore_visible(interval=1)
    assert client.hlen("unacked") == 1 and client.llen(queue_name) == 0


def test_the_sweep_leaves_a_delivery_of_a_worker_without_leases_for_its_old_timeout(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    """A rolling upgrade: a worker of the previous release fetched with BRPOP and records no leases."""
    with Connection(own_redis.url) as legacy:  # kombu's own transport
        _publish(legacy, queue_name, {"n": "legacy"})
        (old,) = _drain(legacy, queue_name, 1)
        client = own_redis.client()
        assert client.hlen("unacked") == 1 and client.hlen(LEASE_KEY) == 0
        client.zadd("unacked_index", {old.delivery_tag: time.time() - 600})  # running for ten minutes
        _sweep_after_a_whole_lease(conn, leases)
        assert client.hlen("unacked") == 1 and client.llen(queue_name) == 0
        client.zadd("unacked_index", {old.delivery_tag: time.time() - transport.LEGACY_TIMEOUT_S - 1})
        conn.default_channel.qos.restore_visible(interval=1)
        assert client.hlen("unacked") == 0 and client.llen(queue_name) == 1


def test_an_ack_after_the_lease_moved_to_a_peer_is_fenced(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    _publish(conn, queue_name, {"n": 4})
    (message,) = _drain(conn, queue_name, 1)
    client = own_redis.client()
    client.hset(LEASE_KEY, message.delivery_tag, "peer:1:abc")  # a peer fetched it after a restore
    assert leases.renew_once(client) == {message.delivery_tag}
    assert leases.is_lost(message.delivery_tag)
    message.ack()
    assert client.hget(LEASE_KEY, message.delivery_tag) == b"peer:1:abc"  # the peer's delivery is untouched
    assert client.hlen("unacked") == 1


def test_a_renewal_that_reaches_redis_after_the_acknowledgement_finds_nothing_lost(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    """The renewal thread takes its list of held jobs, then the event loop acknowledges one (its lease record goes
    with it) before the renewal's call reaches Redis: the job is done, not lost to a peer."""
    _publish(conn, queue_name, {"n": 9})
    (message,) = _drain(conn, queue_name, 1)
    client = own_redis.client()
    tag = message.delivery_tag

    class AckedMeanwhile:
        def evalsha(self, digest: str, *args: Any) -> Any:
            if digest == sha("renew") and not message.acknowledged:
                message.ack()  # the worker's own fenced acknowledgement, applied and answered
            return client.evalsha(digest, *args)

        def script_load(self, text: bytes) -> Any:
            return client.script_load(text)

    assert tag in leases.held()
    assert leases.renew_once(AckedMeanwhile()) == set()
    assert not leases.is_lost(tag) and tag not in leases.held()
    assert client.hlen("unacked") == 0 and client.hlen(LEASE_KEY) == 0


def test_a_renewal_while_an_acknowledgement_awaits_its_reply_finds_nothing_lost(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    """The acknowledging call ran in Redis, its reply is not read yet, and the renewal runs meanwhile (a solo
    worker's fetch carrying its batch's acknowledgements is in flight for a whole round trip)."""
    _publish(conn, queue_name, {"n": 10})
    (message,) = _drain(conn, queue_name, 1)
    client = own_redis.client()
    tag = message.delivery_tag
    renewals: list[set[str]] = []

    class RenewBeforeTheReply:
        def script_load(self, text: bytes) -> Any:
            return client.script_load(text)

        def evalsha(self, digest: str, *args: Any) -> Any:
            reply = client.evalsha(digest, *args)
            renewals.append(leases.renew_once(client))
            return reply

    assert leases.settle(RenewBeforeTheReply(), [tag]) == set()  # acknowledged, not fenced
    assert renewals == [set()] and not leases.is_lost(tag) and tag not in leases.held()
    assert client.hlen("unacked") == 0 and client.hlen(LEASE_KEY) == 0


def test_a_renewal_racing_the_holders_own_requeue_finds_nothing_lost(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    """A requeue by the worker that holds the job clears its lease record with it: a renewal that reaches Redis
    after it, before or after the worker read its reply, is not a peer taking the job."""
    _publish(conn, queue_name, {"n": 11})
    _publish(conn, queue_name, {"n": 12})
    first, second = _drain(conn, queue_name, 2)
    client = own_redis.client()

    class RequeuedMeanwhile:
        def evalsha(self, digest: str, *args: Any) -> Any:
            if digest == sha("renew") and not first.acknowledged:
                first.requeue()  # QoS.reject(requeue=True): restored at the head, released
            return client.evalsha(digest, *args)

        def script_load(self, text: bytes) -> Any:
            return client.script_load(text)

    assert leases.renew_once(RequeuedMeanwhile()) == set()
    assert not leases.is_lost(first.delivery_tag) and first.delivery_tag not in leases.held()
    renewals: list[set[str]] = []

    class RenewBeforeTheReply:
        def transaction(self, *args: Any, **kwargs: Any) -> Any:
            reply = client.transaction(*args, **kwargs)
            renewals.append(leases.renew_once(client))
            return reply

    qos = conn.default_channel.qos
    assert qos.restore_tag(second.delivery_tag, RenewBeforeTheReply(), leftmost=True, owner=leases.owner()) == 1
    assert renewals == [set()] and not leases.is_lost(second.delivery_tag)
    leases.release(second.delivery_tag)
    assert client.llen(queue_name) == 2 and client.hlen("unacked") == 0 and client.hlen(LEASE_KEY) == 0


def test_an_ack_made_while_redis_is_down_is_applied_by_the_renewal(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    _publish(conn, queue_name, {"n": 5})
    (message,) = _drain(conn, queue_name, 1)
    own_redis.stop()
    message.ack()  # no error: remembered
    assert leases.pending_acks() == 1
    own_redis.start()
    leases.renew_once(own_redis.client())
    assert leases.pending_acks() == 0
    assert own_redis.client().hlen("unacked") == 0


def test_a_non_message_is_dead_lettered_and_untracked(
    own_redis: RedisServer, conn: Connection, queue_name: str
) -> None:
    _publish(conn, queue_name, {"n": 6})
    client = own_redis.client()
    poison = f"\xff not json {queue_name}".encode("latin-1")
    client.rpush(queue_name, poison)  # RPUSH: the next element popped
    (message,) = _drain(conn, queue_name, 1)
    assert message.payload == {"n": 6}
    # Dead-lettered (to the app's broker) and no longer tracked.
    assert dead_lettered_as_undecodable(poison)
    assert client.hlen("unacked") == 1 and client.hlen(LEASE_KEY) == 1 and client.llen(queue_name) == 0


def test_a_sweeper_with_a_short_lease_leaves_a_longer_lease_alone(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    """The index holds each lease's expiry, written by its holder: a sweep never judges a peer's lease by its own
    LEASE_SECONDS (a transcode worker may hold a longer lease than the sweeping email worker)."""
    _publish(conn, queue_name, {"n": 9})
    leases.lease_seconds = 120  # this holder's lease: two minutes
    try:
        (message,) = _drain(conn, queue_name, 1)
    finally:
        leases.lease_seconds = 30
    client = own_redis.client()
    expiry = client.zscore("unacked_index", message.delivery_tag)
    assert expiry is not None and expiry > time.time() + 100  # two minutes from the fetch
    leases.release(message.delivery_tag)  # a peer's delivery: this process only sweeps
    client.hset(LEASE_KEY, message.delivery_tag, "peer-with-a-long-lease")
    client.zadd("unacked_index", {message.delivery_tag: time.time() + 50})  # renewed 70 s ago; a 30 s sweeper runs
    _sweep_after_a_whole_lease(conn, leases)
    assert client.hlen("unacked") == 1 and client.llen(queue_name) == 0  # not restored: its lease has 50 s left
    client.zadd("unacked_index", {message.delivery_tag: time.time() - 1})  # the long lease lapsed
    conn.default_channel.qos.restore_visible(interval=1)
    assert client.hlen("unacked") == 0 and client.llen(queue_name) == 1


def test_a_lease_that_cannot_be_renewed_is_due_a_renewal_period_before_it_lapses_and_then_given_up(
    own_redis: RedisServer, conn: Connection, queue_name: str, leases: Leases
) -> None:
    """The stop deadline runs on the worker's own clock from the last call that reached Redis: a renewal that fails
    (Redis stopped) confirms nothing, so the running job is due `LEASE_SECONDS - LEASE_SECONDS/3` after the last
    one that succeeded; a job that ended (its acknowledgement waits for Redis) never is. Given up, the lease is no
    longer renewed and the job is not run here, and a fetch of it anew runs as a new delivery."""
    from pipeline.runtime.lapses import stop_before_lapse

    _publish(conn, queue_name, {"n": 1})
    _publish(conn, queue_name, {"n": 2})
    running, ended = _drain(conn, queue_name, 2)
    tag = running.delivery_tag
    period = stop_before_lapse(leases.lease_seconds)
    sent = time.monotonic()
    leases.renew_once(own_redis.client())
    renewed = time.monotonic()
    assert leases.due(period, now=sent + leases.lease_seconds - period - 0.01) == set()
    own_redis.stop()
    ended.ack()  # remembered: its job is over
    with pytest.raises(redis.ConnectionError):
        leases.renew_once(own_redis.client())
    assert leases.due(period, now=sent + leases.lease_seconds - period - 0.01) == set()
    assert leases.due(period, now=renewed + leases.lease_seconds - period) == {tag}, "the failure confirmed it"

    lapses_at = leases.give_up({tag})[tag]
    assert sent + leases.lease_seconds <= lapses_at <= renewed + leases.lease_seconds
    assert leases.is_lost(tag) and tag not in leases.held()
    own_redis.start()
    client = own_redis.client()
    before = client.zscore("unacked_index", tag)
    leases.renew_once(client)  # applies the remembered acknowledgement; leaves the given-up lease to lapse
    assert leases.pending_acks() == 0 and client.hlen("unacked") == 1
    assert client.zscore("unacked_index", tag) == before
    assert not leases.rehold(tag) and not leases.is_lost(tag)  # fetched anew after a sweep: it runs
