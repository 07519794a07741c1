"""Queue elements that are not messages: found by the worker's fetch, dead-lettered instead of stopping it.

kombu decodes each list element it pops as its JSON message envelope and hands it on unguarded
(`kombu/transport/redis.py`: `Channel._brpop_read` calls `loads(bytes_to_str(item))`;
`kombu/transport/virtual/base.py`: `Channel.basic_consume._callback` builds a `Message` that reads
`payload['properties']['delivery_tag']` and decodes the body). Raw bytes LPUSHed onto a queue (not JSON, or
JSON that is not kombu's envelope) raise there: the worker exits and the popped element is gone. The worker's
fetch (`pipeline.delivery.fetch`) checks each element's envelope in its Lua script and `decode` here what the
script cannot (the JSON as Python reads it, the body's encoding); an element that is not a message
becomes a dead-letter entry with reason `undecodable` (a bounded preview, its size and sha256,
`pipeline.dlq.capture.from_raw`), and the worker goes on consuming.
"""

from __future__ import annotations

import logging
from typing import Any

from kombu.utils.encoding import bytes_to_str

from pipeline.compat.serialization import decoder
from pipeline.dlq.capture import from_raw
from pipeline.observability import metrics

log = logging.getLogger(__name__)


class UndecodableMessage(ValueError):
    """A queue element is JSON but not a broker message envelope."""


def decode(channel: Any, item: bytes, queue: str) -> dict[str, Any] | None:
    """The envelope in `item`, or None once an element that is not one has been dead-lettered. The fetch script
    checked the envelope's shape already; what is left is what Lua cannot tell: the JSON as Python reads it, and
    the body's encoding."""
    try:
        payload = decoder()(bytes_to_str(item))
        if not isinstance(payload, dict):
            raise UndecodableMessage(f"a JSON {type(payload).__name__}, not a message envelope")
        body = payload.get("body")
        if body:  # what kombu's Message does first: a body it cannot decode stops the worker
            channel.decode_body(body, payload["properties"].get("body_encoding"))
    except (ValueError, TypeError, KeyError, AttributeError) as exc:  # base64, JSON, a missing or mistyped field
        dead_letter(item, queue, exc)
        return None
    return payload


def dead_letter(item: bytes, queue: str, exc: Exception) -> None:
    raw = item if isinstance(item, bytes) else str(item).encode("utf-8", "replace")
    try:
        entry_id = from_raw(raw, queue, exc)
    except Exception:
        metrics.signal_handler_errors.labels(handler="undecodable_element").inc()
        log.exception("could not dead-letter an undecodable element of queue %s (%d bytes)", queue, len(raw))
        return
    log.error(
        "queue %s held an element that is not a message (%s): discarded, dead-lettered as %s",
        queue,
        type(exc).__name__,
        entry_id,
    )
