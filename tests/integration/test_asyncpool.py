"""The asyncio pool with many jobs in flight in one worker process: concurrency, a hung job among healthy ones, a cancel
of one running job, and `webhooks.deliver` on one pooled connection set.

Each test starts one `celery worker -P custom` (the pool `pipeline worker` runs) on a queue of its own on the session's
Redis, and sends `test.await` jobs (`tests.support.worker_app`: they record `start`, then `finish` or `cancelled`).
"""

from __future__ import annotations

import collections
import socket
import uuid
from typing import Any

import pytest
from celery.result import AsyncResult

from pipeline.celery_app import get_app
from pipeline.control import cancel
from pipeline.records import record_accepted
from pipeline.runtime.asyncpool import POOL
from tests.support.procs import wait_for
from tests.support.worker_app import ledger_client, run_records

pytestmark = pytest.mark.integration

ASYNC_POOL = {"CELERY_CUSTOM_WORKER_POOL": POOL}


def _send(queue: str, key: str, **job: Any) -> str:
    options = {k: job.pop(k) for k in ("soft_time_limit", "time_limit") if k in job}
    task_id = str(uuid.uuid4())
    record_accepted(task_id, "test.await", queue=queue)  # what a typed enqueue records (a cancel looks it up)
    get_app().send_task("test.await", args=[{"key": key, **job}], queue=queue, task_id=task_id, **options)
    return task_id


def _events(key: str) -> dict[str, collections.Counter[str]]:
    by_event: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for record in run_records(key):
        by_event[record["event"]][record["task_id"]] += 1
    return by_event


def _peak(key: str) -> int:
    """Most jobs of `key` running at once, from their start and finish/cancelled records (the ledger's clock)."""
    running = peak = 0
    for record in sorted(run_records(key), key=lambda r: r["t"]):
        running += 1 if record["event"] == "start" else -1 if record["event"] in ("finish", "cancelled") else 0
        peak = max(peak, running)
    return peak


def test_one_process_runs_a_hundred_jobs_at_once(make_worker: Any) -> None:
    """With a prefetch of twice the limit (a multiplier given), still never more than the limit at once. The jobs are
    held until a hundred run, so that a loaded machine reaches the limit as a quiet one does."""
    key = uuid.uuid4().hex
    queue = f"aio-{key[:8]}"
    env = {**ASYNC_POOL, "WORKER_PREFETCH_MULTIPLIER": "2"}
    make_worker(f"aio-many-{key[:6]}", env=env, pool="custom", concurrency=100, queues=queue)
    jobs = [_send(queue, key, mode="held") for _ in range(150)]
    wait_for(lambda: sum(_events(key)["start"].values()) >= 100, 60, 0.1, what="a hundred jobs running")
    ledger_client().set(f"test:release:{key}", 1, ex=300)
    results = [AsyncResult(job, app=get_app()).get(timeout=60) for job in jobs]
    assert len(results) == 150
    assert len({r["pid"] for r in results}) == 1  # one worker process ran them all
    assert _peak(key) == 100  # the limit reached, never passed
    assert _events(key)["finish"] == collections.Counter(dict.fromkeys(jobs, 1))


def test_a_hung_job_among_99_healthy_ones_is_the_only_one_cancelled(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    queue = f"aio-{key[:8]}"
    make_worker(f"aio-hung-{key[:6]}", env=ASYNC_POOL, pool="custom", concurrency=100, queues=queue)
    hung = _send(queue, key, mode="hang", soft_time_limit=2, time_limit=5)
    healthy = [_send(queue, key, sleep_s=1.0, soft_time_limit=2, time_limit=5) for _ in range(99)]
    for job in healthy:
        AsyncResult(job, app=get_app()).get(timeout=60)
    result = AsyncResult(hung, app=get_app())
    wait_for(lambda: result.state == "FAILURE", 30, 0.1, what="the hung job to fail at its soft limit")
    assert type(result.result).__name__ == "SoftTimeLimitExceeded"
    events = _events(key)
    assert events["cancelled"] == collections.Counter({hung: 1})  # its coroutine was cancelled, no other
    assert events["finish"] == collections.Counter(dict.fromkeys(healthy, 1))


def test_a_cancelled_running_job_stops_and_the_others_finish(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    queue = f"aio-{key[:8]}"
    name = f"aio-cancel-{key[:6]}"
    make_worker(name, env=ASYNC_POOL, pool="custom", concurrency=50, queues=queue)
    jobs = [_send(queue, key, sleep_s=3.0) for _ in range(20)]
    wait_for(lambda: len(_events(key)["start"]) == 20, 30, 0.05, what="the jobs to start")
    # `celery inspect` sees the process's jobs in flight and its pool, as with any pool.
    inspect = get_app().control.inspect(destination=[f"{name}@{socket.gethostname()}"], timeout=2)
    assert sorted(job["id"] for jobs_of in (inspect.active() or {}).values() for job in jobs_of) == sorted(jobs)
    assert [stats["pool"]["max-concurrency"] for stats in (inspect.stats() or {}).values()] == [50]
    assert cancel.cancel(jobs[7]).state.value == "cancelled"
    for job in jobs[:7] + jobs[8:]:
        AsyncResult(job, app=get_app()).get(timeout=30)
    wait_for(lambda: AsyncResult(jobs[7], app=get_app()).state == "REVOKED", 10, 0.1, what="the cancel recorded")
    events = _events(key)
    assert events["cancelled"] == collections.Counter({jobs[7]: 1})
    assert jobs[7] not in events["finish"] and len(events["finish"]) == 19


def test_a_job_that_ignores_its_cancellation_is_ended_reported_and_its_process_recycled(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    queue = f"aio-{key[:8]}"
    worker = make_worker(f"aio-ignore-{key[:6]}", env=ASYNC_POOL, pool="custom", concurrency=20, queues=queue)
    runaway = _send(queue, key, mode="ignore", soft_time_limit=1, time_limit=2)
    healthy = [_send(queue, key, sleep_s=2.5) for _ in range(5)]
    result = AsyncResult(runaway, app=get_app())
    wait_for(lambda: result.state == "FAILURE", 30, 0.1, what="the runaway job to end at its hard limit")
    assert type(result.result).__name__ == "TimeLimitExceeded"
    assert [AsyncResult(job, app=get_app()).get(timeout=30)["key"] for job in healthy] == [key] * 5  # they finished
    assert worker.wait(30) == 0  # then the process left (a warm shutdown): its supervisor starts a fresh one
    assert f"job {runaway} ignored its cancellation" in worker.log()
    assert _events(key)["ignored"] == collections.Counter({runaway: 1})
