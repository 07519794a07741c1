"""Turning a final failure or a refused message into a dead-letter envelope (called by pipeline.runtime.signals)."""

from __future__ import annotations

import json
import logging
from typing import Any

from pipeline.celery_app import get_app
from pipeline.config import get_settings
from pipeline.constants import HEADER_FLOW, HEADER_IDEMPOTENCY_KEY
from pipeline.dlq import poison
from pipeline.dlq.envelope import DELIVERIES_LIMIT, DeadLetter, Reason, exception_name, flush_spool, publish
from pipeline.flows.definition import FLOWS
from pipeline.flows.record import Ref, failed
from pipeline.observability import flow_metrics, payloads
from pipeline.task import request_header

log = logging.getLogger(__name__)


def _queue_for(task_name: str | None, delivery_info: dict[str, Any] | None) -> str | None:
    if delivery_info and delivery_info.get("routing_key"):
        return str(delivery_info["routing_key"])
    if not task_name:
        return None
    return str(get_app().amqp.router.route({}, task_name)["queue"].name)


def from_failure(task: Any, task_id: str | None, exc: BaseException | None, args: Any, kwargs: Any, einfo: Any) -> None:
    """A task failed for good (in a pool child, or in the main process for a lost child / hard time limit)."""
    request = task.request
    name = str(task.name)
    headers: dict[str, Any] = {}
    key = request_header(request, HEADER_IDEMPOTENCY_KEY)
    if key:
        headers[HEADER_IDEMPOTENCY_KEY] = key
    step = Ref.of(request_header(request, HEADER_FLOW))
    if step is not None:  # replayed, the job runs its step of the flow again (and asks the flow first)
        headers[HEADER_FLOW] = {**step.header(), "replayed": True}
    publish(
        DeadLetter(
            reason="failed",
            task_name=name,
            task_id=task_id,
            queue=_queue_for(name, request.delivery_info),
            args=list(args) if args is not None else None,
            kwargs=dict(kwargs) if kwargs else None,
            attempts=int(request.retries or 0) + 1,
            exception_type=exception_name(exc),
            exception_message=str(exc) if exc is not None else "",
            traceback=str(einfo.traceback) if einfo is not None and einfo.traceback else None,
            worker=request.hostname or DeadLetter.model_fields["worker"].get_default(call_default_factory=True),
            headers=headers,
        )
    )
    if step is not None:
        turned = False
        try:
            turned = failed(step)  # the flow is failed at this step until the entry is replayed
        except Exception:  # the entry is kept (or spooled): its flow shows failed once it is replayed or read again
            log.exception("flow %s %s: could not mark %s failed", step.flow, step.id, step.node)
        declared = FLOWS.get(step.flow)
        if declared is not None and step.step in declared.steps:  # declared names only: the labels stay bounded
            flow_metrics.step_dead_lettered(step.flow, step.step, turned)


def _args_kwargs(args: Any, kwargs: Any) -> bool:
    return isinstance(args, list) and isinstance(kwargs, dict)


def _body_fields(message: Any) -> dict[str, Any]:
    """Arguments from a JSON protocol-2 body; a bounded preview of anything else. Never unpickles.

    A body over the worker's size limit is never decoded: the entry keeps its first bytes, size and sha256.
    """
    body = poison.body_bytes(message)
    if len(body) > poison.body_limit(get_settings().max_payload_bytes):
        return poison.bounded_body(body)
    if message.content_type == "application/json":
        try:
            decoded = json.loads(body)
        except ValueError:
            decoded = None
        if (
            isinstance(decoded, list)
            and len(decoded) >= 2
            and isinstance(decoded[0], list)
            and isinstance(decoded[1], dict)
        ):
            return {"args": list(decoded[0]), "kwargs": dict(decoded[1]) or None}
    return {"body_preview": body[: poison.PREVIEW_BYTES].decode("utf-8", "replace")}


def from_message(
    reason: Reason, message: Any, exc: BaseException | None, *, task_name: str | None = None, task_id: str | None = None
) -> str | None:
    """The worker refused a message: disallowed content, unknown task name, or an undecodable body.

    Returns the entry's id. Inside `payloads.refused_message` (Celery's signals sent while our consumer
    handles a message it already dead-lettered) it returns that entry's id and publishes nothing.
    """
    handled = payloads.refused_entry()
    if handled is not None:
        return handled or None
    if poison.from_dead_letter_queue(message.delivery_info):
        # An envelope is never dead-lettered again (it would nest, and the original entry would be gone).
        log.error("a message from the dead-letter queue reached a refusal path; it is not dead-lettered again")
        return None
    headers = message.headers if isinstance(message.headers, dict) else {}
    name = task_name or headers.get("task")
    if reason == "unknown_task":
        exc_type, exc_message = "celery.exceptions.NotRegistered", f"no task named {name!r} is registered"
    elif exc is not None:
        exc_type, exc_message = exception_name(exc), str(exc)
    else:
        exc_type, exc_message = "UnknownMessage", "message is not a Celery task"
    return publish(
        DeadLetter(
            reason=reason,
            task_name=name,
            task_id=task_id or headers.get("id"),
            queue=_queue_for(None, message.delivery_info),
            exception_type=exc_type,
            exception_message=exc_message,
            content_type=message.content_type,
            **_body_fields(message),
        )
    )


def from_delivery_limit(
    message: Any, task_name: str, task_id: str, exc: BaseException, count: int, deliveries: list[dict[str, Any]]
) -> str:
    """A message delivered more than MAX_DELIVERIES times: dead-lettered with its delivery history, not run."""
    headers = message.headers if isinstance(message.headers, dict) else {}
    kept = {HEADER_IDEMPOTENCY_KEY: headers[HEADER_IDEMPOTENCY_KEY]} if headers.get(HEADER_IDEMPOTENCY_KEY) else {}
    return publish(
        DeadLetter(
            reason="delivery_limit",
            task_name=task_name,
            task_id=task_id,
            queue=_queue_for(task_name, message.delivery_info),
            attempts=count,
            exception_type=exception_name(exc),
            exception_message=str(exc),
            content_type=message.content_type,
            headers=kept,
            deliveries=deliveries[-DELIVERIES_LIMIT:],
            **_body_fields(message),
        )
    )


def from_raw(raw: bytes, queue: str | None, exc: BaseException) -> str:
    """A queue held bytes that are not a broker message at all (not JSON, or not kombu's envelope)."""
    return publish(
        DeadLetter(
            reason="undecodable",
            queue=queue,
            exception_type=exception_name(exc),
            exception_message=str(exc),
            **poison.bounded_body(raw),
        )
    )


def on_worker_ready() -> None:
    flush_spool()
    if get_settings().remap_sigterm != "SIGQUIT":
        log.warning(
            "REMAP_SIGTERM is not SIGQUIT: SIGTERM waits for running tasks without a bound. "
            "The start scripts set REMAP_SIGTERM=SIGQUIT for a soft shutdown bounded by "
            "WORKER_SOFT_SHUTDOWN_TIMEOUT."
        )
