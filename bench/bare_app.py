"""The baseline: a bare Celery app with the same broker, serializer, acks and prefetch, and none of ours."""

from __future__ import annotations

import time
from typing import Any

from celery import Celery

from pipeline.config import get_settings
from pipeline.config.celery import celery_conf

conf = celery_conf(get_settings())
for key in ("worker_consumer", "task_routes", "task_queues"):
    conf.pop(key)
app = Celery("bare")
app.conf.update(conf, task_default_queue="bench-bare")


@app.task(name="bare.noop")
def noop(payload: dict[str, Any]) -> dict[str, Any]:
    return {"latency_s": time.time() - float(payload["sent_at"])}
