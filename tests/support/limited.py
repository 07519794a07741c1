"""`test.limited` (20 starts per second across the cluster) and `test.limited-slow` (2 a second): each start appends
its time to `test:limited:<key>`. Both go to a queue of their own (`QUEUE`), which only the workers a test starts for
them consume: the session's workers consume every work queue, and a test's count of starts and their pace must be
its own workers' alone."""

from __future__ import annotations

import time

from pydantic import BaseModel

from pipeline.task import JobContext, typed_task
from tests.support.ticks import ledger_client

#: The limited tasks' queue: no work queue, so no session worker takes their jobs.
QUEUE = "test-limited"


class LimitedJob(BaseModel):
    key: str
    n: int = 0


class LimitedResult(BaseModel):
    attempt: int
    started: float


def _start(job: LimitedJob, ctx: JobContext) -> LimitedResult:
    now = time.time()
    ledger_client().rpush(f"test:limited:{job.key}", now)
    return LimitedResult(attempt=ctx.attempt, started=now)


@typed_task(
    "test.limited", kind="test-limited", payload=LimitedJob, result=LimitedResult, cluster_rate="20/s", queue=QUEUE
)
def limited(job: LimitedJob, ctx: JobContext) -> LimitedResult:
    return _start(job, ctx)


#: 2 starts per second: a slot is judged on time within half an interval (250 ms), wide enough for many jobs.
@typed_task(
    "test.limited-slow",
    kind="test-limited-slow",
    payload=LimitedJob,
    result=LimitedResult,
    cluster_rate="2/s",
    queue=QUEUE,
)
def limited_slow(job: LimitedJob, ctx: JobContext) -> LimitedResult:
    return _start(job, ctx)


def starts(key: str) -> list[float]:
    return sorted(float(x) for x in ledger_client().lrange(f"test:limited:{key}", 0, -1))
