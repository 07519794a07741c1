"""Celery's `revoke(terminate=True)` on the asyncio pool: a running job (async, plain typed, `@app.task`) never reaches
its side effect, REVOKED, acknowledged, its lease gone, not run again in 2 x LEASE_SECONDS, also when the revoke comes
from the `celery control` command; a revoked job still waiting for its ETA in the worker is dropped unrun.

Workers, jobs and the revoke: `tests.faults.revoking` (`celery worker`, REMAP_SIGTERM=SIGQUIT as the start scripts run
them, on the `default` queue of a Redis of the test's own, with a short lease; jobs record `start`, then `finish` after
their sleep, in the ledger).
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import uuid
from typing import Any

import pytest
from celery import Celery

from tests.faults.ledger import run_count
from tests.faults.revoking import (
    Rig,
    revoke_with_terminate_runs_never_again,
    revoked_and_settled,
    send,
    start_worker,
    two_leases_past,
)
from tests.support.procs import ROOT, RedisServer, wait_for

pytestmark = pytest.mark.faults


@pytest.mark.parametrize(
    "task", ["test.run_async", "test.run", "plain.run"], ids=["async-job", "plain-job", "plain-celery-task"]
)
def test_revoke_with_terminate_stops_a_running_job_revoked_acknowledged_never_run_again(
    revoke_rig: Rig, task: str
) -> None:
    revoke_with_terminate_runs_never_again(revoke_rig, "asyncio", task, None)


def test_celery_control_terminate_from_the_command_line_stops_a_celery_task_on_the_asyncio_pool(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """`celery -A pipeline control terminate SIGTERM <id>` (Celery 5's command for a revoke with terminate): the
    main thread, in the job, replies once the job has been stopped."""
    key = uuid.uuid4().hex
    start_worker(make_worker, own_redis, ledger_redis, "asyncio", key)
    job = send(producer, "plain.run", key)
    wait_for(lambda: run_count(ledger_redis, key, "start")[job] == 1, 30, 0.05, what="the job to start")
    argv = [sys.executable, "-m", "celery", "-A", "pipeline", "control", "--timeout", "10", "terminate", "SIGTERM", job]
    env = {**os.environ, "REDIS_URL": own_redis.url}
    done = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done
    print(f"celery control's output: {done.stdout}{done.stderr}")  # which nodes replied, shown if the test fails
    revoked_and_settled(producer, own_redis, job)
    two_leases_past(ledger_redis, key)
    assert run_count(ledger_redis, key, "start") == collections.Counter({job: 1})
    assert run_count(ledger_redis, key, "finish") == collections.Counter()
    assert f"{job} flagged as revoked" in done.stdout or "terminate" in done.stdout, done.stdout  # the worker replied


def test_a_revoked_job_waiting_for_its_eta_behind_a_plain_job_is_dropped_unrun(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """On the asyncio pool, an async job held for its ETA while a plain job runs is revoked with terminate: it never
    starts (when it falls due the worker drops it), REVOKED, acknowledged; the plain job runs to its end."""
    key = uuid.uuid4().hex
    start_worker(make_worker, own_redis, ledger_redis, "asyncio", key)
    waiting = send(producer, "test.run_async", key, countdown=3)
    wait_for(lambda: own_redis.client().hlen("unacked") == 1, 30, 0.05, what="the worker to hold the ETA job")
    running = send(producer, "test.run", key)
    wait_for(lambda: run_count(ledger_redis, key, "start")[running] == 1, 30, 0.05, what="the plain job to start")
    producer.AsyncResult(waiting).revoke(terminate=True)
    assert producer.AsyncResult(running).get(timeout=30)["key"] == key
    revoked_and_settled(producer, own_redis, waiting)
    two_leases_past(ledger_redis, key)
    assert run_count(ledger_redis, key, "start") == collections.Counter({running: 1})
    assert run_count(ledger_redis, key, "finish") == collections.Counter({running: 1})
