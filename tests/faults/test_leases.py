"""Leases with real workers: a dead worker's jobs come back within a lease plus a sweep, a live worker's long job
is never delivered twice, a worker that was frozen past its lease neither runs nor acknowledges the job a peer took
over (fencing), and a worker that cannot reach Redis stops its jobs before their leases lapse.

Each test has its own redis-server (AOF on) for the broker and a ledger Redis the jobs record their starts
(`test:ledger:<key>`) and completions (`test:done:<key>`) in, and runs `celery worker` subprocesses on the
`default` queue. Every worker sharing a broker must use the same LEASE_SECONDS (a sweep judges other
workers' leases by its own), so these workers never share the session's Redis.
"""

from __future__ import annotations

import collections
import signal
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from celery import Celery

from pipeline.constants import DEAD_LETTER_QUEUE, LEASE_KEY
from tests.faults.ledger import SHORT_LEASE, done, env_for, send, settled, starts
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults


def _runs_once_on_two_workers(
    own_redis: RedisServer,
    ledger_redis: RedisServer,
    make_worker: Any,
    send: Callable[[str], str],
    pool: str = "prefork",
) -> None:
    """Two workers with a short lease; the job `send(key)` publishes runs once, and only once, on one of them."""
    key = uuid.uuid4().hex
    env = env_for(own_redis, ledger_redis, **SHORT_LEASE)
    for name in "ab":
        make_worker(f"once-{name}-{key[:6]}", env=env, concurrency=1, pool=pool)
    job = send(key)
    wait_for(lambda: done(ledger_redis, key), 60, 0.2, what="the job to finish")
    wait_for(lambda: settled(own_redis), 10, 0.1, what="its acknowledgement, with no copy left to run")
    assert done(ledger_redis, key) == collections.Counter({job: 1})
    assert len(starts(ledger_redis, key)) == 1, starts(ledger_redis, key)


@pytest.mark.parametrize("pool", ["prefork", "solo", "threads"])
def test_a_job_of_several_leases_with_an_idle_peer_runs_exactly_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery, pool: str
) -> None:
    """The renewal thread renews whatever the pool: with solo the main process itself runs the job."""
    sleep_s = 25 if pool == "prefork" else 15
    _runs_once_on_two_workers(own_redis, ledger_redis, make_worker, lambda key: send(producer, key, sleep_s), pool)


def test_a_countdown_held_past_several_leases_runs_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """A reserved message (a countdown the worker holds in its timer) is renewed like a running one."""

    def send(key: str) -> str:
        return str(producer.send_task("test.ledger", args=[{"key": key}], queue="default", countdown=20).id)

    _runs_once_on_two_workers(own_redis, ledger_redis, make_worker, send)


def test_a_worker_frozen_past_its_lease_neither_runs_nor_acknowledges_the_jobs_a_peer_took(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """The frozen worker holds two jobs: one running, one prefetched behind it. A peer takes both over; thawed,
    the worker terminates the first, drops the second without running it, and acknowledges neither."""
    key = uuid.uuid4().hex
    env = env_for(own_redis, ledger_redis, **SHORT_LEASE)
    frozen = make_worker(f"fence-a-{key[:6]}", env={**env, "WORKER_PREFETCH_MULTIPLIER": "2"}, concurrency=1)
    jobs = [send(producer, key, 20) for _ in range(2)]
    wait_for(lambda: starts(ledger_redis, key), 30, 0.05, what="the first job to start")
    broker = own_redis.client()
    wait_for(lambda: broker.hlen(LEASE_KEY) == 2, 10, 0.05, what="the second job to be prefetched")
    peer = make_worker(f"fence-b-{key[:6]}", env=env, concurrency=2)
    frozen.kill_group(signal.SIGSTOP)  # the whole worker: main process (and its renewal thread) and pool child
    stopped_at = time.time()
    try:
        wait_for(lambda: len(starts(ledger_redis, key)) >= 3, 40, 0.1, what="the peer to take both jobs over")
    finally:
        frozen.kill_group(signal.SIGCONT)
    taken_after = starts(ledger_redis, key)[1]["t"] - stopped_at
    wait_for(lambda: "not run here" in frozen.log(), 10, 0.1, what="the thawed worker to find its leases gone")
    time.sleep(2)  # the thawed worker's fence and its fenced acknowledgements have run by now
    holders = {v.decode().split(":")[1] for v in broker.hvals(LEASE_KEY)}
    assert broker.hlen("unacked") == 2 and holders == {str(peer.pid)}, "the thawed worker touched the peer's jobs"
    wait_for(lambda: len(done(ledger_redis, key)) >= 2, 40, 0.2, what="the peer to finish both jobs")
    wait_for(lambda: settled(own_redis), 10, 0.1, what="the peer's acknowledgements, with no copy left to run")
    print(f"frozen worker's jobs restarted on the peer {taken_after:.1f} s after SIGSTOP (lease 6 s)")
    assert taken_after <= 6 + 1 + 3, taken_after  # the lease, a 1 s sweep, and a margin for a loaded machine
    assert done(ledger_redis, key) == collections.Counter(dict.fromkeys(jobs, 1))
    assert len(starts(ledger_redis, key)) == 3  # the prefetched job never started on the frozen worker
    assert {producer.AsyncResult(job).state for job in jobs} == {"SUCCESS"}
    assert frozen.proc is not None and frozen.proc.poll() is None
    assert "terminating it here" in frozen.log()


def test_a_worker_frozen_past_its_stop_deadline_with_no_peer_goes_on_with_its_job(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """Frozen whole (SIGSTOP) for 5 s, longer than the 4 s a lease may go unconfirmed (lease 6 s), a worker renewed
    nothing; nobody took its job. Thawed, it lets its renewal confirm the lease before judging the deadlines: the
    job is not stopped, it completes once, where it started."""
    key = uuid.uuid4().hex
    env = env_for(own_redis, ledger_redis, **SHORT_LEASE)
    worker = make_worker(f"frozen-alone-{key[:6]}", env=env, concurrency=1)
    job = send(producer, key, 8)
    wait_for(lambda: starts(ledger_redis, key), 30, 0.05, what="the job to start")
    worker.kill_group(signal.SIGSTOP)
    try:
        time.sleep(5)  # the freeze itself, not a wait for an outcome
    finally:
        worker.kill_group(signal.SIGCONT)
    wait_for(lambda: job in done(ledger_redis, key), 30, 0.1, what="the job to finish")
    wait_for(lambda: settled(own_redis), 10, 0.1, what="its acknowledgement")
    assert done(ledger_redis, key) == collections.Counter({job: 1}) and len(starts(ledger_redis, key)) == 1
    assert producer.AsyncResult(job).state == "SUCCESS"
    assert "LeaseLost" not in worker.log() and "abandoned" not in worker.log()


def test_an_outage_longer_than_the_lease_stops_the_running_jobs_and_each_then_runs_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """No worker can tell a Redis outage from a cut of its own link: two renewal periods into a 10 s outage (lease
    6 s) each of two workers stops its two running jobs (`LeaseLost`) and records them abandoned. When Redis is back
    every lease looks expired; the workers sweep only after renewing for a whole lease themselves, then the four jobs
    run again, each to its end once: no failure, no dead letter."""
    key = uuid.uuid4().hex
    env = env_for(own_redis, ledger_redis, **SHORT_LEASE)
    workers = [make_worker(f"outage-{n}-{key[:6]}", env=env, concurrency=2) for n in "ab"]
    jobs = [send(producer, key, 8) for _ in range(4)]
    wait_for(lambda: len(starts(ledger_redis, key)) >= 4, 30, 0.05, what="four jobs to start")
    assert len({s["pid"] for s in starts(ledger_redis, key)}) == 4
    own_redis.stop()
    time.sleep(10)  # the outage itself, not a wait for an outcome
    stopped = sum(w.log().count("abandoned (its lease could not be renewed") for w in workers)
    own_redis.start()
    wait_for(lambda: set(jobs) <= set(done(ledger_redis, key)), 60, 0.2, what="the four jobs to finish")
    wait_for(lambda: settled(own_redis), 10, 0.1, what="every acknowledgement, with no copy left to run")
    runs = collections.Counter(s["task_id"] for s in starts(ledger_redis, key))
    print(f"{stopped} job(s) recorded abandoned during the outage; attempts: {sorted(runs.values())}")
    assert done(ledger_redis, key) == collections.Counter(dict.fromkeys(jobs, 1))
    assert runs == collections.Counter(dict.fromkeys(jobs, 2)), "each job: its stopped attempt and its run after"
    assert sum(w.log().count("abandoned (its lease could not be renewed") for w in workers) == 4
    assert {producer.AsyncResult(job).state for job in jobs} == {"SUCCESS"}
    assert own_redis.client().llen(DEAD_LETTER_QUEUE) == 0


def test_a_prefetched_job_dropped_with_a_lost_connection_runs_once_after_it(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """Celery forgets the jobs it had prefetched when its connection drops (`Consumer.on_close`); the worker gives
    their leases up, so a sweep puts them back and they run once, beside the job that ran through the outage."""
    key = uuid.uuid4().hex
    # The outage (2 s) plus a renewal period (4 s) stays under the time a job may go unrenewed (8 s): the running job
    # goes on through it.
    env = env_for(own_redis, ledger_redis, LEASE_SECONDS="12", UNACKED_RESTORE_INTERVAL="1",
                  WORKER_PREFETCH_MULTIPLIER="2")  # fmt: skip
    worker = make_worker(f"dropped-{key[:6]}", env=env, concurrency=1)
    running, prefetched = send(producer, key, 12), send(producer, key, 0.1)
    wait_for(lambda: starts(ledger_redis, key), 30, 0.05, what="the first job to start")
    wait_for(lambda: own_redis.client().hlen(LEASE_KEY) == 2, 10, 0.05, what="the second job to be prefetched")
    own_redis.stop()
    time.sleep(2)  # the outage itself, not a wait for an outcome
    own_redis.start()
    wait_for(lambda: {running, prefetched} <= set(done(ledger_redis, key)), 60, 0.2, what="both jobs")
    wait_for(lambda: settled(own_redis), 10, 0.1, what="both acknowledgements, with no copy left to run")
    assert done(ledger_redis, key) == collections.Counter({running: 1, prefetched: 1})
    assert len(starts(ledger_redis, key)) == 2
    assert "released 1 prefetched job(s)" in worker.log()
