"""A worker on a Redis Cluster URL (`pipeline.delivery.clustered`): it drains queues that live on different masters,
each job once; an idle one wakes at once on a job of any of them; a killed one's job comes back after its lease and
runs once more; Celery's own `send_task` and `delay().get()` work end to end; the asyncio pool (`pipeline worker`'s
default, on the event loop the transport drives: `pipeline.delivery.cluster_loop`) drains its async jobs at SIGTERM,
each run once.

A real 3+3 cluster (`redis_cluster`), `celery worker` subprocesses, Celery's publish from a process of its own
(`tests.support.cluster_producer`). Jobs record their starts and completions in a ledger Redis (`TEST_LEDGER_URL`),
which is also the result backend here (RESULT_BACKEND_URL on a single Redis: the lease is read in the queue's slot
before a store; results on the cluster itself: `test_cluster_results.py`).
"""

from __future__ import annotations

import collections
import json
import signal
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
from redis.cluster import key_slot

from pipeline.constants import WORK_QUEUES
from pipeline.queues import keys
from pipeline.runtime.asyncpool import POOL
from tests.faults.asyncpool_workers import children
from tests.faults.ledger import SHORT_LEASE, SHORT_LEASE_S, done, each_ran_once, run_count, starts
from tests.support.cluster import Cluster
from tests.support.cluster_send import produce, send
from tests.support.procs import RedisServer, Worker, wait_for

pytestmark = pytest.mark.faults


def _two_queues(cluster: Cluster) -> tuple[str, str]:
    """Two work queues whose slots are served by different masters."""
    master = {queue: cluster.master_of(key_slot(queue.encode())).port for queue in WORK_QUEUES}
    return next((a, b) for a in WORK_QUEUES for b in WORK_QUEUES if master[a] != master[b])


def _env(cluster: Cluster, ledger: RedisServer, **extra: str) -> dict[str, str]:
    return {
        "REDIS_URL": cluster.url(),
        "RESULT_BACKEND_URL": ledger.url,
        "TEST_LEDGER_URL": ledger.url,
        "CELERY_CUSTOM_WORKER_POOL": POOL,  # `-P custom`: the asyncio pool
        **SHORT_LEASE,
        **extra,
    }


def _blocked_on(cluster: Cluster, queue: str) -> bool:
    """Whether a client is blocked on the master serving `queue` (the worker's wait on the queue's marker)."""
    master = cluster.master_of(key_slot(queue.encode()))
    return int(master.client().info("clients")["blocked_clients"]) >= 1


def _held(cluster: Cluster, queue: str) -> int:
    client = cluster.client()
    return int(client.hlen(keys.unacked(queue, True))) + int(client.hlen(keys.lease(queue, True)))


def _past_two_leases(ledger: RedisServer, key: str) -> None:
    """Wait until 2 x LEASE_SECONDS after the last completion's record, on the ledger's clock."""
    client = ledger.client()
    last = max(json.loads(x)["t"] for x in client.lrange(f"test:ledger:{key}", 0, -1))

    def past() -> bool:
        seconds, micros = client.time()
        return bool(seconds + micros / 1e6 >= last + 2 * SHORT_LEASE_S)

    wait_for(past, 6 * SHORT_LEASE_S, 0.2, what="two leases past the last job")


@pytest.mark.parity  # kombu's virtual transport, as the cluster transport extends it (`pipeline.delivery.ENTRIES`)
def test_a_worker_drains_queues_on_two_masters_each_job_once(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    one, other = _two_queues(redis_cluster)
    key, n = uuid.uuid4().hex, 20
    env = _env(redis_cluster, ledger_redis)
    jobs = [*send(env, one, key, n, 0.02)["ids"], *send(env, other, key, n, 0.02)["ids"]]
    make_worker(f"cl-drain-{key[:6]}", env=env, queues=f"{one},{other}", concurrency=2)
    wait_for(lambda: set(jobs) <= set(done(ledger_redis, key)), 120, 0.2, what="every job to finish")
    _past_two_leases(ledger_redis, key)
    assert done(ledger_redis, key) == collections.Counter(dict.fromkeys(jobs, 1))
    ran = collections.Counter(s["task_id"] for s in starts(ledger_redis, key))
    assert ran == collections.Counter(dict.fromkeys(jobs, 1)), "each job started once"
    assert _held(redis_cluster, one) == 0 and _held(redis_cluster, other) == 0, "nothing left in any unacked"


@pytest.mark.parametrize("pool", ["prefork", "custom"], ids=["prefork", "asyncio"])
def test_an_idle_worker_wakes_at_once_on_a_job_of_either_master(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any, pool: str
) -> None:
    """On the event loop (prefork's and the asyncio pool's, `pipeline.delivery.cluster_loop`) as on the synchronous
    one: a job pushed to a queue on any master starts at once, not at the next fallback poll."""
    one, other = _two_queues(redis_cluster)
    key = uuid.uuid4().hex
    env = _env(redis_cluster, ledger_redis, TEST_WAKE_POLL_S="30")  # the fallback poll far above the bound
    make_worker(f"cl-wake-{key[:6]}", env=env, queues=f"{one},{other}", concurrency=1, pool=pool)
    for n, queue in enumerate((one, other, one)):
        wait_for(lambda q=queue: _blocked_on(redis_cluster, q), 20, 0.05, what=f"the worker idle on {queue}'s marker")
        sent = send(env, queue, key, 1, 0)
        (job,) = sent["ids"]
        wait_for(lambda n=n: len(starts(ledger_redis, key)) > n, 20, 0.05, what=f"the job on {queue} to start")
        started = starts(ledger_redis, key)[n]
        assert started["task_id"] == job
        latency = started["t"] - sent["sent"]
        print(f"{queue}: started {latency:.3f} s after the send (fallback poll 30 s)")
        assert latency < 3.0, latency


def test_kill_9_mid_job_the_job_runs_once_more_on_a_peer(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    one, _other = _two_queues(redis_cluster)
    key = uuid.uuid4().hex
    env = _env(redis_cluster, ledger_redis)
    first = make_worker(f"cl-kill-a-{key[:6]}", env=env, queues=one, concurrency=1)
    (job,) = send(env, one, key, 1, 60, once=True)["ids"]  # still running when killed; at once the second time
    wait_for(lambda: len(starts(ledger_redis, key)) >= 1, 30, 0.05, what="the job to start")
    first.kill_group(signal.SIGKILL)
    first.wait(10)
    killed_at = time.time()
    make_worker(f"cl-kill-b-{key[:6]}", env=env, queues=one, concurrency=1)
    wait_for(lambda: job in done(ledger_redis, key), 60, 0.1, what="the job to finish on the peer")
    _past_two_leases(ledger_redis, key)
    assert [s["task_id"] for s in starts(ledger_redis, key)] == [job, job], "run once more, not twice more"
    assert starts(ledger_redis, key)[1]["t"] > killed_at
    assert done(ledger_redis, key) == collections.Counter({job: 1})
    assert _held(redis_cluster, one) == 0


def test_a_late_result_of_a_worker_that_lost_the_lease_is_refused(
    redis_cluster: Cluster, ledger_redis: RedisServer
) -> None:
    """The fence with results on a single Redis beside a cluster: the lease is read in the job's queue's slot, where a
    peer's sweep and fetch moved it."""
    queue, tag, task_id = "default", uuid.uuid4().hex, uuid.uuid4().hex
    lease = keys.lease(queue, True)
    client = redis_cluster.client()
    client.hset(lease, tag, "peer:2:b")  # the peer's fetch took the job after the first worker's lease lapsed
    env = _env(redis_cluster, ledger_redis)
    try:
        assert produce(env, "store", queue, tag, "first:1:a", task_id) == {"stored": False, "by": None}
        assert produce(env, "store", queue, tag, "peer:2:b", task_id) == {"stored": True, "by": "peer:2:b"}
    finally:
        client.hdel(lease, tag)


@pytest.mark.parametrize("pool", ["prefork", "custom"], ids=["prefork", "asyncio"])
def test_send_task_and_delay_get_end_to_end(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any, pool: str
) -> None:
    one = "default"  # test.ledger's route
    key = uuid.uuid4().hex
    env = _env(redis_cluster, ledger_redis)
    make_worker(f"cl-get-{key[:6]}", env=env, queues=one, concurrency=1, pool=pool)
    got = produce(env, "get", one, key)
    assert got["result"]["key"] == key and got["result"]["attempt"] == 1
    wait_for(lambda: _held(redis_cluster, one) == 0, 10, 0.1, what="the acknowledgement")


def test_a_queue_with_one_job_is_not_starved_by_a_full_one(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """Each round of the fetch starts one queue further: a job sent to one queue while another on a different master
    holds a long backlog runs within a round or two, not after the backlog drains."""
    full, other = _two_queues(redis_cluster)
    key = uuid.uuid4().hex
    env = _env(redis_cluster, ledger_redis)
    make_worker(f"cl-fair-{key[:6]}", env=env, queues=f"{full},{other}", concurrency=1)
    flood = send(env, full, key, 60, 0.05)["ids"]
    wait_for(lambda: len(starts(ledger_redis, key)) >= 3, 30, 0.05, what="the flood to be running")
    sent = send(env, other, key, 1, 0)
    (lone,) = sent["ids"]
    ahead = sum(1 for s in starts(ledger_redis, key) if s["t"] < sent["sent"])  # started before the lone job was sent
    wait_for(lambda: lone in done(ledger_redis, key), 60, 0.1, what="the lone job")
    order = [s["task_id"] for s in starts(ledger_redis, key)]
    waited = order.index(lone) - ahead
    print(f"the lone job started after {waited} more of the flood's ({len(flood) - ahead} were still queued)")
    assert waited <= 10, waited  # the prefetch (4) held and a round, not the rest of the flood
    wait_for(lambda: set(flood) <= set(done(ledger_redis, key)), 120, 0.2, what="the flood")


def test_celery_control_reaches_a_worker_on_a_cluster_and_its_reply_comes_back(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any
) -> None:
    """Celery's fanout (a control broadcast) over pub/sub on one node reaches a worker subscribed on any node; its
    reply comes back on kombu's pidbox reply queue, a list of the cluster."""
    key = uuid.uuid4().hex
    env = _env(redis_cluster, ledger_redis)
    make_worker(f"cl-ping-{key[:6]}", env=env, queues="default", concurrency=1)
    replies = produce(env, "ping", "-", "5")
    pongs = [reply for reply in replies for name in reply if name.startswith(f"cl-ping-{key[:6]}@")]
    assert pongs and all(next(iter(p.values())) == {"ok": "pong"} for p in pongs), replies


def test_sigterm_to_pipeline_worker_with_async_jobs_in_flight_on_two_masters_runs_each_once(
    redis_cluster: Cluster, ledger_redis: RedisServer, make_worker: Any, work_dir: Any
) -> None:
    """`pipeline worker` (the asyncio pool) on queues of two masters, SIGTERM with async jobs in flight: they finish
    and are acknowledged before the connection closes, the rest go back; a new worker started at once runs those.
    Counted at the ledger two leases after the last finish: 0 lost, 0 run twice."""
    one, other = _two_queues(redis_cluster)
    key = uuid.uuid4().hex
    env = _env(redis_cluster, ledger_redis, WORKER_CONCURRENCY="20")
    old = Worker(f"cl-aio-sd-a-{key[:6]}", work_dir / "logs", env)
    old.argv = [sys.executable, "-m", "pipeline", "worker", "--processes", "1", "--app", "tests.support.worker_app"]
    old.argv += ["-Q", f"{one},{other}", "-l", "INFO", "--without-gossip", "--without-mingle"]
    old.start()
    try:
        kids = children(old.pid)
        assert [Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")[6:8] for pid in kids] == [[b"-P", b"custom"]]
        jobs = [job for queue in (one, other) for job in produce(env, "await", queue, key, "30", "1.5")["ids"]]
        wait_for(lambda: len(run_count(ledger_redis, key, "start")) >= 15, 60, 0.05, what="15 async jobs in flight")
        old.send_signal(signal.SIGTERM)
        make_worker(f"cl-aio-sd-b-{key[:6]}", env=env, queues=f"{one},{other}", pool="custom", concurrency=20)
        assert old.wait(40) == 0, old.log()[-3000:]
        each_ran_once(ledger_redis, key, jobs)
        assert _held(redis_cluster, one) == 0 and _held(redis_cluster, other) == 0, "nothing left in any unacked"
    finally:
        old.stop()


@pytest.mark.parity  # the cluster transport on kombu's hub (`pipeline.delivery.ENTRIES`)
def test_the_event_loop_polls_the_subscription_socket_and_wakes_on_a_marker(
    redis_cluster: Cluster, ledger_redis: RedisServer
) -> None:
    """kombu's hub drives the cluster transport (`pipeline.delivery.cluster_loop`): an idle queue's waiter is armed,
    the pub/sub socket is among the hub's readers and a fanout publish is delivered, and a job pushed with its marker
    is delivered within a moment (the fallback poll is 30 s) and acknowledged."""
    queue = "webhooks"
    seen = produce(_env(redis_cluster, ledger_redis), "loop", queue, "-")
    assert seen["armed"] and seen["subscription_polled"] and seen["fanout"], seen
    assert seen["work"] and seen["latency"] < 3.0, seen
    assert seen["held"] == 0, seen
    assert _held(redis_cluster, queue) == 0, seen
