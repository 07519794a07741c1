"""The typed path's cost: no-op jobs through the pipeline versus a bare Celery app, same broker/pool/concurrency.

Figures (each the median of RUNS runs): enqueue rate (jobs/s, producer only), drain rate (jobs/s with the
queue pre-filled), and enqueue-to-start latency p50/p99 at a steady moderate rate on an idle worker.
Targets for the pipeline: throughput ratio >= 0.90 of bare Celery, p99 latency < 5 ms.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery.result import AsyncResult

from bench.procs import Worker

RUNS = 3
DRAIN_JOBS = 2000
ENQUEUE_JOBS = 2000
LATENCY_JOBS = 300
LATENCY_RATE = 100.0  # jobs/s
CONCURRENCY = 2


@dataclass
class Path:
    name: str
    app_module: str
    queue: str
    send: Callable[[dict[str, Any]], str]
    app: Any


def paths() -> list[Path]:
    from bench import bare_app, pipeline_app

    return [
        Path(
            "bare celery",
            "bench.bare_app",
            "bench-bare",
            lambda p: str(bare_app.noop.apply_async((p,)).id),
            bare_app.app,
        ),
        Path("pipeline", "bench.pipeline_app", "bench-pipeline", pipeline_app.noop.enqueue, pipeline_app.app),
    ]


def _wait_done(path: Path, ids: list[str], timeout: float = 300) -> float:
    backend = path.app.backend
    keys = [backend.get_key_for_task(i) for i in ids]
    client = backend.client
    deadline = time.monotonic() + timeout
    while client.exists(*keys) < len(keys):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path.name}: jobs did not finish")
        time.sleep(0.02)
    return time.monotonic()


def enqueue_rate(path: Path) -> float:
    began = time.perf_counter()
    for _ in range(ENQUEUE_JOBS):
        path.send({"sent_at": time.time()})
    rate = ENQUEUE_JOBS / (time.perf_counter() - began)
    path.app.backend.client.delete(path.queue)
    return rate


def drain_rate(path: Path) -> float:
    ids = [path.send({"sent_at": time.time()}) for _ in range(DRAIN_JOBS)]
    worker = Worker(path.app_module, path.queue, CONCURRENCY)
    try:
        ready = worker.start()
        finished = _wait_done(path, ids)
    finally:
        worker.stop()
    return DRAIN_JOBS / (finished - ready)


def latency(path: Path) -> tuple[float, float]:
    worker = Worker(path.app_module, path.queue, CONCURRENCY)
    try:
        worker.start()
        ids = []
        interval = 1.0 / LATENCY_RATE
        next_at = time.monotonic()
        for _ in range(LATENCY_JOBS):
            next_at += interval
            ids.append(path.send({"sent_at": time.time()}))
            time.sleep(max(0.0, next_at - time.monotonic()))
        _wait_done(path, ids)
        values = sorted(AsyncResult(i, app=path.app).get(timeout=10)["latency_s"] * 1000 for i in ids)
    finally:
        worker.stop()
    return values[len(values) // 2], values[int(len(values) * 0.99) - 1]


def main() -> None:
    figures: dict[str, dict[str, float]] = {}
    for path in paths():
        enq, drain, p50, p99 = [], [], [], []
        for run in range(RUNS):
            print(f"  {path.name}: run {run + 1}/{RUNS}", flush=True)
            enq.append(enqueue_rate(path))
            drain.append(drain_rate(path))
            lat = latency(path)
            p50.append(lat[0])
            p99.append(lat[1])
        figures[path.name] = {
            "enqueue": statistics.median(enq),
            "drain": statistics.median(drain),
            "p50": statistics.median(p50),
            "p99": statistics.median(p99),
        }
    bare, ours = figures["bare celery"], figures["pipeline"]
    print(f"\nno-op jobs, prefork concurrency {CONCURRENCY}, median of {RUNS} runs")
    print(f"{'':28}{'bare celery':>14}{'pipeline':>14}{'ratio':>9}")
    for key, label, unit in (
        ("enqueue", "enqueue rate", "jobs/s"),
        ("drain", "drain rate", "jobs/s"),
        ("p50", "enqueue→start p50", "ms"),
        ("p99", "enqueue→start p99", "ms"),
    ):
        print(f"{label + ' (' + unit + ')':28}{bare[key]:>14.1f}{ours[key]:>14.1f}{ours[key] / bare[key]:>9.2f}")
    print("targets: throughput ratios >= 0.90; pipeline p99 < 5 ms on an idle worker")
