"""The accepted-job record: written before a job is published, so its id never reads as "unknown".

Celery answers PENDING for any id it never saw. So every producer path of the pipeline (`enqueue`,
fan-out, DLQ replay) records the job id in Redis (`pipeline:job:<id>`, JSON with task name, accepted time
and ETA) *before* publishing, with a TTL of RESULT_EXPIRES past the ETA. `pipeline.status` reads it.
"""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime
from typing import Any

from pipeline.broker import broker_redis
from pipeline.config import get_settings
from pipeline.constants import JOB_RECORD_KEY


def accepted_entry(task_name: str, eta: datetime | None = None) -> tuple[str, int]:
    """The record `record_accepted` stores (JSON) and its time to live in seconds."""
    now = datetime.now(UTC)
    if eta is not None and eta.tzinfo is None:
        eta = eta.replace(tzinfo=UTC)  # Celery reads a naive ETA as UTC (enable_utc)
    ahead = max(0.0, (eta - now).total_seconds()) if eta is not None else 0.0
    record = {"task": task_name, "accepted_at": now.isoformat(), "eta": eta.isoformat() if eta else None}
    return json.dumps(record), get_settings().result_expires + int(ahead) + 1


def record_accepted(task_id: str, task_name: str, eta: datetime | None = None) -> None:
    """Remember that `task_id` was accepted; call before publishing it (raises if Redis is unreachable)."""
    value, ttl = accepted_entry(task_name, eta)
    with broker_redis() as client:
        client.set(JOB_RECORD_KEY.format(id=task_id), value, ex=ttl)


def forget_accepted(task_id: str) -> None:
    """Drop the record of a job whose publish failed (best effort: Redis is likely the reason it failed)."""
    with contextlib.suppress(Exception), broker_redis() as client:
        client.delete(JOB_RECORD_KEY.format(id=task_id))


def accepted_record(task_id: str) -> dict[str, Any] | None:
    with broker_redis() as client:
        raw = client.get(JOB_RECORD_KEY.format(id=task_id))
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
