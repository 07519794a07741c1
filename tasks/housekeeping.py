"""Housekeeping tasks the beat schedule runs (`pipeline.config.beat`), nightly: dead-letter retention and the
envelope spool, and the purge of stored artifacts. (Queue figures need no task: the metrics exporter reads
Redis at each scrape.)"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline.config import get_settings
from pipeline.dlq import admin, envelope
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
    spooled = envelope.flush_spool()
    return RetentionResult(removed=admin.apply_retention(), spooled_published=spooled)


class PurgeResult(BaseModel):
    removed: int


@typed_task("pipeline.artifact_purge", kind="artifact-purge", public=False, payload=NoPayload, result=PurgeResult)
def artifact_purge(_: NoPayload, ctx: JobContext) -> PurgeResult:
    """Delete stored outputs (and abandoned partial files) older than ARTIFACT_MAX_AGE."""
    return PurgeResult(removed=get_storage().purge_older_than(get_settings().artifact_max_age))
