"""The tests' ledger tasks: `test.ledger` writes one record per attempt to a Redis list (attempt number, time, pid)
so tests can measure retries, redeliveries and timing from the outside, then behaves as its payload asks; `test.spawn`
enqueues a probe job from inside a running job; `test.run` and `test.run_async` record their start, finish or stop
in `test:run:<key>`. `tests.support.worker_app` (the tests' worker app) and `tests.support.flow_tasks` use them.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from typing import Any, Literal

import redis
from celery.exceptions import SoftTimeLimitExceeded
from pydantic import BaseModel, Field

from pipeline.config import get_settings
from pipeline.errors import PermanentError, TransientError
from pipeline.task import JobContext, typed_task


class LedgerJob(BaseModel):
    key: str
    #: "flag" fails permanently while the Redis key test:flag:<key> exists; "hang" ignores the soft time limit;
    #: "kill_worker" kills the whole worker (its main process, then the pool child), as an OOM kill would.
    fail: Literal["none", "transient", "permanent", "crash", "flag", "hang", "kill_worker"] = "none"
    fail_times: int = Field(default=0, ge=0)
    sleep_s: float = 0.0
    #: With fail="transient": the error asks for at least this long before the next attempt.
    retry_after: float | None = None
    #: Sleep only on the first delivery (a redelivered copy finishes at once).
    sleep_once: bool = False


class LedgerResult(BaseModel):
    key: str
    attempt: int
    pid: int


def _sleep_through_soft_limit(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            time.sleep(0.1)
        except SoftTimeLimitExceeded:
            continue  # a task that ignores its soft limit: only the hard limit stops it


def ledger_client() -> redis.Redis:
    """The broker's Redis, or `TEST_LEDGER_URL` (a Redis the test does not stop) when set."""
    return redis.Redis.from_url(os.environ.get("TEST_LEDGER_URL") or get_settings().broker_url)


def attempts(key: str) -> list[dict[str, float]]:
    return [json.loads(item) for item in ledger_client().lrange(f"test:ledger:{key}", 0, -1)]


@typed_task("test.ledger", kind="test-ledger", payload=LedgerJob, result=LedgerResult)
def ledger(job: LedgerJob, ctx: JobContext) -> LedgerResult:
    record = {"attempt": ctx.attempt, "t": time.time(), "pid": os.getpid(), "task_id": ctx.task_id}
    ledger_client().rpush(f"test:ledger:{job.key}", json.dumps(record))
    if job.fail == "hang":
        _sleep_through_soft_limit(job.sleep_s or 3600)
    elif job.sleep_s and (not job.sleep_once or len(attempts(job.key)) == 1):
        time.sleep(job.sleep_s)
    if job.fail == "flag" and ledger_client().exists(f"test:flag:{job.key}"):
        raise PermanentError("flag is set")
    failing = job.fail_times == 0 or ctx.attempt <= job.fail_times
    if job.fail == "transient" and failing:
        raise TransientError(f"transient failure on attempt {ctx.attempt}", retry_after=job.retry_after)
    if job.fail == "permanent":
        raise PermanentError("permanent failure")
    if job.fail == "kill_worker":
        os.kill(os.getppid(), signal.SIGKILL)
        os._exit(1)
    if job.fail == "crash" and failing:
        os._exit(1)  # the pool child dies mid-task
    ledger_client().rpush(f"test:done:{job.key}", ctx.task_id)
    return LedgerResult(key=job.key, attempt=ctx.attempt, pid=os.getpid())


class SpawnJob(BaseModel):
    message: str


class SpawnResult(BaseModel):
    child_id: str


@typed_task("test.spawn", kind="test-spawn", payload=SpawnJob, result=SpawnResult)
def spawn(job: SpawnJob, ctx: JobContext) -> SpawnResult:
    """Enqueue a probe job from inside this running job (its message names this job as parent)."""
    from tasks.probe import probe

    return SpawnResult(child_id=probe.enqueue({"message": job.message}))


class RunJob(BaseModel):
    key: str
    #: How long a run takes (after its release, when it waits for one).
    sleep_s: float = 0.0
    #: When a run ends: "sleep" after `sleep_s`; "release" once the ledger holds `test:release:<key>`;
    #: "rerun_release": the first run after `sleep_s`, a later run of the same job (a peer's, after the first
    #: holder lost its lease) once released, so the test decides when the peer's copy stores its result.
    ends: Literal["sleep", "release", "rerun_release"] = "sleep"
    #: The first run swallows every exception raised in it during `sleep_s` (recording `ignored`): a job that ignores
    #: a stop, which only its process's end can stop.
    ignores_stop: bool = False


class RunResult(BaseModel):
    key: str
    #: The worker that ran it (its node name, `name@host`) and the pool process.
    node: str
    pid: int


def run_records(key: str) -> list[dict[str, Any]]:
    """What `test.run` recorded for `key`, in order: each run's start and finish."""
    return [json.loads(item) for item in ledger_client().lrange(f"test:run:{key}", 0, -1)]


def _record(key: str, event: str, task_id: str, node: str) -> int:
    client = ledger_client()
    seconds, micros = client.time()  # the ledger's clock: a worker's own may be faked (tests/support/faketime.py)
    record = {"event": event, "task_id": task_id, "node": node, "pid": os.getpid(), "t": seconds + micros / 1e6}
    return int(client.rpush(f"test:run:{key}", json.dumps(record)))


def _wait_for_release(key: str, limit_s: float = 120.0) -> None:
    deadline = time.monotonic() + limit_s
    while not ledger_client().exists(f"test:release:{key}") and time.monotonic() < deadline:
        time.sleep(0.05)


def _pause(seconds: float) -> None:
    """Sleep `seconds` in short steps, as Python code works: a stop raised in the job's thread (a plain job of the
    asyncio pool) lands within a step, where one blocking `time.sleep` would hold it to its end."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        time.sleep(min(0.05, left))


def _sleep_ignoring_stops(key: str, seconds: float, task_id: str, node: str) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            time.sleep(max(0.0, deadline - time.monotonic()))
        except Exception:  # noqa: BLE001  # what this job is for: it goes on
            _record(key, "ignored", task_id, node)


@typed_task("test.run", kind="test-run", payload=RunJob, result=RunResult)
def run(job: RunJob, ctx: JobContext) -> RunResult:
    """Record the run's start and finish (node, pool process, the ledger's time) in `test:run:<key>`: a terminated
    run has a start and no finish, a run stopped by an exception raised in it records `stopped` instead, a run whose
    result was fenced has both; the stored result names who ran it."""
    from celery import current_task

    node = str(current_task.request.hostname)
    _record(job.key, "start", ctx.task_id, node)
    rerun = sum(r["event"] == "start" and r["task_id"] == ctx.task_id for r in run_records(job.key)) > 1
    try:
        if job.ends == "release" or (job.ends == "rerun_release" and rerun):
            _wait_for_release(job.key)
        elif job.ignores_stop:
            _sleep_ignoring_stops(job.key, job.sleep_s, ctx.task_id, node)
        else:
            _pause(job.sleep_s)
    except Exception:  # stopped by an exception raised in it (a limit, a cancel, a lease that could not be renewed)
        _record(job.key, "stopped", ctx.task_id, node)
        raise
    _record(job.key, "finish", ctx.task_id, node)
    return RunResult(key=job.key, node=node, pid=os.getpid())


@typed_task("test.run_async", kind="test-run-async", payload=RunJob, result=RunResult)
async def run_async(job: RunJob, ctx: JobContext) -> RunResult:
    """`test.run` as an `async def` job (for the asyncio pool): the same records, its waits awaited. Its coroutine may
    run outside the job's task context, so the node is the worker's `TEST_NODE` (set by the test)."""
    node = os.environ.get("TEST_NODE", "")
    _record(job.key, "start", ctx.task_id, node)
    rerun = sum(r["event"] == "start" and r["task_id"] == ctx.task_id for r in run_records(job.key)) > 1
    try:
        if job.ends == "release" or (job.ends == "rerun_release" and rerun):
            deadline = time.monotonic() + 120
            while not ledger_client().exists(f"test:release:{job.key}") and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
        else:
            await asyncio.sleep(job.sleep_s)
    except asyncio.CancelledError:  # stopped: a limit, a cancel, a lease that could not be renewed
        _record(job.key, "stopped", ctx.task_id, node)
        raise
    _record(job.key, "finish", ctx.task_id, node)
    return RunResult(key=job.key, node=node, pid=os.getpid())
