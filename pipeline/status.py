"""A job's status in the pipeline's words, from the result backend, the accepted-job record and the DLQ.

The one vocabulary of job states (`JobState`) and the one status model (`JobStatus`): the CLI
(`pipeline status`, `pipeline enqueue --wait`), the API (`GET /jobs/{id}`), its event stream and the job
page all read them from here.

Celery answers PENDING for any id it never saw. So every producer path of the pipeline (`enqueue`,
DLQ replay) records the job id in Redis (`pipeline:job:<id>`, JSON with task name, accepted time and
ETA) *before* publishing, with a TTL of RESULT_EXPIRES past the ETA. A PENDING id with a record is
`queued` (or `scheduled` while its ETA is ahead); without one it is `unknown`. A job accepted with a
202 can therefore never read as unknown while its result is kept. Its SUCCESS, once stored, drops the record
(`pipeline.records`): a succeeded job's accepted time comes from its queue's recent-jobs index, its ETA from its
meta.

A job that fails for good is stored as FAILURE by the worker a moment before its dead-letter entry is
published, so `failed` normally turns into `dead_lettered` within milliseconds. A status is `final`
when nothing will change any more: succeeded, dead_lettered, cancelled, unknown, and failed once FAILED_GRACE_S
have passed since it finished without a dead-letter entry (replayed or deleted from the DLQ).

A cancelled job (`pipeline.control.cancel`) is stored as Celery's REVOKED, read as `cancelled`: a final state of its
own, neither failed nor dead-lettered. The result backend's store keeps a REVOKED, as it keeps a SUCCESS
(`store.lua`): a job cancelled as it finished cannot turn into `succeeded` afterwards.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import UTC, datetime, timedelta
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field, ValidationError

from pipeline.celery_app import get_app
from pipeline.dlq import admin as dlq_admin
from pipeline.publish import parked_due, parked_dues
from pipeline.records import accepted_record, accepted_records, accepted_times


class JobState(StrEnum):
    """Every state a job can be in, in the order a job moves through them."""

    UNKNOWN = "unknown"
    SCHEDULED = "scheduled"
    QUEUED = "queued"
    STARTED = "started"
    PROGRESS = "progress"
    RETRYING = "retrying"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    DEAD_LETTERED = "dead_lettered"
    CANCELLED = "cancelled"

    @property
    def final(self) -> bool:
        """Nothing changes any more (`failed` may still become `dead_lettered` shortly: see `JobStatus.final`)."""
        return self in FINAL_STATES

    @property
    def waiting(self) -> bool:
        """No worker has started the job yet."""
        return self in WAITING_STATES


FINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.DEAD_LETTERED, JobState.CANCELLED, JobState.UNKNOWN})
WAITING_STATES = frozenset({JobState.UNKNOWN, JobState.SCHEDULED, JobState.QUEUED})
#: How long a job may read `failed` before that is final (its dead-letter entry follows the FAILURE at once).
FAILED_GRACE_S = 5.0

#: Celery state → pipeline state. PENDING becomes queued, scheduled or unknown (see the module docstring);
#: a job parked by `pipeline.publish` is scheduled too. THROTTLED: waiting for a cluster rate-limit slot. REVOKED
#: is what a cancel stores (`pipeline.control.cancel`; Celery's own revoke stores it too): `cancelled`, never run again.
#: A state of a task's own (`update_state`) not listed here reads as `started`: a worker has the job.
CELERY_STATES: Mapping[str, JobState] = {
    "PENDING": JobState.QUEUED,
    "RECEIVED": JobState.QUEUED,
    "STARTED": JobState.STARTED,
    "PROGRESS": JobState.PROGRESS,
    "RETRY": JobState.RETRYING,
    "SUCCESS": JobState.SUCCEEDED,
    "FAILURE": JobState.FAILED,
    "REVOKED": JobState.CANCELLED,
    "REJECTED": JobState.FAILED,
    "THROTTLED": JobState.SCHEDULED,
}


class Progress(BaseModel):
    percent: float = Field(ge=0, le=100)
    eta_s: float | None = Field(default=None, description="Seconds left, as the task estimates them.")


class JobError(BaseModel):
    type: str
    message: str


class JobStatus(BaseModel):
    """State, progress, result or error, attempts and timestamps of one job."""

    id: str
    state: JobState
    final: bool = Field(
        default=False, description="Nothing will change any more: clients stop following the job (see `state`)."
    )
    task: str | None = None
    queue: str | None = None
    worker: str | None = None
    attempts: int = 0
    progress: Progress | None = None
    result: Any = None
    error: JobError | None = None
    accepted_at: str | None = Field(default=None, description="When a producer accepted the job (ISO 8601, UTC).")
    eta: str | None = Field(default=None, description="Not run before this time (ISO 8601, UTC), if delayed.")
    due_at: str | None = Field(default=None, description="When a parked delayed job is released (ISO 8601, UTC).")
    finished_at: str | None = None
    dlq_id: str | None = Field(default=None, description="The dead-letter entry, when state is dead_lettered.")


def _pending_state(record: dict[str, Any] | None) -> JobState:
    if record is None:
        return JobState.UNKNOWN
    eta = record.get("eta")
    if eta and datetime.fromisoformat(eta) > datetime.now(UTC):
        return JobState.SCHEDULED
    return JobState.QUEUED


def _progress(info: Any) -> Progress | None:
    try:
        return Progress.model_validate(info)
    except ValidationError:
        return None  # a task's own PROGRESS meta in another shape: shown as no progress


def is_final(state: JobState, finished_at: str | None, now: datetime | None = None) -> bool:
    """`state` is final, or it is `failed` and has been for FAILED_GRACE_S (no dead-letter entry followed)."""
    if state.final:
        return True
    if state is not JobState.FAILED:
        return False
    if finished_at is None:
        return True
    done = datetime.fromisoformat(finished_at)
    done = done if done.tzinfo else done.replace(tzinfo=UTC)
    return (now or datetime.now(UTC)) - done > timedelta(seconds=FAILED_GRACE_S)


def job_status(task_id: str) -> JobStatus:
    """State, progress, result or error, attempts and timestamps of one job (O(1) Redis work)."""
    meta = get_app().backend.get_task_meta(task_id)
    celery_state = str(meta.get("status", "PENDING"))
    record = _succeeded_records([task_id], [meta], [accepted_record(task_id)])[0]
    due = parked_due(task_id, _queue(record)) if celery_state == "PENDING" else None
    entry = dlq_admin.find(task_id) if celery_state == "FAILURE" else None
    return _status(task_id, meta, record, due, entry)


def job_statuses(task_ids: Sequence[str]) -> list[JobStatus]:
    """`job_status` of each of `task_ids`, in order, in a bounded number of Redis round trips however many they are:
    the result backend's entries in one MGET, the accepted-job records in one, the parked jobs' due times in one
    ZMSCORE, the dead-letter entries of the failed ones in two (`pipeline.dlq.store.lookup_tasks`)."""
    ids = list(task_ids)
    if not ids:
        return []
    backend: Any = get_app().backend  # RESULT_BACKEND_URL may name another Redis than the broker
    raws = backend.mget([backend.get_key_for_task(task_id) for task_id in ids])
    metas = [backend.decode_result(raw) if raw else {"status": "PENDING", "result": None} for raw in raws]
    records = _succeeded_records(ids, metas, accepted_records(ids))
    pending = [task_id for task_id, meta in zip(ids, metas, strict=True) if meta.get("status", "PENDING") == "PENDING"]
    dues = parked_dues(pending, {queue for record in records if (queue := _queue(record))})
    entries = dlq_admin.find_tasks([t for t, m in zip(ids, metas, strict=True) if m.get("status") == "FAILURE"])
    return [
        _status(task_id, meta, record, dues.get(task_id), entries.get(task_id))
        for task_id, meta, record in zip(ids, metas, records, strict=True)
    ]


def _queue(record: Mapping[str, Any] | None) -> str | None:
    """The queue a job's record names (on a Redis Cluster, where its parked entry is: its queue's slot)."""
    queue = (record or {}).get("queue")
    return str(queue) if queue else None


def _succeeded_records(
    ids: Sequence[str], metas: Sequence[Mapping[str, Any]], records: list[dict[str, Any] | None]
) -> list[dict[str, Any] | None]:
    """`records`, each succeeded job's without one (its SUCCESS dropped it: `pipeline.records`) rebuilt from its meta
    (task, ETA) and its queue's recent-jobs index (the accepted time, while the job is in it)."""
    missing = [
        i
        for i, (meta, record) in enumerate(zip(metas, records, strict=True))
        if record is None and meta.get("status") == "SUCCESS" and meta.get("queue")
    ]
    times = accepted_times([(ids[i], str(metas[i]["queue"])) for i in missing])
    rebuilt = list(records)
    for i, at in zip(missing, times, strict=True):
        accepted = datetime.fromtimestamp(at, UTC).isoformat() if at is not None else None
        rebuilt[i] = {"task": metas[i].get("name"), "accepted_at": accepted, "eta": metas[i].get("eta")}
    return rebuilt


def _status(
    task_id: str,
    meta: Mapping[str, Any],
    record: dict[str, Any] | None,
    due: float | None,
    entry: dlq_admin.DeadLetter | None,
) -> JobStatus:
    """The status of job `task_id` from what Redis holds of it: its result backend entry (`meta`), its accepted-job
    record, when it is due if it is parked, its dead-letter entry if it has one."""
    record = record or {}
    celery_state = str(meta.get("status", "PENDING"))
    if celery_state == "PENDING":
        state = _pending_state(record or None)
    else:
        state = CELERY_STATES.get(celery_state, JobState.STARTED)
    info = meta.get("result")
    status = JobStatus(
        id=task_id,
        state=state,
        task=meta.get("name") or record.get("task"),
        queue=meta.get("queue") or record.get("queue"),
        worker=meta.get("worker"),
        attempts=(meta.get("retries") or 0) + (0 if state.waiting else 1),
        progress=_progress(info) if celery_state == "PROGRESS" else None,
        result=info if celery_state == "SUCCESS" else None,
        accepted_at=record.get("accepted_at"),
        eta=record.get("eta"),
        finished_at=str(meta["date_done"]) if meta.get("date_done") else None,
    )
    if celery_state in ("FAILURE", "RETRY", "REJECTED"):
        status.error = JobError(
            type=type(info).__name__ if isinstance(info, BaseException) else celery_state, message=str(info)
        )
    if celery_state == "PENDING" and due is not None:
        status.state = JobState.SCHEDULED
        status.due_at = datetime.fromtimestamp(due, UTC).isoformat()
    if celery_state == "SUCCESS":
        status.progress = Progress(percent=100.0, eta_s=0)
    if celery_state == "FAILURE" and entry is not None:
        status.state, status.dlq_id, status.attempts = JobState.DEAD_LETTERED, entry.id, entry.attempts
    status.final = is_final(status.state, status.finished_at)
    return status
