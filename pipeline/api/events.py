"""`GET /jobs/{id}/events`: server-sent events with a job's state and progress until it ends.

Each change of state, progress, attempts or finality is one `event: status` whose data is the job's
status JSON (the same object as `GET /jobs/{id}`); a comment line keeps idle connections open. The
stream closes after a status with `final: true` (see `pipeline.status`), or once a job has read
`failed` for FAILED_GRACE_S by this server's clock. If the broker becomes unreachable mid-stream an
`event: error` is sent and the stream closes; clients reconnect. A broker outage before the first event
is a plain 503.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from pipeline.api.auth import require_token
from pipeline.api.errors import BROKER_DOWN, BROKER_ERRORS
from pipeline.api.jobs import ERRORS, JobId
from pipeline.api.strict import reject_unknown_query
from pipeline.status import FAILED_GRACE_S, JobState, JobStatus, job_status

POLL_S = 0.4
KEEPALIVE_S = 15.0


#: One event of the stream (OpenAPI 3.1 reads an event-stream `schema` as the schema of each event).
EVENT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "event": {"type": "string", "enum": ["status", "error"]},
        "data": {
            "type": "string",
            "contentMediaType": "application/json",
            "contentSchema": {"$ref": "#/components/schemas/JobStatus"},
            "description": "`status`: the job's status, as GET /jobs/{id}; `error`: {detail}.",
        },
        "retry": {"type": "integer"},
    },
}


def sse(event: str, data: Any) -> str:
    return f"event: {event}\ndata: {json.dumps(data, default=str, separators=(',', ':'))}\n\n"


async def stream(request: Request, job_id: str, status: JobStatus) -> AsyncIterator[str]:
    yield "retry: 2000\n\n"
    last: tuple[Any, ...] | None = None
    last_sent = failed_since = time.monotonic()
    while True:
        now = time.monotonic()
        key = (status.state, status.progress, status.attempts, status.final)
        if key != last:
            yield sse("status", status.model_dump(mode="json"))
            last, last_sent = key, now
        elif now - last_sent > KEEPALIVE_S:
            yield ": keep-alive\n\n"
            last_sent = now
        if status.final:
            return
        if status.state is not JobState.FAILED:
            failed_since = now
        elif now - failed_since > FAILED_GRACE_S:
            return
        if await request.is_disconnected():
            return
        await asyncio.sleep(POLL_S)
        try:
            status = await run_in_threadpool(job_status, job_id)
        except BROKER_ERRORS:
            yield sse("error", {"detail": BROKER_DOWN})
            return


def router() -> APIRouter:
    routes = APIRouter(dependencies=[Depends(require_token), Depends(reject_unknown_query)], responses=ERRORS)

    @routes.get(
        "/jobs/{job_id}/events",
        tags=["jobs"],
        summary="Server-sent events: the job's status on every change, until it ends",
        response_class=StreamingResponse,
        responses={200: {"description": "An event stream", "content": {"text/event-stream": {"schema": EVENT_SCHEMA}}}},
    )
    async def job_events(job_id: JobId, request: Request) -> StreamingResponse:
        first = await run_in_threadpool(job_status, job_id)  # a broker outage here is a 503, not a broken stream
        return StreamingResponse(
            stream(request, job_id, first),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-store", "X-Accel-Buffering": "no"},
        )

    return routes
