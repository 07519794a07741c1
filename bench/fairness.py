"""Fairness of groups: jobs of a second group enqueued behind one group's backlog, and what groups cost in drain.

    python -m bench fairness            (or `python -m bench.fairness [REPS] [BACKLOG]`)

A throwaway Redis (the one `python -m bench` starts). Each measurement: BACKLOG (20,000) no-op jobs of group
`big` are enqueued (`enqueue_many`), two solo workers of the pipeline start and drain them, and once they run,
PROBES (20) jobs of group `small` are enqueued, one every 10 ms. The probes' wait is their start minus their
enqueue (both on this host's clock); the drain rate is the backlog divided by the time between the first and the
last start, as the jobs recorded them. The plain run does the same with no group on any job: the probes wait
behind the backlog, as on any FIFO queue. Plain and grouped runs alternate; medians of the reps.
Not a test: nothing is asserted.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
from typing import Any

import redis

from bench.procs import ROOT, bench_env

KEY = "bench:fair"
BACKLOG = 20_000
PROBES = 20
WORKERS = 2

_apps: dict[str, Any] = {}


def _task() -> Any:
    """The no-op typed task `bench.fair`, registered once per process."""
    if "task" in _apps:
        return _apps["task"]
    from pydantic import BaseModel

    from pipeline.task import JobContext, typed_task

    class FairJob(BaseModel):
        probe: bool = False
        sent_at: float = 0.0

    class FairResult(BaseModel):
        ok: bool = True

    clients: dict[int, redis.Redis] = {}

    @typed_task("bench.fair", kind="bench-fair", payload=FairJob, result=FairResult, public=False)
    def fair(job: FairJob, ctx: JobContext) -> FairResult:
        pid = os.getpid()
        client = clients.get(pid) or clients.setdefault(pid, redis.Redis.from_url(os.environ["REDIS_URL"]))
        now = time.time()
        pipe = client.pipeline(transaction=False)
        pipe.setnx(f"{KEY}:first", now)
        pipe.set(f"{KEY}:last", now)
        pipe.incr(f"{KEY}:done")
        if job.probe:
            pipe.rpush(f"{KEY}:wait", now - job.sent_at)
        pipe.execute()
        return FairResult()

    _apps["task"] = fair
    return fair


def __getattr__(name: str) -> Any:
    """`app`: the pipeline's app with the no-op task (celery -A bench.fairness:app)."""
    if name != "app":
        raise AttributeError(name)
    if "app" not in _apps:
        from pipeline import app as pipeline_app

        _task()
        _apps["app"] = pipeline_app
    return _apps["app"]


def _once(url: str, grouped: bool, backlog: int) -> dict[str, float]:
    client = redis.Redis.from_url(url)
    client.flushdb()
    task = _task()
    group = "big" if grouped else None
    for start in range(0, backlog, 5000):
        task.enqueue_many([{} for _ in range(min(5000, backlog - start))], group=group)
    env = {**bench_env(url), "LOG_LEVEL": "WARNING"}
    argv = [sys.executable, "-m", "celery", "-A", "bench.fairness:app", "worker", "-P", "solo", "-l", "WARNING"]
    argv += ["--without-mingle", "--without-gossip", "-Q", task.queue]
    procs = [
        subprocess.Popen(
            [*argv, "-n", f"fair{i}@%h"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        for i in range(WORKERS)
    ]
    try:
        deadline = time.monotonic() + 60
        while int(client.get(f"{KEY}:done") or 0) < 200 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(PROBES):
            task.enqueue({"probe": True, "sent_at": time.time()}, group="small" if grouped else None)
            time.sleep(0.01)
        total = backlog + PROBES
        deadline = time.monotonic() + 600
        while int(client.get(f"{KEY}:done") or 0) < total and time.monotonic() < deadline:
            time.sleep(0.05)
        waits = sorted(float(w) for w in client.lrange(f"{KEY}:wait", 0, -1))
        first, last = float(client.get(f"{KEY}:first") or 0), float(client.get(f"{KEY}:last") or 0)
        return {
            "probe_wait_p50_ms": 1000 * statistics.median(waits),
            "probe_wait_max_ms": 1000 * max(waits),
            "drain_jobs_per_s": total / (last - first) if last > first else 0.0,
        }
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


def main(reps: int = 3, backlog: int = BACKLOG) -> dict[str, Any]:
    url = os.environ["REDIS_URL"]
    runs: dict[str, list[dict[str, float]]] = {"plain": [], "grouped": []}
    for rep in range(reps):
        for name in ("plain", "grouped") if rep % 2 == 0 else ("grouped", "plain"):
            runs[name].append(_once(url, name == "grouped", backlog))
            print(f"  rep {rep + 1} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    medians = {name: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for name, rs in runs.items()}
    ratio = medians["grouped"]["drain_jobs_per_s"] / medians["plain"]["drain_jobs_per_s"]
    print(f"fairness: {backlog:,} jobs of one group queued, then {PROBES} of another; {WORKERS} solo workers")
    print(f"{'':22}{'plain':>12}{'grouped':>12}")
    for k in ("probe_wait_p50_ms", "probe_wait_max_ms", "drain_jobs_per_s"):
        print(f"  {k:20}{medians['plain'][k]:12.1f}{medians['grouped'][k]:12.1f}")
    print(f"  drain grouped / plain: {ratio:.2f}x")
    result = {"backlog": backlog, "probes": PROBES, "reps": reps, "medians": medians, "drain_ratio": round(ratio, 3)}
    import json

    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main(*(int(a) for a in sys.argv[1:3]))
