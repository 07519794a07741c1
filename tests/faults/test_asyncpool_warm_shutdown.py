"""A warm shutdown of an asyncio-pool worker (`celery control shutdown`, or the recycle after an abandoned coroutine)
with async jobs in flight keeps the delivery promise: with a new worker started at once each job runs once, counted at
the ledger until 2 x LEASE_SECONDS after the last finish.

Workers and jobs: `tests.faults.asyncpool_workers` (`celery worker -P custom`, short lease, `test.await` jobs on the
`default` queue).
"""

from __future__ import annotations

import socket
import uuid
from typing import Any

import pytest
from celery import Celery

from tests.faults.asyncpool_workers import aio_env, send
from tests.faults.ledger import each_ran_once, run_count
from tests.support.procs import RedisServer, wait_for

pytestmark = pytest.mark.faults


def _recycle(producer: Celery, key: str, node: str) -> None:
    """A job whose coroutine ignores its cancellation until its hard limit: abandoned, and the process recycled."""
    payload = {"key": f"{key}-ignores", "mode": "ignore"}
    producer.send_task("test.await", args=[payload], queue="default", soft_time_limit=1, time_limit=2)


def _control_shutdown(producer: Celery, key: str, node: str) -> None:
    producer.control.broadcast("shutdown", destination=[node])


@pytest.mark.parametrize("how", [_control_shutdown, _recycle], ids=["celery-control-shutdown", "recycle"])
def test_a_warm_shutdown_with_jobs_in_flight_runs_each_once_with_a_new_worker_at_once(
    own_redis: RedisServer, ledger_redis: RedisServer, make_worker: Any, producer: Celery, how: Any
) -> None:
    """The lease renewal, the lapse watch and the cancel listener outlive the drain of a warm shutdown, and the
    acknowledgements land before the connection closes: no delivery is restored or left to lapse while its job runs."""
    key = uuid.uuid4().hex
    env = aio_env(own_redis, ledger_redis)
    name = f"aio-warm-a-{key[:6]}"
    old = make_worker(name, env=env, pool="custom", concurrency=40)
    jobs = [send(producer, key, 4.0) for _ in range(30)]
    wait_for(lambda: len(run_count(ledger_redis, key, "start")) == 30, 30, 0.05, what="30 jobs in flight")
    how(producer, key, f"{name}@{socket.gethostname()}")
    make_worker(f"aio-warm-b-{key[:6]}", env=env, pool="custom", concurrency=40)
    assert old.wait(30) is not None
    each_ran_once(ledger_redis, key, jobs)
