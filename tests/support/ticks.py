"""`test.tick`: a task beat entries in tests fire; each run appends its time to `test:tick:<key>`."""

from __future__ import annotations

import time

from pydantic import BaseModel

from pipeline.task import JobContext, typed_task
from tests.support.ledger_tasks import ledger_client  # the broker's Redis, or TEST_LEDGER_URL (a cluster's tests)

__all__ = ["ledger_client", "tick", "ticks"]


class TickJob(BaseModel):
    key: str


class TickResult(BaseModel):
    t: float


@typed_task("test.tick", kind="test-tick", payload=TickJob, result=TickResult)
def tick(job: TickJob, ctx: JobContext) -> TickResult:
    now = time.time()
    ledger_client().rpush(f"test:tick:{job.key}", now)
    return TickResult(t=now)


def ticks(key: str) -> list[float]:
    return [float(x) for x in ledger_client().lrange(f"test:tick:{key}", 0, -1)]
