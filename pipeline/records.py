"""The accepted-job record: written before a job is published, so its id never reads as "unknown".

Celery answers PENDING for any id it never saw. So every producer path of the pipeline (`enqueue`,
fan-out, DLQ replay) records the job id in Redis (`pipeline:job:<id>`, JSON with task name, accepted time,
ETA and queue) *before* publishing, with a TTL of RESULT_EXPIRES past the ETA. `pipeline.status` reads it. On a Redis
Cluster the record is `pipeline:job:{celery-task-meta-<id>}`, in its result's slot (`pipeline.queues.jobkeys`).

In the same round trip the id joins its queue's recent-jobs index (`pipeline:recent:<queue>`, a sorted set
by accepted time trimmed to the newest RECENT_JOBS_MAX), from which the job browser (`pipeline.browse`)
lists retrying, succeeded and failed jobs. On a Redis Cluster the record and the index live in different slots:
`record_accepted` sends them in one pipeline without MULTI (a batch per master), and the producer's own paths write
the record before the queue's call (`pipeline.producer.script`).

A stored SUCCESS makes the record useless (a result tells the job from an unknown one): the script that stores it
deletes it in the same step (`pipeline/lua/store.lua`), the meta keeps the ETA, and the accepted time is read from the
queue's recent-jobs index while the job is in it (`accepted_times`).
"""

from __future__ import annotations

import contextlib
import json
import time
from datetime import UTC, datetime
from typing import Any

from redis.client import Pipeline

from pipeline import cluster
from pipeline.broker import broker_redis
from pipeline.config import get_settings
from pipeline.queues import jobkeys, keys


def accepted_entry(task_name: str, eta: datetime | None = None, queue: str | None = None) -> tuple[str, int]:
    """The record `record_accepted` stores (JSON) and its time to live in seconds. Its `queue` is what a waiting job's
    status names (no result names it yet), so a cancel on a Redis Cluster writes the tombstone in that queue's slot."""
    now = datetime.now(UTC)
    if eta is not None and eta.tzinfo is None:
        eta = eta.replace(tzinfo=UTC)  # Celery reads a naive ETA as UTC (enable_utc)
    ahead = max(0.0, (eta - now).total_seconds()) if eta is not None else 0.0
    record = {"task": task_name, "accepted_at": now.isoformat(), "eta": eta.isoformat() if eta else None}
    if queue is not None:
        record["queue"] = queue
    return json.dumps(record), get_settings().result_expires + int(ahead) + 1


def remember_recent(pipe: Pipeline, queue: str | None, task_ids: list[str], now: float | None = None) -> None:
    """Queue the commands adding `task_ids` to `queue`'s recent-jobs index and trimming it (none if no queue)."""
    if queue is None or not task_ids:
        return
    key = keys.recent(queue)
    at = time.time() if now is None else now
    pipe.zadd(key, dict.fromkeys(task_ids, at))
    pipe.zremrangebyrank(key, 0, -get_settings().recent_jobs_max - 1)


def record_accepted(task_id: str, task_name: str, eta: datetime | None = None, queue: str | None = None) -> None:
    """Remember that `task_id` was accepted (on `queue`); call before publishing it (raises if Redis is down)."""
    value, ttl = accepted_entry(task_name, eta, queue)
    with broker_redis() as client:
        pipe = client.pipeline(transaction=not keys.clustered())  # on a cluster: two slots, one batch per master
        pipe.set(jobkeys.record(task_id), value, ex=ttl)
        remember_recent(pipe, queue, [task_id])
        pipe.execute()


def forget_accepted(task_id: str, queue: str | None = None) -> None:
    """Drop the record of a job whose publish failed (best effort: Redis is likely the reason it failed)."""
    with contextlib.suppress(Exception), broker_redis() as client:
        pipe = client.pipeline(transaction=not keys.clustered())
        pipe.delete(jobkeys.record(task_id))
        if queue is not None:
            pipe.zrem(keys.recent(queue), task_id)
        pipe.execute()


def accepted_record(task_id: str) -> dict[str, Any] | None:
    with broker_redis() as client:
        raw = client.get(jobkeys.record(task_id))
    return _parse_record(raw)


def accepted_records(task_ids: list[str]) -> list[dict[str, Any] | None]:
    """`accepted_record` of each of `task_ids`, in order, in one MGET (one per slot on a cluster)."""
    if not task_ids:
        return []
    with broker_redis() as client:
        raws = cluster.get_many(client, [jobkeys.record(task_id) for task_id in task_ids])
    return [_parse_record(raw) for raw in raws]


def accepted_times(jobs: list[tuple[str, str]]) -> list[float | None]:
    """When each (task id, queue) of `jobs` was accepted, from its queue's recent-jobs index (epoch s; None once it
    left the index), in one round trip: what a succeeded job's record said (a stored SUCCESS drops the record)."""
    if not jobs:
        return []
    with broker_redis() as client:
        pipe = client.pipeline(transaction=False)
        for task_id, queue in jobs:
            pipe.zscore(keys.recent(queue), task_id)
        scores = pipe.execute()
    return [None if score is None else float(score) for score in scores]


def _parse_record(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    try:
        record = json.loads(raw)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None
