"""The asyncio pool's shutdown paths keep the delivery promise: SIGTERM with jobs in flight and a new worker started at
once runs each job once, counted at the ledger until 2 x LEASE_SECONDS after the last finish (a lease that lapsed on
an acknowledgement that never landed would show up as a second run by then).

Workers are `pipeline worker` (the supervisor, `-P custom` children) or `celery worker -P custom` (one child as the
supervisor starts it, REMAP_SIGTERM=SIGQUIT from tests/conftest.py) on the `default` queue, with a short lease;
`test.await` jobs record `start` and `finish` in the ledger (`tests.faults.ledger`).
"""

from __future__ import annotations

import os
import signal
import socket
import sys
import uuid
from pathlib import Path
from typing import Any

import pytest
from celery import Celery

from pipeline.runtime.asyncpool import POOL
from tests.faults.ledger import SHORT_LEASE, each_ran_once, env_for, run_count
from tests.support.procs import RedisServer, Worker, wait_for

pytestmark = pytest.mark.faults


def send(producer: Celery, key: str, sleep_s: float, task: str = "test.await") -> str:
    payload = {"key": key, "sleep_s": sleep_s}
    return str(producer.send_task(task, args=[payload], queue="default").id)


def aio_env(own_redis: RedisServer, ledger: RedisServer, **extra: str) -> dict[str, str]:
    return env_for(own_redis, ledger, CELERY_CUSTOM_WORKER_POOL=POOL, **SHORT_LEASE, **extra)


def supervisor(name: str, work_dir: Path, env: dict[str, str], processes: int, in_flight: int) -> Worker:
    """`pipeline worker --processes N` on the `default` queue (started; stopped by the caller's `make_worker` list)."""
    worker = Worker(name, work_dir / "logs", {**env, "WORKER_CONCURRENCY": str(in_flight)})
    worker.argv = [sys.executable, "-m", "pipeline", "worker", "--processes", str(processes)]
    worker.argv += ["--app", "tests.support.worker_app", "-Q", "default", "-l", "INFO", "--without-gossip"]
    worker.argv += ["--without-mingle"]
    worker.start()
    wait_for(lambda: worker.log().count(" ready.") >= processes, 60, 0.2, what="every worker process ready")
    return worker


def children(pid: int) -> list[int]:
    """The processes `pid` started (the supervisor's workers, each in a session of its own)."""
    text = Path(f"/proc/{pid}/task/{pid}/children").read_text()
    return [int(x) for x in text.split()]


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
