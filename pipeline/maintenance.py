"""Housekeeping tasks the beat schedule runs: dead-letter retention and the envelope spool."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict

from pipeline import dlq, dlq_admin
from pipeline.task import JobContext, typed_task


class NoPayload(BaseModel):
    model_config = ConfigDict(extra="forbid")


class RetentionResult(BaseModel):
    removed: int
    spooled_published: int


@typed_task("pipeline.dlq_retention", kind="dlq-retention", payload=NoPayload, result=RetentionResult)
def dlq_retention(_: NoPayload, ctx: JobContext) -> RetentionResult:
    """Publish spooled envelopes, then drop dead-letter entries past DLQ_MAX_AGE / DLQ_MAX_ENTRIES."""
    spooled = dlq.flush_spool()
    return RetentionResult(removed=dlq_admin.apply_retention(), spooled_published=spooled)
