"""The asyncio pool's delivery guarantees with a hundred jobs in flight in one process: `kill -9`, SIGTERM, and a
group cap counted per job.

Each test has its own broker Redis and a ledger Redis (`tests.faults.ledger`); workers are `celery worker -P custom`
(the pool `pipeline worker` runs) on the `default` queue; `test.await` jobs record `start` and `finish` there.
"""

from __future__ import annotations

import collections
import signal
import uuid
from typing import Any

import pytest
from celery import Celery

from pipeline.constants import HEADER_GROUP, LEASE_KEY
from pipeline.runtime.asyncpool import POOL
from tests.faults.ledger import SHORT_LEASE, each_ran_once, env_for, run_count, runs
from tests.support.procs import RedisServer, wait_for, wait_progressing

pytestmark = pytest.mark.faults


def _send(producer: Celery, key: str, sleep_s: float, mode: str = "sleep", **headers: str) -> str:
    payload = {"key": key, "sleep_s": sleep_s, "mode": mode}
    return str(producer.send_task("test.await", args=[payload], queue="default", headers=headers or None).id)


def _release(ledger: RedisServer, key: str) -> None:
    """Let every held `test.await` job of `key` finish."""
    ledger.client().set(f"test:release:{key}", 1, ex=300)


def _env(own_redis: RedisServer, ledger: RedisServer, **extra: str) -> dict[str, str]:
    return env_for(own_redis, ledger, CELERY_CUSTOM_WORKER_POOL=POOL, **extra)


def test_kill_9_with_100_in_flight_loses_none_and_runs_none_twice(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    key = uuid.uuid4().hex
    env = _env(own_redis, ledger_redis, **SHORT_LEASE)
    first = make_worker(f"aio-k9-a-{key[:6]}", env=env, pool="custom", concurrency=100)
    jobs = [_send(producer, key, 0, mode="held") for _ in range(100)]  # running until released, however slow the start
    wait_progressing(lambda: len(run_count(ledger_redis, key, "start")), 100, 30, what="100 jobs in flight")
    first.kill_group(signal.SIGKILL)
    first.wait(10)
    assert not run_count(ledger_redis, key, "finish")  # killed with all 100 running
    _release(ledger_redis, key)  # their copies on the peer finish at once
    make_worker(f"aio-k9-b-{key[:6]}", env=env, pool="custom", concurrency=100)
    wait_for(lambda: set(jobs) <= set(run_count(ledger_redis, key, "finish")), 60, 0.1, what="the jobs on the peer")
    assert run_count(ledger_redis, key, "finish") == collections.Counter(dict.fromkeys(jobs, 1))  # lost 0, twice 0
    results = [producer.AsyncResult(job).get(timeout=10) for job in jobs]
    assert all(r["key"] == key for r in results)
    broker = own_redis.client()
    wait_for(lambda: broker.hlen("unacked") == 0 and broker.hlen(LEASE_KEY) == 0, 10, 0.1, what="acknowledgements")


def test_sigterm_with_100_in_flight_lets_them_finish_and_leaves_the_rest_queued(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    key = uuid.uuid4().hex
    env = _env(own_redis, ledger_redis, REMAP_SIGTERM="SIGQUIT", WORKER_SOFT_SHUTDOWN_TIMEOUT="10", **SHORT_LEASE)
    first = make_worker(f"aio-term-a-{key[:6]}", env=env, pool="custom", concurrency=100)
    jobs = [_send(producer, key, 0, mode="held") for _ in range(150)]  # running until released, however slow the start
    wait_progressing(lambda: len(run_count(ledger_redis, key, "start")), 100, 30, what="100 jobs in flight")
    first.send_signal(signal.SIGTERM)
    wait_for(lambda: "Hitting Ctrl+C again" in first.log(), 20, 0.05, what="the shutdown to begin")
    _release(ledger_redis, key)  # the 100 finish in the soft shutdown
    assert first.wait(20) is not None
    finished = run_count(ledger_redis, key, "finish")
    assert len(finished) == 100 and set(finished.values()) == {1}  # every job in flight finished before the exit
    assert len(run_count(ledger_redis, key, "start")) == 100  # nothing more was started during the shutdown
    make_worker(f"aio-term-b-{key[:6]}", env=env, pool="custom", concurrency=100)
    each_ran_once(ledger_redis, key, jobs)  # counted two leases past the last finish: none ran again after a lapse


def test_a_group_cap_of_2_holds_with_50_jobs_of_the_group_on_one_process(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    key = uuid.uuid4().hex
    env = _env(own_redis, ledger_redis, GROUP_CONCURRENCY="2")
    capped = [_send(producer, key, 0.1, **{HEADER_GROUP: "tenant-c"}) for _ in range(50)]
    other = [_send(producer, key, 0.5, **{HEADER_GROUP: "tenant-d"}) for _ in range(2)]
    make_worker(f"aio-group-{key[:6]}", env=env, pool="custom", concurrency=100)
    wait_for(lambda: len(run_count(ledger_redis, key, "finish")) == 52, 60, 0.1, what="all 52 jobs")
    running: set[str] = set()
    most = 0
    for record in sorted(runs(ledger_redis, key), key=lambda r: r["t"]):
        (running.add if record["event"] == "start" else running.discard)(record["task_id"])
        most = max(most, len(running & set(capped)))
    assert most == 2  # the cap, reached and never passed, with 98 free slots in the process
    assert run_count(ledger_redis, key, "finish") == collections.Counter(dict.fromkeys(capped + other, 1))
