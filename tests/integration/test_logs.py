"""Structured worker logs: every line a task writes is one JSON object with the task's identity bound."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest

from tests.support.obs_tasks import leaky
from tests.support.procs import wait_for

pytestmark = pytest.mark.integration
QUEUE = "obs-logs"
SENTINEL_SECRET = "sentinel-secret-9191"  # noqa: S105  # a planted value the test must not find


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def test_task_log_lines_are_json_with_task_fields(make_worker: Any) -> None:
    worker = make_worker(
        "logs", env={"LOG_FORMAT": "json", "REDIS_SENTINEL_PASSWORD": SENTINEL_SECRET}, queues=QUEUE, concurrency=2
    )
    smtp_password = f"smtp-{uuid.uuid4().hex}"
    payload = {"email": "bob@example.com", "smtp_password": smtp_password, "note": "n", "fail": False}
    task_id = leaky.task.apply_async((payload,), queue=QUEUE).id
    assert leaky.task.AsyncResult(task_id).get(timeout=30) == {"ok": True}

    def task_lines() -> list[dict[str, Any]]:
        return [line for line in _json_lines(worker.log()) if line.get("task_id") == task_id]

    lines = wait_for(lambda: len(task_lines()) >= 3 and task_lines(), 15, 0.1, what="the task's log lines")
    assert isinstance(lines, list)
    by_message = {line["message"]: line for line in lines}
    own = by_message["rendering the report"]
    assert own["task_name"] == "test.leaky"
    assert own["queue"] == QUEUE
    assert own["attempt"] == 1
    assert own["level"] == "INFO"
    assert own["logger"] == "tests.obs"
    assert own["report_kind"] == "weekly", "extra fields are kept"
    assert any("succeeded" in m for m in by_message), "Celery's own task lines carry the fields too"
    succeeded = next(m for m in by_message if "succeeded in" in m)
    assert "ok" not in succeeded, "no return value in the succeeded line (LOG_PAYLOADS=false)"

    text = worker.log()
    assert SENTINEL_SECRET not in text
    assert smtp_password not in text, "credentials inside URLs are removed"
    lines_outside = [line for line in _json_lines(text) if "ready" in line["message"]]
    assert lines_outside
    assert "task_id" not in lines_outside[0], "no task fields outside a task"
