"""SIGTERM to `pipeline worker` with async jobs in flight keeps the delivery promise: with a new worker started at
once each job runs once, counted at the ledger until 2 x LEASE_SECONDS after the last finish (a lease that lapsed on
an acknowledgement that never landed would show up as a second run by then).

Workers and jobs: `tests.faults.asyncpool_workers` (short lease, `test.await` jobs on the `default` queue). The warm
shutdowns: `tests/faults/test_asyncpool_warm_shutdown.py`.
"""

from __future__ import annotations

import os
import signal
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from tests.faults.asyncpool_workers import aio_env, children, send, supervisor
from tests.faults.ledger import each_ran_once, run_count
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults


@pytest.mark.parametrize("every_process", [False, True], ids=["to-supervisor", "to-every-process"])
def test_sigterm_to_pipeline_worker_with_jobs_in_flight_runs_each_once_with_a_new_worker_at_once(
    own_redis: RedisServer,
    ledger_redis: RedisServer,
    make_worker: Any,
    producer: Celery,
    work_dir: Path,
    every_process: bool,
) -> None:
    key = uuid.uuid4().hex
    env = aio_env(own_redis, ledger_redis)
    old = supervisor(f"aio-sd-a-{key[:6]}", work_dir, env, processes=2, in_flight=40)
    try:
        jobs = [send(producer, key, 1.5) for _ in range(120)]
        wait_for(lambda: len(run_count(ledger_redis, key, "start")) >= 80, 30, 0.05, what="80 jobs in flight")
        pids = [old.pid, *children(old.pid)] if every_process else [old.pid]
        for pid in pids:
            os.kill(pid, signal.SIGTERM)
        make_worker(f"aio-sd-b-{key[:6]}", env=env, pool="custom", concurrency=40)
        assert old.wait(30) is not None
        each_ran_once(ledger_redis, key, jobs)
    finally:
        old.stop()
