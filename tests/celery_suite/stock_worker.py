"""The baseline: a stock Celery app (no pipeline code) with the suite's tasks, on the suite's broker and backend.

`celery -A tests.celery_suite.stock_worker worker` is configured as the suite's own session app is
(`t/integration/conftest.py: celery_config`), from the same TEST_BROKER and TEST_BACKEND.
"""

from __future__ import annotations

import os

from celery import Celery

app = Celery("celery", broker=os.environ["TEST_BROKER"], backend=os.environ["TEST_BACKEND"])
app.conf.update(result_extended=True)

import t.integration.tasks  # noqa: E402  # registers the suite's shared tasks and control commands

app.register_task(t.integration.tasks.ClassBasedAutoRetryTask())
