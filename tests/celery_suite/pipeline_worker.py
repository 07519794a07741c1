"""The pipeline's worker app (`celery -A pipeline`: transport, result backend, runtime) with the suite's tasks.

Configured by the environment like any deployment (REDIS_URL, RESULT_BACKEND_URL, ...). The one change a Celery user
bringing this suite's code would make: its tasks live on Celery's default queue `celery`, so that is the queue the
worker consumes and the one every job published from a task (a chain's next step, a chord's callback) goes to.
"""

from __future__ import annotations

from kombu import Queue

from pipeline import app

app.conf.update(
    task_default_queue="celery",
    task_queues=[Queue("celery", routing_key="celery")],
    task_routes={"*": {"queue": "celery", "priority": app.conf.task_default_priority}},
)

import t.integration.tasks  # noqa: E402  # registers the suite's shared tasks and control commands

from tests.celery_suite import pool_tasks  # noqa: E402, F401  # our canvas checks' typed and async tasks

app.register_task(t.integration.tasks.ClassBasedAutoRetryTask())
