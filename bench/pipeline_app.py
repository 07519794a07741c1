"""The pipeline app plus the benchmark's no-op as a typed task: validation, records, signals, DLQ hooks and
metrics all on, no work. Its jobs go to their own queue, `bench-pipeline`.

    celery -A bench.pipeline_app worker -Q bench-pipeline -P prefork -c 2 --loglevel WARNING
"""

from __future__ import annotations

from pydantic import BaseModel

from bench import job
from pipeline import app
from pipeline.task import JobContext, typed_task

__all__ = ["QUEUE", "add", "app", "noop"]

QUEUE = "bench-pipeline"


class NoopJob(BaseModel):
    run: str
    sent_at: float | None = None


class NoopResult(BaseModel):
    ok: bool = True


@typed_task("bench.noop", kind="bench-noop", payload=NoopJob, result=NoopResult, public=False, queue=QUEUE)
def noop(payload: NoopJob, ctx: JobContext) -> NoopResult:
    job.record(payload.run, payload.sent_at)
    return NoopResult()


@app.task(name="bench.add", queue=QUEUE)
def add(x: int, y: int) -> int:
    """A Celery tutorial's task, plain `@app.task` on the pipeline's app (`bench.celery_api`)."""
    return x + y
