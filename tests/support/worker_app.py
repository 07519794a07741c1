"""The pipeline app plus tasks that only tests use; workers in tests run `celery -A tests.support.worker_app`.

The ledger tasks (`test.ledger`, `test.spawn`, `test.run`, `test.run_async`) live in `tests.support.ledger_tasks`
and are re-exported here; `test.await` is an `async def` job for the asyncio pool.
"""

from __future__ import annotations

import asyncio
import os
from typing import Literal

from pydantic import BaseModel

from pipeline import app  # the worker's app, runtime installed (`celery -A pipeline`)
from pipeline.flows import handoff
from pipeline.task import JobContext, typed_task
from tests.support import cluster_flows, flow_tasks, limited, obs_tasks, plain_tasks, ticks, tracked  # noqa: F401  # registers test.limited, test.leaky, test.tick, test.tracked, plain.*, the test flows
from tests.support.ledger_tasks import (
    LedgerJob,
    LedgerResult,
    RunJob,
    RunResult,
    _record,
    attempts,
    ledger,
    ledger_client,
    run,
    run_async,
    run_records,
    spawn,
)

handoff.CLAIMED.append(cluster_flows.crash_between_claim_and_enqueue)  # a fault test kills a hand-off there

__all__ = [
    "LedgerJob",
    "LedgerResult",
    "RunJob",
    "RunResult",
    "app",
    "attempts",
    "awaiting",
    "ledger",
    "ledger_client",
    "run",
    "run_async",
    "run_records",
    "spawn",
]


class AwaitJob(BaseModel):
    key: str
    sleep_s: float = 0.0
    #: "sleep": awaits `sleep_s`; "hang": awaits forever (until cancelled); "ignore": swallows its cancellation and
    #: goes on awaiting (only abandoning it ends the job); "stray": on its first attempt lets out the CancelledError
    #: of an inner future it cancelled (as a library may), then awaits `sleep_s` on the next; "held": awaits until
    #: `test:release:<key>` is set in the ledger (the soft limit stops it otherwise).
    mode: Literal["sleep", "hang", "ignore", "stray", "held"] = "sleep"


class AwaitResult(BaseModel):
    key: str
    pid: int


#: Limits a test may shorten per job (`send_task(..., soft_time_limit=...)`); a message cannot lengthen them.
@typed_task("test.await", kind="test-await", payload=AwaitJob, result=AwaitResult, soft_time_limit=60, time_limit=90)
async def awaiting(job: AwaitJob, ctx: JobContext) -> AwaitResult:
    """An `async def` job for the asyncio pool: records `start`, then `finish` or `cancelled`, with the ledger's
    clock in `test:run:<key>` (as `test.run` does)."""
    _record(job.key, "start", ctx.task_id, "")
    try:
        if job.mode == "sleep":
            await asyncio.sleep(job.sleep_s)
        elif job.mode == "hang":
            await asyncio.Event().wait()
        elif job.mode == "held":
            client = ledger_client()  # one connection for the wait, not one per look
            while not client.exists(f"test:release:{job.key}"):
                await asyncio.sleep(0.25)
        elif job.mode == "stray":
            if ctx.attempt == 1:
                inner = asyncio.ensure_future(asyncio.sleep(3600))
                inner.cancel()
                await inner
            await asyncio.sleep(job.sleep_s)
        else:
            while True:
                try:
                    await asyncio.sleep(3600)
                except asyncio.CancelledError:
                    _record(job.key, "ignored", ctx.task_id, "")
    except asyncio.CancelledError:
        _record(job.key, "cancelled", ctx.task_id, "")
        raise
    _record(job.key, "finish", ctx.task_id, "")
    return AwaitResult(key=job.key, pid=os.getpid())
