"""Response bodies of the API, as pydantic models so the OpenAPI schema documents every answer.

The job status (`pipeline.status.JobStatus`) and the dead-letter row (`pipeline.dlq.envelope.DeadLetterRow`)
are defined once with what they describe, and shared with the CLI.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field


class Accepted(BaseModel):
    """A job was stored in the broker: follow it at `status_url`."""

    id: str
    status_url: str = Field(description="Path of the job's status, relative to the API root.")


class AcceptedBatch(BaseModel):
    """Every job of a batch was stored in the broker, in the order sent."""

    ids: list[str]
    status_urls: list[str] = Field(description="Paths of the jobs' statuses, relative to the API root, in order.")


class Kind(BaseModel):
    kind: str
    task: str
    queue: str
    description: str
    payload_schema: dict[str, Any]
    example: dict[str, Any]


class FlowAccepted(BaseModel):
    """A flow was started: its first steps' jobs are stored in the broker; follow it at `status_url`."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {"id": "5f0c7a52-1b7e-4c2b-9a51-0e7f3d4c2a10", "flow": "invoice", "status_url": "/flows/5f0c7a52-..."}
            ]
        }
    )
    id: str
    flow: str
    status_url: str = Field(description="Path of the flow's status, relative to the API root.")


class FlowStep(BaseModel):
    name: str
    task: str
    after: list[str] = Field(description="The steps it runs after (all of them must have succeeded).")
    fan_out: bool = Field(description="One job per item its mapping returns, run in parallel.")


class FlowKind(BaseModel):
    """A declared flow: what `POST /flows/{name}` takes."""

    name: str
    description: str
    input_schema: dict[str, Any]
    example: dict[str, Any] | None = Field(description="An input to try the flow with (null if it has none).")
    steps: list[FlowStep] = Field(description="In the order they are declared (a step after the steps it waits on).")


class QueueInfo(BaseModel):
    name: str
    depth: int = Field(description="Jobs waiting (all priorities).")
    levels: dict[str, int] = Field(
        default_factory=dict,
        description="Jobs waiting per priority level, most urgent first: level '0' holds priorities 0-2, '3' 3-5, "
        "'6' 6-8, '9' 9 (workers empty a level before taking the next).",
    )
    in_flight: int = Field(description="Jobs delivered to a worker and not yet acknowledged.")
    oldest_wait_s: float | None = Field(description="Age of the oldest waiting job, seconds.")
    paused: bool = Field(description="Paused: it accepts jobs and no worker starts one until it is resumed.")


class Queues(BaseModel):
    queues: list[QueueInfo]
    in_flight: int


class QueueState(BaseModel):
    name: str
    paused: bool = Field(description="The queue's state after the call.")
    changed: bool = Field(description="False when the queue was in that state already.")


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
