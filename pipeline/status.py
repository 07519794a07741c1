"""A job's status in the pipeline's words, from the result backend, the accepted-job record and the DLQ.

Celery answers PENDING for any id it never saw. So every producer path of the pipeline (`enqueue`,
DLQ replay) records the job id in Redis (`pipeline:job:<id>`, JSON with task name, accepted time and
ETA) *before* publishing, with a TTL of RESULT_EXPIRES past the ETA. A PENDING id with a record is
`queued` (or `scheduled` while its ETA is ahead); without one it is `unknown`. A job accepted with a
202 can therefore never read as unknown while its result is kept.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from celery.result import AsyncResult

from pipeline.celery_app import get_app
from pipeline.dlq import admin as dlq_admin
from pipeline.publish import parked_due
from pipeline.records import accepted_record

#: Celery state → pipeline state. PENDING becomes queued, scheduled or unknown (see the module docstring);
#: a job parked by `pipeline.publish` is scheduled too. THROTTLED: waiting for a cluster rate-limit slot.
STATES = {
    "PENDING": "queued",
    "RECEIVED": "queued",
    "STARTED": "started",
    "PROGRESS": "progress",
    "RETRY": "retrying",
    "SUCCESS": "succeeded",
    "FAILURE": "failed",
    "REVOKED": "failed",
    "THROTTLED": "scheduled",
}
#: Every state `job_status` answers, in the order a job moves through them.
ALL_STATES = (
    "unknown",
    "scheduled",
    "queued",
    "started",
    "progress",
    "retrying",
    "succeeded",
    "failed",
    "dead_lettered",
)
#: States after which nothing changes any more (`failed` may still become `dead_lettered` shortly).
FINAL_STATES = frozenset({"succeeded", "dead_lettered", "unknown"})


def _pending_state(record: dict[str, Any] | None) -> str:
    if record is None:
        return "unknown"
    eta = record.get("eta")
    if eta and datetime.fromisoformat(eta) > datetime.now(UTC):
        return "scheduled"
    return "queued"


def job_status(task_id: str) -> dict[str, Any]:
    """State, progress, result or error, attempts and timestamps of one job."""
    result: AsyncResult[Any] = AsyncResult(task_id, app=get_app())
    meta = result.backend.get_task_meta(task_id)
    record = accepted_record(task_id)
    celery_state = str(meta.get("status", "PENDING"))
    state = _pending_state(record) if celery_state == "PENDING" else STATES.get(celery_state, celery_state.lower())
    info = meta.get("result")
    waiting = state in ("unknown", "scheduled", "queued")
    status: dict[str, Any] = {
        "id": task_id,
        "state": state,
        "task": meta.get("name") or (record or {}).get("task"),
        "queue": meta.get("queue"),
        "worker": meta.get("worker"),
        "attempts": (meta.get("retries") or 0) + (0 if waiting else 1),
        "progress": info if celery_state == "PROGRESS" and isinstance(info, dict) else None,
        "result": info if celery_state == "SUCCESS" else None,
        "error": None,
        "accepted_at": (record or {}).get("accepted_at"),
        "eta": (record or {}).get("eta"),
        "finished_at": str(meta["date_done"]) if meta.get("date_done") else None,
        "dlq_id": None,
    }
    if celery_state in ("FAILURE", "RETRY", "REVOKED"):
        status["error"] = {
            "type": type(result.result).__name__ if isinstance(result.result, BaseException) else celery_state,
            "message": str(result.result),
        }
    if celery_state == "PENDING":
        due = parked_due(task_id)
        if due is not None:
            status.update(state="scheduled", due_at=datetime.fromtimestamp(due, UTC).isoformat())
    if celery_state == "SUCCESS":
        status["progress"] = {"percent": 100.0, "eta_s": 0}
    if celery_state == "FAILURE":
        try:
            entry = dlq_admin.get(task_id)
        except dlq_admin.DeadLetterNotFound:
            pass
        else:
            status.update(state="dead_lettered", dlq_id=entry.id, attempts=entry.attempts)
    return status
