"""Plain (sync) jobs on the asyncio pool: their functions run on the pool's bounded threads, beside the other jobs.

Each test starts one `celery worker -P custom` (the pool `pipeline worker` runs) on a queue of its own on the session's
Redis and sends it Celery tutorial tasks (`plain.*`, `tests.support.plain_tasks`) and `test.run` jobs (which record
`start`, then `finish` or `stopped`, with the ledger's clock).
"""

from __future__ import annotations

import collections
import socket
import uuid
from typing import Any

import pytest
from celery.exceptions import TimeLimitExceeded
from celery.result import AsyncResult

from pipeline.celery_app import get_app
from pipeline.control import cancel
from pipeline.records import record_accepted
from pipeline.runtime.asyncpool import POOL
from tests.support.ledger_tasks import run_records
from tests.support.procs import wait_for

pytestmark = pytest.mark.integration

ASYNC_POOL = {"CELERY_CUSTOM_WORKER_POOL": POOL}


def _run(queue: str, key: str, **job: Any) -> str:
    """A `test.run` job (a typed plain job), recorded as a typed enqueue records it (a cancel looks it up)."""
    task_id = str(uuid.uuid4())
    record_accepted(task_id, "test.run", queue=queue)
    get_app().send_task("test.run", args=[{"key": key, **job}], queue=queue, task_id=task_id)
    return task_id


def _plain(name: str, queue: str, *args: Any, **options: Any) -> AsyncResult[Any]:
    return get_app().send_task(f"plain.{name}", args=list(args), queue=queue, **options)


def _events(key: str) -> dict[str, collections.Counter[str]]:
    by_event: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
    for record in run_records(key):
        by_event[record["event"]][record["task_id"]] += 1
    return by_event


def _started(key: str, count: int) -> None:
    wait_for(lambda: sum(_events(key)["start"].values()) >= count, 30, 0.05, what=f"{count} job(s) to start")


def _worker(make_worker: Any, key: str, **env: str) -> tuple[Any, str]:
    queue = f"plain-{key[:8]}"
    worker = make_worker(f"plain-{key[:6]}", env={**ASYNC_POOL, **env}, pool="custom", concurrency=20, queues=queue)
    return worker, queue


def test_a_short_job_sent_beside_a_sleeping_plain_job_returns_before_it_ends(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    _, queue = _worker(make_worker, key)
    sleeper = _run(queue, key, sleep_s=5.0)
    _started(key, 1)
    assert _plain("add", queue, 1, 2).get(timeout=30) == 3
    assert _events(key)["finish"] == collections.Counter()  # the sleeper still sleeps: it did not hold the add up
    AsyncResult(sleeper, app=get_app()).get(timeout=30)
    assert _events(key)["finish"] == collections.Counter({sleeper: 1})


def test_control_commands_are_answered_while_plain_jobs_run(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    worker, queue = _worker(make_worker, key)
    jobs = [_run(queue, key, sleep_s=6.0) for _ in range(3)]
    _started(key, 3)
    node = f"{worker.name}@{socket.gethostname()}"
    inspect = get_app().control.inspect(destination=[node], timeout=1)
    assert inspect.ping() == {node: {"ok": "pong"}}
    assert sorted(job["id"] for job in (inspect.active() or {}).get(node, [])) == sorted(jobs)
    assert _events(key)["finish"] == collections.Counter()  # answered while all three ran


def test_plain_jobs_run_at_most_the_threads_bound_at_once(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    _, queue = _worker(make_worker, key, WORKER_PLAIN_THREADS="3")
    jobs = [_run(queue, key, sleep_s=1.0) for _ in range(8)]
    for job in jobs:
        AsyncResult(job, app=get_app()).get(timeout=60)
    running = peak = 0
    for record in sorted(run_records(key), key=lambda r: r["t"]):
        running += {"start": 1, "finish": -1}.get(record["event"], 0)
        peak = max(peak, running)
    assert peak == 3  # the bound reached, never passed
    assert _events(key)["finish"] == collections.Counter(dict.fromkeys(jobs, 1))


def test_a_per_call_soft_limit_is_raised_in_a_plain_job_which_recovers(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    _, queue = _worker(make_worker, key)
    assert _plain("soft_guard", queue, 30.0, soft_time_limit=1).get(timeout=20) == "recovered"
    assert _plain("soft_guard", queue, 0.2, soft_time_limit=5).get(timeout=20) == "finished"


def test_a_per_call_hard_limit_ends_a_plain_job_and_the_worker_goes_on(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    worker, queue = _worker(make_worker, key)
    spinning = _plain("spin", queue, 60.0, time_limit=1)
    with pytest.raises(TimeLimitExceeded):
        spinning.get(timeout=20)
    assert spinning.state == "FAILURE"
    assert _plain("add", queue, 2, 2).get(timeout=20) == 4  # the same process goes on: the job's thread stopped
    assert worker.proc.poll() is None and "ignored its cancellation" not in worker.log()


def test_a_plain_job_sees_its_request_and_current_task(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    _, queue = _worker(make_worker, key)
    result = _plain("context", queue, True, headers={"probe": "p-1"})
    seen = result.get(timeout=20)
    assert seen == {"id": result.id, "retries": 1, "probe": "p-1", "current": result.id, "same": True}


def test_a_cancelled_running_plain_job_stops_and_is_not_run_again(make_worker: Any) -> None:
    key = uuid.uuid4().hex
    worker, queue = _worker(make_worker, key)
    job = _run(queue, key, ends="release")  # waits for a release that never comes, in short steps
    other = _run(queue, key, sleep_s=1.0)
    _started(key, 2)
    assert cancel.cancel(job).state.value == "cancelled"
    result = AsyncResult(job, app=get_app())
    wait_for(lambda: result.state == "REVOKED", 20, 0.1, what="the cancel recorded")
    AsyncResult(other, app=get_app()).get(timeout=20)
    wait_for(lambda: _events(key)["stopped"][job] == 1, 10, 0.1, what="the job to stop")
    events = _events(key)
    assert events["start"][job] == 1 and job not in events["finish"]
    assert worker.proc.poll() is None and "ignored its cancellation" not in worker.log()  # stopped, not abandoned
