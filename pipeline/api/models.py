"""Response bodies of the API, as pydantic models so the OpenAPI schema documents every answer."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

JobState = Literal[
    "unknown", "scheduled", "queued", "started", "progress", "retrying", "succeeded", "failed", "dead_lettered"
]


class Accepted(BaseModel):
    """A job was stored in the broker: follow it at `status_url`."""

    id: str
    status_url: str = Field(description="Path of the job's status, relative to the API root.")


class Progress(BaseModel):
    percent: float = Field(ge=0, le=100)
    eta_s: float | None = Field(default=None, description="Seconds left, as the task estimates them.")


class JobError(BaseModel):
    type: str
    message: str


class JobStatus(BaseModel):
    id: str
    state: JobState
    task: str | None = None
    queue: str | None = None
    worker: str | None = None
    attempts: int = 0
    progress: Progress | None = None
    result: Any = None
    error: JobError | None = None
    accepted_at: str | None = Field(default=None, description="When a producer accepted the job (ISO 8601, UTC).")
    eta: str | None = Field(default=None, description="Not run before this time (ISO 8601, UTC), if delayed.")
    finished_at: str | None = None
    dlq_id: str | None = Field(default=None, description="The dead-letter entry, when state is dead_lettered.")


class Kind(BaseModel):
    kind: str
    task: str
    queue: str
    description: str
    payload_schema: dict[str, Any]
    example: dict[str, Any]


class QueueInfo(BaseModel):
    name: str
    depth: int = Field(description="Jobs waiting (all priorities).")
    in_flight: int = Field(description="Jobs delivered to a worker and not yet acknowledged.")
    oldest_wait_s: float | None = Field(description="Age of the oldest waiting job, seconds.")


class Queues(BaseModel):
    queues: list[QueueInfo]
    in_flight: int


class DeadLetterRow(BaseModel):
    id: str
    task_id: str | None
    task: str | None
    queue: str | None
    reason: str
    exception: str
    message: str
    attempts: int
    failed_at: str
    replayable: bool


class Replayed(BaseModel):
    id: str = Field(description="The dead-letter entry that was replayed (and removed).")
    new_task_id: str
    status_url: str


class Deleted(BaseModel):
    deleted: str


class Problem(BaseModel):
    """An error answer: `detail` says what went wrong."""

    detail: str


class Health(BaseModel):
    status: str
