"""One producer measurement in a process of its own; prints one JSON line.

    python -m bench.producer {stock|pipeline} single N RUN     N sequential one-job calls (delay / enqueue)
    python -m bench.producer {stock|pipeline} bulk N RUN       one multi-job call (group / enqueue_many)
    python -m bench.producer {stock|pipeline} batches N SIZE RUN   N sequential multi-job calls of SIZE jobs each
    python -m bench.producer {stock|pipeline} paced RATE SECONDS RUN   one-job calls at a fixed rate, each
                                                               carrying its enqueue time (start latency)

`stock` imports only `bench.stock_app` (stock Celery); `pipeline` imports `bench.pipeline_app`.
"""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Callable
from typing import Any

from bench import job

WARM_UP = 20


def _senders(system: str) -> tuple[Callable[[dict[str, Any]], Any], Callable[[list[dict[str, Any]]], Any]]:
    if system == "stock":
        from celery import group

        from bench.stock_app import noop

        return noop.delay, lambda payloads: group(noop.s(p) for p in payloads).apply_async()
    from bench.pipeline_app import noop as typed

    return typed.enqueue, typed.enqueue_many


def main(argv: list[str]) -> dict[str, Any]:
    system, mode, *rest = argv
    one, many = _senders(system)
    for _ in range(WARM_UP):  # connections, queue declaration, templates: not measured
        one(job.payload("warm-up"))
    many([job.payload("warm-up")] * WARM_UP)
    if mode == "single":
        count, run = int(rest[0]), rest[1]
        began = time.perf_counter()
        for _ in range(count):
            one(job.payload(run))
        return {"jobs": count, "seconds": time.perf_counter() - began}
    if mode == "bulk":
        count, run = int(rest[0]), rest[1]
        began = time.perf_counter()
        many([job.payload(run) for _ in range(count)])
        return {"jobs": count, "seconds": time.perf_counter() - began}
    if mode == "batches":
        count, size, run = int(rest[0]), int(rest[1]), rest[2]
        batch = [job.payload(run) for _ in range(size)]
        began = time.perf_counter()
        for _ in range(count):
            many(batch)
        return {"jobs": count * size, "calls": count, "seconds": time.perf_counter() - began}
    if mode == "paced":
        rate, seconds, run = float(rest[0]), float(rest[1]), rest[2]
        count = int(rate * seconds)
        next_at = time.monotonic()
        late = 0
        for _ in range(count):
            one(job.payload(run, time.time()))
            next_at += 1 / rate
            pause = next_at - time.monotonic()
            if pause > 0:
                time.sleep(pause)
            else:
                late += 1
        return {"jobs": count, "late_sends": late}
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
