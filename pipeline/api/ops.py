"""Operations routes: queue depths, pause and resume of a queue, the dead-letter queue (list, show, replay, delete),
health and readiness."""

from __future__ import annotations

from collections.abc import Callable
from datetime import datetime
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query
from fastapi.responses import JSONResponse

from pipeline.api.auth import require_token
from pipeline.api.enqueue import status_path
from pipeline.api.errors import BROKER_ERRORS, answers, broker_unavailable
from pipeline.api.jobs import ERRORS
from pipeline.api.models import Deleted, Health, Problem, QueueInfo, Queues, QueueState, Replayed
from pipeline.api.strict import reject_unknown_query
from pipeline.broker import broker_redis, in_flight_by_queue, queue_stats
from pipeline.dlq import admin as dlq_admin
from pipeline.dlq.envelope import DeadLetter, DeadLetterRow
from pipeline.dlq.filters import parse_time
from pipeline.scheduling import pause as pausing

NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "No dead-letter entry has this id."}
}
NOT_PAUSABLE: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "No queue the app routes to has this name."},
    409: {"model": Problem, "description": "The queue has no consumer to pause (the dead-letter queue)."},
}


def _since(text: str | None) -> datetime | None:
    if not text:
        return None
    try:
        return parse_time(text)
    except (ValueError, OverflowError):  # BadFilter is a ValueError
        raise HTTPException(
            422,
            detail=[
                {
                    "loc": ["query", "since"],
                    "type": "value_error",
                    "msg": "since must be an ISO 8601 time or an age like 90s, 15m, 12h, 7d",
                }
            ],
        ) from None


#: The routes `POST /queues/{name}/<action>` and what each does.
SWITCHES = {
    "pause": "Pause a queue: it keeps accepting jobs, no worker starts one until it is resumed",
    "resume": "Resume a paused queue: idle workers start its jobs within a second",
}


def _switch(action: str) -> Callable[[str], QueueState]:
    """The route that pauses or resumes queue `name`: 404 for a name that is no queue the app routes to, 409 for the
    dead-letter queue."""
    switch = pausing.pause if action == "pause" else pausing.resume

    def route(
        name: Annotated[str, Path(description="A queue the app routes to (`GET /queues`).")],
    ) -> QueueState:
        with answers({pausing.UnknownQueue: 404, pausing.NotPausable: 409}):
            changed = switch(name)
        return QueueState(name=name, paused=action == "pause", changed=changed)

    return route


def router() -> APIRouter:
    routes = APIRouter(dependencies=[Depends(require_token), Depends(reject_unknown_query)], responses=ERRORS)

    @routes.get("/queues", response_model=Queues, tags=["operations"], summary="Depth, in flight, oldest wait")
    def queues() -> Queues:
        flying = in_flight_by_queue()
        infos = [
            QueueInfo(
                name=s.name,
                depth=s.depth,
                levels={str(step): n for step, n in s.levels.items()},
                in_flight=flying.get(s.name, 0),
                oldest_wait_s=s.oldest_age_s,
                paused=s.paused,
            )
            for s in queue_stats()
        ]
        return Queues(queues=infos, in_flight=sum(flying.values()))

    for action, summary in SWITCHES.items():
        routes.add_api_route(
            f"/queues/{{name}}/{action}",
            _switch(action),
            methods=["POST"],
            response_model=QueueState,
            responses=NOT_PAUSABLE,
            tags=["operations"],
            summary=summary,
            name=action,
        )

    @routes.get("/dlq", response_model=list[DeadLetterRow], tags=["dead letters"], summary="Dead-lettered jobs")
    def list_dlq(
        task: Annotated[str | None, Query(max_length=200, description="Task name or glob, e.g. 'email.*'.")] = None,
        exception: Annotated[str | None, Query(max_length=200, description="Exception class name.")] = None,
        since: Annotated[str | None, Query(max_length=64, description="ISO time, or an age like 1h / 2d.")] = None,
        limit: Annotated[int, Query(ge=1, le=10_000, description="At most this many, newest first.")] = 100,
    ) -> list[DeadLetterRow]:
        filters = dlq_admin.Filters(task=task, exception=exception, since=_since(since))
        return [e.row() for e in dlq_admin.list_entries(filters, limit)]

    @routes.get(
        "/dlq/{entry_id}",
        response_model=DeadLetter,
        responses=NOT_FOUND,
        tags=["dead letters"],
        summary="One entry whole: payload, error, traceback",
    )
    def get_entry(entry_id: str) -> DeadLetter:
        with answers({dlq_admin.DeadLetterNotFound: 404}):
            return dlq_admin.get(entry_id)

    @routes.post(
        "/dlq/{entry_id}/replay",
        response_model=Replayed,
        status_code=202,
        tags=["dead letters"],
        summary="Run the job again (new id, original queue); the entry is removed once republished",
        responses={**NOT_FOUND, 409: {"model": Problem, "description": "The entry cannot be replayed."}},
    )
    def replay(entry_id: str) -> Replayed:
        with answers({dlq_admin.DeadLetterNotFound: 404, dlq_admin.NotReplayable: 409}):
            entry = dlq_admin.get(entry_id)
            new_id = dlq_admin.replay(entry_id)
        return Replayed(id=entry.id, new_task_id=new_id, status_url=status_path(new_id))

    @routes.delete(
        "/dlq/{entry_id}",
        response_model=Deleted,
        responses=NOT_FOUND,
        tags=["dead letters"],
        summary="Remove one entry without running it",
    )
    def delete_entry(entry_id: str) -> Deleted:
        with answers({dlq_admin.DeadLetterNotFound: 404}):
            return Deleted(deleted=dlq_admin.delete(entry_id).id)

    return routes


def health_router() -> APIRouter:
    routes = APIRouter(tags=["health"])

    @routes.get("/healthz", response_model=Health, summary="The process is alive (no dependencies checked)")
    def healthz() -> Health:
        return Health(status="ok")

    @routes.get(
        "/readyz",
        response_model=Health,
        summary="The broker answers; 503 if not",
        responses={503: {"model": Problem, "description": "The broker is unreachable."}},
    )
    def readyz() -> Health | JSONResponse:
        try:
            with broker_redis() as client:
                client.ping()
        except BROKER_ERRORS:
            return broker_unavailable()
        return Health(status="ready")

    return routes
