"""The worker's job request: a job cancelled because the broker connection dropped goes back to its queue.

With `worker_cancel_long_running_tasks_on_connection_loss` (set in `pipeline.config.celery`), Celery's
`Consumer.on_connection_error_after_connected` (`celery/worker/consumer/consumer.py`) terminates every running
late-acknowledged job with `request.cancel(self.pool)`, leaving its message unacknowledged so that it is
delivered again (`pipeline.runtime.transport` puts it back on its queue when the worker reconnects).

`Request.cancel` (`celery/worker/request.py`) then calls `_announce_cancelled`, which by default
(`emit_retry=True`) first stores a RETRY state through the result backend and only then marks the request
cancelled. With the broker's Redis also the result backend, that write happens while Redis is down:
`result_backend_always_retry` retries it for seconds, the worker's main loop is blocked meanwhile (the other
running jobs are not terminated yet and may finish into a dead connection, to be delivered and run again),
and once the retries give up the request is never marked cancelled, so the terminated child's failure is
taken for a revoke: `_announce_revoked` acknowledges the message and the job is lost.

`Consumer.cancel_active_requests` (the shutdown path, same file) already passes `emit_retry=False` for
late-acknowledged jobs, "since broker will handle redelivery"; this request does the same for every cancel of a
late-acknowledged job, and never acknowledges or dead-letters a job it cancelled: its message stays in the
broker's unacknowledged set and is put back on its queue. In a solo worker (the I/O profile), where a
cold shutdown's `cancel` runs inside the running job, the job is unwound with `WorkerTerminate` instead of
a kill the pool cannot do.
"""

from __future__ import annotations

import threading
from typing import Any

from celery.exceptions import WorkerTerminate
from celery.platforms import EX_OK
from celery.worker.request import Request as CeleryRequest

#: What `Task.Request` names: the worker's strategy resolves it per task (`celery/worker/strategy.py`).
REQUEST_CLASS = "pipeline.runtime.request:Request"


def _runs_jobs_in_this_thread(pool: Any) -> bool:
    """The solo pool: a job runs in the worker's main thread, where a cold shutdown's signal handler runs."""
    return type(pool).__module__ == "celery.concurrency.solo"


class Request(CeleryRequest):
    def cancel(self, pool: Any, signal: Any = None, emit_retry: bool = True) -> None:
        if self.task.acks_late:
            emit_retry = False  # no backend write while the broker is away; its message comes back instead
        if (
            self.time_start
            and _runs_jobs_in_this_thread(pool)
            and threading.current_thread() is threading.main_thread()
        ):
            # Celery would ask the pool to kill the job, which the solo pool cannot (NotImplementedError, raised
            # in the job: a failure, dead-lettered). The job is running below this very call: unwind it without
            # a failure, as a killed child would be; its unacknowledged message is put back when the worker
            # closes its connection.
            self._announce_cancelled(emit_retry=False)  # type: ignore[attr-defined]  # Celery's own; not in celery-types
            raise WorkerTerminate(EX_OK)
        super().cancel(pool, signal, emit_retry=emit_retry)

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> None:
        if getattr(self, "_already_cancelled", False) and self.task.acks_late:
            # The child died of our cancel (Terminated, SystemExit or a lost worker alike): not a failure, not a
            # revoke. Leave the message unacknowledged; it is delivered again.
            return
        super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)
