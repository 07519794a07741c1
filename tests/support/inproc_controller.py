"""The embedded worker's controller: Celery's test controller plus the signals `celery worker` sends.

`celery worker` (`celery.apps.worker.Worker`) sends `celeryd_init` before it starts and `worker_ready` once
it consumes, and `worker_shutdown` when it stops; the worker's runtime hangs Sentry, the dead-letter set-up
and the delayed-job releaser on them. Celery's embedded controller is a bare `WorkController`: it sends
neither of the first two, and `worker_shutdown` only on a warm stop, while the embedded worker stops cold.
Imported only when an embedded worker starts.
"""

from __future__ import annotations

from typing import Any

from celery import signals
from celery.contrib.testing.worker import TestWorkController


class Controller(TestWorkController):
    def on_before_init(self, **kwargs: Any) -> None:
        super().on_before_init(**kwargs)
        signals.celeryd_init.send(sender=self.hostname, instance=self, conf=self.app.conf, options=kwargs)

    def on_consumer_ready(self, consumer: Any) -> None:
        signals.worker_ready.send(sender=consumer)
        super().on_consumer_ready(consumer)

    def terminate(self, in_sighandler: bool = False) -> None:
        """The embedded worker stops cold; `worker_shutdown` still stops what `worker_ready` started."""
        super().terminate(in_sighandler)
        self._send_worker_shutdown()
