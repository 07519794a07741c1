"""The pipeline app plus a no-op typed task: validation, signals, DLQ hooks and metrics, no work."""

from __future__ import annotations

import time

from pydantic import BaseModel

from pipeline import app
from pipeline.task import JobContext, typed_task

__all__ = ["app"]


class NoopJob(BaseModel):
    sent_at: float


class NoopResult(BaseModel):
    latency_s: float


@typed_task("bench.noop", kind="bench-noop", payload=NoopJob, result=NoopResult, queue="bench-pipeline")
def noop(job: NoopJob, ctx: JobContext) -> NoopResult:
    return NoopResult(latency_s=time.time() - job.sent_at)
