"""`test.tracked` (track_started, like pdf.render and media.transcode) and `test.untracked`: each runs until
the Redis key `test:release:<key>` exists, so a test can read the job's status while it runs."""

from __future__ import annotations

import time

from pydantic import BaseModel

from pipeline.task import JobContext, typed_task
from tests.support.ticks import ledger_client


class HeldJob(BaseModel):
    key: str


class HeldResult(BaseModel):
    key: str


def _hold(job: HeldJob) -> HeldResult:
    ledger_client().rpush(f"test:running:{job.key}", 1)
    deadline = time.monotonic() + 60
    while not ledger_client().exists(f"test:release:{job.key}") and time.monotonic() < deadline:
        time.sleep(0.05)
    return HeldResult(key=job.key)


@typed_task("test.tracked", kind="test-tracked", payload=HeldJob, result=HeldResult, track_started=True)
def tracked(job: HeldJob, ctx: JobContext) -> HeldResult:
    return _hold(job)


@typed_task("test.untracked", kind="test-untracked", payload=HeldJob, result=HeldResult)
def untracked(job: HeldJob, ctx: JobContext) -> HeldResult:
    return _hold(job)
