"""What makes a message poison: the checks a worker runs before Celery turns a message into a job.

Celery assumes a protocol-2 message is well formed: `celery/worker/request.py` (`Request.__init__`)
reads `headers['id']` and unpacks the body as `args, kwargs, embed`, and `celery/worker/strategy.py`
(`default.task_message_handler`) evaluates `'args' in message.payload`. A body that is a JSON object,
a number or a two-element list, or headers without an `id`, raise there, outside the errors the
consumer handles (`celery/worker/consumer/consumer.py`, `create_task_handler.on_task_received`
catches only InvalidTaskError, ContentDisallowed and DecodeError), and the worker exits. The consumer
(`pipeline.dlq.consumer`) runs `problem()` first and refuses such a message as an InvalidTaskError.

Size: a message bigger than a payload may be (MAX_PAYLOAD_BYTES, plus room for kwargs and Celery's
embed) is refused before it is decoded, so it is never run, no result is stored for it, and its
dead-letter entry keeps only a preview, the size and a sha256 (`bounded_body`).
"""

from __future__ import annotations

import hashlib
from typing import Any

from celery.exceptions import InvalidTaskError
from kombu.exceptions import KombuError

from pipeline.constants import DEAD_LETTER_QUEUE

#: What a message body may carry beyond the payload itself (kwargs, Celery's embed: callbacks, chord).
BODY_OVERHEAD_BYTES = 64 * 1024
#: How much of a refused message's body its dead-letter entry keeps.
PREVIEW_BYTES = 2048


class MessageTooLarge(InvalidTaskError):
    """The message body is over the size a worker accepts."""


class MalformedMessage(InvalidTaskError):
    """The message claims to be a task but its headers or body are not Celery's protocol 2."""


def body_bytes(message: Any) -> bytes:
    body = message.body
    if isinstance(body, bytes):
        return body
    return str(body if body is not None else "").encode("utf-8", "replace")


def body_limit(max_payload_bytes: int) -> int:
    return max_payload_bytes + BODY_OVERHEAD_BYTES


def bounded_body(raw: bytes) -> dict[str, Any]:
    """A preview of `raw` (its first PREVIEW_BYTES, as text), its size and its sha256."""
    return {
        "body_preview": raw[:PREVIEW_BYTES].decode("utf-8", "replace"),
        "body_size": len(raw),
        "body_sha256": hashlib.sha256(raw).hexdigest(),
    }


def from_dead_letter_queue(delivery_info: Any) -> bool:
    """The message was delivered from the dead-letter queue (an envelope: never a job)."""
    if not isinstance(delivery_info, dict):
        return False
    return DEAD_LETTER_QUEUE in (delivery_info.get("routing_key"), delivery_info.get("exchange"))


def _body_problem(payload: Any) -> str | None:
    if isinstance(payload, dict):
        # Celery's "hybrid" form (a protocol-1 body with protocol-2 headers) carries `args` in the body.
        return None if "args" in payload else "the body is a JSON object, not [args, kwargs, embed]"
    if not isinstance(payload, list | tuple) or len(payload) != 3:
        return f"the body is a {type(payload).__name__} of the wrong shape, not [args, kwargs, embed]"
    args, kwargs, embed = payload
    if not isinstance(args, list | tuple):
        return "the body's args are not a list"
    if not isinstance(kwargs, dict):
        return "the body's kwargs are not an object"
    if embed is not None and not isinstance(embed, dict):
        return "the body's embed is not an object"
    return None


def problem(message: Any, limit: int) -> InvalidTaskError | None:
    """Why the worker must refuse `message` before Celery handles it, or None.

    Only what would crash the worker or bypass the size bound is checked; everything else (an unknown
    task name, disallowed content, an undecodable body, a message that is not a task) is left to
    Celery, whose handlers the consumer extends.
    """
    size = len(body_bytes(message))
    if size > limit:
        return MessageTooLarge(f"the message body is {size} bytes; the limit is {limit}")
    headers = message.headers
    if not isinstance(headers, dict) or "task" not in headers:
        return None  # not protocol 2: Celery tells a protocol-1 task from an unknown message
    if not isinstance(headers["task"], str) or not headers["task"]:
        return MalformedMessage("the message's task header is not a name")
    if not isinstance(headers.get("id"), str) or not headers["id"]:
        return MalformedMessage("the message has no task id header")
    if message.content_type != "application/json":
        return None  # refused by Celery (accept_content is JSON only), never decoded
    try:
        payload = message.decode()
    except (KombuError, ValueError, TypeError):
        return None  # Celery's decode-error path dead-letters it as undecodable
    reason = _body_problem(payload)
    return MalformedMessage(reason) if reason else None
