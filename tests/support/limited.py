"""`test.limited`: 20 starts per second across the cluster; each start appends its time to `test:limited:<key>`."""

from __future__ import annotations

import time

from pydantic import BaseModel

from pipeline.task import JobContext, typed_task
from tests.support.ticks import ledger_client


class LimitedJob(BaseModel):
    key: str
    n: int = 0


class LimitedResult(BaseModel):
    attempt: int
    started: float


@typed_task("test.limited", kind="test-limited", payload=LimitedJob, result=LimitedResult, cluster_rate="20/s")
def limited(job: LimitedJob, ctx: JobContext) -> LimitedResult:
    now = time.time()
    ledger_client().rpush(f"test:limited:{job.key}", now)
    return LimitedResult(attempt=ctx.attempt, started=now)


def starts(key: str) -> list[float]:
    return sorted(float(x) for x in ledger_client().lrange(f"test:limited:{key}", 0, -1))
