"""A job's status in the pipeline's words, from the result backend and the dead-letter queue."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from celery.result import AsyncResult

from pipeline.app import app

#: Celery state → pipeline state. PENDING is "queued" (Celery cannot tell a queued job from an unknown id),
#: or "scheduled" while the job is parked by `pipeline.delayed`. THROTTLED: waiting for a rate-limit slot.
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


def job_status(task_id: str) -> dict[str, Any]:
    """State, progress, result or error, attempts and timestamps of one job."""
    from pipeline import delayed, dlq_admin

    result: AsyncResult[Any] = AsyncResult(task_id, app=app)
    meta = result.backend.get_task_meta(task_id)
    celery_state = str(meta.get("status", "PENDING"))
    state = STATES.get(celery_state, celery_state.lower())
    info = meta.get("result")
    status: dict[str, Any] = {
        "id": task_id,
        "state": state,
        "task": meta.get("name"),
        "queue": meta.get("queue"),
        "attempts": (meta.get("retries") or 0) + (0 if state == "queued" else 1),
        "progress": info if celery_state == "PROGRESS" and isinstance(info, dict) else None,
        "result": info if celery_state == "SUCCESS" else None,
        "error": None,
        "finished_at": str(meta["date_done"]) if meta.get("date_done") else None,
    }
    if celery_state in ("FAILURE", "RETRY", "REVOKED"):
        status["error"] = {
            "type": type(result.result).__name__ if isinstance(result.result, BaseException) else celery_state,
            "message": str(result.result),
        }
    if celery_state == "PENDING":
        due = delayed.parked_due(task_id)
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
