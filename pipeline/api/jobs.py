"""Job routes: `POST /jobs/<kind>` for every registered kind, `GET /jobs/{id}`, `GET /kinds`.

The enqueue routes are generated from `pipeline.task.REGISTRY`: each kind's body is exactly its payload
model (so the same JSON works for the API, the CLI and `send_task`), and OpenAPI documents it. Delay
and ETA are query parameters; the `Idempotency-Key` header makes a repeated request return the first
job's id. The 202 is sent only after the publish to Redis returned; any broker error propagates to
the 503 handler in `pipeline.api.errors`.
"""

from __future__ import annotations

import inspect
import re
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, HTTPException, Path, Query, Response
from pydantic import BeforeValidator

from pipeline.api.auth import require_token
from pipeline.api.models import Accepted, JobStatus, Kind, Problem
from pipeline.api.strict import reject_unknown_query
from pipeline.app import app as celery_app
from pipeline.config import get_settings
from pipeline.jobs import job_status
from pipeline.task import TypedTask

ETA_PATTERN = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?([Zz]|[+-]\d{2}:?\d{2})?$")
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,200}$"
JobId = Annotated[str, Path(min_length=1, max_length=255, description="The job's id (a Celery task id).")]
ERRORS: dict[int | str, dict[str, Any]] = {
    401: {"model": Problem, "description": "Missing or invalid bearer token."},
    503: {"model": Problem, "description": "The broker is unreachable; see Retry-After."},
}


def status_path(job_id: str) -> str:
    return f"/jobs/{job_id}"


def max_delay_s() -> int:
    """Longest delay the Redis broker honours safely: a countdown past the visibility timeout is redelivered."""
    return get_settings().visibility_timeout


def parse_eta(value: Any) -> Any:
    """An ISO 8601 time only: pydantic alone would also read a bare number as a Unix timestamp."""
    if isinstance(value, str) and not ETA_PATTERN.match(value):
        raise ValueError("eta must be an ISO 8601 date-time, e.g. 2030-01-31T12:00:00Z")
    return value


IsoDateTime = Annotated[datetime, BeforeValidator(parse_eta)]


def _run_at(delay_seconds: float | None, eta: datetime | None) -> tuple[float | None, datetime | None]:
    if delay_seconds is not None and eta is not None:
        raise HTTPException(
            422, detail=[{"loc": ["query", "eta"], "msg": "give delay_seconds or eta, not both", "type": "value_error"}]
        )
    if eta is not None:
        eta = eta if eta.tzinfo else eta.replace(tzinfo=UTC)
        if eta - datetime.now(UTC) > timedelta(seconds=max_delay_s()):
            raise HTTPException(
                422,
                detail=[
                    {"loc": ["query", "eta"], "type": "value_error", "msg": f"eta is more than {max_delay_s()} s ahead"}
                ],
            )
    return delay_seconds, eta


def require_json(content_type: Annotated[str | None, Header(include_in_schema=False)] = None) -> None:
    """415 for a body declared as anything but JSON (a missing Content-Type is read as JSON)."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise HTTPException(415, detail="send the payload as JSON (Content-Type: application/json)")


def enqueue_endpoint(typed: TypedTask[Any, Any]) -> Any:
    """A route function whose body parameter is `typed`'s payload model (FastAPI reads `__signature__`)."""

    def endpoint(
        response: Response, payload: Any, delay_seconds: float | None, eta: datetime | None, idempotency_key: str | None
    ) -> Accepted:
        countdown, when = _run_at(delay_seconds, eta)
        task_id = typed.enqueue(payload, countdown=countdown, eta=when, idempotency_key=idempotency_key)
        response.headers["Location"] = status_path(task_id)
        return Accepted(id=task_id, status_url=status_path(task_id))

    params = [
        inspect.Parameter("response", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Response),
        inspect.Parameter(
            "payload", inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=Annotated[typed.payload_model, Body()]
        ),
        inspect.Parameter(
            "delay_seconds",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=None,
            annotation=Annotated[
                float | None, Query(ge=0, le=max_delay_s(), description="Run no sooner than this many seconds.")
            ],
        ),
        inspect.Parameter(
            "eta",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=None,
            annotation=Annotated[
                IsoDateTime | None,
                Query(description="Run no sooner than this time (ISO 8601, UTC if no offset); not with delay_seconds."),
            ],
        ),
        inspect.Parameter(
            "idempotency_key",
            inspect.Parameter.POSITIONAL_OR_KEYWORD,
            default=None,
            annotation=Annotated[
                str | None,
                Header(
                    alias="Idempotency-Key",
                    pattern=IDEMPOTENCY_KEY_PATTERN,
                    description="The same key (per kind, within ENQUEUE_IDEMPOTENCY_TTL) returns the first job's id.",
                ),
            ],
        ),
    ]
    endpoint.__signature__ = inspect.Signature(params, return_annotation=Accepted)  # type: ignore[attr-defined]  # FastAPI reads it
    endpoint.__name__ = f"enqueue_{typed.kind.replace('-', '_')}"
    return endpoint


def kind_info(typed: TypedTask[Any, Any]) -> Kind:
    schema = typed.payload_model.model_json_schema()
    examples = schema.get("examples") or [{}]
    return Kind(
        kind=typed.kind,
        task=typed.name,
        queue=celery_app.amqp.router.route({}, typed.name)["queue"].name,
        description=inspect.getdoc(typed.task) or "",
        payload_schema=schema,
        example=examples[0] if isinstance(examples[0], dict) else {},
    )


def router(registry: dict[str, TypedTask[Any, Any]]) -> APIRouter:
    routes = APIRouter(dependencies=[Depends(require_token), Depends(reject_unknown_query)], responses=ERRORS)
    kinds = sorted(registry)
    for kind in kinds:
        typed = registry[kind]
        routes.add_api_route(
            f"/jobs/{kind}",
            enqueue_endpoint(typed),
            methods=["POST"],
            status_code=202,
            response_model=Accepted,
            tags=["jobs"],
            summary=f"Enqueue a {kind} job ({typed.name})",
            description=kind_info(typed).description,
            dependencies=[Depends(require_json)],
            responses={
                400: {"model": Problem, "description": "The body is not UTF-8 text, or Content-Length is invalid."},
                413: {"model": Problem, "description": "Request body too large."},
                415: {"model": Problem, "description": "The body is not JSON."},
            },
        )

    @routes.post("/jobs/{kind}", include_in_schema=False)
    def unknown_kind(kind: str) -> None:
        raise HTTPException(404, detail=f"unknown job kind {kind!r}; known: {', '.join(kinds)}")

    @routes.get("/jobs/{job_id}", response_model=JobStatus, tags=["jobs"], summary="A job's state and result")
    def get_job(job_id: JobId) -> dict[str, Any]:
        return job_status(job_id)

    @routes.get("/kinds", response_model=list[Kind], tags=["jobs"], summary="Job kinds, their schemas and examples")
    def list_kinds() -> list[Kind]:
        return [kind_info(registry[k]) for k in kinds]

    return routes
