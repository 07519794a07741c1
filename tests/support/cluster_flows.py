"""A flow whose steps run on queues served by three different masters of the test cluster, and the point where a
worker is killed in the middle of a hand-off.

`test_spread`: `top` (`test.run` on `default`) → `items`, a fan-out of `test.spread_item` jobs on ITEMS → `end`,
their join, one `test.spread_end` job on ENDS. Each item and the join record their run in the ledger
(`test:ledger:<key>:item` and `test:ledger:<key>:end`), where the test counts them; item i then fails permanently
(it is dead-lettered) while the ledger holds `test:flag:<key>:item:<i>`. With the even split of slots over
three masters, `default`, ITEMS and ENDS hash to the second, the first and the third.

`crash_between_claim_and_enqueue` (installed by the tests' worker app, `tests.support.worker_app`): a worker whose
hand-off claimed a step of a flow the ledger names (`test:crash-handoff:<flow id>`, taken once) is SIGKILLed there,
after the flow's call and before the step's enqueue.
"""

from __future__ import annotations

import json
import os
import signal
import time

from pydantic import BaseModel, Field

from pipeline.errors import PermanentError
from pipeline.flows import Flow
from pipeline.task import JobContext, typed_task
from tests.support.ledger_tasks import LedgerResult, RunJob, RunResult, ledger_client, run

ITEMS, ENDS = "spread-c", "spread-a"


class SpreadInput(BaseModel):
    key: str
    n: int = Field(default=3, ge=1, le=100)


class SpreadJob(BaseModel):
    key: str
    i: int = 0


def _count(job: SpreadJob, ctx: JobContext, kind: str) -> LedgerResult:
    record = {"attempt": ctx.attempt, "t": time.time(), "pid": os.getpid(), "task_id": ctx.task_id, "i": job.i}
    ledger_client().rpush(f"test:ledger:{job.key}:{kind}", json.dumps(record))
    return LedgerResult(key=f"{job.key}:{kind}:{job.i}", attempt=ctx.attempt, pid=os.getpid())


@typed_task(
    "test.spread_item", kind="test-spread-item", payload=SpreadJob, result=LedgerResult, public=False, queue=ITEMS
)
def spread_item(job: SpreadJob, ctx: JobContext) -> LedgerResult:
    counted = _count(job, ctx, "item")
    if ledger_client().exists(f"test:flag:{job.key}:item:{job.i}"):
        raise PermanentError(f"item {job.i} is flagged to fail")
    return counted


@typed_task("test.spread_end", kind="test-spread-end", payload=SpreadJob, result=LedgerResult, public=False, queue=ENDS)
def spread_end(job: SpreadJob, ctx: JobContext) -> LedgerResult:
    return _count(job, ctx, "end")


spread = Flow("test_spread", SpreadInput)


@spread.step("top", run)
def top(order: SpreadInput) -> RunJob:
    return RunJob(key=order.key, ends="release")


@spread.step("items", spread_item, after=["top"], each=True)
def items(order: SpreadInput, top: RunResult) -> list[SpreadJob]:
    return [SpreadJob(key=order.key, i=i) for i in range(order.n)]


@spread.step("end", spread_end, after=["items"])
def end(order: SpreadInput, items: list[LedgerResult]) -> SpreadJob:
    return SpreadJob(key=order.key, i=len(items))


def crash_between_claim_and_enqueue(flow_id: str, claimed: list[str]) -> None:
    """SIGKILL this process when the ledger asks for it for this flow (once), with steps claimed and not queued."""
    if claimed and ledger_client().delete(f"test:crash-handoff:{flow_id}"):
        os.kill(os.getpid(), signal.SIGKILL)
