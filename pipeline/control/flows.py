"""Watching and cancelling flows: one flow's steps with their states and progress, the recent flows, a cancel.

A flow's state is `running`, `succeeded`, `cancelled`, or `failed` while one of its jobs is dead-lettered (and not
replayed): `failed_step` names the step. A step's state comes from the one job-state vocabulary (`pipeline.status`):
a step not queued yet has none (`waiting_for` names the steps it waits on); a step of several jobs (a fan-out) shows
the state of its least advanced job, with a count per state. Nodes whose result the flow recorded are `succeeded`
without asking the result backend; the others are read as any job is, all in one batch (`pipeline.status.job_statuses`):
a flow's status costs a bounded number of Redis round trips (five, seven with dead-lettered jobs) however many jobs
its steps have.

The CLI (`pipeline flow status`), the API (`GET /flows/{id}`) and the page read `FlowStatus` from here.
"""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, Field

from pipeline.broker import broker_redis
from pipeline.constants import FLOWS_INDEX_KEY
from pipeline.control.cancel import JobFinished, JobNotFound, cancel
from pipeline.flows import record
from pipeline.flows.definition import FLOWS, Step
from pipeline.flows.launch import FlowNotFound
from pipeline.status import JobState, job_statuses

#: Jobs of a step listed one by one (a fan-out's first ones; `counts` has them all).
JOBS_SHOWN = 50
#: A step's state is its least advanced job's: the first of these any of its jobs is in.
_PRECEDENCE = (
    JobState.DEAD_LETTERED,
    JobState.FAILED,
    JobState.CANCELLED,
    JobState.UNKNOWN,
    JobState.RETRYING,
    JobState.SCHEDULED,
    JobState.QUEUED,
    JobState.STARTED,
    JobState.PROGRESS,
    JobState.SUCCEEDED,
)


class FlowState(StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


class FlowFinished(ValueError):
    """The flow has finished: there is nothing left to cancel."""


class StepJob(BaseModel):
    node: str = Field(description="`step`, or `step[i]` for item i of a fan-out step.")
    id: str = Field(description="The job's id (`GET /jobs/{id}`).")
    state: JobState
    progress: float = Field(ge=0, le=100)


class StepStatus(BaseModel):
    name: str
    task: str
    after: list[str]
    fan_out: bool
    state: JobState | None = Field(description="The least advanced job's state; null while the step waits.")
    waiting_for: list[str] = Field(description="Steps it still waits on, before it is queued.")
    jobs: int = Field(description="Its jobs (a fan-out's items); 0 before it is queued.")
    counts: dict[str, int] = Field(description="How many of its jobs are in each state.")
    progress: float = Field(ge=0, le=100)
    items: list[StepJob] = Field(description=f"Its jobs, the first {JOBS_SHOWN}.")


class FlowSummary(BaseModel):
    id: str
    flow: str
    state: FlowState
    final: bool = Field(
        description="The flow will not move on by itself: it succeeded, was cancelled, or failed at a step (replaying "
        "that step's dead-letter entry continues it). Clients follow a flow until this is true."
    )
    failed_step: str | None = None
    created_at: str
    finished_at: str | None = None
    progress: float = Field(ge=0, le=100, description="Jobs succeeded, against jobs queued and steps to come.")


class FlowStatus(FlowSummary):
    input: Any = None
    steps: list[StepStatus]


def _iso(value: Any) -> str | None:
    return datetime.fromtimestamp(float(value), UTC).isoformat() if value else None


def _summary(flow_id: str, meta: dict[str, str], failed: set[str]) -> FlowSummary:
    state = FlowState(meta.get("state", "running"))
    failed_step = min(record.parse_node(n)[0] for n in failed) if failed else None
    if state is FlowState.RUNNING and failed:
        state = FlowState.FAILED
    done, total, left = (int(meta.get(k, 0)) for k in ("done", "total", "left"))
    progress = 100.0 if state is FlowState.SUCCEEDED else 100.0 * done / max(1, total + left)
    return FlowSummary(
        id=flow_id,
        flow=meta.get("name", ""),
        state=state,
        final=state is not FlowState.RUNNING,
        failed_step=failed_step,
        created_at=_iso(meta.get("created")) or "",
        finished_at=_iso(meta.get("finished")),
        progress=round(progress, 1),
    )


def _texts(values: Any) -> set[str]:
    return {record.text(v) for v in values}


def _pairs(values: Any) -> dict[str, str]:
    return {record.text(k): record.text(v) for k, v in values.items()}


def flow_status(flow_id: str) -> FlowStatus:
    """One flow, step by step (`FlowNotFound` if no such flow is kept)."""
    with broker_redis() as client:
        meta = _pairs(client.hgetall(record.key(flow_id)))
        if not meta:
            raise FlowNotFound(f"no flow {flow_id} (never started, or expired)")
        definition = FLOWS.get(meta.get("name", ""))
        names = list(definition.steps) if definition is not None else []
        pipe = client.pipeline(transaction=False)
        pipe.smembers(record.key(flow_id, ":failed"))
        pipe.hgetall(record.key(flow_id, ":tasks"))
        pipe.hkeys(record.key(flow_id, ":results"))
        for name in names:
            pipe.smembers(record.key(flow_id, f":wait:{name}"))
        failed, tasks, done, *waits = pipe.execute()
    summary = _summary(flow_id, meta, _texts(failed))
    steps = definition.steps if definition is not None else {}
    jobs = _jobs(meta, [steps[name] for name in names], _pairs(tasks), _texts(done))
    shown = [
        _step(steps[name], meta, jobs.get(name, []), sorted(_texts(wait)))
        for name, wait in zip(names, waits, strict=True)
    ]
    return FlowStatus(**summary.model_dump(), input=json.loads(meta.get("input") or "null"), steps=shown)


def _jobs(meta: dict[str, str], steps: list[Step], tasks: dict[str, str], done: set[str]) -> dict[str, list[StepJob]]:
    """The jobs of each queued step: a node whose result the flow recorded is `succeeded`; the others are read in one
    batch (`job_statuses`), so a flow of any size is read in a bounded number of round trips."""
    nodes = {
        step.name: [f"{step.name}[{i}]" for i in range(int(meta.get(f"n:{step.name}", 0)))]
        if step.each
        else [step.name]
        for step in steps
        if f"on:{step.name}" in meta
    }
    unknown = [node for listed in nodes.values() for node in listed if node not in done]
    statuses = dict(zip(unknown, job_statuses([tasks.get(node, "") for node in unknown]), strict=True))
    jobs: dict[str, list[StepJob]] = {}
    for name, listed in nodes.items():
        jobs[name] = []
        for node in listed:
            task_id = tasks.get(node, "")
            status = statuses.get(node)
            if status is None:
                jobs[name].append(StepJob(node=node, id=task_id, state=JobState.SUCCEEDED, progress=100.0))
                continue
            percent = status.progress.percent if status.progress is not None else 0.0
            jobs[name].append(StepJob(node=node, id=task_id, state=status.state, progress=percent))
    return jobs


def _step(step: Step, meta: dict[str, str], jobs: list[StepJob], waiting: list[str]) -> StepStatus:
    name, task, after, each = step.name, step.task.name, list(step.after), step.each
    if f"on:{name}" not in meta:
        return StepStatus(
            name=name, task=task, after=after, fan_out=each, state=None, waiting_for=waiting or after, jobs=0,
            counts={}, progress=0.0, items=[],
        )  # fmt: skip
    counts: dict[str, int] = {}
    for job in jobs:
        counts[job.state.value] = counts.get(job.state.value, 0) + 1
    state = next((s for s in _PRECEDENCE if s.value in counts), None)
    progress = sum(j.progress for j in jobs) / max(1, len(jobs))
    return StepStatus(
        name=name, task=task, after=after, fan_out=each, state=state, waiting_for=[], jobs=len(jobs), counts=counts,
        progress=round(progress, 1), items=jobs[:JOBS_SHOWN],
    )  # fmt: skip


def list_flows(limit: int = 50, name: str | None = None) -> list[FlowSummary]:
    """The most recent flows, newest first (only those named `name`, if given)."""
    with broker_redis() as client:
        ids = [record.text(i) for i in client.zrevrange(FLOWS_INDEX_KEY, 0, max(limit * (4 if name else 1), 1) - 1)]
        pipe = client.pipeline(transaction=False)
        for flow_id in ids:
            pipe.hmget(record.key(flow_id), ["name", "state", "created", "finished", "done", "total", "left"])
            pipe.smembers(record.key(flow_id, ":failed"))
        replies = pipe.execute()
    out = []
    fields = ("name", "state", "created", "finished", "done", "total", "left")
    for flow_id, values, failed in zip(ids, replies[::2], replies[1::2], strict=True):
        meta = {f: record.text(v) for f, v in zip(fields, values, strict=True) if v is not None}
        if not meta or (name and meta.get("name") != name):
            continue
        out.append(_summary(flow_id, meta, _texts(failed)))
    return out[:limit]


def cancel_flow(flow_id: str) -> FlowStatus:
    """Cancel a running flow: no step of it is queued any more, and its queued and running jobs are cancelled
    (`pipeline.control.cancel`). `FlowNotFound`, or `FlowFinished` for a flow that succeeded or was cancelled."""
    with broker_redis() as client:
        before = record.cancel(client, flow_id)
        tasks = _pairs(client.hgetall(record.key(flow_id, ":tasks")))
        done = _texts(client.hkeys(record.key(flow_id, ":results")))
    if before is None:
        raise FlowNotFound(f"no flow {flow_id} (never started, or expired)")
    if before != "running":
        raise FlowFinished(f"flow {flow_id} has finished ({before}): nothing to cancel")
    for node, task_id in tasks.items():
        if node not in done:
            with contextlib.suppress(JobNotFound, JobFinished):  # it finished first: nothing to stop
                cancel(task_id)
    return flow_status(flow_id)
