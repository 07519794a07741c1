"""Plain Celery tasks on the pipeline's app, written as Celery's tutorials write them (`@app.task`), for the tests of
Celery's own API on the pipeline's worker (`tests/integration/test_celery_api.py`).

`TEST_WAKE_POLL_S`, when set, is the worker's fallback poll (`pipeline.delivery.waking.Waking.wake_poll_s`): a test
sets it long, so a job started well within it was woken, not polled.
"""

from __future__ import annotations

import os
import time
from typing import Any

import redis
from celery import Task, current_task
from celery.exceptions import SoftTimeLimitExceeded

from pipeline import app
from pipeline.delivery import waking

if os.environ.get("TEST_WAKE_POLL_S"):
    waking.Waking.wake_poll_s = float(os.environ["TEST_WAKE_POLL_S"])


@app.task(name="plain.add")
def add(x: int, y: int) -> int:
    return x + y


class ExpectedFailure(Exception):
    """What `plain.fail` raises (importable by a client, which rebuilds it from the stored result)."""


@app.task(name="plain.fail")
def fail(*args: Any) -> None:
    """Fails at once, whatever it is given (a chord's header part, a chain's step)."""
    raise ExpectedFailure("failed as asked")


@app.task(name="plain.fail_after")
def fail_after(gate: str) -> None:
    """Fails once key `gate` exists on the broker's Redis (a test opens it when it wants the failure)."""
    client = redis.Redis.from_url(os.environ["REDIS_URL"])
    deadline = time.monotonic() + 30
    while not client.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    raise ExpectedFailure("failed as asked")


@app.task(name="plain.identity")
def identity(value: Any) -> Any:
    return value


@app.task(name="plain.total")
def total(values: list[int]) -> int:
    """A chord's body: the sum of its header's results."""
    return sum(values)


@app.task(name="plain.sleep")
def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


def _steps(seconds: float) -> None:
    """Sleep `seconds` in short steps: Python code an exception raised in its thread stops within a step."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        time.sleep(0.05)


@app.task(name="plain.spin")
def spin(seconds: float) -> float:
    _steps(seconds)
    return seconds


@app.task(name="plain.soft_guard")
def soft_guard(seconds: float) -> str:
    """As Celery's own `delayed_sum_with_soft_guard`: a soft time limit is caught, and the job recovers."""
    try:
        _steps(seconds)
    except SoftTimeLimitExceeded:
        return "recovered"
    return "finished"


@app.task(name="plain.context", bind=True)
def context(self: Task[Any, Any], retry: bool = False) -> dict[str, Any]:
    """What the job sees of its own request and of `celery.current_task`; retried once first when `retry`."""
    if retry and not self.request.retries:
        raise self.retry(countdown=0)
    return {
        "id": self.request.id,
        "retries": self.request.retries,
        "probe": (self.request.headers or {}).get("probe", getattr(self.request, "probe", None)),
        "current": current_task.request.id,
        "same": current_task.name == self.name,
    }


@app.task(name="plain.run")
def run(key: str, sleep_s: float) -> str:
    """`test.run` as a tutorial writes a task: records `start` in the ledger, then `finish` after its sleep (its side
    effect, which a stop must prevent)."""

    from tests.support.ledger_tasks import _record

    task_id, node = str(current_task.request.id), str(current_task.request.hostname)
    _record(key, "start", task_id, node)
    _steps(sleep_s)  # Python code: a plain job of the asyncio pool is stopped within a step (see `_steps`)
    _record(key, "finish", task_id, node)
    return key
