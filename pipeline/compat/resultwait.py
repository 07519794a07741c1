"""`AsyncResult.get()` raising a failed parent's error, not its own, also when its own result is final at once.

`AsyncResult.get()` of a result with parents (a chord's header, a chain's earlier steps) raises the first failure
of the canvas: it reads the parents (`_maybe_reraise_parent_error`) before it waits, and after each wait, as the
wait loop's `on_interval`. A chord whose header task failed thus raises the header task's error, not the
`ChordError` Celery stores on the body for it. The worker stores the header task's FAILURE before that `ChordError`
(`tests/integration/test_chord_errors.py`), but a client can read in between: its first read of the header sees it
unfinished, the worker then stores both, and the client reads the body.

Celery up to 5.6 ran `on_interval` after each wait, the first included (`Drainer.drain_events_until`); 5.7 waits
`while not p.ready`, so a result found final by its first read (`on_wait_for_pending`) runs no wait and no check,
and `get()` raises the body's `ChordError`. `_wait_for_pending` here (the result backend's, mixed into the classes of
`pipeline.compat.results`) runs `on_interval` once when Celery's loop ran no wait: one read of the parents, only when
the result was final at once.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from pipeline import compat


class ParentsReadAfterWait:
    """`_wait_for_pending` reading the parents once when the result was final at once (mixed into a Celery backend
    with `AsyncBackendMixin`)."""

    def _wait_for_pending(
        self: Any,
        result: Any,
        timeout: float | None = None,
        on_interval: Callable[[], Any] | None = None,
        on_message: Callable[..., Any] | None = None,
        **kwargs: Any,
    ) -> Iterator[Any]:
        steps = super()._wait_for_pending(  # type: ignore[misc]  # the Celery backend it is mixed into
            result, timeout=timeout, on_interval=on_interval, on_message=on_message, **kwargs
        )
        if not compat.enabled(__name__):
            yield from steps
            return
        waited = False
        for step in steps:
            waited = True
            yield step
        if not waited and on_interval:
            on_interval()
