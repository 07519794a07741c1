"""How failures become HTTP answers: broker unreachable → 503 + Retry-After, bad input → 422 field errors.

A request never turns a broker outage into a 500, and never gets a 202 for a job that was not stored:
the enqueue path raises before answering, and these handlers translate what it raised. A write the broker
refused as durable (`BrokerWriteRefused`: fewer replicas than REDIS_WAIT_REPLICAS confirmed it, or Redis is at
maxmemory) is a 503 with Retry-After too, its detail saying which: retry, with the same Idempotency-Key.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import redis.exceptions
from celery.exceptions import BackendGetMetaError, BackendStoreError
from fastapi import FastAPI, HTTPException, Request
from fastapi.exception_handlers import http_exception_handler
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from kombu.exceptions import OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException

from pipeline.api.strict import documented_methods
from pipeline.broker import full, oom_cause
from pipeline.config import get_settings
from pipeline.errors import BrokerWriteRefused, PayloadInvalid

#: What producer and status calls raise when Redis cannot be reached (or is still loading its AOF).
BROKER_ERRORS: tuple[type[Exception], ...] = (
    OperationalError,
    redis.exceptions.ConnectionError,
    redis.exceptions.TimeoutError,
    BackendGetMetaError,
    BackendStoreError,
)
BROKER_DOWN = "the broker is unreachable; nothing was stored, retry later"


@contextmanager
def answers(codes: dict[type[Exception], int]) -> Iterator[None]:
    """A route's own failures as answers: an exception of `codes` becomes its status (404 no such thing, 409 not in a
    state for it) with its message as the detail."""
    try:
        yield
    except tuple(codes) as exc:
        status = next(status for kind, status in codes.items() if isinstance(exc, kind))
        raise HTTPException(status, detail=str(exc)) from None


def broker_unavailable(detail: str = BROKER_DOWN) -> JSONResponse:
    return JSONResponse(
        {"detail": detail},
        status_code=503,
        headers={"Retry-After": str(get_settings().api_retry_after)},
    )


def _field_errors(errors: list[Any]) -> list[dict[str, Any]]:
    """Pydantic/FastAPI errors without the echoed input: location, message and type only."""
    return [
        {
            "loc": [str(p) if not isinstance(p, int) else p for p in e.get("loc", ())],
            "msg": str(e.get("msg", "")),
            "type": str(e.get("type", "value_error")),
        }
        for e in errors
        if isinstance(e, dict)
    ]


async def _on_broker_error(request: Request, exc: Exception) -> JSONResponse:
    refusal = oom_cause(exc)  # kombu re-raises Redis's OOM refusal as a connection error
    return broker_unavailable(str(full(refusal))) if refusal is not None else broker_unavailable()


async def _on_write_refused(request: Request, exc: Exception) -> JSONResponse:
    """`NotReplicated` or `BrokerFull` (or Redis's own OOM refusal from a path that did not wrap it)."""
    refusal = oom_cause(exc)
    if not isinstance(exc, BrokerWriteRefused) and refusal is not None:
        exc = full(refusal)
    return broker_unavailable(str(exc))


async def _on_payload_invalid(request: Request, exc: Exception) -> JSONResponse:
    return JSONResponse({"detail": _field_errors(getattr(exc, "errors", []))}, status_code=422)


async def _on_validation_error(request: Request, exc: Exception) -> JSONResponse:
    errors = exc.errors() if isinstance(exc, RequestValidationError) else []
    return JSONResponse({"detail": _field_errors(list(errors))}, status_code=422)


async def _on_http_error(request: Request, exc: Exception) -> Response:
    """Starlette's answer, except that a 405's Allow lists every documented method of the path."""
    response = await http_exception_handler(request, exc)  # type: ignore[arg-type]  # registered for HTTPException
    if response.status_code == 405:
        response.headers["Allow"] = ", ".join(sorted(documented_methods(request.app, request.url.path)))
    return response


def install(app: FastAPI) -> None:
    app.add_exception_handler(StarletteHTTPException, _on_http_error)
    for error in BROKER_ERRORS:
        app.add_exception_handler(error, _on_broker_error)
    app.add_exception_handler(BrokerWriteRefused, _on_write_refused)
    app.add_exception_handler(redis.exceptions.OutOfMemoryError, _on_write_refused)
    app.add_exception_handler(PayloadInvalid, _on_payload_invalid)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
