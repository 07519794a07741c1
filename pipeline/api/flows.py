"""Flow routes: `GET /flows/kinds`, `POST /flows/<name>` per declared flow, `GET /flows`, `GET /flows/{id}`,
`POST /flows/{id}/cancel`.

The start routes are generated from `pipeline.flows.FLOWS` (every module in TASK_MODULES is imported first), so
OpenAPI documents each flow's input model and only declared flows can be started. A start answers `202` only after
the flow and its first steps' jobs are stored (one script call, `pipeline.flows.launch`); broker errors, refused
writes and invalid input reach the handlers of `pipeline.api.errors` as a job's enqueue does (503, 422). A start with
an `Idempotency-Key` header that an earlier start of the same flow used answers with that flow (`202`, nothing stored).
"""

from __future__ import annotations

import inspect
from typing import Annotated, Any

from fastapi import APIRouter, Body, Depends, Header, HTTPException, Path, Query, Request, Response
from fastapi.concurrency import run_in_threadpool

from pipeline.api.auth import require_token
from pipeline.api.enqueue import IDEMPOTENCY_KEY_PATTERN, parameter, require_json, strict_body
from pipeline.api.errors import answers
from pipeline.api.jobs import BODY_ERRORS
from pipeline.api.jobs import ERRORS as JOB_ERRORS
from pipeline.api.models import FlowAccepted, FlowKind, FlowStep, Problem
from pipeline.api.strict import reject_unknown_query
from pipeline.config import example
from pipeline.control.flows import FlowFinished, FlowStatus, FlowSummary, cancel_flow, flow_status, list_flows
from pipeline.flows import FLOWS, Flow, FlowNotFound, start
from pipeline.flows.definition import NAME

IdempotencyKey = Annotated[
    str | None,
    Header(
        alias="Idempotency-Key",
        pattern=IDEMPOTENCY_KEY_PATTERN,
        description="The same key (per flow name, within ENQUEUE_IDEMPOTENCY_TTL) returns the first flow's id and "
        "stores nothing.",
    ),
]
FlowId = Annotated[str, Path(min_length=1, max_length=255, description="The flow's id (`POST /flows/{name}` gave it).")]
ERRORS: dict[int | str, dict[str, Any]] = {
    401: JOB_ERRORS[401],
    503: {
        "model": Problem,
        "description": "The broker is unreachable or out of memory (nothing was stored), or its replicas did not "
        "confirm the write (REDIS_WAIT_REPLICAS: a flow may have started on the primary; a retry with the same "
        "Idempotency-Key answers with it); retry after Retry-After.",
    },
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {
    404: {"model": Problem, "description": "No flow has this id (never started, or its record has expired)."}
}
#: Most flows one `GET /flows` lists.
MAX_LIST = 500


def status_path(flow_id: str) -> str:
    return f"/flows/{flow_id}"


def wrong_method() -> HTTPException:
    """405 for a path that names a flow (or `kinds`) with the method of a flow id's route (`Allow` is set by
    `pipeline.api.errors`): flow names and flow ids (UUIDs) share `/flows/<x>`."""
    return HTTPException(405, detail="Method Not Allowed")


def flow_kind(flow: Flow[Any]) -> FlowKind:
    schema = flow.input_model.model_json_schema()
    examples = schema.get("examples") or [None]
    given = flow.example if flow.example is not None else example(examples[0])  # webhook URLs pointed at the sink
    return FlowKind(
        name=flow.name,
        description=flow.description,
        input_schema=schema,
        example=given if isinstance(given, dict) else None,
        steps=[
            FlowStep(name=s.name, task=s.task.name, after=list(s.after), fan_out=s.each) for s in flow.steps.values()
        ],
    )


def start_endpoint(flow: Flow[Any]) -> Any:
    """The route function starting `flow`. Its body parameter is the flow's input model (FastAPI reads
    `__signature__`, and documents it); the body is then validated again strictly, as the batch route does (JSON types
    must match the schema: `0` is not a date, `"5"` is not an integer), so what OpenAPI refuses is refused."""
    model = flow.input_model

    async def endpoint(
        request: Request, response: Response, payload: Any, idempotency_key: str | None = None
    ) -> FlowAccepted:
        data = strict_body(model.model_validate_json, await request.body())
        flow_id = await run_in_threadpool(lambda: start(flow, data, idempotency_key=idempotency_key))
        response.headers["Location"] = status_path(flow_id)
        return FlowAccepted(id=flow_id, flow=flow.name, status_url=status_path(flow_id))

    body = Annotated[model, Body()]  # type: ignore[valid-type]  # a runtime model
    endpoint.__signature__ = inspect.Signature(  # type: ignore[attr-defined]  # FastAPI reads it
        [
            parameter("request", Request),
            parameter("response", Response),
            parameter("payload", body),
            parameter("idempotency_key", IdempotencyKey, None),
        ],
        return_annotation=FlowAccepted,
    )
    endpoint.__name__ = f"start_{flow.name}"
    return endpoint


def _start_routes(routes: APIRouter, names: list[str]) -> None:
    """`POST /flows/<name>` for each declared flow, and a 404 naming them for any other name."""
    for name in names:
        flow = FLOWS[name]
        routes.add_api_route(
            f"/flows/{name}",
            start_endpoint(flow),
            methods=["POST"],
            status_code=202,
            tags=["flows"],
            dependencies=[Depends(require_json)],
            strict_content_type=False,  # as the job routes: a body without Content-Type is read as JSON
            response_model=FlowAccepted,
            response_description="The flow and its first steps' jobs are stored; `Location` is its status URL.",
            summary=f"Start a {name} flow",
            description=f"{flow.description}\n\nSteps: {flow.outline()} (`each`: one job per item, in "
            "parallel).\n\nThe body is the flow's input, validated "
            "strictly (JSON types must match the schema); a `422` names each invalid field, and nothing is stored.",
            responses=BODY_ERRORS,
        )

    @routes.post("/flows/{name}", include_in_schema=False)
    def unknown_flow(name: str) -> None:
        if name == "kinds":
            raise wrong_method()
        raise HTTPException(404, detail=f"unknown flow {name!r}; declared: {', '.join(names) or 'none'}")


def router() -> APIRouter:
    routes = APIRouter(dependencies=[Depends(require_token), Depends(reject_unknown_query)], responses=ERRORS)
    names = sorted(FLOWS)

    @routes.get("/flows/kinds", response_model=list[FlowKind], tags=["flows"], summary="Declared flows and inputs")
    def kinds() -> list[FlowKind]:
        return [flow_kind(FLOWS[name]) for name in names]

    _start_routes(routes, names)

    @routes.get(
        "/flows",
        response_model=list[FlowSummary],
        tags=["flows"],
        summary="Recent flows, newest first: state, failed step, progress (no inputs)",
    )
    def recent(
        flow: Annotated[
            str | None, Query(max_length=63, pattern=NAME.pattern, description="Only flows of this name.")
        ] = None,
        limit: Annotated[int, Query(ge=1, le=MAX_LIST, description="At most this many.")] = 50,
    ) -> list[FlowSummary]:
        if flow is not None and flow not in FLOWS:
            message = f"no flow named {flow!r}; declared: {', '.join(names) or 'none'}"
            raise HTTPException(422, detail=[{"loc": ["query", "flow"], "msg": message, "type": "value_error"}])
        return list_flows(limit, flow)

    @routes.get(
        "/flows/{flow_id}",
        response_model=FlowStatus,
        responses=NOT_FOUND,
        tags=["flows"],
        summary="A flow step by step: each step's state, jobs and progress; the flow's state",
    )
    def get_flow(flow_id: FlowId) -> FlowStatus:
        if flow_id in FLOWS:  # `/flows/<name>` starts that flow: POST only
            raise wrong_method()
        with answers({FlowNotFound: 404}):
            return flow_status(flow_id)

    @routes.post(
        "/flows/{flow_id}/cancel",
        response_model=FlowStatus,
        tags=["flows"],
        summary="Cancel a flow: no further step is queued, its waiting and running jobs are cancelled",
        description="The flow ends `cancelled`; its steps' jobs that had not finished end `cancelled` as a cancelled "
        "job does (`POST /jobs/{id}/cancel`). A failed flow can be cancelled too (instead of replaying its step).",
        responses={
            **NOT_FOUND,
            409: {
                "model": Problem,
                "description": "The flow has finished (succeeded or cancelled): nothing to cancel.",
            },
        },
    )
    def cancel(flow_id: FlowId) -> FlowStatus:
        with answers({FlowNotFound: 404, FlowFinished: 409}):
            return cancel_flow(flow_id)

    return routes
