"""Sentry from a real prefork worker to a local HTTP server standing in for Sentry's ingest endpoint.

A failing task produces exactly one event, tagged with the task name; no secret, e-mail address or
payload value appears anywhere in what the worker sends.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.observability.sentry import scrub_event
from tests.support.obs_tasks import leaky
from tests.support.procs import wait_for
from tests.support.sentry_sink import Ingest

pytestmark = pytest.mark.integration
QUEUE = "obs-sentry"
SECRETS = {
    "FLOWER_BASIC_AUTH": "ops:flower-secret-4242",
    "REDIS_SENTINEL_PASSWORD": "sentinel-secret-4242",
}
SMTP_PASSWORD = "smtp-secret-4242"  # noqa: S105  # a planted value the test must not find
EMAIL = "alice.customer@example.com"


@pytest.fixture
def ingest() -> Iterator[Ingest]:
    server = Ingest()
    yield server
    server.stop()


def test_failing_task_sends_one_scrubbed_event(ingest: Ingest, make_worker: Any) -> None:
    env = {
        "SENTRY_DSN": ingest.dsn,
        "ENVIRONMENT": "obs-test",
        "RELEASE": "pipeline-test@1",
        "LOG_FORMAT": "json",
        "SMTP_PASSWORD": SMTP_PASSWORD,
        **SECRETS,
    }
    make_worker("sentry", env=env, queues=QUEUE, concurrency=1)
    marker = f"payload-marker-{uuid.uuid4().hex}"
    payload = {"email": EMAIL, "smtp_password": SMTP_PASSWORD, "note": marker}
    first = leaky.task.apply_async((payload,), queue=QUEUE).id
    # A second failure from the same (single) pool process: once its event is in, any duplicate of
    # the first one would be too.
    second = leaky.task.apply_async(({**payload, "note": marker + "-2"},), queue=QUEUE).id

    def both() -> list[dict[str, Any]] | None:
        events = ingest.events()
        ids = {e.get("tags", {}).get("celery_task_id") for e in events}
        return events if {first, second} <= ids else None

    events = wait_for(both, 60, 0.2, what="two events at the stand-in ingest endpoint")
    assert isinstance(events, list)
    for_first = [e for e in events if e.get("tags", {}).get("celery_task_id") == first]
    assert len(for_first) == 1, for_first
    assert len(events) == 2
    event = for_first[0]
    assert event["tags"]["celery_task_name"] == "test.leaky"
    assert event["environment"] == "obs-test"
    assert event["release"] == "pipeline-test@1"
    assert event["exception"]["values"][-1]["type"] == "PermanentError"
    assert "SMTP login refused" in event["exception"]["values"][-1]["value"]

    everything = b"\n".join(ingest.bodies).decode("utf-8", "replace")
    for secret in [*SECRETS.values(), "flower-secret-4242", SMTP_PASSWORD, EMAIL, marker]:
        assert secret not in everything, f"{secret!r} leaked to Sentry"


def test_scrubber_covers_urls_pairs_and_emails() -> None:
    event = {
        "message": "redis://:hunter2pw@redis:6379/0 rediss://user:pw-9@h/1 token=abc123 bob@example.org",
        "extra": {"celery-job": {"task_name": "email.send", "args": [{"to": "x@example.org"}], "kwargs": {}}},
        "breadcrumbs": {"values": [{"message": "Authorization: Bearer sekrit-token"}]},
    }
    scrubbed = json.dumps(scrub_event(event))
    for leaked in ("hunter2pw", "pw-9", "abc123", "bob@example.org", "x@example.org", "sekrit-token"):
        assert leaked not in scrubbed
    assert '"celery_task_name": "email.send"' in scrubbed
