"""Job routes: `POST /jobs/<kind>` and `/jobs/<kind>/batch` per kind, `GET /jobs/{id}`, `POST /jobs/{id}/cancel`,
`GET /jobs`, `GET /kinds`.

The enqueue routes are generated from `pipeline.task.REGISTRY` (see `pipeline.api.enqueue`), so OpenAPI
documents each kind's payload model, and only registered kinds can be enqueued.
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from fastapi import APIRouter, Depends, HTTPException, Path, Query

from pipeline.api.auth import require_token
from pipeline.api.enqueue import MAX_BATCH, enqueue_batch_endpoint, enqueue_endpoint, require_json
from pipeline.api.errors import answers
from pipeline.api.models import Accepted, AcceptedBatch, Kind, Problem
from pipeline.api.strict import reject_unknown_query
from pipeline.browse.listing import browse
from pipeline.browse.model import MAX_LIMIT, BadCursor, BrowseState, JobPage
from pipeline.celery_app import get_app
from pipeline.config import example
from pipeline.control.cancel import JobFinished, JobNotFound, cancel
from pipeline.queues.routed import UnknownQueue
from pipeline.status import JobStatus, job_status
from pipeline.task import TypedTask

JobId = Annotated[str, Path(min_length=1, max_length=255, description="The job's id (a Celery task id).")]
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "Missing or invalid bearer token."},
    503: {
        "model": Problem,
        "description": "The broker is unreachable, out of memory, or its replicas did not confirm the write "
        "(REDIS_WAIT_REPLICAS): nothing is accepted; retry after Retry-After (with the same Idempotency-Key).",
    },
}


BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {"model": Problem, "description": "The body is not UTF-8 text, or Content-Length is invalid."},
    408: {"model": Problem, "description": "The body did not arrive within API_BODY_TIMEOUT."},
    413: {"model": Problem, "description": "Request body too large."},
    415: {"model": Problem, "description": "Content-Type is not JSON (none at all is read as JSON)."},
}


def kind_info(typed: TypedTask[Any, Any]) -> Kind:
    schema = typed.payload_model.model_json_schema()
    examples = schema.get("examples") or [{}]
    return Kind(
        kind=typed.kind,
        task=typed.name,
        queue=get_app().amqp.router.route({}, typed.name)["queue"].name,
        description=inspect.getdoc(typed.task) or "",
        payload_schema=schema,
        example=example(examples[0]) if isinstance(examples[0], dict) else {},
    )


def _bad_query(name: str, message: str) -> HTTPException:
    return HTTPException(422, detail=[{"loc": ["query", name], "msg": message, "type": "value_error"}])


def router(registry: dict[str, TypedTask[Any, Any]]) -> APIRouter:
    routes = APIRouter(dependencies=[Depends(require_token), Depends(reject_unknown_query)], responses=ERRORS)
    kinds = sorted(registry)
    # A body without Content-Type is read as JSON (documented). FastAPI's strict default guards
    # cookie-authenticated apps against cross-site form posts; these routes need a bearer header,
    # which a cross-site request cannot carry without a CORS preflight.
    post: dict[str, Any] = {
        "methods": ["POST"],
        "status_code": 202,
        "tags": ["jobs"],
        "dependencies": [Depends(require_json)],
        "strict_content_type": False,
        "responses": BODY_ERRORS,
    }
    for kind in kinds:
        typed = registry[kind]
        routes.add_api_route(
            f"/jobs/{kind}",
            enqueue_endpoint(typed),
            response_model=Accepted,
            response_description="The job is stored in the broker; `Location` is its status URL.",
            summary=f"Enqueue a {kind} job ({typed.name})",
            description=kind_info(typed).description,
            **post,
        )
        batch, batch_body = enqueue_batch_endpoint(typed)
        routes.add_api_route(
            f"/jobs/{kind}/batch",
            batch,
            response_model=AcceptedBatch,
            response_description="Every job is stored in the broker, in order.",
            summary=f"Enqueue up to {MAX_BATCH} {kind} jobs at once ({typed.name})",
            description="A JSON array of payloads, validated together: one invalid item refuses the whole "
            "batch (422, its `loc` names the item's index) and nothing is published.",
            openapi_extra=batch_body,
            **post,
        )

    @routes.post("/jobs/{kind}", include_in_schema=False)
    def unknown_kind(kind: str) -> None:
        raise HTTPException(404, detail=f"unknown job kind {kind!r}; known: {', '.join(kinds)}")

    @routes.get("/jobs/{job_id}", response_model=JobStatus, tags=["jobs"], summary="A job's state and result")
    def get_job(job_id: JobId) -> JobStatus:
        return job_status(job_id)

    @routes.post(
        "/jobs/{job_id}/cancel",
        response_model=JobStatus,
        tags=["jobs"],
        summary="Cancel a job: waiting, scheduled or retrying, it never runs; running, it is stopped",
        description="The job ends `cancelled` (not failed, not dead-lettered): a waiting, scheduled or retrying job "
        "never runs; a running one is stopped within a few seconds, and its worker goes on to its next job.",
        responses={
            404: {"model": Problem, "description": "No job has this id (or its record has expired)."},
            409: {
                "model": Problem,
                "description": "The job has finished (succeeded, failed, dead-lettered or "
                "cancelled): nothing to cancel.",
            },
        },
    )
    def cancel_job(job_id: JobId) -> JobStatus:
        with answers({JobNotFound: 404, JobFinished: 409}):
            return cancel(job_id)

    @routes.get(
        "/jobs",
        response_model=JobPage,
        tags=["jobs"],
        summary="Every queue's jobs by state: counts and one page of rows (no payloads)",
    )
    def list_jobs(
        queue: Annotated[str, Query(max_length=200, description="A queue the app routes to (`GET /queues`).")],
        state: Annotated[BrowseState, Query(description="Which of the queue's jobs to list.")],
        cursor: Annotated[str | None, Query(max_length=512, description="`next_cursor` of the previous page.")] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_LIMIT, description="Rows per page.")] = 50,
    ) -> JobPage:
        try:
            return browse(queue, state, cursor, limit)
        except UnknownQueue as exc:
            raise _bad_query("queue", str(exc)) from None
        except BadCursor as exc:
            raise _bad_query("cursor", str(exc)) from None

    @routes.get("/kinds", response_model=list[Kind], tags=["jobs"], summary="Job kinds, their schemas and examples")
    def list_kinds() -> list[Kind]:
        return [kind_info(registry[k]) for k in kinds]

    return routes
