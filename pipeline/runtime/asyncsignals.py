"""Shutdown signals in an asyncio-pool worker: handled at a safe point of the pool's, never where they land.

The worker's main thread runs every job's trace (in its greenlet) and steps the asyncio loop (`pipeline.runtime.
asyncpool`); under load that is most of its time, so that is where a SIGTERM usually lands. Celery's handler (the soft
shutdown, its cancels, the pool's stop) must not run there: the drain cannot step a loop that is running, nor go on
with other jobs from inside one job's greenlet or from the middle of the pool's bookkeeping, and code interrupted
there may hold a lock (a lease's, the hub's ready queue) that the drain's acknowledgements take again. `Deferred`
wraps the handlers Celery installs for SIGTERM, SIGQUIT and SIGINT (`Worker.install_platform_tweaks`): while async
jobs are in flight a signal waits in a queue, the loop is woken (`nudge`: a write to its self-pipe), and the pool runs
the handler at the end of its next `run_once`, which the hub calls from its own dispatch: within one loop iteration.
With none in flight the handler runs at once, as Celery's does.
"""

from __future__ import annotations

import collections
import signal
from collections.abc import Callable
from typing import Any

from celery import platforms

#: The shutdown signals whose handlers are wrapped.
SIGNALS = ("SIGTERM", "SIGQUIT", "SIGINT")

Handler = Callable[[int, Any], Any]


class Deferred:
    """The handlers of one worker's shutdown signals, deferred while `busy()` (async jobs in flight)."""

    def __init__(self, busy: Callable[[], bool], nudge: Callable[[], None]) -> None:
        self.busy = busy
        self.nudge = nudge
        self.pending: collections.deque[tuple[Handler, Handler, int, Any]] = collections.deque()

    def install(self) -> None:
        """Wrap the handlers installed now for SIGNALS (Celery's, after `install_platform_tweaks`)."""
        for name in SIGNALS:
            handler = platforms.signals[name]
            if callable(handler):
                platforms.signals[name] = self.wrap(handler)

    def wrap(self, handler: Handler) -> Handler:
        def handle(signum: int, frame: Any) -> None:
            if not self.busy():
                handler(signum, frame)
            elif all(pending[2] != signum for pending in self.pending):  # the same signal twice is one request
                self.pending.append((handle, handler, signum, frame))  # run by `deliver` once outside
                self.nudge()  # soon, even when nothing else wakes the pool

        return handle

    def deliver(self) -> None:
        """At the pool's safe point (the end of `run_once`): run the handlers of the signals that waited. A handler
        that replaced itself meanwhile (a soft shutdown ignores a second SIGTERM) is not run again: the signal's
        current handler is."""
        while self.pending:
            wrapper, handler, signum, frame = self.pending.popleft()
            current = signal.getsignal(signum)
            (handler if current is wrapper or not callable(current) else current)(signum, frame)
