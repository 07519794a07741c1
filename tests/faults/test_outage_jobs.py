"""Jobs running while Redis goes away: each ends done exactly once (or dead-lettered with a reason), none lost.

A worker subprocess (LEASE_SECONDS=6) runs ledger jobs of a few seconds on its own redis-server (AOF on); Redis
is stopped while they run and started again on the same port 12 s later, twice the leases. The running jobs are
stopped before their leases lapse (the worker cannot renew them) and run again after the outage. The test counts the
jobs the producer was told were accepted against the jobs that completed (the ledger's `test:done:<key>`
list), and looks at each job's attempts, stored result, the dead-letter queue and the `unacked` hash.
"""

from __future__ import annotations

import base64
import collections
import json
import time
import uuid
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from pipeline.constants import DEAD_LETTER_QUEUE, LEASE_KEY
from pipeline.delivery import transport
from pipeline.delivery.lease import Leases
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults

#: Longer than the lease: when Redis is back every lease looks expired, and none may be restored.
OUTAGE_S = 12.0
JOB_S = 6.0
SHORT_LEASE = {"LEASE_SECONDS": "6", "UNACKED_RESTORE_INTERVAL": "2"}
JOBS = 3
QUEUED = 2


def _done(ledger: RedisServer, key: str) -> list[str]:
    return [x.decode() for x in ledger.client().lrange(f"test:done:{key}", 0, -1)]


def _attempts(ledger: RedisServer, key: str) -> list[dict[str, Any]]:
    return [json.loads(x) for x in ledger.client().lrange(f"test:ledger:{key}", 0, -1)]


def _settled(broker: RedisServer, ledger: RedisServer, key: str, sent: list[str]) -> bool:
    """Every accepted job completed, and nothing is left that could run again: no queued or unacknowledged job."""
    client = broker.client()
    return set(sent) <= set(_done(ledger, key)) and client.hlen("unacked") == 0 and client.llen("default") == 0


def test_jobs_running_through_an_outage_complete_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any
) -> None:
    key = uuid.uuid4().hex
    env = {"REDIS_URL": own_redis.url, "TEST_LEDGER_URL": ledger_redis.url, **SHORT_LEASE}
    worker = make_worker(f"jobs-outage-{key[:6]}", env=env, concurrency=JOBS)
    worker_pid = worker.pid
    producer = Celery("jobs-outage-producer", broker=own_redis.url, backend=own_redis.url, set_as_current=False)
    producer.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
    try:
        # JOBS run when Redis goes away; QUEUED more wait for a free slot through the outage.
        sent = [
            str(producer.send_task("test.ledger", args=[{"key": key, "sleep_s": JOB_S}], queue="default").id)
            for _ in range(JOBS + QUEUED)
        ]
        wait_for(lambda: len(_attempts(ledger_redis, key)) >= JOBS, 60, 0.1, what="the first jobs to start")
        own_redis.stop()
        time.sleep(OUTAGE_S)  # the outage itself, not a wait for an outcome
        own_redis.start()
        wait_for(lambda: _settled(own_redis, ledger_redis, key, sent), 120, 0.2, what="every accepted job to complete")

        runs = collections.Counter(_done(ledger_redis, key))
        dead = [
            json.loads(base64.b64decode(json.loads(x)["body"]))
            for x in own_redis.client().lrange(DEAD_LETTER_QUEUE, 0, -1)
        ]
        report = {
            job: {
                "attempts": sum(1 for a in _attempts(ledger_redis, key) if a["task_id"] == job),
                "done": runs[job],
                "state": producer.AsyncResult(job).state,
                "dead": [(d["reason"], d["exception_type"]) for d in dead if d["task_id"] == job],
            }
            for job in sent
        }
        print(json.dumps(report, indent=1))
        assert worker.proc is not None and worker.proc.pid == worker_pid and worker.proc.poll() is None
        # The JOBS running were stopped two renewal periods into the outage (their leases could not be renewed) and
        # ran again after it; the QUEUED ones ran once. Each completed once.
        assert {job: r for job, r in report.items() if r["done"] != 1 or r["dead"]} == {}, report
        assert sorted(r["attempts"] for r in report.values()) == [1] * QUEUED + [2] * JOBS, report
        assert worker.log().count("abandoned (its lease could not be renewed") == JOBS
        assert {r["state"] for r in report.values()} == {"SUCCESS"}, report
    finally:
        producer.close()


def test_an_acknowledgement_made_while_redis_is_down_is_applied_on_reconnect(
    own_redis: RedisServer, leases: Leases
) -> None:
    """A job that finished as the connection dropped is acknowledged once Redis is back, not delivered again;
    the job beside it, still running, stays leased to this worker (renewed), not restored."""
    name = f"outage-acks-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, "direct"), name)
    with Connection(own_redis.url, transport=transport.bound(leases)) as first:
        channel = first.channel()
        for body in ("finished", "interrupted"):
            first.Producer(channel).publish({"job": body}, exchange=queue.exchange, routing_key=name, declare=[queue])
        bound = queue(channel)
        finished, interrupted = bound.get(no_ack=False), bound.get(no_ack=False)
        assert finished is not None and interrupted is not None
        assert own_redis.client().hlen("unacked") == 2

        own_redis.stop()
        finished.ack()  # no error: remembered
        assert leases.pending_acks() == 1
        first.close()  # what the worker does on a connection error: no restore (not a shutdown)
        own_redis.start()

    client = own_redis.client()
    lost = leases.renew_once(client)  # what the renewal thread does once Redis answers
    assert lost == set() and leases.pending_acks() == 0
    assert client.llen(name) == 0, "a job came back to its queue"
    assert list(client.hkeys("unacked")) == [interrupted.delivery_tag.encode()]
    assert client.hget(LEASE_KEY, interrupted.delivery_tag).decode() == leases.owner()
    interrupted.ack()  # the closed channel: remembered, then applied
    leases.renew_once(client)
    assert client.hlen("unacked") == 0


def test_an_acknowledgement_waiting_for_a_fetch_redis_never_answered_is_applied_not_given_back(
    own_redis: RedisServer, leases: Leases, loop: Any
) -> None:
    """Redis goes away with a fetch in flight, unanswered, and a job's acknowledgement deferred for the next fetch to
    carry (`pipeline.delivery.acks`): the worker's connection is closed as Celery closes it after a connection error,
    then its consumer's `on_close` gives up the leases of every job not running (`pipeline.delivery.fencing`). The
    finished job's acknowledgement is applied once Redis is back; its delivery is not given back for a sweep to run
    again (it was: the fetch's unread reply stopped the channel's close, which never wrote or kept that
    acknowledgement)."""
    from tests.support.consuming import one_delivered

    client = own_redis.client()
    with one_delivered(own_redis, leases, "outage-inflight") as (conn, channel, finished):
        client.execute_command("CLIENT", "PAUSE", 60_000, "ALL")  # the next fetch is sent, and never answered
        channel._brpop_start()
        finished.ack()  # the job ends: its acknowledgement waits for the fetch after the one in flight
        own_redis.stop()
        conn.collect()  # what Celery's consumer does after a connection error (`on_connection_error_after_connected`)
    leases.drop(leases.held())  # its `on_close`: no job runs (`_release_what_on_close_drops`)
    for tick in list(loop.on_tick):  # the event loop's next ticks, after the reconnect
        tick()
    own_redis.start()
    client = own_redis.client()
    leases.renew_once(client)  # what the renewal thread does once Redis answers

    assert leases.pending_acks() == 0 and leases.held() == set()
    assert client.hlen("unacked") == 0 and client.zcard("unacked_index") == 0, "the finished job was given back"
    assert client.llen(finished.delivery_info["routing_key"]) == 0
