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
