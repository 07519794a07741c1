"""The asyncio pool's workers and jobs in the fault tests: `test.await` jobs on the `default` queue, the environment of
a worker with a short lease, and `pipeline worker` (the supervisor) with its processes.

Workers are `pipeline worker` (the supervisor, `-P custom` children) or `celery worker -P custom` (one child as the
supervisor starts it, REMAP_SIGTERM=SIGQUIT from tests/conftest.py); `test.await` jobs record `start`, `finish` and
`cancelled` in the ledger (`tests.faults.ledger`).
"""

from __future__ import annotations

import sys
from pathlib import Path

from celery import Celery

from pipeline.runtime.asyncpool import POOL
from tests.faults.ledger import SHORT_LEASE, env_for
from tests.support.procs import RedisServer, Worker, wait_for


def send(producer: Celery, key: str, sleep_s: float, task: str = "test.await") -> str:
    payload = {"key": key, "sleep_s": sleep_s}
    return str(producer.send_task(task, args=[payload], queue="default").id)


def aio_env(own_redis: RedisServer, ledger: RedisServer, **extra: str) -> dict[str, str]:
    return env_for(own_redis, ledger, CELERY_CUSTOM_WORKER_POOL=POOL, **SHORT_LEASE, **extra)


def supervisor(name: str, work_dir: Path, env: dict[str, str], processes: int, in_flight: int) -> Worker:
    """`pipeline worker --processes N` on the `default` queue (started; the caller stops it)."""
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
