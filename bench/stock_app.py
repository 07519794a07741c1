"""The baseline: stock Celery with its default settings, given only the broker and result backend URLs.

Nothing of the pipeline is imported here (no settings, no signal handlers, no transport), and it runs in
processes of its own: `celery -A bench.stock_app worker ...` and `python -m bench.producer stock ...`.
"""

from __future__ import annotations

import os
from typing import Any

from celery import Celery

from bench import job

URL = os.environ.get("BENCH_REDIS_URL", "redis://127.0.0.1:6379/0")
app = Celery("stock", broker=URL, backend=URL)


@app.task(name="stock.noop")
def noop(payload: dict[str, Any]) -> None:
    job.record(payload["run"], payload.get("sent_at"))
