"""pipeline: typed Celery tasks on Redis with retries, a dead-letter queue, schedules and operations.

`celery -A pipeline worker|beat|flower` finds the application here: `pipeline.app` is built on first
access (settings read and validated then, never at import) with the worker's runtime installed
(`pipeline.runtime`). Producers use `pipeline.celery_app.get_app()`, or simply a task's `enqueue()`.
"""

from __future__ import annotations

from typing import Any

__all__ = ["app"]


def __getattr__(name: str) -> Any:
    if name == "app":
        from pipeline.runtime import worker_app  # the entry point of `celery -A pipeline`: the top of the graph

        return worker_app()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
