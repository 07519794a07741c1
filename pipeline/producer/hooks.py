"""Whether anything watches Celery's publishes; if something does, jobs are built by Celery itself.

A templated message (`pipeline.producer.template`) skips `apply_async`, so it skips what hooks into it: the
`before_task_publish` / `after_task_publish` signals and Sentry's Celery integration (which wraps
`apply_async` to add its trace headers). While any such hook is present in the process, `pipeline.producer`
builds each job through Celery and captures it instead (the same one round trip, more CPU), so the hook sees
every job. The pipeline's own receiver (it only stamps `pipeline_published_at`, which the template carries)
is marked with `publish_safe` and does not count.

The receivers are read from the signal's public `receivers` list (each entry a lookup key and the receiver or a
weak reference to it), all of them whatever sender they were connected for: a receiver connected for one task
only makes every job go through Celery, which is slower, never wrong.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
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
        if any(not getattr(r, _SAFE, False) for r in _connected(signal)):
            return True
    return _sentry_traces_celery()


def _connected(signal: Any) -> Iterator[Any]:
    """Every receiver connected to `signal` and still alive (a weakly referenced one may have been collected)."""
    for _, receiver in list(signal.receivers):
        target = receiver() if isinstance(receiver, weakref.ReferenceType) else receiver
        if target is not None:
            yield target


def _sentry_traces_celery() -> bool:
    import sys

    if "sentry_sdk" not in sys.modules:  # never initialised in this process
        return False
    import sentry_sdk
    from sentry_sdk.integrations.celery import CeleryIntegration

    client = sentry_sdk.get_client()
    return bool(client.is_active() and client.get_integration(CeleryIntegration) is not None)
