"""A Redis restart on a prefork worker with a job handed to a pool process that has not taken it yet.

Celery's prefork pool writes a job into a process's pipe, and the process tells the main process it took it (its
ACK) only when it reads it. A lost connection in between makes Celery's consumer flush the pool
(`Consumer.on_close` → `AsynPool.flush`), which forgets every job not taken yet: the process still reads the job
from its pipe and runs it, and the main process ignores its outcome, so the job would never be acknowledged, while
its lease, held for the job still to end, was renewed for good (issue 39, finding 7: a delivery left in `unacked`
after every job had run once). The test makes that window as wide as it likes: the pool's only process is stopped
(SIGSTOP) before the job is sent, so the job waits in its pipe, unread, while Redis restarts.
"""

from __future__ import annotations

import collections
import fcntl
import logging
import os
import signal
import struct
import termios
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection, Exchange, Queue

from pipeline.constants import LEASE_KEY
from pipeline.delivery import transport
from pipeline.delivery.lease import Leases
from tests.support.consuming import one_delivered
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults

LEASE_S = 6


def _children(pid: int) -> list[int]:
    return [int(x) for x in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _unread_bytes(pid: int) -> int:
    """Bytes waiting, unread, in the pipes process `pid` holds (FIONREAD on each, reopened through /proc)."""
    total = 0
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            if not os.readlink(fd).startswith("pipe:"):
                continue
            handle = os.open(fd, os.O_RDONLY | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            total += struct.unpack("i", fcntl.ioctl(handle, termios.FIONREAD, b"\0\0\0\0"))[0]
        finally:
            os.close(handle)
    return total


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """Process `pid` stopped (SIGSTOP) inside the block, continued after it whatever happens."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def _done(ledger: RedisServer, key: str) -> list[str]:
    return [x.decode() for x in ledger.client().lrange(f"test:done:{key}", 0, -1)]


@pytest.mark.parity  # Celery's flush forgets such a job, and `pipeline.delivery.handed` puts it back
def test_a_job_in_a_pool_process_pipe_at_a_redis_restart_is_acknowledged_once_it_ran(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any
) -> None:
    key = uuid.uuid4().hex
    env = {"REDIS_URL": own_redis.url, "TEST_LEDGER_URL": ledger_redis.url, "LEASE_SECONDS": str(LEASE_S)}
    worker = make_worker(f"pipe-restart-{key[:6]}", env=env, concurrency=1)
    [child] = _children(worker.pid)
    producer = Celery("pipe-restart-producer", broker=own_redis.url, set_as_current=False)
    producer.conf.update(task_serializer="json")
    broker = own_redis.client()
    with stopped(child):
        before = _unread_bytes(child)
        job = str(producer.send_task("test.ledger", args=[{"key": key}], queue="default").id)
        producer.close()
        wait_for(lambda: broker.hlen("unacked") == 1, 30, 0.05, what="the job's delivery")
        wait_for(lambda: _unread_bytes(child) > before, 30, 0.05, what="the job written to the stopped process")
        connected = worker.log().count("Connected to")
        own_redis.stop()
        own_redis.start()
        wait_for(lambda: worker.log().count("Connected to") > connected, 60, 0.2, what="the worker to reconnect")
    wait_for(lambda: job in _done(ledger_redis, key), 30, 0.1, what="the job to run")
    finished = time.monotonic()

    def settled() -> bool:
        return own_redis.client().hlen("unacked") == 0 and own_redis.client().llen("default") == 0

    try:
        wait_for(settled, 4 * LEASE_S, 0.2, what="the job's acknowledgement")
    except TimeoutError:
        unacked = own_redis.client().hgetall("unacked")
        raise AssertionError(f"never acknowledged: {unacked}\n{worker.log()[-4000:]}") from None
    # A lease that lapsed or was given up has been swept, and its job run again, two leases after the finish.
    time.sleep(max(0.0, finished + 2 * LEASE_S - time.monotonic()))  # not a wait for an outcome: a re-run's time
    assert settled()
    runs = collections.Counter(_done(ledger_redis, key))
    assert runs == {job: 1}, f"runs: {runs}\n{worker.log()[-4000:]}"


def test_a_requeue_that_cannot_reach_redis_gives_the_lease_up(own_redis: RedisServer, leases: Leases) -> None:
    """A job given back (`reject(requeue=True)`: Celery's for a pool process lost with `task_reject_on_worker_lost`)
    while Redis is away: its lease is given up once Redis answers, so a sweep puts it back on its queue (it was held
    and renewed for good, neither run nor acknowledged again)."""
    name = f"requeue-outage-{uuid.uuid4().hex[:8]}"
    queue = Queue(name, Exchange(name, "direct"), name)
    with Connection(own_redis.url, transport=transport.bound(leases)) as conn:
        channel = conn.channel()
        conn.Producer(channel).publish({"job": 1}, exchange=queue.exchange, routing_key=name, declare=[queue])
        message = queue(channel).get(no_ack=False)
        assert message is not None
        tag = message.delivery_tag
        own_redis.stop()
        message.requeue()
        own_redis.start()
    client = own_redis.client()
    leases.renew_once(client)  # what the renewal thread does once Redis answers

    assert leases.held() == set()
    assert client.hget(LEASE_KEY, tag) is None, "still leased to this worker"
    assert client.zscore("unacked_index", tag) == 0, "not given up for the sweep"


def test_an_acknowledgement_applied_by_a_fetch_whose_reply_was_lost_is_not_reported_fenced(
    own_redis: RedisServer, leases: Leases, loop: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """A fetch carries a finished job's acknowledgement and Redis runs it, but its reply is lost with the connection:
    the acknowledgement is remembered and applied again by the renewal thread, which finds nothing left to remove. That
    is logged as applied already, not as a lease lost to another worker (no peer ever had it)."""
    client = own_redis.client()
    with one_delivered(own_redis, leases, "lost-reply") as (_conn, channel, finished):
        finished.ack()  # deferred for the next fetch to carry
        channel._brpop_start()  # that fetch: Redis runs it, acknowledging the job
        wait_for(lambda: client.hlen("unacked") == 0, 10, 0.01, what="the fetch to acknowledge the job")
        channel.client.connection.disconnect()  # its reply is lost with the connection
        with pytest.raises(channel.connection_errors):
            channel._brpop_read()
        assert leases.pending_acks() == 1
        with caplog.at_level(logging.INFO, logger="pipeline.delivery.lease"):
            leases.renew_once(client)  # what the renewal thread does next
    assert leases.pending_acks() == 0 and leases.held() == set()
    lines = [r.getMessage() for r in caplog.records if r.name == "pipeline.delivery.lease"]
    assert not [line for line in lines if "fenced" in line], lines
    assert [line for line in lines if "acknowledged already" in line], lines
