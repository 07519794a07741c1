"""The worker profile scripts of the image, run for real: pool, queues and metrics as documented."""

from __future__ import annotations

import os
import sys
import uuid
from pathlib import Path

import pytest

from tests.support.procs import ROOT, RedisServer, Worker, free_port, wait_for
from tests.support.scrape import scrape, try_scrape, value
from tests.support.worker_app import ledger

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("script", "pool", "processes"),
    [("start-worker-io", "asyncio", ""), ("start-worker-io", "solo", "2"), ("start-worker-cpu", "prefork", "")],
)
def test_profile_script_runs_a_worker_with_metrics(
    script: str, pool: str, processes: str, work_dir: Path, redis_server: RedisServer
) -> None:
    queue = f"obs-{script}-{uuid.uuid4().hex[:6]}"
    port = free_port()
    multiproc = work_dir / f"multiproc-{script}-{processes}"
    env = {
        "CELERY_APP": "tests.support.worker_app",
        "WORKER_QUEUES": queue,
        "WORKER_CONCURRENCY": "2",  # the cpu profile's pool processes, the io profile's jobs in flight per process
        "WORKER_PROCESSES": processes,  # the io profile's workers; empty: one per CPU (asyncio), plus one (solo)
        "WORKER_POOL": pool if script == "start-worker-io" else "",
        "METRICS_PORT": str(port),
        "METRICS_ADDRESS": "127.0.0.1",
        "PROMETHEUS_MULTIPROC_DIR": str(multiproc),
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}",
    }
    worker = Worker(f"{script}{processes}", work_dir / "logs", env)
    worker.argv = [str(ROOT / "deploy" / "docker" / script), "--without-gossip", "--without-mingle"]
    supervised = int(processes) if processes else len(os.sched_getaffinity(0)) + 1
    worker.start()
    try:
        if pool == "solo":  # workers of one process each, under the supervisor
            wait_for(lambda: worker.log().count(" ready.") == supervised, 60, 0.2, what=f"{supervised} solo workers")
            assert worker.log().count("concurrency: 1 (solo)") == supervised
        elif pool == "asyncio":  # workers of WORKER_CONCURRENCY jobs in flight each, under the supervisor
            wait_for(lambda: worker.log().count(" ready.") == supervised, 60, 0.2, what=f"{supervised} workers")
            assert worker.log().count("concurrency: 2 (asyncpool)") == supervised
        else:
            assert f"concurrency: 2 ({pool})" in worker.log()
        wait_for(lambda: try_scrape(port), 20, 0.2, what=f"{script} /metrics")
        key = uuid.uuid4().hex
        for _ in range(3):
            ledger.task.apply_async(({"key": key},), queue=queue)
        wait_for(lambda: redis_server.client().llen(f"test:done:{key}") == 3, 30, 0.1, what="3 tasks done")
        labels = {"task": "test.ledger", "queue": queue, "outcome": "succeeded"}
        wait_for(lambda: value(scrape(port), "pipeline_tasks_total", **labels) == 3, 15, 0.2, what="3 counted")
        assert value(scrape(port), "pipeline_workers_up", queue=queue) == (1 if pool == "prefork" else supervised)
    finally:
        worker.stop()
