"""Typed tasks of the pipeline (`typed_task`, run by `PipelineTask`) for our canvas checks (`suite_pools`).

`suite.double` is `async def`: the asyncio pool awaits it on its event loop, other pools on a loop of their own
(`pipeline.pools.aio`). `suite.square` is a plain typed task. Both take and return a `Number`, so each step's result is
the next step's payload. `suite.total` (a plain Celery task) sums a chord header's results.
"""

from __future__ import annotations

import asyncio
from typing import Any

from celery import shared_task
from pydantic import BaseModel

from pipeline.task import JobContext, typed_task


class Number(BaseModel):
    value: int


@typed_task("suite.double", payload=Number, result=Number, public=False)
async def double(job: Number, ctx: JobContext) -> Number:
    await asyncio.sleep(0.01)  # yields to the loop: other jobs run meanwhile on the asyncio pool
    return Number(value=job.value * 2)


@typed_task("suite.square", payload=Number, result=Number, public=False)
def square(job: Number, ctx: JobContext) -> Number:
    return Number(value=job.value * job.value)


@shared_task(name="suite.total")
def total(results: list[dict[str, Any]]) -> int:
    return sum(int(result["value"]) for result in results)
