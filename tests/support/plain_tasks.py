"""Plain Celery tasks on the pipeline's app, written as Celery's tutorials write them (`@app.task`), for the tests of
Celery's own API on the pipeline's worker (`tests/integration/test_celery_api.py`).

`TEST_WAKE_POLL_S`, when set, is the worker's fallback poll (`pipeline.delivery.waking.Waking.wake_poll_s`): a test
sets it long, so a job started well within it was woken, not polled.
"""

from __future__ import annotations

import os
import time

from pipeline import app
from pipeline.delivery import waking

if os.environ.get("TEST_WAKE_POLL_S"):
    waking.Waking.wake_poll_s = float(os.environ["TEST_WAKE_POLL_S"])


@app.task(name="plain.add")
def add(x: int, y: int) -> int:
    return x + y


@app.task(name="plain.sleep")
def sleep(seconds: float) -> float:
    time.sleep(seconds)
    return seconds


@app.task(name="plain.run")
def run(key: str, sleep_s: float) -> str:
    """`test.run` as a tutorial writes a task: records `start` in the ledger, then `finish` after its sleep (its side
    effect, which a stop must prevent)."""
    from celery import current_task

    from tests.support.ledger_tasks import _record

    task_id, node = str(current_task.request.id), str(current_task.request.hostname)
    _record(key, "start", task_id, node)
    time.sleep(sleep_s)
    _record(key, "finish", task_id, node)
    return key
