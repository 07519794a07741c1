"""The asyncio pool's stops beside a shutdown's drain, and its bookkeeping: a cancellation no stop of the pool made,
two deliveries of one task id in flight together, jobs waiting for a turn (a prefetch multiplier above 1) at a
SIGTERM, async jobs a soft shutdown cannot finish while a plain job runs, and a lost lease stopping a job (async,
then plain). Each is counted at the ledger two leases
past the last finish (`tests.faults.ledger`).

Workers are `celery worker -P custom` on the `default` queue (REMAP_SIGTERM=SIGQUIT, as `pipeline worker` runs them),
with a short lease; `test.await` jobs record `start`, `finish` and `cancelled`.
"""

from __future__ import annotations

import collections
import os
import signal
import uuid
from typing import Any

import pytest
from celery import Celery

from tests.faults import ledger
from tests.faults.asyncpool_workers import aio_env, send
from tests.faults.ledger import each_finished_once, each_ran_once, past_the_lease, run_count
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults


def test_a_cancellation_no_stop_made_is_a_transient_failure_retried_not_a_cancel(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """A job whose coroutine lets out the CancelledError of an inner future it cancelled was stopped by nothing: it
    fails transiently and is retried (and finishes), never stored REVOKED and acknowledged unrun."""
    key = uuid.uuid4().hex
    make_worker(f"aio-stray-{key[:6]}", env=aio_env(own_redis, ledger_redis), pool="custom", concurrency=10)
    job = str(producer.send_task("test.await", args=[{"key": key, "mode": "stray"}], queue="default").id)
    assert producer.AsyncResult(job).get(timeout=30)["key"] == key
    assert run_count(ledger_redis, key, "finish") == collections.Counter({job: 1})
    assert run_count(ledger_redis, key, "cancelled") == collections.Counter({job: 1})  # the first attempt's


def test_two_deliveries_of_one_task_id_in_flight_are_each_drained_and_acknowledged_at_sigterm(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """Both deliveries of one id run side by side (a producer reusing an id): the pool keeps both, the soft shutdown
    drains both, and each lands its acknowledgement; a new worker started at once runs neither again."""
    key = uuid.uuid4().hex
    env = aio_env(own_redis, ledger_redis)
    old = make_worker(f"aio-twins-a-{key[:6]}", env=env, pool="custom", concurrency=10)
    twin = str(uuid.uuid4())
    for sleep_s in (3.0, 1.0):  # the second delivery ends first
        producer.send_task("test.await", args=[{"key": key, "sleep_s": sleep_s}], queue="default", task_id=twin)
    wait_for(lambda: run_count(ledger_redis, key, "start")[twin] == 2, 30, 0.05, what="both deliveries running")
    old.send_signal(signal.SIGTERM)
    make_worker(f"aio-twins-b-{key[:6]}", env=env, pool="custom", concurrency=10)
    assert old.wait(30) is not None
    wait_for(lambda: run_count(ledger_redis, key, "finish")[twin] >= 2, 30, 0.1, what="both deliveries to finish")
    past_the_lease(ledger_redis, key)
    assert run_count(ledger_redis, key, "start") == collections.Counter({twin: 2})
    assert run_count(ledger_redis, key, "finish") == collections.Counter({twin: 2})


def test_jobs_waiting_for_a_turn_at_sigterm_never_start_there_and_run_once_on_the_new_worker(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """With a prefetch multiplier of 2, 5 jobs run and 5 wait in the pool. The soft shutdown (3 s) drains the 5
    running (2 s) without starting the waiting ones, which go back to the queue at once: each job runs once."""
    key = uuid.uuid4().hex
    env = aio_env(own_redis, ledger_redis, WORKER_PREFETCH_MULTIPLIER="2", WORKER_SOFT_SHUTDOWN_TIMEOUT="3")
    old = make_worker(f"aio-wait-a-{key[:6]}", env=env, pool="custom", concurrency=5)
    jobs = [send(producer, key, 2.0) for _ in range(10)]
    wait_for(lambda: len(run_count(ledger_redis, key, "start")) == 5, 30, 0.05, what="5 jobs running")
    wait_for(lambda: old.log().count("Task test.await[") >= 10, 30, 0.05, what="10 jobs received")
    old.send_signal(signal.SIGTERM)
    make_worker(f"aio-wait-b-{key[:6]}", env=env, pool="custom", concurrency=5)
    assert old.wait(30) is not None
    each_ran_once(ledger_redis, key, jobs)


def test_sigterm_with_a_plain_job_beside_async_ones_gives_back_what_cannot_finish(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """SIGTERM lands while a plain job runs beside async jobs (2.5 s) a soft shutdown of 1 s cannot finish. Celery's
    `cancel_active_requests` stopped at a plain request (unwound with WorkerTerminate) and the async ones after it
    were stored REVOKED and acknowledged unrun. Here the signal waits for the pool's safe point, and the pool gives
    back itself what it cannot finish (a plain job's thread stopped as an async job's coroutine is): none is stored
    REVOKED, each finishes once (on the old worker, or again on the new one), the plain job once."""
    key = uuid.uuid4().hex
    env = aio_env(own_redis, ledger_redis, WORKER_SOFT_SHUTDOWN_TIMEOUT="1")
    old = make_worker(f"aio-plain-a-{key[:6]}", env=env, pool="custom", concurrency=40)
    jobs = [send(producer, key, 2.5) for _ in range(20)]
    wait_for(lambda: len(run_count(ledger_redis, key, "start")) == 20, 30, 0.05, what="20 async jobs in flight")
    plain = ledger.send(producer, key, 1.5)
    wait_for(lambda: len(ledger.starts(ledger_redis, key)) == 1, 30, 0.05, what="the plain job running")
    old.send_signal(signal.SIGTERM)
    make_worker(f"aio-plain-b-{key[:6]}", env=env, pool="custom", concurrency=40)
    assert old.wait(30) is not None
    each_finished_once(ledger_redis, key, jobs)
    wait_for(lambda: ledger.done(ledger_redis, key)[plain] >= 1, 30, 0.1, what="the plain job done")
    assert ledger.done(ledger_redis, key) == collections.Counter({plain: 1})
    assert {producer.AsyncResult(job).state for job in jobs} == {"SUCCESS"}


def test_a_lease_lost_after_a_soft_limit_still_stops_the_job(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """A job past its soft limit (1 s) that ignores its cancellation runs on towards its hard limit (9 s, sent with it).
    When the worker then cannot renew its lease (its Redis frozen by SIGSTOP past two renewal periods; the ledger is
    another Redis), `LeaseLost` is still raised in it (its coroutine cancelled a second time, given up at the lapse),
    not ignored because a limit stopped it first."""
    key = uuid.uuid4().hex
    worker = make_worker(f"aio-lost-{key[:6]}", env=aio_env(own_redis, ledger_redis), pool="custom", concurrency=4)
    payload = {"key": key, "mode": "ignore"}
    job = str(producer.send_task("test.await", args=[payload], queue="default", soft_time_limit=1, time_limit=9).id)
    wait_for(lambda: run_count(ledger_redis, key, "ignored")[job] == 1, 30, 0.05, what="the soft limit ignored")
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: "stopping it (LeaseLost)" in worker.log(), 30, 0.1, what="the lapse watch to stop it")
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)  # the worker's event loop, held up by a Redis call, turns again
    wait_for(lambda: run_count(ledger_redis, key, "ignored")[job] == 2, 30, 0.1, what="LeaseLost raised in it")


def test_a_lease_lost_stops_a_plain_job_in_its_thread(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """A plain job (`test.run`, waiting in short steps for a release) whose worker cannot renew its lease (its Redis
    frozen by SIGSTOP past two renewal periods; the ledger is another Redis) gets `LeaseLost` in its thread and stops
    there: it records `stopped`, and the worker process is neither killed nor recycled for it."""
    key = uuid.uuid4().hex
    worker = make_worker(f"aio-lost-p-{key[:6]}", env=aio_env(own_redis, ledger_redis), pool="custom", concurrency=4)
    job = str(producer.send_task("test.run", args=[{"key": key, "ends": "release"}], queue="default").id)
    wait_for(lambda: run_count(ledger_redis, key, "start")[job] == 1, 30, 0.05, what="the plain job running")
    assert own_redis.proc is not None
    os.kill(own_redis.proc.pid, signal.SIGSTOP)
    try:
        wait_for(lambda: run_count(ledger_redis, key, "stopped")[job] == 1, 30, 0.1, what="LeaseLost raised in it")
    finally:
        os.kill(own_redis.proc.pid, signal.SIGCONT)
        ledger_redis.client().set(f"test:release:{key}", "1")  # its next run (after the lapse) ends at once
    assert "stopping it (LeaseLost)" in worker.log()
    assert "ignored its cancellation" not in worker.log() and "ignored LeaseLost" not in worker.log()
    assert worker.proc is not None and worker.proc.poll() is None
