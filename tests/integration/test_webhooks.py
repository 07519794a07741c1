"""webhooks.deliver against a real HTTP server: signature, retries, DLQ, Retry-After, SSRF refusal."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from pipeline.status import job_status
from tasks import webhook_http, webhooks
from tests.conftest import TEST_ENV
from tests.support.dlq import dead_letter
from tests.support.http_peer import HttpPeer
from tests.support.procs import waiting

pytestmark = pytest.mark.integration

SECRET = TEST_ENV["WEBHOOK_SIGNING_SECRET"].encode()


@pytest.fixture
def peer() -> Iterator[HttpPeer]:
    server = HttpPeer().start()
    yield server
    server.stop()


def path() -> str:
    return f"/hook/{uuid.uuid4().hex}"


def test_delivery_is_signed_and_carries_the_idempotency_key(session_worker: Any, peer: HttpPeer) -> None:
    hook = path()
    job = {"url": peer.url(hook), "event": "order.paid", "payload": {"order": 42}, "idempotency_key": "order-42"}
    result = webhooks.deliver.result(webhooks.enqueue(job), timeout=30)

    assert result.status_code == 200
    assert result.attempts == 1
    assert result.duration_ms > 0
    [request] = peer.received(hook)
    assert json.loads(request.body) == {"event": "order.paid", "payload": {"order": 42}}
    assert webhook_http.verify(SECRET, request.headers[webhook_http.SIGNATURE_HEADER], request.body)
    assert not webhook_http.verify(b"wrong", request.headers[webhook_http.SIGNATURE_HEADER], request.body)
    assert request.headers[webhook_http.IDEMPOTENCY_HEADER] == "order-42"
    assert request.headers[webhook_http.EVENT_HEADER] == "order.paid"
    assert request.headers["Content-Type"] == "application/json"
    assert request.headers["Host"] == f"127.0.0.1:{peer.port}"


def test_503_then_200_retries_once_with_the_same_idempotency_key(session_worker: Any, peer: HttpPeer) -> None:
    hook = path()
    peer.script(hook, [(503, {}), (200, {})])
    task_id = webhooks.enqueue({"url": peer.url(hook), "event": "e", "payload": {}})
    result = webhooks.deliver.result(task_id, timeout=30)

    assert (result.status_code, result.attempts) == (200, 2)
    first, second = peer.received(hook)
    assert first.headers[webhook_http.IDEMPOTENCY_HEADER] == second.headers[webhook_http.IDEMPOTENCY_HEADER] == task_id
    assert second.headers[webhook_http.ATTEMPT_HEADER] == "2"


def test_404_goes_to_the_dead_letter_queue_without_retrying(
    session_worker: Any, peer: HttpPeer, clean_dlq: None
) -> None:
    hook = path()
    peer.script(hook, [(404, {})])
    task_id = webhooks.enqueue({"url": peer.url(hook), "event": "e", "payload": {"a": 1}})
    entry = dead_letter(task_id)

    assert entry.task_name == "webhooks.deliver"
    assert entry.exception_type.endswith("PermanentError")
    assert "404" in entry.exception_message
    assert entry.payload["payload"] == {"a": 1}
    assert len(peer.received(hook)) == 1


def test_429_waits_at_least_retry_after(session_worker: Any, peer: HttpPeer) -> None:
    hook = path()
    peer.script(hook, [(429, {"Retry-After": "2"}), (200, {})])
    result = webhooks.deliver.result(webhooks.enqueue({"url": peer.url(hook), "event": "e", "payload": {}}), timeout=30)

    first, second = peer.received(hook)
    assert result.attempts == 2
    assert second.t - first.t >= 2.0, f"retried after {second.t - first.t:.2f}s despite Retry-After: 2"


@pytest.mark.parametrize(
    "url", ["http://10.0.0.7:9/hook", "http://169.254.169.254/latest/meta-data", "http://[::1]:9/"]
)
def test_private_addresses_are_refused(session_worker: Any, clean_dlq: None, url: str) -> None:
    entry = dead_letter(webhooks.enqueue({"url": url, "event": "e", "payload": {}}))
    assert entry.exception_type.endswith("AddressRefused")
    assert "not a public address" in entry.exception_message


def test_enqueue_many_publishes_every_delivery(session_worker: Any, peer: HttpPeer) -> None:
    hook = path()
    jobs = [{"url": peer.url(hook), "event": "sync", "payload": {"n": i}} for i in range(30)]
    ids = webhooks.enqueue_many(jobs)

    assert len(set(ids)) == 30
    assert job_status(ids[-1]).state != "unknown"  # accepted before it was published, like enqueue()
    results = [webhooks.deliver.result(i, timeout=60) for i in ids]
    assert all(r.status_code == 200 for r in results)
    delivered = sorted(json.loads(r.body)["payload"]["n"] for r in peer.received(hook))
    assert delivered == list(range(30))


def test_enqueue_many_publishes_nothing_when_one_payload_is_invalid(redis_server: Any) -> None:
    from pipeline.errors import PayloadInvalid

    client = redis_server.client()
    before = waiting(client, "webhooks")
    good = {"url": "https://example.com/h", "event": "e", "payload": {}}
    with pytest.raises(PayloadInvalid) as caught:
        webhooks.enqueue_many([good, good, {**good, "url": "not a url"}])
    assert caught.value.errors[0]["loc"][0] == 2
    assert waiting(client, "webhooks") == before
