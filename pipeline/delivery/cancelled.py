"""A cancelled job's message met by the fetch: dropped unrun, counted, logged.

`pipeline.control.cancel` writes the job's tombstone (`pipeline:cancel:<id>`); the fetch script acknowledges a
message whose tombstone is set as it pops it (no lease, nothing held: `fetch.lua`) and returns it as kind
CANCELLED. Its state (`cancelled`, Celery's REVOKED) was stored by the cancel itself; here it is only counted in
`pipeline_tasks_total{outcome="cancelled"}` and logged.
"""

from __future__ import annotations

import json
import logging

from pipeline.celery_app import get_app
from pipeline.observability import metrics

log = logging.getLogger(__name__)


def dropped(item: bytes, queue: str) -> None:
    """Count and log the cancelled job whose message `item` the fetch took from `queue`."""
    try:
        headers = json.loads(item).get("headers") or {}
    except (ValueError, AttributeError):
        headers = {}
    name = headers.get("task")
    task = str(name) if name in get_app().tasks else metrics.UNREGISTERED  # a bounded label set
    metrics.child(metrics.tasks, task, queue, "cancelled").inc()
    log.info("job %s[%s] was cancelled: dropped unrun", task, headers.get("id"))
