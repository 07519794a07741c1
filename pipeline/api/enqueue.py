"""Building the `POST /jobs/<kind>` and `POST /jobs/<kind>/batch` route functions of one job kind.

The body parameter is exactly the kind's payload model (so the same JSON works for the API, the CLI and
`send_task`). Delay and ETA are query parameters, at most `MAX_DELAY_S` ahead (a product limit: delayed
jobs are parked in Redis, so no worker holds them meanwhile); the
`Idempotency-Key` header makes a repeated request return the first job's id; `?priority=` (0-9, 0 the most
urgent) is the job's priority (`pipeline.queues.priority`). The function returns only
after `enqueue()` did, i.e. after the publish to Redis returned; broker errors propagate to the 503
handler in `pipeline.api.errors`. The batch route takes a JSON array of such payloads (at most MAX_BATCH)
and publishes them with `TypedTask.enqueue_many`: all or none, a bad item named by its index.
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Annotated, Any, TypeVar

from fastapi import Body, Header, HTTPException, Query, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from pydantic import BeforeValidator, Field, TypeAdapter, ValidationError

from pipeline.api.models import Accepted, AcceptedBatch
from pipeline.constants import GROUP_MAX_LENGTH
from pipeline.queues.priority import MAX_PRIORITY, MIN_PRIORITY
from pipeline.task import TypedTask

_T = TypeVar("_T")

ETA_PATTERN = re.compile(r"^\d{4}-\d{2}-\d{2}[Tt ]\d{2}:\d{2}(:\d{2}(\.\d{1,6})?)?([Zz]|[+-]\d{2}:?\d{2})?$")
IDEMPOTENCY_KEY_PATTERN = r"^[\x21-\x7e]{1,200}$"


def status_path(job_id: str) -> str:
    return f"/jobs/{job_id}"


#: Furthest ahead a job may be scheduled through the API: a year. Any delay is safe (a job due later than
#: DELAYED_RELEASE_AHEAD is parked in Redis by `pipeline.publish.schedule`, not held by a worker); this only
#: refuses absurd values, e.g. milliseconds sent as seconds.
MAX_DELAY_S = 365 * 24 * 3600
MAX_DELAY_TEXT = f"{MAX_DELAY_S // 86400} days"


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
        if eta - datetime.now(UTC) > timedelta(seconds=MAX_DELAY_S):
            raise HTTPException(
                422,
                detail=[
                    {"loc": ["query", "eta"], "type": "value_error", "msg": f"eta is more than {MAX_DELAY_TEXT} ahead"}
                ],
            )
    return delay_seconds, eta


def require_json(content_type: Annotated[str | None, Header(include_in_schema=False)] = None) -> None:
    """415 for a body declared as anything but JSON (a missing Content-Type is read as JSON)."""
    media = (content_type or "application/json").split(";")[0].strip().lower()
    if media != "application/json" and not media.endswith("+json"):
        raise HTTPException(415, detail="send the payload as JSON (Content-Type: application/json)")


def parameter(name: str, annotation: Any, default: Any = inspect.Parameter.empty) -> inspect.Parameter:
    """A parameter of a route function built at run time (FastAPI reads where it comes from in `annotation`)."""
    return inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, annotation=annotation, default=default)


def strict_body(validate_json: Callable[..., _T], body: bytes) -> _T:
    """`body` read by `validate_json` (a model's or adapter's) in strict mode; its errors as the 422 FastAPI gives
    a declared body, each located under `body`, without the input echoed."""
    try:
        return validate_json(body, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False, include_input=False)
        raise RequestValidationError([{**e, "loc": ("body", *e["loc"])} for e in errors]) from None


#: `?priority=`: 0 (most urgent) to 9; anything else is a 422 before anything is published.
PriorityQuery = Annotated[
    int | None,
    Query(
        ge=MIN_PRIORITY,
        le=MAX_PRIORITY,
        description=f"{MIN_PRIORITY} (most urgent) to {MAX_PRIORITY}; omitted: TASK_DEFAULT_PRIORITY. Workers "
        "take the most urgent level first (levels 0-2, 3-5, 6-8, 9; first in, first out within one).",
    ),
]


def enqueue_endpoint(typed: TypedTask[Any, Any]) -> Any:
    """A route function whose body parameter is `typed`'s payload model (FastAPI reads `__signature__`)."""

    def endpoint(
        response: Response,
        payload: Any,
        delay_seconds: float | None,
        eta: datetime | None,
        priority: int | None,
        idempotency_key: str | None,
        group: str | None = None,
    ) -> Accepted:
        countdown, when = _run_at(delay_seconds, eta)
        task_id = typed.enqueue(
            payload, countdown=countdown, eta=when, idempotency_key=idempotency_key, priority=priority, group=group
        )
        response.headers["Location"] = status_path(task_id)
        return Accepted(id=task_id, status_url=status_path(task_id))

    params = [
        parameter("response", Response),
        parameter("payload", Annotated[typed.payload_model, Body()]),
        parameter(
            "delay_seconds",
            Annotated[
                float | None,
                Query(
                    ge=0,
                    le=MAX_DELAY_S,
                    description=f"Run no sooner than this many seconds (at most {MAX_DELAY_S}: {MAX_DELAY_TEXT}).",
                ),
            ],
            None,
        ),
        parameter(
            "eta",
            Annotated[
                IsoDateTime | None,
                Query(
                    description=f"Run no sooner than this time (ISO 8601, UTC if no offset), at most {MAX_DELAY_TEXT} "
                    "ahead; not with delay_seconds."
                ),
            ],
            None,
        ),
        parameter("priority", PriorityQuery, None),
        parameter(
            "idempotency_key",
            Annotated[
                str | None,
                Header(
                    alias="Idempotency-Key",
                    pattern=IDEMPOTENCY_KEY_PATTERN,
                    description="The same key (per kind, within ENQUEUE_IDEMPOTENCY_TTL) returns the first job's id.",
                ),
            ],
            None,
        ),
        GROUP_PARAMETER,
    ]
    endpoint.__signature__ = inspect.Signature(params, return_annotation=Accepted)  # type: ignore[attr-defined]  # FastAPI reads it
    endpoint.__name__ = f"enqueue_{typed.kind.replace('-', '_')}"
    return endpoint


GROUP_DESCRIPTION = (
    f"The job's group (a tenant, up to {GROUP_MAX_LENGTH} printable characters): a queue's jobs are taken "
    "round-robin across groups, and GROUP_CONCURRENCY caps how many of one group run at once."
)
#: `?group=`, on the single and the batch route.
GROUP_PARAMETER = parameter(
    "group", Annotated[str | None, Query(max_length=GROUP_MAX_LENGTH, description=GROUP_DESCRIPTION)], None
)


#: Most jobs one `POST /jobs/<kind>/batch` request may carry (its body also counts against API_MAX_BODY_BYTES).
MAX_BATCH = 1000


def enqueue_batch_endpoint(typed: TypedTask[Any, Any]) -> tuple[Any, dict[str, Any]]:
    """The batch route function of `typed` and its OpenAPI request body (a JSON array of the kind's payloads).

    The body is validated as JSON in one call, strictly (JSON types must match the schema: `false` is not an
    integer, `"5"` is not a number), errors located like FastAPI's (`["body", index, field]`), then published
    with `TypedTask.enqueue_many`.
    """
    model: Any = typed.payload_model
    adapter: TypeAdapter[list[Any]] = TypeAdapter(Annotated[list[model], Field(min_length=1, max_length=MAX_BATCH)])

    async def endpoint(
        request: Request,
        priority: PriorityQuery = None,
        group: Annotated[str | None, Query(max_length=GROUP_MAX_LENGTH, description=GROUP_DESCRIPTION)] = None,
    ) -> AcceptedBatch:
        jobs = strict_body(adapter.validate_json, await request.body())
        ids = await run_in_threadpool(lambda: typed.enqueue_many(jobs, priority=priority, group=group))
        return AcceptedBatch(ids=ids, status_urls=[status_path(i) for i in ids])

    endpoint.__name__ = f"enqueue_{typed.kind.replace('-', '_')}_batch"
    # The most items is said in words, not as maxItems: a longer array is refused (422) like any invalid body,
    # but a body over API_MAX_BODY_BYTES gets its 413 before it is read, which OpenAPI cannot express.
    schema = {
        "type": "array",
        "items": {"$ref": f"#/components/schemas/{model.__name__}"},
        "minItems": 1,
        "description": f"1 to {MAX_BATCH} payloads, validated together.",
    }
    body = {"required": True, "content": {"application/json": {"schema": schema}}}
    return endpoint, {"requestBody": body}
