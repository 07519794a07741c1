"""Housekeeping tasks the beat schedule runs (`pipeline.schedule`): dead-letter retention and the envelope
spool, the purge of stored artifacts (nightly), queue-health figures for the metrics exporter (every minute)."""

from __future__ import annotations

import time

from pydantic import BaseModel, ConfigDict

from pipeline import broker, delayed, dlq, dlq_admin
from pipeline.config import get_settings
from pipeline.constants import QUEUE_HEALTH_KEY
from pipeline.storage import get_storage
from pipeline.task import JobContext, typed_task


class NoPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetentionResult(BaseModel):
    removed: int
    spooled_published: int


@typed_task("pipeline.dlq_retention", kind="dlq-retention", public=False, payload=NoPayload, result=RetentionResult)
def dlq_retention(_: NoPayload, ctx: JobContext) -> RetentionResult:
    """Publish spooled envelopes, then drop dead-letter entries past DLQ_MAX_AGE / DLQ_MAX_ENTRIES."""
    spooled = dlq.flush_spool()
    return RetentionResult(removed=dlq_admin.apply_retention(), spooled_published=spooled)


class QueueHealthResult(BaseModel):
    queues: int
    parked: int


@typed_task("pipeline.queue_health", kind="queue-health", public=False, payload=NoPayload, result=QueueHealthResult)
def queue_health(_: NoPayload, ctx: JobContext) -> QueueHealthResult:
    """Write each queue's depth and oldest-job age, and the parked delayed jobs, to `pipeline:queue_health`."""
    stats = broker.queue_stats()
    parked = delayed.parked_count()
    figures: dict[str, float] = {"delayed.parked": parked, "updated_at": round(time.time(), 3)}
    for queue in stats:
        figures[f"{queue.name}.depth"] = queue.depth
        # -1: the queue is empty (a hash cannot hold "none"); the exporter reports 0 for it.
        figures[f"{queue.name}.oldest_age_s"] = -1 if queue.oldest_age_s is None else round(queue.oldest_age_s, 3)
    with broker.broker_redis() as client:
        pipe = client.pipeline(transaction=True)
        pipe.delete(QUEUE_HEALTH_KEY)
        pipe.hset(QUEUE_HEALTH_KEY, items=[part for pair in figures.items() for part in pair])
        pipe.execute()
    return QueueHealthResult(queues=len(stats), parked=parked)


class PurgeResult(BaseModel):
    removed: int


@typed_task("pipeline.artifact_purge", kind="artifact-purge", public=False, payload=NoPayload, result=PurgeResult)
def artifact_purge(_: NoPayload, ctx: JobContext) -> PurgeResult:
    """Delete stored outputs (and abandoned partial files) older than ARTIFACT_MAX_AGE."""
    return PurgeResult(removed=get_storage().purge_older_than(get_settings().artifact_max_age))
