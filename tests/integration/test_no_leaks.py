"""No payloads, no secrets: real workers and a real API, with a local HTTP server standing in for Sentry.

- A refused message (unregistered task, undecodable body, pickle) gives a log line and a Sentry event that name
  its dead-letter entry and hold none of its body.
- Celery's "succeeded" line has no return value, unless LOG_PAYLOADS=true.
- Secrets are filtered by value, not by fragment: with FLOWER_BASIC_AUTH=admin:s3cret and a DSN set,
  "admin" and "https://example.org" survive; the password and the DSN's key do not.
- The API (`uvicorn pipeline.api:app`) logs like a worker, never writes query-string values, and reports
  an unhandled error to Sentry.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery import Celery
from kombu import Connection

from pipeline.celery_app import get_app
from pipeline.constants import DEAD_LETTER_QUEUE
from pipeline.dlq import admin as dlq_admin
from tests.support.api import ApiServer
from tests.support.dlq import dead_letter
from tests.support.obs_tasks import talker
from tests.support.procs import RedisServer, Worker, wait_for
from tests.support.sentry_sink import Ingest

pytestmark = pytest.mark.integration
CONSUMER_LOGGER = "celery.worker.consumer.consumer"
FLOWER_PASSWORD = "s3cret"  # noqa: S105  # a planted value the test must not find


@pytest.fixture
def ingest() -> Iterator[Ingest]:
    server = Ingest()
    yield server
    server.stop()


def _json_lines(text: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in text.splitlines() if line.startswith("{")]


def _events(ingest: Ingest, logger: str, count: int) -> list[dict[str, Any]]:
    def found() -> list[dict[str, Any]] | None:
        events = [e for e in ingest.events() if e.get("logger") == logger]
        return events if len(events) >= count else None

    events = wait_for(found, 30, 0.2, what=f"{count} Sentry event(s) from {logger}")
    assert isinstance(events, list)
    return events


def test_refused_messages_name_their_dead_letter_entry_never_their_body(
    ingest: Ingest, make_worker: Any, redis_server: Any
) -> None:
    queue = f"obs-refused-{uuid.uuid4().hex[:6]}"
    worker: Worker = make_worker(
        "refused", env={"SENTRY_DSN": ingest.dsn, "LOG_FORMAT": "json"}, queues=queue, concurrency=1, pool="threads"
    )
    marker = f"body-marker-{uuid.uuid4().hex}"
    unknown_id = get_app().send_task("does.not.exist", args=[{"card": marker}], queue=queue).id
    bad_id = f"undecodable-{uuid.uuid4().hex}"
    with Connection(redis_server.url) as conn:
        conn.Producer().publish(
            f"{{not json {marker}".encode(),
            exchange="",
            routing_key=queue,
            content_type="application/json",
            content_encoding="utf-8",
            headers={"task": "test.leaky", "id": bad_id, "lang": "py", "argsrepr": marker},
        )
    foreign = Celery(broker=redis_server.url)
    foreign.conf.update(task_serializer="pickle", accept_content=["pickle", "json"])
    pickled_id = foreign.send_task("test.leaky", args=[{"note": marker}], queue=queue).id
    unknown, bad, pickled = dead_letter(unknown_id), dead_letter(bad_id), dead_letter(pickled_id)
    assert (unknown.reason, bad.reason, pickled.reason) == ("unknown_task", "undecodable", "rejected")
    assert bad.body_preview is not None and marker in bad.body_preview, "the body is kept in the dead-letter entry"

    def consumer_lines() -> list[dict[str, Any]] | None:
        lines = [line for line in _json_lines(worker.log()) if line["logger"] == CONSUMER_LOGGER]
        return lines if len(lines) >= 3 else None

    lines = wait_for(consumer_lines, 30, 0.1, what="Celery's lines for the refused messages")
    assert isinstance(lines, list)
    by_id = {entry.id: [line for line in lines if entry.id in line["message"]] for entry in (unknown, bad, pickled)}
    assert (
        len(by_id[unknown.id]) == 1 and "unregistered task of type 'does.not.exist'" in by_id[unknown.id][0]["message"]
    )
    assert len(by_id[bad.id]) == 1 and "Can't decode message body" in by_id[bad.id][0]["message"]
    assert len(by_id[pickled.id]) == 1 and "Received invalid task message" in by_id[pickled.id][0]["message"]
    assert marker not in worker.log()

    events = _events(ingest, CONSUMER_LOGGER, 3)
    formatted = [e["logentry"]["formatted"] for e in events]
    assert all(any(entry.id in f for f in formatted) for entry in (unknown, bad, pickled))
    assert marker not in ingest.text()
    once = [e for e in dlq_admin.list_entries() if e.task_id in (unknown_id, bad_id, pickled_id)]
    assert len(once) == 3, "each dead-lettered once (the consumer), not again (the signal handlers)"


def _succeeded_line(worker: Worker, task_id: str) -> str:
    def found() -> str | None:
        for line in _json_lines(worker.log()):
            if line.get("task_id") == task_id and "succeeded in" in line["message"]:
                return str(line["message"])
        return None

    line = wait_for(found, 15, 0.1, what=f"the succeeded line of {task_id}")
    assert isinstance(line, str)
    return line


def test_no_return_value_in_logs_and_secrets_filtered_by_value_only(ingest: Ingest, make_worker: Any) -> None:
    queue = f"obs-secrets-{uuid.uuid4().hex[:6]}"
    env = {"SENTRY_DSN": ingest.dsn, "LOG_FORMAT": "json", "FLOWER_BASIC_AUTH": f"admin:{FLOWER_PASSWORD}"}
    worker: Worker = make_worker("secrets", env=env, queues=queue, concurrency=1, pool="threads")
    marker = f"result-marker-{uuid.uuid4().hex}"
    task_id = talker.task.apply_async(({"echo": marker},), queue=queue).id
    assert talker.task.AsyncResult(task_id).get(timeout=30) == {"echo": marker}

    assert "succeeded in" in _succeeded_line(worker, task_id)
    assert marker not in worker.log(), "neither the return value nor the arguments are logged"

    said = "user admin fetched https://example.org/report; flower password [Filtered]; dsn [Filtered]"
    line = next(line for line in _json_lines(worker.log()) if line.get("logger") == "tests.obs")
    assert line["message"] == said
    event = _events(ingest, "tests.obs", 1)[0]
    assert event["logentry"]["formatted"] == said
    for where in (worker.log(), ingest.text()):
        assert FLOWER_PASSWORD not in where and ingest.key not in where and marker not in where
        assert "[Filtered]s://" not in where


def test_log_payloads_true_puts_the_return_value_in_the_succeeded_line(make_worker: Any) -> None:
    queue = f"obs-payloads-{uuid.uuid4().hex[:6]}"
    env = {"LOG_FORMAT": "json", "LOG_PAYLOADS": "true"}
    worker: Worker = make_worker("payloads", env=env, queues=queue, concurrency=1, pool="threads")
    marker = f"result-marker-{uuid.uuid4().hex}"
    task_id = talker.task.apply_async(({"echo": marker},), queue=queue).id
    assert talker.task.AsyncResult(task_id).get(timeout=30) == {"echo": marker}
    assert marker in _succeeded_line(worker, task_id)


def test_api_logs_like_a_worker_without_query_values_and_reports_errors(ingest: Ingest, work_dir: Path) -> None:
    redis = RedisServer(work_dir / f"leaks-redis-{uuid.uuid4().hex[:6]}").start()
    env = {"REDIS_URL": redis.url, "SENTRY_DSN": ingest.dsn, "LOG_FORMAT": "json"}
    api = ApiServer(f"leaks-{uuid.uuid4().hex[:6]}", work_dir / "logs", env).start()
    try:
        with api.client() as client:
            assert client.get("/healthz", params={"token": "abc123secret"}).status_code == 200
            # Unknown query parameters are refused (422), and still logged, without their values.
            assert client.get("/dlq/nothing-here", params={"token": "abc123secret", "q": "x"}).status_code == 422
            redis.client().set(DEAD_LETTER_QUEUE, "not a list")  # listing the DLQ now fails in Redis (WRONGTYPE)
            assert client.get("/dlq", params={"task": "abc123secret"}).status_code == 500

        event = wait_for(
            lambda: next((e for e in ingest.events() if e.get("exception")), None), 30, 0.2, what="the API's event"
        )
        assert isinstance(event, dict)
        assert event["exception"]["values"][-1]["type"] == "ResponseError"
        assert event["tags"]["component"] == "api"
        assert event["request"]["query_string"] == "task=[Filtered]"

        def access_lines() -> list[dict[str, Any]] | None:
            lines = [line for line in _json_lines(api.log()) if line["logger"] == "uvicorn.access"]
            return lines if len(lines) >= 3 else None

        lines = wait_for(access_lines, 15, 0.1, what="three JSON access-log lines")
        assert isinstance(lines, list)
        assert any("GET /dlq/nothing-here?token=[Filtered]&q=[Filtered] HTTP/1.1" in line["message"] for line in lines)
        assert "abc123secret" not in api.log()
        assert "abc123secret" not in ingest.text()
    finally:
        api.stop()
        redis.stop()
