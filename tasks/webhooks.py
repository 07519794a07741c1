"""`webhooks.deliver` (kind `webhook`, queue `webhooks`): POST a signed JSON event to a subscriber's URL.

Body: ``{"event": <event>, "payload": <payload>}`` (compact JSON). Headers: `X-Pipeline-Signature`
(see `tasks.webhook_http`), `Idempotency-Key` (the job's key, or its task id: the same on every
attempt), `X-Pipeline-Event`, `X-Pipeline-Attempt`, `Content-Type: application/json`.

Outcomes: 2xx succeeds; 5xx, 408, timeouts and connection errors are transient (retried with backoff);
429 is transient and the next attempt waits at least its `Retry-After`; other 3xx/4xx are permanent
(dead-letter queue; redirects are not followed). Deliveries are limited cluster-wide per destination
host (WEBHOOK_RATE_PER_HOST). The task is `async def`: a worker process of the asyncio pool keeps WORKER_CONCURRENCY
deliveries in flight on one pooled HTTP client (`tasks.webhook_http`). `enqueue_many` fans out thousands of
deliveries in a few round trips.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import json
import time
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime
from typing import Any

import yarl
from pydantic import BaseModel, ConfigDict, Field, HttpUrl

from pipeline.config import get_settings
from pipeline.errors import PermanentError, TransientError
from pipeline.task import JobContext, typed_task
from tasks import netguard, webhook_http

#: Longest Retry-After honoured as such; a longer one is treated as this (the job retries, not waits a week).
MAX_RETRY_AFTER_S = 24 * 3600.0


class WebhookJob(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={
            "examples": [
                {
                    "url": "https://example.com/hooks/orders",
                    "event": "order.paid",
                    "payload": {"order_id": 42, "amount_cents": 1999, "currency": "EUR"},
                    "idempotency_key": "order-42-paid",
                }
            ]
        },
    )

    url: HttpUrl
    event: str = Field(min_length=1, max_length=200, pattern=r"^[A-Za-z0-9_.:\-/]+$")
    payload: dict[str, Any]
    #: Sent as `Idempotency-Key`; default: the job's own idempotency key or task id.
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=255)


class WebhookResult(BaseModel):
    status_code: int
    attempts: int
    duration_ms: float


def _host(job: WebhookJob) -> str:
    return (job.url.host or "").lower()


def retry_after_s(value: str | None, now: float | None = None) -> float | None:
    """Seconds from a Retry-After header (delta-seconds or an HTTP date), capped; None if absent/invalid."""
    if not value:
        return None
    value = value.strip()
    if value.isdigit():
        return min(float(value), MAX_RETRY_AFTER_S)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError):
        return None
    seconds = when.astimezone(UTC).timestamp() - (time.time() if now is None else now)
    return min(max(0.0, seconds), MAX_RETRY_AFTER_S)


def classify(response: webhook_http.Answer, host: str) -> None:
    """Raise for a response that is not a success, transient or permanent as the module docstring says."""
    code = response.status_code
    if 200 <= code < 300:
        return
    message = f"{host} answered {code} {response.reason}"
    if code == 429:
        raise TransientError(message, retry_after=retry_after_s(response.retry_after))
    if code >= 500 or code == 408:
        raise TransientError(message)
    raise PermanentError(message + (" (redirects are not followed)" if 300 <= code < 400 else ""))


@typed_task(
    "webhooks.deliver",
    kind="webhook",
    payload=WebhookJob,
    result=WebhookResult,
    cluster_rate=lambda: get_settings().webhook_rate_per_host,
    rate_key=_host,
)
async def deliver(job: WebhookJob, ctx: JobContext) -> WebhookResult:
    """Sign and POST the event to a vetted address of the destination; classify the answer."""
    settings = get_settings()
    if settings.webhook_signing_secret is None:
        raise PermanentError("WEBHOOK_SIGNING_SECRET is not set: refusing to send unsigned webhooks")
    url = yarl.URL(str(job.url))
    vet = functools.partial(netguard.vet, str(url), settings.webhook_allowed_hosts, setting="WEBHOOK_ALLOWED_HOSTS")
    # An address needs no lookup; a name is resolved off the event loop (a slow DNS answer stalls no other job).
    target = await asyncio.to_thread(vet) if netguard.needs_lookup(url.host or "") else vet()
    body = json.dumps({"event": job.event, "payload": job.payload}, separators=(",", ":")).encode()
    secret = settings.webhook_signing_secret.get_secret_value().encode()
    headers = {
        "Content-Type": "application/json",
        webhook_http.SIGNATURE_HEADER: webhook_http.sign(secret, int(time.time()), body),
        webhook_http.IDEMPOTENCY_HEADER: job.idempotency_key or ctx.idempotency_key,
        webhook_http.EVENT_HEADER: job.event,
        webhook_http.ATTEMPT_HEADER: str(ctx.attempt),
    }
    started = time.monotonic()
    connections = webhook_http.pool(settings.webhook_max_connections, settings.webhook_connections_per_host)
    response = await webhook_http.post(
        url, target, body, headers, settings.webhook_connect_timeout, settings.webhook_timeout, connections
    )
    classify(response, target.host)
    duration_ms = round((time.monotonic() - started) * 1000, 1)
    return WebhookResult(status_code=response.status_code, attempts=ctx.attempt, duration_ms=duration_ms)


def enqueue(
    payload: WebhookJob | Mapping[str, Any],
    *,
    countdown: float | None = None,
    eta: datetime | None = None,
    idempotency_key: str | None = None,
) -> str:
    return deliver.enqueue(payload, countdown=countdown, eta=eta, idempotency_key=idempotency_key)


def enqueue_many(jobs: Iterable[WebhookJob | Mapping[str, Any]]) -> list[str]:
    """Validate all, then publish every delivery in batches (`TypedTask.enqueue_many`); return the ids."""
    return deliver.enqueue_many(jobs)
