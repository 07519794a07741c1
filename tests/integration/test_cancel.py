"""Cancel (`pipeline.control.cancel`, `pipeline cancel`): a waiting, held, scheduled or running job ends `cancelled`,
never runs (or is stopped), is not dead-lettered, is counted, and its worker serves the next job.

A running job is stopped on the session's solo worker (in-process: the job is interrupted in the worker's thread)
and on the session's prefork worker of the transcode queue (its pool process is terminated). A finished job and an
unknown id are refused.
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from pipeline.broker import broker_redis
from pipeline.celery_app import get_app
from pipeline.constants import CANCEL_KEY, DELAYED_KEY, TRANSCODE_QUEUE, UNACKED_KEY
from pipeline.control.cancel import JobFinished, JobNotFound, cancel
from pipeline.dlq import admin as dlq_admin
from pipeline.observability import metrics
from pipeline.records import record_accepted
from pipeline.status import JobState, job_status
from tasks.probe import probe
from tests.support.cli import run_cli
from tests.support.inproc import InProcessWorker
from tests.support.procs import Worker, wait_for
from tests.support.worker_app import run, run_records

pytestmark = pytest.mark.integration


def cancelled_count(queue: str = "default") -> float:
    """`pipeline_tasks_total{task="test.run", outcome="cancelled"}` of this process (the in-process worker's)."""
    return float(metrics.tasks.labels("test.run", queue, "cancelled")._value.get())


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:  # gone (reaped)
        return False
    return not stat.split(") ")[-1].startswith("Z")  # a zombie has stopped


def events(key: str) -> list[str]:
    return [r["event"] for r in run_records(key)]


def held_ids() -> str:
    with broker_redis() as client:
        return b"".join(client.hvals(UNACKED_KEY)).decode(errors="replace")


def assert_cancelled(task_id: str) -> None:
    status = job_status(task_id)
    assert status.state is JobState.CANCELLED and status.final, status
    assert dlq_admin.find(task_id) is None  # not dead-lettered


def test_a_waiting_job_is_dropped_by_the_fetch_unrun(transcode_worker: Worker) -> None:
    """The fetch script of a worker on the pipeline's transport acknowledges the cancelled job as it pops it."""
    key = uuid.uuid4().hex
    task_id = str(uuid.uuid4())
    record_accepted(task_id, "test.run", queue=TRANSCODE_QUEUE)
    # Waiting on a queue no worker consumes, then moved where the transcode worker fetches.
    run.task.apply_async(({"key": key},), task_id=task_id, queue="cancel-idle", priority=0)  # its plain list
    assert job_status(task_id).state is JobState.QUEUED
    assert cancel(task_id).state is JobState.CANCELLED
    with broker_redis() as client:
        assert client.exists(CANCEL_KEY.format(id=task_id))
        client.lmove("cancel-idle", TRANSCODE_QUEUE, "RIGHT", "LEFT")
        wait_for(lambda: not client.llen(TRANSCODE_QUEUE), 10, 0.02, what="the worker to fetch the job")
    line = f"job test.run[{task_id}] was cancelled: dropped unrun"
    wait_for(lambda: line in transcode_worker.log(), 10, 0.05, what="the worker to drop the job")
    assert events(key) == [] and task_id not in held_ids()
    assert_cancelled(task_id)


def test_a_job_held_for_its_countdown_is_not_run(session_worker: InProcessWorker) -> None:
    """A retry's countdown, or a short delay, waits in the worker's timer: the cancel reaches it there."""
    key = uuid.uuid4().hex
    task_id = run.enqueue({"key": key}, countdown=1.0)
    wait_for(lambda: task_id in held_ids(), 10, 0.02, what="the worker to hold the job")
    before = cancelled_count()
    cancel(task_id)
    wait_for(lambda: cancelled_count() == before + 1, 10, 0.05, what="the held job to be discarded when due")
    wait_for(lambda: task_id not in held_ids(), 5, 0.02, what="its message to be acknowledged")
    assert events(key) == []
    assert_cancelled(task_id)


def test_a_parked_delayed_job_is_removed() -> None:
    task_id = probe.enqueue({"message": "later"}, countdown=3600)
    assert job_status(task_id).state is JobState.SCHEDULED
    cancel(task_id)
    with broker_redis() as client:
        assert client.zscore(DELAYED_KEY, task_id) is None
    assert_cancelled(task_id)


def test_a_running_job_on_a_solo_worker_is_stopped_and_the_worker_serves_the_next(
    session_worker: InProcessWorker,
) -> None:
    key = uuid.uuid4().hex
    task_id = run.enqueue({"key": key, "ends": "release"})  # runs until released: never, here
    wait_for(lambda: events(key) == ["start"], 10, 0.02, what="the job to start")
    before = cancelled_count()
    result = run_cli("cancel", task_id)
    assert result.returncode == 0 and result.stdout.strip() == f"{task_id} cancelled", result
    wait_for(lambda: cancelled_count() == before + 1, 5, 0.02, what="the running job to be stopped")
    assert probe.result(probe.enqueue({"message": "next"}), timeout=10).message == "next"
    assert events(key) == ["start", "stopped"]  # JobCancelled raised in it: no finish
    assert_cancelled(task_id)
    wait_for(lambda: task_id not in held_ids(), 5, 0.02, what="its message to be acknowledged")


def test_a_running_job_on_a_solo_worker_process_is_interrupted_in_its_main_thread(make_worker: Any) -> None:
    """`celery worker -P solo` runs the job in its main thread: the cancel is raised there by the SIGALRM handler of
    the time limits (a blocking call is interrupted), and the same process serves the next job."""
    worker = make_worker("cancel-solo", pool="solo", concurrency=1, queues="cancel-solo")
    key = uuid.uuid4().hex
    task_id = str(uuid.uuid4())
    record_accepted(task_id, "test.run", queue="cancel-solo")
    run.task.apply_async(({"key": key, "sleep_s": 60},), task_id=task_id, queue="cancel-solo")  # one long sleep
    wait_for(lambda: events(key) == ["start"], 30, 0.05, what="the job to start")
    cancel(task_id)
    wait_for(lambda: task_id not in held_ids(), 10, 0.05, what="the job to be stopped and acknowledged")
    assert_cancelled(task_id)
    after: Any = get_app().send_task("test.run", args=[{"key": uuid.uuid4().hex}], queue="cancel-solo")
    assert after.get(timeout=30)["pid"] == worker.pid == run_records(key)[0]["pid"]  # the same process goes on
    assert events(key) == ["start", "stopped"]  # JobCancelled raised in it: no finish
    assert f"job {task_id} was cancelled while it ran: interrupting it" in worker.log()


def test_a_running_job_on_a_prefork_worker_is_stopped_and_the_worker_serves_the_next(transcode_worker: Worker) -> None:
    app = get_app()
    key = uuid.uuid4().hex
    task_id = str(uuid.uuid4())
    record_accepted(task_id, "test.run", queue=TRANSCODE_QUEUE)
    run.task.apply_async(({"key": key, "ends": "release"},), task_id=task_id, queue=TRANSCODE_QUEUE)
    wait_for(lambda: events(key) == ["start"], 30, 0.05, what="the job to start")
    child = run_records(key)[0]["pid"]
    cancel(task_id)
    wait_for(lambda: not alive(child), 10, 0.05, what="the job's pool process to be terminated")
    wait_for(lambda: task_id not in held_ids(), 10, 0.05, what="the job to be acknowledged")
    assert_cancelled(task_id)
    after: Any = app.send_task("test.run", args=[{"key": uuid.uuid4().hex}], queue=TRANSCODE_QUEUE)
    assert after.get(timeout=30)["node"].startswith("transcode@")
    assert events(key) == ["start"]
    assert "was cancelled: terminating it" in transcode_worker.log()


def test_a_finished_job_or_an_unknown_id_cannot_be_cancelled(session_worker: InProcessWorker) -> None:
    done = probe.enqueue({"message": "done"})
    probe.result(done, timeout=10)
    with pytest.raises(JobFinished, match="has finished"):
        cancel(done)
    assert job_status(done).state is JobState.SUCCEEDED
    refused = run_cli("cancel", done)
    assert refused.returncode == 1 and refused.stderr.strip().count("\n") == 0, refused
    assert "has finished (succeeded)" in refused.stderr
    unknown = str(uuid.uuid4())
    with pytest.raises(JobNotFound):
        cancel(unknown)
    missing = run_cli("cancel", unknown, "--json")
    assert missing.returncode == 2 and unknown in missing.stdout
