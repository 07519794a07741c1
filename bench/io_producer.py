"""Enqueue the webhook jobs of `bench.io_concurrency`, in a process of its own; print one JSON line.

    python -m bench.io_producer pipeline|stock N ENDPOINT

pipeline: `tasks.webhooks.enqueue_many` (the typed producer, its settings from the environment); stock:
`stock.webhook.delay()` once per job (bench/stock_app.py). Job i POSTs to ENDPOINT/hooks/i. The BullMQ side has
its own producer (bench/node/bullmq_io.cjs).
"""

from __future__ import annotations

import json
import sys
import time
from typing import Any

EVENT = "record.synced"


def jobs(n: int, endpoint: str) -> list[dict[str, Any]]:
    return [
        {"url": f"{endpoint}/hooks/{i}", "event": EVENT, "payload": {"id": i, "status": "synced"}} for i in range(n)
    ]


def main(system: str, n: int, endpoint: str) -> dict[str, Any]:
    batch = jobs(n, endpoint)
    started = time.perf_counter()
    if system == "pipeline":
        from tasks import webhooks

        webhooks.enqueue_many(batch)
    elif system == "stock":
        from bench.stock_app import webhook

        for payload in batch:
            webhook.delay(payload)
    else:
        raise SystemExit(f"unknown system {system!r}")
    return {"jobs": n, "seconds": time.perf_counter() - started}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), sys.argv[3])), flush=True)
