"""Shutdown signals in an asyncio-pool worker: handled only outside every job and outside the asyncio loop's iteration.

The worker's main thread runs every job's trace (in its greenlet) and steps the asyncio loop (`pipeline.runtime.
asyncpool`); under load that is most of its time, so that is where a SIGTERM usually lands. Celery's handler (the soft
shutdown, its cancels, the pool's stop) must not run there: the drain cannot step a loop that is running, nor go on
with other jobs from inside one job's greenlet, and closing the loop from there ends every job under it. `Deferred`
wraps the handlers Celery installs for SIGTERM, SIGQUIT and SIGINT (`Worker.install_platform_tweaks`): a signal that
lands inside waits in a queue, and the pool runs it as soon as the main thread is outside again (at the end of its
`run_once` or of a job's start): within one loop iteration or one trace step.
"""

from __future__ import annotations

import collections
from collections.abc import Callable
from typing import Any

from celery import platforms

#: The shutdown signals whose handlers are wrapped.
SIGNALS = ("SIGTERM", "SIGQUIT", "SIGINT")

Handler = Callable[[int, Any], Any]


class Deferred:
    """The handlers of one worker's shutdown signals, deferred while `inside()` says the main thread is in a job or in
    the loop's iteration."""

    def __init__(self, inside: Callable[[], bool]) -> None:
        self.inside = inside
        self.pending: collections.deque[tuple[Handler, int, Any]] = collections.deque()

    def install(self) -> None:
        """Wrap the handlers installed now for SIGNALS (Celery's, after `install_platform_tweaks`)."""
        for name in SIGNALS:
            handler = platforms.signals[name]
            if callable(handler):
                platforms.signals[name] = self.wrap(handler)

    def wrap(self, handler: Handler) -> Handler:
        def handle(signum: int, frame: Any) -> None:
            if self.inside():
                self.pending.append((handler, signum, frame))  # run by `deliver` once outside
            else:
                handler(signum, frame)

        return handle

    def deliver(self) -> None:
        """From the main thread: run the handlers of the signals that landed inside, if it is outside now."""
        while self.pending and not self.inside():
            handler, signum, frame = self.pending.popleft()
            handler(signum, frame)
