"""What a step inside a flow costs against the same task as a plain job, and a 1,000-way fan-out with its join.

    python -m bench flows            (also run by `make bench`; or `python -m bench.flows [REPS] [N]` on REDIS_URL)

The task is the benchmark's no-op (`bench.noop`: one Redis round trip, `bench/job.py`) on both sides. Plain: N jobs
queued by `enqueue_many`. Flow: one flow (`bench_fan`) whose first step is a fan-out of N `bench.noop` items, then a
join (one more `bench.noop`): each item runs as any step with a step after it does, `flow_begin.lua` before the job
and `flow_advance.lua` after it (recording its result, offering the join's message). That is the cost measured. N
one-step flows would leave the advance nothing to offer (no step after them), and a chain of N steps runs one job at
a time: neither is a drain. Both sides: the same worker command line, started once the N jobs are queued; the rate
is N / (last start - first start) as the jobs recorded them, as in `bench.compare`'s drain (worker boot excluded).
Plain and flow runs alternate; medians of the reps.

Then, on warm workers (the same command line): a 1,000-way fan-out and its join from `start()` to the join's advance
(the flow's `created` and `finished`), and for scale 1,000 plain jobs from `enqueue_many()` to the last one's start.
Not a test: nothing is asserted.

The worker is `bench.compare`'s drain worker on this module's app (which declares the flow); BENCH_FLOWS_WORKER
replaces the command line on both sides (`... -P solo`, say):

    celery -A bench.flows worker -Q bench-pipeline -P prefork -c 2 --loglevel WARNING
"""

from __future__ import annotations

import json
import os
import shlex
import statistics
import sys
import time
import uuid
from typing import Any

import redis
from pydantic import BaseModel, Field

from bench import job
from bench.pipeline_app import NoopJob, NoopResult, app, noop
from bench.procs import Workers, bench_env
from pipeline.flows import Flow, start

__all__ = ["app", "fan"]

WORKER = "celery -A bench.flows worker -Q bench-pipeline -P prefork -c 2 --loglevel WARNING"
DRAIN_JOBS = 5000
FAN_OUT = 1000
TARGET = 0.8


class FanOrder(BaseModel):
    run: str
    n: int = Field(ge=1, le=100_000)


fan = Flow("bench_fan", FanOrder)


@fan.step("items", noop, each=True)
def items(order: FanOrder) -> list[NoopJob]:
    return [NoopJob(run=order.run)] * order.n


@fan.step("join", noop, after=["items"])
def join(order: FanOrder, items: list[NoopResult]) -> NoopJob:
    return NoopJob(run=f"{order.run}-join")


def _run() -> str:
    return uuid.uuid4().hex[:12]


def _wait(client: redis.Redis, run: str, count: int, workers: Workers, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while int(client.get(job.keys(run)["done"]) or 0) < count:
        workers.check()
        if time.monotonic() > deadline:
            raise TimeoutError(f"{run}: {client.get(job.keys(run)['done'])!r} of {count} jobs done")
        time.sleep(0.02)


def _rate(client: redis.Redis, run: str, count: int) -> float:
    k = job.keys(run)
    first, last = (float(v) for v in client.mget(k["first"], k["last"]))
    return count / (last - first)


def _queue(kind: str, run: str, n: int) -> str | None:
    """N plain jobs, or one flow of N items; the flow's id."""
    if kind == "flow":
        return start(fan, FanOrder(run=run, n=n))
    for at in range(0, n, 5000):
        noop.enqueue_many([NoopJob(run=run) for _ in range(min(5000, n - at))])
    return None


def _finished(client: redis.Redis, flow_id: str, timeout: float = 30) -> tuple[float, float]:
    """When the flow was created and when it finished (its join's advance), once it has."""
    deadline = time.monotonic() + timeout
    while True:
        created, finished = client.hmget(f"pipeline:flow:{{{flow_id}}}", ["created", "finished"])
        if finished is not None:
            return float(created), float(finished)
        if time.monotonic() > deadline:
            raise TimeoutError(f"flow {flow_id} did not finish")
        time.sleep(0.005)


def _drain(client: redis.Redis, env: dict[str, str], kind: str, n: int) -> float:
    client.flushdb()
    run = _run()
    flow_id = _queue(kind, run, n)
    workers = Workers([_argv()], env).start()
    try:
        _wait(client, run, n, workers)
        if flow_id is not None:
            _wait(client, f"{run}-join", 1, workers)
            _finished(client, flow_id)
    finally:
        workers.stop()
    return _rate(client, run, n)


def _fan_out(client: redis.Redis, env: dict[str, str], n: int) -> dict[str, float]:
    """On warm workers: n plain jobs, enqueue to last start; a flow of n items and its join, start to finish."""
    client.flushdb()
    workers = Workers([_argv()], env).start()
    try:
        warm = _run()
        _queue("flow", warm, 50)
        _wait(client, f"{warm}-join", 1, workers)
        plain = _run()
        began = time.time()
        _queue("plain", plain, n)
        _wait(client, plain, n, workers)
        plain_s = float(client.get(job.keys(plain)["last"]) or 0) - began
        run = _run()
        flow_id = _queue("flow", run, n) or ""
        _wait(client, f"{run}-join", 1, workers)
        created, finished = _finished(client, flow_id)
    finally:
        workers.stop()
    return {"flow_s": finished - created, "flow_jobs_per_s": (n + 1) / (finished - created), "plain_s": plain_s}


def _argv() -> list[str]:
    argv = shlex.split(os.environ.get("BENCH_FLOWS_WORKER") or WORKER)
    if argv[0] == "celery":  # the venv's, whatever PATH says
        argv[0] = os.path.join(os.path.dirname(sys.executable), "celery")
    return argv


def main(reps: int = 3, n: int = DRAIN_JOBS) -> dict[str, Any]:
    url = os.environ["REDIS_URL"]
    client = redis.Redis.from_url(url)
    env = bench_env(url)
    rates: dict[str, list[float]] = {"plain": [], "flow": []}
    fans: list[dict[str, float]] = []
    for rep in range(reps):
        for kind in ("plain", "flow") if rep % 2 == 0 else ("flow", "plain"):
            rates[kind].append(_drain(client, env, kind, n))
            print(f"  rep {rep + 1} drain {kind}: {rates[kind][-1]:,.0f} jobs/s", file=sys.stderr, flush=True)
        fans.append(_fan_out(client, env, FAN_OUT))
        print(f"  rep {rep + 1} fan-out: {fans[-1]}", file=sys.stderr, flush=True)
    plain, flow = statistics.median(rates["plain"]), statistics.median(rates["flow"])
    fan_med = {k: statistics.median(f[k] for f in fans) for k in fans[0]}
    ratio = flow / plain
    print(f"flows: {n:,} bench.noop jobs, plain vs as the items of one fan-out; worker: {' '.join(_argv()[1:])}")
    print(f"  drain, plain jobs        {plain:10,.0f} jobs/s")
    print(f"  drain, fan-out items     {flow:10,.0f} jobs/s   {ratio:.2f}x plain (target >= {TARGET})")
    print(
        f"  {FAN_OUT:,}-way fan-out + join, start to the join's end: {1000 * fan_med['flow_s']:,.0f} ms "
        f"({fan_med['flow_jobs_per_s']:,.0f} jobs/s); {FAN_OUT:,} plain jobs, enqueue to last start: "
        f"{1000 * fan_med['plain_s']:,.0f} ms"
    )
    result = {
        "jobs": n,
        "reps": reps,
        "drain": {"plain": plain, "flow": flow, "ratio": round(ratio, 3), "all": rates},
        "fan_out": {"width": FAN_OUT, **fan_med, "all": fans},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
