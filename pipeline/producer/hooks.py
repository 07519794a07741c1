"""Whether anything watches Celery's publishes; if something does, jobs are built by Celery itself.

A templated message (`pipeline.producer.template`) skips `apply_async`, so it skips what hooks into it: the
`before_task_publish` / `after_task_publish` signals and Sentry's Celery integration (which wraps
`apply_async` to add its trace headers). While any such hook is present in the process, `pipeline.producer`
builds each job through Celery and captures it instead (the same one round trip, more CPU), so the hook sees
every job. The pipeline's own receiver (it only stamps `pipeline_published_at`, which the template carries)
is marked with `publish_safe` and does not count.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from celery import signals

F = TypeVar("F", bound=Callable[..., Any])

_SAFE = "__pipeline_publish_safe__"


def publish_safe(receiver: F) -> F:
    """Mark a publish-signal receiver that templated messages may skip (kept by `functools.wraps`)."""
    setattr(receiver, _SAFE, True)
    return receiver


def publish_hooked() -> bool:
    """True when a publish signal has a receiver not marked `publish_safe`, or Sentry traces Celery."""
    watched: tuple[Any, ...] = (signals.before_task_publish, signals.after_task_publish)
    for signal in watched:
        if any(not getattr(r, _SAFE, False) for r in signal._live_receivers(None)):
            return True
    return _sentry_traces_celery()


def _sentry_traces_celery() -> bool:
    import sys

    if "sentry_sdk" not in sys.modules:  # never initialised in this process
        return False
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration

    client = sentry_sdk.get_client()
    return bool(client.is_active() and client.get_integration(CeleryIntegration) is not None)
