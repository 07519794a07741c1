"""Cancelling a job: waiting, scheduled, retrying or running, it ends `cancelled` and never runs (again).

`cancel(task_id)` refuses an id nobody accepted (`JobNotFound`) and a job that has finished (`JobFinished`:
succeeded, failed, dead-lettered or cancelled already). Otherwise, in one script on the broker (`cancel.lua`):

* a parked delayed job (a countdown, an ETA, a long retry: `pipeline.publish`) is taken out of `pipeline:delayed`;
* the job's tombstone `pipeline:cancel:<id>` is written (on a Redis Cluster both are the job's queue's keys, in its
  slot: the queue comes from the job's status, whichever queue it is, and a job whose queue is unknown gets one on
  every work queue), for RESULT_EXPIRES: a worker's fetch acknowledges the job's message as it pops it and drops it
  unrun (`fetch.lua`, `pipeline.delivery.cancelled`), a waiting job and the next attempt of a retrying one alike;
* its id is PUBLISHed on `pipeline:cancel`: the worker holding the job (prefetched, a retry's countdown in its
  timer, or running) drops it, or stops it within a second (`pipeline.runtime.cancels`).

Then its final state is stored in the result backend: Celery's REVOKED, which every reader shows as `cancelled`
(`pipeline.status`). The store keeps a REVOKED as it keeps a SUCCESS (`store.lua`), so a job cancelled while it ran
never turns into `succeeded`; a job whose SUCCESS was stored first stays succeeded, and the cancel says it had
finished. Nothing is dead-lettered. With REDIS_WAIT_REPLICAS the script's write is confirmed by the replicas, or the
cancel fails (`NotReplicated`) and may be repeated: cancelling twice is harmless until the state is stored.
"""

from __future__ import annotations

import logging

from pipeline.broker import broker_redis, check_replicas, run_script_waited
from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import CANCEL_CHANNEL
from pipeline.observability import metrics
from pipeline.queues import keys
from pipeline.queues.routed import routed_queues
from pipeline.status import JobState, JobStatus, job_status

log = logging.getLogger(__name__)

#: States a job cannot be cancelled in any more (`failed` only lasts until its dead-letter entry is written).
FINISHED = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.DEAD_LETTERED, JobState.CANCELLED})
#: The reason Celery's REVOKED meta carries for a cancel (`TaskRevokedError`'s message).
REASON = "cancelled"


class JobNotFound(LookupError):
    """No producer accepted a job with this id (or its record and result have expired)."""

    def __init__(self, task_id: str) -> None:
        super().__init__(f"no job {task_id}")


class JobFinished(ValueError):
    """The job has finished: there is nothing left to cancel."""

    def __init__(self, status: JobStatus) -> None:
        self.status = status
        super().__init__(f"job {status.id} has finished ({status.state}): nothing to cancel")


def _tombstone(task_id: str, queue: str | None) -> int:
    """Run `cancel.lua` for `task_id`: once on a single Redis (shared keys); on a cluster in the slot of the job's
    `queue` (any queue: a typed task's own, a flow step's), or of every queue the app routes to when it is not known
    (`pipeline.queues.routed`). 1 when a parked entry was dropped."""
    calls = [queue] if queue or not keys.clustered() else list(routed_queues(get_app()))
    parked = 0
    with broker_redis() as client:
        for n, each in enumerate(calls):
            names = [keys.cancel(each or "", task_id), *keys.delayed(each or "")]
            args = [task_id, get_settings().result_expires, CANCEL_CHANNEL if n == 0 else ""]
            dropped, reached = run_script_waited(client, "cancel", names, args)
            if reached is not None:
                check_replicas(reached)
            parked = max(parked, int(dropped))
    return parked


def cancel(task_id: str) -> JobStatus:
    """Cancel the job `task_id` (see the module doc); return its status, `cancelled`."""
    before = job_status(task_id)
    if before.state is JobState.UNKNOWN:
        raise JobNotFound(task_id)
    if before.state in FINISHED:
        raise JobFinished(before)
    parked = _tombstone(task_id, before.queue)
    get_app().backend.mark_as_revoked(task_id, REASON)
    after = job_status(task_id)
    if after.state is not JobState.CANCELLED:  # it finished first: its outcome stands
        raise JobFinished(after)
    if parked:  # no worker will see it: counted here
        metrics.child(metrics.tasks, after.task or metrics.UNREGISTERED, after.queue or "unknown", "cancelled").inc()
    log.info("job %s (%s) cancelled (was %s)", task_id, before.task, before.state)
    return after
