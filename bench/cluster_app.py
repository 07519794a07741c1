"""The pipeline app plus the cluster benchmark's no-op (`bench.job`) as three typed tasks, one per queue. The queues'
names hash to slots in the three even thirds of the slot space, so on a 3-master cluster each lives on a master of
its own, and on a 1-master cluster all three share it.

    celery -A bench.cluster_app worker -Q bench-cluster-0,bench-cluster-1,bench-cluster-2 -P prefork -c 2
    python -m bench.cluster_app N RUN        enqueue N jobs, spread evenly over the queues (enqueue_many each)
"""

from __future__ import annotations

import json
import sys
import time

from pydantic import BaseModel

from bench import job
from bench.cluster import QUEUES
from pipeline import app
from pipeline.task import JobContext, TypedTask, typed_task

__all__ = ["QUEUES", "app", "noops"]


class NoopJob(BaseModel):
    run: str


class NoopResult(BaseModel):
    ok: bool = True


def _noop(payload: NoopJob, ctx: JobContext) -> NoopResult:
    job.record(payload.run, None)
    return NoopResult()


def _typed(queue: str) -> TypedTask[NoopJob, NoopResult]:
    name = f"bench.cluster_noop_{queue.rsplit('-', 1)[1]}"
    return typed_task(name, kind=name, payload=NoopJob, result=NoopResult, public=False, queue=queue)(_noop)


noops = [_typed(queue) for queue in QUEUES]


def main(argv: list[str]) -> dict[str, float]:
    count, run = int(argv[0]), argv[1]
    began = time.perf_counter()
    for i, typed in enumerate(noops):
        typed.enqueue_many([job.payload(run) for _ in range(count // len(noops) + (i < count % len(noops)))])
    return {"jobs": count, "seconds": time.perf_counter() - began}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
