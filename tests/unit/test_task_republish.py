"""A message published from a delivery (Celery's `retry`, a job deferred by the rate limiter) carries the job's
own headers, never the ones a worker's fetch set on that delivery (its lease owner, delivery count and rate slot)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from celery import Task

from pipeline.constants import (
    DELIVERY_HEADERS,
    HEADER_DELIVERY_COUNT,
    HEADER_IDEMPOTENCY_KEY,
    HEADER_LEASE_OWNER,
    HEADER_LEASE_QUEUE,
    HEADER_RATE_GRANT,
)
from pipeline.task import PipelineTask
from tests.support.limited import limited

DELIVERED = {
    "id": "job-1",
    "task": "test.limited",
    "retries": 1,
    HEADER_IDEMPOTENCY_KEY: "order-7",
    HEADER_DELIVERY_COUNT: 3,
    HEADER_LEASE_OWNER: "host:123:abcd",
    HEADER_LEASE_QUEUE: "default",
    HEADER_RATE_GRANT: {"key": "pipeline:ratelimit:test.limited", "slot": 12.0, "due": 12.0},
}


@pytest.fixture
def delivered() -> Iterator[Any]:
    """`limited` inside a request built as the tracer builds it from a fetched message's headers."""
    task = limited.task
    task.push_request(**DELIVERED)
    try:
        yield task
    finally:
        task.pop_request()


def test_a_retry_keeps_the_jobs_headers_and_drops_the_deliverys(delivered: PipelineTask) -> None:
    upstream = Task.signature_from_request(delivered).options["headers"]
    assert set(DELIVERY_HEADERS) <= set(upstream)  # what Celery alone would publish

    headers = delivered.signature_from_request(retries=2).options["headers"]

    assert headers == {k: v for k, v in upstream.items() if k not in DELIVERY_HEADERS}
    assert not set(DELIVERY_HEADERS) & set(headers)
    assert headers[HEADER_IDEMPOTENCY_KEY] == "order-7"


def test_headers_given_for_the_new_message_lose_the_deliverys_too(delivered: PipelineTask) -> None:
    given = {**(delivered.request.headers or {}), "pipeline_rate_slot": 12.5}

    headers = delivered.signature_from_request(delivered.request, headers=given).options["headers"]

    assert headers == {HEADER_IDEMPOTENCY_KEY: "order-7", "pipeline_rate_slot": 12.5}
