"""SIGTERM at random instants under load to asyncio-pool workers in turn: the signal then usually lands inside the
asyncio loop's iteration or a job's trace (`pipeline.runtime.asyncsignals`). Counted at the ledger two leases past the
last finish (`tests.faults.ledger`); workers as in `tests.faults.asyncpool_workers`."""

from __future__ import annotations

import random
import signal
import time
import uuid
from typing import Any

import pytest
from celery import Celery

from tests.faults.asyncpool_workers import aio_env, send
from tests.faults.ledger import each_ran_once
from tests.support.procs import RedisServer

pytestmark = pytest.mark.faults


def test_sigterm_at_random_instants_under_load_runs_each_job_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery
) -> None:
    """Three workers in turn get SIGTERM at a random instant while short jobs stream through them (under load the main
    thread is mostly inside the asyncio loop's iteration or a job's trace, where the signal then lands); the next
    worker is started at once. Each job runs once, counted two leases past the last finish."""
    key = uuid.uuid4().hex
    env = aio_env(own_redis, ledger_redis)
    rng = random.Random()
    jobs = [send(producer, key, rng.uniform(0.2, 0.6)) for _ in range(600)]
    worker = make_worker(f"aio-rand-0-{key[:6]}", env=env, pool="custom", concurrency=20)
    for round_ in range(1, 4):
        time.sleep(rng.uniform(0.2, 1.5))  # a random instant, not an assertion
        worker.send_signal(signal.SIGTERM)
        successor = make_worker(f"aio-rand-{round_}-{key[:6]}", env=env, pool="custom", concurrency=20)
        assert worker.wait(30) is not None
        worker = successor
    each_ran_once(ledger_redis, key, jobs, timeout=120)
