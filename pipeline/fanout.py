"""Fan-out: enqueue thousands of jobs of one typed task in a few Redis round trips.

`enqueue_many(typed, payloads)` validates every payload first (one bad item: `PayloadInvalid` naming
its index, nothing published), builds each message with Celery on one producer (the exact envelope a
single `enqueue()` would send, recorded by `pipeline.delayed.capture_many`), then pushes them with
multi-value LPUSHes in a non-transactional Redis pipeline, CHUNK messages per round trip. Order is
kept (first payload, first consumed). Idempotency keys and delays are per-job features of `enqueue()`.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from itertools import groupby
from typing import Any

from celery.utils import uuid
from pydantic import BaseModel

from pipeline import delayed, jobs
from pipeline.broker import broker_redis
from pipeline.constants import HEADER_PUBLISHED_AT, JOB_RECORD_KEY
from pipeline.errors import PayloadInvalid

#: Messages per Redis round trip.
CHUNK = 1000


def _validate_all(typed: Any, payloads: Iterable[BaseModel | Mapping[str, Any]]) -> list[BaseModel]:
    jobs = []
    for index, payload in enumerate(payloads):
        try:
            jobs.append(typed.validate(payload))
        except PayloadInvalid as exc:
            errors = [{**e, "loc": [index, *e.get("loc", ())]} for e in exc.errors]
            raise PayloadInvalid(typed.name, errors) from None
    return jobs


def enqueue_many(typed: Any, payloads: Iterable[BaseModel | Mapping[str, Any]]) -> list[str]:
    """Publish one job of `typed` (a `TypedTask`) per payload; return their task ids in order."""
    validated = _validate_all(typed, payloads)
    ids: list[str] = []
    for start in range(0, len(validated), CHUNK):
        chunk = validated[start : start + CHUNK]
        chunk_ids = [uuid() for _ in chunk]

        def sender(job: BaseModel, task_id: str) -> Any:
            headers = {HEADER_PUBLISHED_AT: time.time()}
            args = (job.model_dump(mode="json"),)
            return lambda producer: typed.task.apply_async(args, task_id=task_id, headers=headers, producer=producer)

        messages = delayed.capture_many(sender(job, task_id) for job, task_id in zip(chunk, chunk_ids, strict=True))
        record, ttl = jobs.accepted_entry(typed.name)
        with broker_redis() as client:
            pipe = client.pipeline(transaction=False)
            for task_id in chunk_ids:  # before the jobs, as `enqueue()` does: an id is never "unknown"
                pipe.set(JOB_RECORD_KEY.format(id=task_id), record, ex=ttl)
            for dest, group in groupby(messages, key=lambda m: m.dest):
                batch = list(group)
                pipe.lpush(dest, *[m.body for m in batch])
                for message in batch:
                    for _, args in message.extra:
                        pipe.publish(*args)
            pipe.execute()
        ids.extend(chunk_ids)
    return ids
