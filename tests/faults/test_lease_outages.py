"""Leases through Redis outages with real workers: a worker that cannot reach Redis stops its jobs before their leases
lapse and each then runs once, and a prefetched job Celery drops with a lost connection runs once after it.

Brokers, ledgers and workers as in `tests/faults/test_leases.py` (each test its own broker, one LEASE_SECONDS for
every worker on it).
"""

from __future__ import annotations

import collections
import time
import uuid
from typing import Any

import pytest
from celery import Celery

from pipeline.constants import DEAD_LETTER_QUEUE, LEASE_KEY
from tests.faults.ledger import SHORT_LEASE, done, env_for, send, settled, starts
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults


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
