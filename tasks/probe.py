"""`pipeline.probe`: a canary job to check a deployment end to end, and to see failures handled.

`pipeline enqueue probe '{"fail": "permanent"}'` shows a job landing in the dead-letter queue;
`{"fail": "transient", "fail_times": 2}` shows two retries with backoff, then success;
`{"sleep_s": 5, "progress_steps": 10}` reports progress every half second (status pages show a bar).
"""

from __future__ import annotations

import os
import time
from datetime import UTC, datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from pipeline.errors import PermanentError, TransientError
from pipeline.task import JobContext, typed_task


class ProbeJob(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        json_schema_extra={"examples": [{"message": "hello", "sleep_s": 5, "progress_steps": 10}]},
    )

    message: str = Field(default="ping", max_length=1000)
    #: "transient" fails the first `fail_times` attempts (all of them when 0); "permanent" always fails.
    fail: Literal["none", "transient", "permanent"] = "none"
    fail_times: int = Field(default=0, ge=0, le=100)
    sleep_s: float = Field(default=0.0, ge=0, le=600)
    #: Report progress this many times while sleeping (percent and seconds left), for status pages.
    progress_steps: int = Field(default=0, ge=0, le=1000)


class ProbeResult(BaseModel):
    message: str
    attempt: int
    worker_pid: int
    finished_at: datetime


@typed_task("pipeline.probe", kind="probe", payload=ProbeJob, result=ProbeResult)
def probe(job: ProbeJob, ctx: JobContext) -> ProbeResult:
    """Sleep, then fail or echo the message back, as the payload asks."""
    if job.progress_steps:
        step = job.sleep_s / job.progress_steps
        for done in range(1, job.progress_steps + 1):
            time.sleep(step)
            ctx.progress(100 * done / job.progress_steps, eta_s=round(step * (job.progress_steps - done), 2))
    elif job.sleep_s:
        time.sleep(job.sleep_s)
    if job.fail == "permanent":
        raise PermanentError(f"probe asked to fail permanently: {job.message}")
    if job.fail == "transient" and (job.fail_times == 0 or ctx.attempt <= job.fail_times):
        raise TransientError(f"probe asked to fail (attempt {ctx.attempt})")
    return ProbeResult(message=job.message, attempt=ctx.attempt, worker_pid=os.getpid(), finished_at=datetime.now(UTC))


enqueue = probe.enqueue
