"""One Celery-API client measurement in a process of its own; prints one JSON line.

    python -m bench.celery_client {stock|pipeline} N     N sequential `add.delay(1, 2).get()`, then N sequential
                                                        chains of five `add` steps, `.get()` on each

Start to finish of each call, in ms (the client's monotonic clock). `stock` imports only `bench.stock_app` (stock
Celery); `pipeline` imports `bench.pipeline_app` (plain `@app.task` on the pipeline's app).
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from typing import Any

from celery import chain

WARM_UP = 10
TIMEOUT_S = 30.0


def main(argv: list[str]) -> dict[str, Any]:
    system, count = argv[0], int(argv[1])
    if system == "stock":
        from bench.stock_app import add
    else:
        from bench.pipeline_app import add

    def one() -> None:
        assert add.delay(1, 2).get(timeout=TIMEOUT_S) == 3

    def five() -> None:
        steps = [add.s(1, 1), *(add.s(1) for _ in range(4))]
        assert chain(*steps).apply_async().get(timeout=TIMEOUT_S) == 6

    out: dict[str, Any] = {}
    for name, call in (("add", one), ("chain5", five)):
        for _ in range(WARM_UP):
            call()
        took = []
        for _ in range(count):
            start = time.perf_counter()
            call()
            took.append((time.perf_counter() - start) * 1000)
        out[name] = statistics.median(took)
    return out


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:])), flush=True)
